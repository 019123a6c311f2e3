"""A waiting request waits for a running prefill of the prefix it shares (`engine.in_batch_prefix_tokens`,
SGLang's in-batch prefix caching), then hits it: a burst computes a shared prefix once."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_cases import BACKENDS, serving
from prefixcache.engine import Engine, GenerationRequest, load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def burst(n: int = 6, shared: int = 300, own: int = 20, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(250) for _ in range(shared)]
    return [prefix + [rng.randrange(250) for _ in range(own)] for _ in range(n)]


def run(tiny, prompts, *, backend="hash", threshold=32, namespaces=None, num_blocks=1024, **engine):
    e = Engine(serving("tiny", backend=backend, num_blocks=num_blocks, in_batch_prefix_tokens=threshold, **engine),
               model=tiny)
    reqs = [GenerationRequest(prompt=p, max_tokens=4, ignore_eos=True, namespace=(namespaces or {}).get(i))
            for i, p in enumerate(prompts)]
    outs = e.generate(reqs)
    e.check_invariants()  # every pinned block is the tree's or a live request's: there are none
    held = e.cache.tree.protected_size if backend == "radix" else e.cache.pool.num_pinned
    assert held == 0
    return e, outs


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_burst_computes_its_shared_prefix_once(tiny, backend):
    prompts = burst()
    off, plain = run(tiny, prompts, backend=backend, threshold=0)
    on, waited = run(tiny, prompts, backend=backend)
    assert [o.token_ids for o in waited] == [o.token_ids for o in plain]  # greedy: the same tokens
    # Off, all six are admitted in the first step and compute the prefix side by side.
    assert [o.metrics.cached_tokens for o in plain] == [0] * 6
    # On, the first computes it and the others wait one step, then hit its 18 whole blocks.
    assert [o.metrics.cached_tokens for o in waited] == [0] + [288] * 5
    assert on.stats().prefill_tokens_computed == 320 + 5 * 32
    assert off.stats().prefill_tokens_computed == 6 * 320
    assert on.stats().prefix_waits == 5 and off.stats().prefix_waits == 0


def test_only_what_is_still_to_compute_counts_and_never_across_namespaces(tiny):
    prompts = burst(n=2, shared=40)  # 40 shared tokens: 2 whole blocks, at least 32 to compute
    assert run(tiny, prompts)[0].stats().prefix_waits == 1
    assert run(tiny, prompts, threshold=48)[0].stats().prefix_waits == 0  # fewer shared than the threshold
    e, outs = run(tiny, prompts, namespaces={1: "tenant-b"})
    assert e.stats().prefix_waits == 0 and [o.metrics.cached_tokens for o in outs] == [0, 0]


def test_requests_behind_a_waiting_one_go_first(tiny):
    """The second waits for the first's prefill; the third, unrelated, is admitted meanwhile."""
    prompts = burst(n=2, shared=300) + [[7] * 50]
    e, outs = run(tiny, prompts, max_num_batched_tokens=400)
    assert e.stats().prefix_waits == 1
    first = [o.metrics.first_token_s for o in outs]
    assert first[2] == first[0] < first[1]  # the third ran in the first step, the second after
    # Off, the second takes the rest of the first step's budget and the third waits a step.
    _, plain = run(tiny, prompts, threshold=0, max_num_batched_tokens=400)
    assert plain[2].metrics.first_token_s > plain[0].metrics.first_token_s


