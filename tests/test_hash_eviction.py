"""The hash strategy under eviction policies other than its free queue's LRU.

`lru` stays the pool's free queue (no BlockEvictor at all); any other policy orders the
free cached blocks, ranked once when freed. A Python LRU must therefore replay exactly
like the native free queue, and each built-in must evict what its name says."""

from __future__ import annotations

import random

import pytest

import prefixcache
from prefixcache import CacheConfig
from prefixcache._C import BlockEvictor, CallbackBlockEvictor
from prefixcache.backends.hash import HashCache
from prefixcache.eviction import LRU
from prefixcache.events import BlockRemoved
from prefixcache.evictors import FreeQueueEvictor

BS = 4


class PythonLRU(LRU):
    """LRU with no native order: the hash backend ranks blocks with it, in Python."""

    native = None


def make(num_blocks: int, eviction: str = "lru", **changes) -> HashCache:
    return prefixcache.build_cache(CacheConfig(block_size=BS, num_blocks=num_blocks, eviction=eviction, **changes))


def serve(cache, rid, tokens, priority=0):
    adm = cache.admit(rid, tokens, priority=priority)
    assert adm is not None
    cache.commit(rid, len(tokens))
    cache.release(rid)
    return adm.num_cached_tokens


def test_lru_is_the_free_queue_with_no_evictor():
    assert type(make(8)._evictor) is FreeQueueEvictor
    assert type(make(8, "lfu")._evictor) is BlockEvictor
    assert type(make(8, f"{__name__}:PythonLRU")._evictor) is CallbackBlockEvictor


def test_python_lru_replays_exactly_like_the_native_free_queue():
    rng = random.Random(7)
    prefixes = [list(range(100 * i, 100 * i + 4 * BS)) for i in range(6)]
    prompts = [rng.choice(prefixes)[: rng.randint(1, 4 * BS)] + [rng.randint(0, 3) for _ in range(rng.randint(1, 9))]
               for _ in range(400)]
    native, python = make(14), make(14, f"{__name__}:PythonLRU")
    for i, p in enumerate(prompts):
        assert serve(native, i, p) == serve(python, i, p), f"request {i}"
        if i % 50 == 0:
            python.check_invariants()
    assert native.stats() == python.stats()
    assert native.stats().evictions > 100


def test_lfu_keeps_the_most_hit_blocks():
    cache = make(6, "lfu")
    hot, cold = list(range(9)), list(range(100, 109))  # two full blocks each
    serve(cache, "hot", hot)
    serve(cache, "hot2", hot)  # hits both hot blocks
    serve(cache, "cold", cold)
    serve(cache, "new", list(range(200, 209)))  # needs 3 blocks: 2 free + 1 evicted, never a hot one
    assert cache.match(hot).num_tokens == 8
    assert cache.match(cold).num_tokens < 8
    cache.check_invariants()


def test_priority_evicts_low_priority_requests_first():
    cache = make(6, "priority")
    high, low = list(range(9)), list(range(100, 109))
    serve(cache, "high", high, priority=5)
    serve(cache, "low", low, priority=0)  # more recent, but lower priority
    serve(cache, "new", list(range(200, 209)))
    assert cache.match(high).num_tokens == 8 and cache.match(low).num_tokens < 8


def test_gslru_protects_reused_content_against_a_flood_of_one_offs():
    lru, gslru = make(12), make(12, "gslru")
    shared = list(range(9))
    for cache in (lru, gslru):
        serve(cache, "a", shared)
        serve(cache, "b", shared)  # reused: protected under gslru
        for i in range(6):  # one-off prompts, 2 cached blocks each: enough to push LRU past it
            serve(cache, f"x{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
        cache.check_invariants()
    assert lru.match(shared).num_tokens < 8
    assert gslru.match(shared).num_tokens == 8


def test_gslru_remembers_evicted_content_in_its_ghost():
    cache = make(4, "gslru")
    first = list(range(9))
    serve(cache, "a", first)
    serve(cache, "b", list(range(100, 109)))  # evicts first's blocks (4 blocks in the pool)
    serve(cache, "c", list(range(200, 209)))
    assert cache.match(first).num_tokens == 0
    serve(cache, "a again", first)  # recomputed: its blocks come back with use_count 2
    hits = cache.pool.lookup_chain_packed(cache._prompt_digests(first, None)[: 2 * cache.digest_size],
                                          cache.digest_size)
    assert [cache._evictor.candidate(b).use_count for b in hits] == [2, 2]


def test_policy_evictions_are_reported_as_events_and_stats():
    cache = make(4, "lfu")
    serve(cache, "a", list(range(9)))
    cache.drain_events()
    serve(cache, "b", list(range(100, 109)))
    removed = [e for e in cache.drain_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == cache.stats().evictions == 1
    assert cache.evict(10) == 3 and cache.stats().evictions == 4


def test_a_raising_python_policy_leaves_release_undone():
    class Raises(LRU):
        native = None
        armed = False

        def priority(self, candidate):
            if Raises.armed:
                raise RuntimeError("policy bug")
            return candidate.last_access_time

    cache = HashCache(prefixcache.BlockPool(8), CacheConfig(block_size=BS, num_blocks=8, eviction="lru"))
    cache.policy = Raises()

    cache._evictor = CallbackBlockEvictor(cache.pool, BS, cache.policy.priority, 0)
    cache.admit("r", list(range(9)))
    cache.commit("r", 9)
    Raises.armed = True
    with pytest.raises(RuntimeError, match="policy bug"):
        cache.release("r")
    assert cache.block_table("r")  # still live, nothing freed
    cache.check_invariants()
    Raises.armed = False
    cache.release("r")
    cache.check_invariants()
