"""The engine on the tiny random model: caching never changes the output, namespaces do not
share, a small pool still finishes every request, sampling is reproducible."""

from __future__ import annotations

import pytest

from engine_cases import (
    BACKENDS,
    BLOCK_SIZES,
    assert_same_outputs,
    engine_for,
    run_waves,
    serving,
    shared_prefix_waves,
)
from prefixcache.engine import GenerationRequest, SamplingParams, load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


@pytest.fixture(scope="module")
def waves(tiny):
    return shared_prefix_waves(tiny.weights.config.vocab_size)


@pytest.fixture(scope="module")
def uncached(tiny, waves):
    """The reference: the same pool and scheduler, prefix caching off."""
    return {bs: run_waves(engine_for(tiny, serving("tiny", block_size=bs, prefix_caching=False)), waves) for bs in BLOCK_SIZES}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_cache_does_not_change_output(tiny, waves, uncached, backend, block_size):
    # A small token budget so prompts are prefilled in chunks, next to other requests' decodes.
    engine = engine_for(tiny, serving("tiny", backend=backend, block_size=block_size, max_num_batched_tokens=24))
    got = run_waves(engine, waves)
    assert_same_outputs(got, uncached[block_size])
    stats = engine.stats()
    assert stats.prefill_tokens_saved > 0  # the cache did serve the shared prefixes
    assert stats.prefill_tokens_computed + stats.prefill_tokens_saved == stats.prompt_tokens
    assert stats.cache.hits == stats.prefill_tokens_saved


def test_uncached_run_saves_nothing(tiny, waves):
    engine = engine_for(tiny, serving("tiny", prefix_caching=False))
    run_waves(engine, waves)
    stats = engine.stats()
    assert stats.prefill_tokens_saved == 0 and stats.prefill_tokens_computed == stats.prompt_tokens
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks  # everything freed


def test_second_request_skips_the_cached_prefix(tiny):
    engine = engine_for(tiny, serving("tiny", backend="hash", block_size=16))
    prompt = list(range(100))
    first = engine.generate([GenerationRequest(prompt=prompt, max_tokens=3)])[0]
    second = engine.generate([GenerationRequest(prompt=prompt + [7, 8, 9], max_tokens=3)])[0]
    assert first.metrics.cached_tokens == 0 and first.metrics.computed_prompt_tokens == 100
    # 100 prompt tokens = 6 full blocks of 16 (96 tokens) cached; the rest is computed.
    assert second.metrics.cached_tokens == 96 and second.metrics.computed_prompt_tokens == 103 - 96


@pytest.mark.parametrize("backend", BACKENDS)
def test_namespaces_never_share(tiny, backend):
    engine = engine_for(tiny, serving("tiny", backend=backend, block_size=1))
    prompt = list(range(50, 90))
    a = engine.generate([GenerationRequest(prompt=prompt, namespace="tenant-a", max_tokens=4)])[0]
    b = engine.generate([GenerationRequest(prompt=prompt, namespace="tenant-b", max_tokens=4)])[0]
    a_again = engine.generate([GenerationRequest(prompt=prompt, namespace="tenant-a", max_tokens=4)])[0]
    assert a.metrics.cached_tokens == 0
    assert b.metrics.cached_tokens == 0  # identical prompt, other namespace: zero cross hits
    assert a_again.metrics.cached_tokens == len(prompt) - 1  # the same namespace does hit
    assert a.token_ids == b.token_ids == a_again.token_ids
    assert engine.stats().cache.hits == len(prompt) - 1
    engine.check_invariants()


def _pressure_requests(vocab: int) -> list[GenerationRequest]:
    base = [(i * 37) % vocab for i in range(48)]
    return [GenerationRequest(prompt=base[: 20 + 4 * i] + [i, i + 1], max_tokens=24, keep_first_logits=True) for i in range(6)]


