"""Shared scenarios of the engine tests: prompts that share prefixes, run through an engine
with and without the cache, compared token for token and logit for logit."""

from __future__ import annotations

import random

import torch

from prefixcache.config import CacheConfig
from prefixcache.engine import Engine, EngineConfig, GenerationRequest, LoadedModel, ServingConfig

BACKENDS = ("hash", "radix")
BLOCK_SIZES = (1, 16)


def serving(model: str, *, backend: str = "hash", block_size: int = 16, num_blocks: int = 512, **engine) -> ServingConfig:
    cache = CacheConfig(backend=backend, block_size=block_size, num_blocks=num_blocks)
    return ServingConfig(cache, EngineConfig(model=model, **engine))


def shared_prefix_waves(vocab: int, *, seed: int = 0, prefix_len: int = 40, max_tokens: int = 6) -> list[list[GenerationRequest]]:
    """Two waves of token-id prompts over one shared prefix: the first wave has prompts
    that share it (and each other's middles, and one prompt is a prefix of another, and
    one is repeated), the second repeats and extends them so it hits what the first
    cached."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    prefix, middle = toks(prefix_len), toks(13)
    first = [prefix + toks(5), prefix + middle + toks(7), prefix + middle, prefix + middle + toks(21), toks(9)]
    first.append(list(first[1]))  # the same prompt twice in one wave
    second = [p + toks(3) for p in first[:4]] + [prefix + middle + toks(30), list(first[0])]

    def wave(prompts: list[list[int]]) -> list[GenerationRequest]:
        return [GenerationRequest(prompt=p, max_tokens=max_tokens, keep_first_logits=True) for p in prompts]

    return [wave(first), wave(second)]


def run_waves(engine: Engine, waves: list[list[GenerationRequest]]):
    """Every wave through `engine` in turn; all outputs in order."""
    outs = []
    for w in waves:
        outs += engine.generate(w)
        engine.check_invariants()
    return outs


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over the finite entries of `b`, where `a` must be finite too
    (-inf: an id the model rules out, such as the tiny model's `lm_head_bias` does); inf
    when the two rule out different ids."""
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):
        return float("inf")
    return float((a[finite] - b[finite]).abs().max() / b[finite].abs().max())


def assert_same_outputs(got, want, *, logits_rtol: float = 1e-4) -> None:
    """Token ids identical; first-token logits within `logits_rtol` (relative)."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert g.first_logits is not None and w.first_logits is not None
        err = relative_error(g.first_logits, w.first_logits)
        assert err <= logits_rtol, f"{g.request_id}: first-token logits differ by {err:.2e} (relative)"


def engine_for(loaded: LoadedModel, config: ServingConfig) -> Engine:
    return Engine(config, model=loaded)