def test_at_most_max_num_seqs_are_passed_over_a_step(tiny):
    e, _ = run(tiny, burst(n=12), max_num_seqs=4)
    # The leader's prefill takes one step; in it 4 of the 11 followers are looked at and
    # passed over, not 11; the next step admits followers, which hit.
    assert e.stats().prefix_waits == 4


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_waiting_never_changes_an_output_and_leaves_nothing_pinned(tiny, data):
    """Random bursts over a few prefixes, namespaces, budgets and pools (small ones preempt):
    the same tokens with and without waiting, every request finished, invariants held."""
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    prefixes = [[rng.randrange(250) for _ in range(rng.randint(1, 120))] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(250) for _ in range(rng.randint(1, 30))]
               for _ in range(data.draw(st.integers(1, 10)))]
    namespaces = {i: rng.choice([None, "b"]) for i in range(len(prompts))}
    budget = data.draw(st.sampled_from([16, 64, 512]))
    backend = data.draw(st.sampled_from(BACKENDS))
    pool = data.draw(st.sampled_from([12, 24, 1024]))  # 16-token blocks: the longest request needs 11
    off, plain = run(tiny, prompts, backend=backend, threshold=0, namespaces=namespaces, max_num_batched_tokens=budget,
                     num_blocks=pool)
    on, waited = run(tiny, prompts, backend=backend, threshold=data.draw(st.sampled_from([1, 16, 32])),
                     namespaces=namespaces, max_num_batched_tokens=budget, max_num_seqs=data.draw(st.integers(1, 4)),
                     num_blocks=pool)
    assert [o.token_ids for o in waited] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" for o in waited)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hybrid_cache_that_caches_a_prompt_at_its_end_keeps_followers_waiting(backend):
    """`radix` on a hybrid model inserts a prompt when its prefill ends: the leader's
    computed tokens are no hit before, so followers let in near the end (by what the
    leader still had to compute) computed the whole prompt again. They wait until the
    cache would give them the tokens they share, then hit them (n choices of one prompt)."""
    from prefixcache.config import CacheConfig
    from prefixcache.engine.exactness import engines_for, tiny_hybrid

    model = tiny_hybrid(seed=0)
    engine, _ = engines_for(model, CacheConfig(backend=backend, block_size=16, num_blocks=256))
    rng = random.Random(1)
    prompt = [rng.randrange(model.weights.config.vocab_size) for _ in range(200)]
    outs = engine.generate([GenerationRequest(prompt=prompt, max_tokens=2) for _ in range(4)])
    assert [o.metrics.cached_tokens for o in outs] == [0, 192, 192, 192]
    assert engine.stats().prefill_tokens_computed == 200 + 3 * 8  # the prompt once, then each one's last 8
    engine.check_invariants()


def test_the_leader_sharing_most_decides_whatever_the_running_order():
    """Two leaders in prefill share 40 and 60 tokens with a short follower that could hit 16
    now: it waits for the one sharing 60 (44 more), not the one sharing 40 (24 more). A
    leader was once skipped when it could not beat the best so far by the whole threshold,
    which it need not: this fails with that skip."""
    from prefixcache import build_cache
    from prefixcache.config import CacheConfig
    from prefixcache.engine.metrics import RequestMetrics
    from prefixcache.engine.sampling import SamplingParams
    from prefixcache.engine.scheduler import Scheduler, Sequence

    def seq(rid: str, prompt: list[int]) -> Sequence:
        return Sequence(rid, prompt, None, SamplingParams(), 4, frozenset(), None, RequestMetrics(0.0, len(prompt)))

    rng = random.Random(3)
    shared = [rng.randrange(250) for _ in range(60)]
    a = seq("a", shared[:40] + [rng.randrange(250) for _ in range(30)])
    b = seq("b", shared + [rng.randrange(250) for _ in range(30)])
    follower = seq("f", shared + [1, 2, 3, 4, 5])  # 64 tokens it could hit
    cache = build_cache(CacheConfig(block_size=16, num_blocks=64))
    cache.admit("w", shared[:17])  # its first block cached: the follower hits 16 now
    cache.commit("w", 17)
    cache.release("w")
    sched = Scheduler(cache, max_num_batched_tokens=64, max_num_seqs=4, in_batch_prefix_tokens=32)
    sched.running = [a, b]  # both in prefill (admitted here only as far as the rule reads)
    assert sched._waits_for_leader(follower)  # 60 shared - 16 cached = 44 >= 32
    sched.running = [a]
    assert not sched._waits_for_leader(follower)  # 40 - 16 = 24 < 32
    sched.running = [b, a]
    assert sched._waits_for_leader(follower)