@pytest.mark.parametrize("backend", [*BACKENDS, None])
def test_small_pool_completes_every_request(tiny, backend):
    # Each request needs 3 to 5 blocks of 16 over its life; all 6 at once need 24.
    # A pool of 8 makes admissions wait and decodes preempt; every request still finishes
    # with the output it has on a pool big enough for all of them.
    reqs = _pressure_requests(tiny.weights.config.vocab_size)
    big = engine_for(tiny, serving("tiny", backend=backend or "hash", num_blocks=512, prefix_caching=backend is not None))
    small = engine_for(tiny, serving("tiny", backend=backend or "hash", num_blocks=8, prefix_caching=backend is not None))
    want = big.generate(reqs)
    got = small.generate(reqs)
    assert_same_outputs(got, want)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in got)
    stats = small.stats()
    assert stats.preemptions > 0 and stats.cache.rejected > 0
    assert big.stats().preemptions == 0
    small.check_invariants()
    small.cache.evict(8)  # every request released: evicting the cache frees the whole pool
    assert small.cache.pool.num_free == 8


def test_request_larger_than_the_pool_is_refused_up_front(tiny):
    engine = engine_for(tiny, serving("tiny", num_blocks=4, block_size=16))
    with pytest.raises(ValueError, match="cache.num_blocks = 4"):
        engine.add_request(GenerationRequest(prompt=list(range(60)), max_tokens=5))
    with pytest.raises(ValueError, match="context length"):
        engine.add_request(GenerationRequest(prompt=[1] * 4000, max_tokens=200))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request(GenerationRequest(prompt=[1, 999]))
    with pytest.raises(ValueError, match="exactly one of prompt and messages"):
        engine.add_request(GenerationRequest())
    assert not engine.has_unfinished()


def test_seeded_sampling_is_reproducible_and_cache_independent(tiny, waves):
    def sampled(backend, block_size, caching, seed=1234):
        p = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=seed)
        engine = engine_for(tiny, serving("tiny", backend=backend, block_size=block_size, prefix_caching=caching))
        reqs = [[GenerationRequest(prompt=r.prompt, max_tokens=8, sampling=p) for r in w] for w in waves]
        return [o.token_ids for o in run_waves(engine, reqs)]

    reference = sampled("hash", 16, False)
    assert sampled("hash", 16, True) == reference
    assert sampled("radix", 1, True) == reference
    assert sampled("hash", 16, False, seed=99) != reference


def test_stop_token_ends_a_request(tiny):
    engine = engine_for(tiny, serving("tiny"))
    free_run = engine.generate([GenerationRequest(prompt=[5, 6, 7], max_tokens=10)])[0]
    stop = free_run.token_ids[3]
    stopped = engine.generate([GenerationRequest(prompt=[5, 6, 7], max_tokens=10, stop_token_ids=(stop,))])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: free_run.token_ids.index(stop) + 1]


def test_text_and_chat_prompts_on_the_byte_tokenizer(tiny):
    engine = engine_for(tiny, serving("tiny", max_tokens=4))
    chat = engine.generate([GenerationRequest(messages=[{"role": "user", "content": "hi"}])])[0]
    text = engine.generate(["<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                            "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"])[0]
    assert chat.prompt_token_ids == text.prompt_token_ids
    assert chat.prompt_token_ids[0] == 257  # <|im_start|>
    assert chat.token_ids == text.token_ids
    assert text.metrics.cached_tokens > 0  # the rendered chat was cached by the first request


def test_partial_block_copies_keep_the_output(tiny, waves, uncached):
    """The copy-on-write plugin (examples/partial_block.py) hits inside blocks: the engine
    must copy the reused slots before the forward pass, and the output must not change."""
    engine = engine_for(tiny, serving("tiny", backend="partial_block:PartialBlockHash", block_size=16))
    copies: list = []
    take = engine.scheduler.take_copies
    engine.scheduler.take_copies = lambda: copies.extend(c := take()) or c  # record what was applied
    got = run_waves(engine, waves)
    assert_same_outputs(got, uncached[16])
    assert copies, "the workload reuses a block head, so at least one copy must happen"
    whole = run_waves(engine_for(tiny, serving("tiny", backend="hash", block_size=16)), waves)
    assert_same_outputs(whole, uncached[16])
    saved_partial = engine.stats().prefill_tokens_saved
    assert saved_partial > sum(o.metrics.cached_tokens for o in whole)  # the copies saved compute
    assert saved_partial % 16 != 0
