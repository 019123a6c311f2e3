"""One request's fault ends that request alone: sampling parameters checked and clamped as
vLLM 0.33's SamplingParams does, a row of logits that cannot be sampled, and a forward
pass that raises for one request, each with the rest of the batch unchanged (issue 27)."""

from __future__ import annotations

import pytest
import torch

from engine_cases import BACKENDS, engine_for, serving
from prefixcache.config import ConfigError
from prefixcache.engine import GenerationRequest, SamplingParams, load_model
from prefixcache.engine.config import MIN_TEMPERATURE
from prefixcache.engine.sampling import SamplingError, sample

POISON = 7  # a token id the fault injections below key on


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-6, 0.005])
def test_a_tiny_temperature_is_raised_to_vllms_floor_not_divided_into_inf(temperature):
    with pytest.warns(RuntimeWarning, match="raised to 0.01"):
        p = SamplingParams(temperature=temperature, top_k=5)
    assert p.temperature == MIN_TEMPERATURE and not p.greedy and p.top_k == 5


def test_temperature_zero_is_greedy_and_resets_the_filters_as_vllm_does():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3)
    assert p.greedy and (p.top_p, p.top_k) == (1.0, 0)


@pytest.mark.parametrize("bad, field", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"seed": 2**63}, "seed"), ({"seed": True}, "seed"),
])
def test_sampling_parameters_outside_vllms_ranges_are_refused_naming_the_field(bad, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        SamplingParams(**bad)


def test_seed_minus_one_means_unseeded_and_other_negative_seeds_are_kept_as_vllm_does():
    assert SamplingParams(temperature=1.0, seed=-1).seed is None
    assert SamplingParams(temperature=1.0, seed=-5).seed == -5


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.tensor([[0.0, 5.0, 1.0], [float("nan"), 1.0, 2.0], [1.0, float("inf"), 0.0],
                           [float("-inf")] * 3, [3.0, 0.0, float("-inf")]])
    greedy, hot = SamplingParams(), SamplingParams(temperature=1.0, seed=0)
    got = sample(logits, [greedy, hot, greedy, hot, greedy], [None, torch.Generator().manual_seed(0), None, None, None])
    assert got[0] == 1 and got[4] == 0  # -inf is a masked token, not a fault
    assert all(isinstance(got[i], SamplingError) for i in (1, 2, 3))


def _prompts() -> list[list[int]]:
    return [[10 + i] * 20 + [30 + i] for i in range(4)] + [[POISON] * 12]


def _requests(prompts: list[list[int]]) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=p, max_tokens=6, ignore_eos=True) for p in prompts]


def _faulty(engine, fault: str):
    """Inject `fault` into `engine`'s forward pass for every chunk that holds POISON:
    "raise" fails the pass, "nan" makes that chunk's logits nan."""
    forward = engine.model.forward

    def forward_with_fault(plan):
        logits = forward(plan)
        rows = plan.logit_rows.tolist()
        poisoned = [j for j, row in enumerate(rows) if int(plan.token_ids[row]) == POISON]
        if fault == "raise" and POISON in plan.token_ids.tolist():
            raise RuntimeError("injected: this request's forward pass fails")
        if fault == "nan" and poisoned:
            logits = logits.clone()
            logits[poisoned] = float("nan")
        return logits

    engine.model.forward = forward_with_fault
    return engine


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_a_request_whose_forward_or_sampling_fails_ends_alone_and_the_batch_goes_on(tiny, backend, fault):
    clean = engine_for(tiny, serving("tiny", backend=backend, block_size=4, num_blocks=64))
    expected = clean.generate(_requests(_prompts()[:-1]))
    engine = _faulty(engine_for(tiny, serving("tiny", backend=backend, block_size=4, num_blocks=64)), fault)
    got = engine.generate(_requests(_prompts()))  # all five in the same steps
    assert [o.token_ids for o in got[:-1]] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "length" and o.error is None for o in got[:-1])
    failed = got[-1]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert ("injected" in failed.error) if fault == "raise" else ("not finite" in failed.error)
    engine.check_invariants()
    assert engine.cache.pool.num_pinned == 0 if backend == "hash" else engine.cache.tree.protected_size == 0
    again = engine.generate(_requests(_prompts()[:1]))[0]  # the engine serves on, its cache intact
    assert again.token_ids == expected[0].token_ids and again.metrics.cached_tokens > 0
