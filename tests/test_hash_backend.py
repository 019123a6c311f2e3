"""The `hash` backend: vLLM's prefix-caching scenarios, ported to the protocol.

Each test follows a test of vLLM 0.33's tests/v1/core/test_prefix_caching.py (see
/work/shared/reference/vllm_tests.md). vLLM reserves block 0 as a null block and we do
not, so every block id here is vLLM's minus one and every pool one block smaller.
"""

from __future__ import annotations

import numpy as np
import pytest

import prefixcache
from prefixcache import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.backends.hash import HashCache
from prefixcache.config import CacheConfig, ConfigError, HashConfig
from prefixcache.hashing import hash_function, none_hash

BS = 16
COMMON = [i for i in range(3) for _ in range(BS)]  # 16 x 0, 16 x 1, 16 x 2: three full blocks
sha = hash_function("sha256_cbor")


def make(num_blocks: int = 10, **changes) -> HashCache:
    cache = prefixcache.build_cache(CacheConfig(block_size=BS, num_blocks=num_blocks, **changes))
    assert isinstance(cache, HashCache)
    return cache


def run(cache: HashCache, request_id, tokens, *, namespace=None):
    """admit + commit the whole prompt (vLLM caches at allocate_slots); returns the admission."""
    admission = cache.admit(request_id, tokens, namespace=namespace)
    assert admission is not None
    cache.commit(request_id, len(tokens))
    cache.check_invariants()
    return admission


def chain(tokens, extra=None):
    """vLLM's hash_block_tokens chain over the full blocks of `tokens`."""
    parent, out = none_hash("sha256_cbor"), []
    for start in range(0, len(tokens) // BS * BS, BS):
        parent = sha((parent, tuple(tokens[start : start + BS]), extra if start == 0 else None))
        out.append(parent)
    return out


def refs(cache: HashCache, blocks) -> list[int]:
    return [cache.pool.ref_count(b) for b in blocks]


# ---------------------------------------------------------------------- vLLM scenarios


def test_prefill():
    cache = make(10)
    req0 = COMMON + [3] * 7
    assert run(cache, "0", req0) == prefixcache.Admission((0, 1, 2, 3), 0)
    assert [cache.pool.key(b) for b in range(4)] == [*chain(COMMON), None]
    assert refs(cache, range(4)) == [1, 1, 1, 1]

    req1 = COMMON + [3] * 5
    assert cache.match(req1) == prefixcache.Match(48, (0, 1, 2))
    assert run(cache, "1", req1) == prefixcache.Admission((0, 1, 2, 4), 48)
    assert refs(cache, range(5)) == [2, 2, 2, 1, 1]
    assert cache.pool.num_free == 5

    cache.release("0")
    cache.release("1")
    # Keyless tails to the front (req1's, freed last, first), cached blocks to the
    # tail in reverse (the longest prefix is evicted first). vLLM: [5,4,6,7,8,9,10,3,2,1].
    assert cache.pool.free_queue() == [4, 3, 5, 6, 7, 8, 9, 2, 1, 0]

    req2 = COMMON + [3] * 6
    assert run(cache, "2", req2) == prefixcache.Admission((0, 1, 2, 4), 48)  # reuses the partial block
    assert cache.pool.num_free == 6
    assert all(cache.pool.ref_count(b) == 0 for b in cache.pool.free_queue())
    cache.release("2")

    # A miss takes blocks in eviction order, dropping the cached ones' hashes.
    cache.drain_events()
    assert run(cache, "3", [99] * 160).block_table == (4, 3, 5, 6, 7, 8, 9, 2, 1, 0)
    assert cache.pool.free_queue() == [] and cache.pool.num_cached == 10
    removed = [e for e in cache.drain_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removed] == chain(COMMON)[::-1]
    assert cache.stats().evictions == 3


def test_evict_order():
    cache = make(10)
    assert run(cache, "0", list(range(87))).block_table == (0, 1, 2, 3, 4, 5)
    assert run(cache, "1", list(range(87, 135))).block_table == (6, 7, 8)
    assert cache.pool.num_free == 1
    cache.release("0")
    assert cache.pool.free_queue() == [5, 9, 4, 3, 2, 1, 0]  # vLLM [6,10,5,4,3,2,1]
    cache.release("1")
    assert cache.pool.free_queue() == [5, 9, 4, 3, 2, 1, 0, 8, 7, 6]
    assert run(cache, "2", list(range(35))) == prefixcache.Admission((0, 1, 5), 32)  # vLLM new [6]
    assert cache.pool.num_free == 7


def test_computed_blocks_not_evicted():
    cache = make(2)
    assert run(cache, "0", list(range(16))).block_table == (0,)
    cache.release("0")
    assert run(cache, "1", list(range(16, 32))).block_table == (1,)
    cache.release("1")
    assert cache.pool.free_queue() == [0, 1]
    # The hit (block 0, at the front) is pinned before allocation, so the new block
    # evicts block 1 instead of the hit itself.
    assert run(cache, "2", list(range(32))) == prefixcache.Admission((0, 1), 16)
    assert cache.pool.key(0) == chain(range(16))[0]


def test_not_enough_free_blocks_with_computed_blocks_changes_nothing():
    cache = make(10)
    run(cache, "0", COMMON)
    assert run(cache, "1", COMMON * 2) == prefixcache.Admission((0, 1, 2, 3, 4, 5), 48)
    cache.release("1")
    assert refs(cache, range(6)) == [1, 1, 1, 0, 0, 0]
    run(cache, "2", [7] * 32)
    assert cache.pool.num_free == 5
    before = (cache.pool.free_queue(), refs(cache, range(10)), cache.stats(), len(cache.drain_events()))

    # Hits 6 blocks (96 tokens), 3 of them free: 3 new + 3 touched = 6 > 5 free.
    assert cache.match(COMMON * 3).num_tokens == 96
    assert cache.admit("3", COMMON * 3) is None
    after = (cache.pool.free_queue(), refs(cache, range(10)), cache.stats(), len(cache.drain_events()))
    assert after[:2] == before[:2] and after[3] == 0
    # vLLM records a lookup only for a request it schedules: the refusal is no query.
    assert after[2] == prefixcache.CacheStats(
        requests=3, queries=before[2].queries, hits=48, evictions=0, rejected=1
    )
    with pytest.raises(KeyError):
        cache.block_table("3")
    cache.check_invariants()


def test_hash_block_correct_reuse():
    cache = make(1)
    run(cache, "0", list(range(16)))
    cache.release("0")
    assert cache.pool.key(0) is not None
    cache.drain_events()
    assert run(cache, "1", list(range(15))).block_table == (0,)
    assert cache.pool.key(0) is None  # evicted when reused
    assert cache.drain_events() == [BlockRemoved((chain(range(16))[0],), group_idx=0)]


def test_decode_caches_blocks_as_they_fill():
    cache = make(10)
    prompt = COMMON + [3] * 7
    run(cache, "0", prompt)
    assert cache.append("0", [8] * 4) == []  # 59 tokens still fit in 4 blocks
    cache.commit("0", 59)
    assert cache.pool.key(3) is None
    assert cache.append("0", [9] * 19) == [4]  # 78 tokens need a 5th block
    cache.commit("0", 78)
    tokens = prompt + [8] * 4 + [9] * 19
    assert cache.block_table("0") == (0, 1, 2, 3, 4)
    assert [cache.pool.key(b) for b in range(5)] == [*chain(tokens), None]
    cache.check_invariants()
    # The decoded block is hittable by the next request.
    assert cache.match(tokens[:70]).num_tokens == 64


def test_cache_key_salting():
    cache = make(10)
    tokens = COMMON + [3] * 11
    salt = (("cache_salt", "salt1"),)
    run(cache, "0", tokens, namespace="salt1")
    h = chain(tokens, salt)
    assert h[0] == sha((none_hash("sha256_cbor"), tuple(tokens[:16]), salt))
    assert h[1] == sha((h[0], tuple(tokens[16:32]), None))  # the salt is on block 0 only
    assert [cache.pool.key(b) for b in range(3)] == h
    cache.append("0", [8] * 5)
    cache.commit("0", 64)
    assert cache.pool.key(3) == sha((h[2], tuple(tokens[48:64] + [8] * 5)[:16], None))

    assert run(cache, "1", tokens, namespace="salt1").num_cached_tokens == 48
    assert cache.admit("2", tokens, namespace="salt2").num_cached_tokens == 0
    assert cache.match(tokens).num_tokens == 0  # no namespace is a namespace of its own
    assert cache.match(tokens + [8] * 5, namespace="salt1").num_tokens == 64


def test_kv_cache_events():
    for n in (2, 3, 10):
        cache = make(n)
        tokens = list(range(n * BS))
        run(cache, "0", tokens)
        [stored] = cache.drain_events()
        assert stored == BlockStored(
            block_hashes=tuple(chain(tokens)),
            parent_block_hash=None,
            token_ids=tuple(tokens),
            block_size=BS,
            extra_keys=(None,) * n,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
        assert cache.pool.num_cached == n and stored.medium == "GPU" and stored.lora_id is None
        cache.release("0")
        # A request that misses reuses every cached block: n removals, then 1 store.
        other = [t + 1000 for t in tokens]
        run(cache, "1", other)
        events = cache.drain_events()
        assert len(events) == n + 1 and isinstance(events[-1], BlockStored)
        assert all(isinstance(e, BlockRemoved) for e in events[:-1])
        assert {e.block_hashes[0] for e in events[:-1]} == set(stored.block_hashes)
        cache.release("1")
        assert cache.reset() is True
        assert cache.drain_events()[-1] == AllBlocksCleared()
        assert cache.pool.num_cached == 0


def test_stored_event_of_a_decode_block_names_its_parent_and_salt():
    cache = make(4)
    run(cache, "0", list(range(20)), namespace="t")
    first = cache.drain_events()[0]
    assert first.extra_keys == (("t",),)  # vLLM publishes the salt untagged
    cache.append("0", list(range(20, 40)))
    cache.commit("0", 40)
    [second] = cache.drain_events()
    h = chain(list(range(40)), (("cache_salt", "t"),))
    assert second.block_hashes == (h[1],) and second.parent_block_hash == h[0]
    assert second.token_ids == tuple(range(16, 32)) and second.extra_keys == (None,)


def test_reset_prefix_cache():
    cache = make(10)
    run(cache, "0", COMMON + [3] * 7)
    assert run(cache, "1", COMMON + [3] * 5).block_table == (0, 1, 2, 4)
    assert cache.reset() is False  # blocks in use
    assert cache.pool.num_cached == 3
    cache.release("0")
    cache.release("1")
    cache.drain_events()
    assert cache.reset() is True
    assert cache.pool.num_cached == 0 and all(cache.pool.key(b) is None for b in range(10))
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.stats() == prefixcache.CacheStats()
    assert cache.match(COMMON).num_tokens == 0
    cache.check_invariants()


def test_last_prompt_token_is_always_computed():
    cache = make(10)
    run(cache, "0", COMMON)
    cache.release("0")
    # 48 tokens cached; the same 48-token prompt hits only 32 and recomputes block 2.
    assert cache.match(COMMON).num_tokens == 48
    assert run(cache, "1", COMMON) == prefixcache.Admission((0, 1, 3), 32)
    # Block 2 and block 3 now hold the same hash; the index keeps both, earliest first.
    assert cache.pool.blocks_for(chain(COMMON)[2]) == [2, 3]


def test_duplicate_blocks_are_all_indexed_and_reused_one_by_one():
    cache = make(8)
    prompt = list(range(40))  # 2 full blocks + 8 tokens
    # Both miss: the second is admitted before the first commits (a concurrent batch).
    assert cache.admit("a", prompt).block_table == (0, 1, 2)
    assert cache.admit("b", prompt).block_table == (3, 4, 5)
    cache.commit("a", 40)
    cache.commit("b", 40)
    h = chain(prompt)
    assert [cache.pool.blocks_for(k) for k in h] == [[0, 3], [1, 4]]
    assert cache.match(prompt) == prefixcache.Match(32, (0, 1))  # earliest copies
    cache.release("a")
    cache.release("b")
    assert cache.pool.free_queue() == [5, 2, 6, 7, 1, 0, 4, 3]
    # Reusing a's copies (the LRU ones) drops only their entries: b's still hit.
    cache.drain_events()
    assert cache.admit("c", [500] * 80).block_table == (5, 2, 6, 7, 1)
    assert cache.drain_events() == [BlockRemoved((h[1],), group_idx=0)]
    assert cache.match(prompt) == prefixcache.Match(32, (0, 4))
    cache.check_invariants()


def test_match_is_pure():
    cache = make(6)
    run(cache, "0", list(range(40)))
    cache.release("0")
    state = (cache.pool.free_queue(), refs(cache, range(6)), cache.stats())
    cache.drain_events()
    assert cache.match(list(range(40))) == prefixcache.Match(32, (0, 1))
    assert cache.match(list(range(40)), namespace="x") == prefixcache.Match(0, ())
    assert cache.match([]) == prefixcache.Match(0, ())
    assert (cache.pool.free_queue(), refs(cache, range(6)), cache.stats()) == state
    assert cache.drain_events() == []


# ---------------------------------------------------------------------- our protocol


def test_evict_drops_least_recently_freed_cached_blocks():
    cache = make(8)
    run(cache, "0", list(range(48)))
    run(cache, "1", list(range(100, 132)))
    assert cache.evict(2) == 0  # every cached block is pinned
    cache.release("0")
    cache.drain_events()
    # Queue: 5..7 keyless, then request 0's blocks tail first: 2, 1, 0.
    assert cache.evict(2) == 2
    assert cache.drain_events() == [BlockRemoved((chain(range(48))[i],), group_idx=0) for i in (2, 1)]
    assert cache.match(list(range(48))).num_tokens == 16
    assert cache.evict(10) == 1 and cache.evict(1) == 0
    assert cache.stats().evictions == 3
    assert cache.match(list(range(100, 132))).num_tokens == 32  # pinned blocks stay cached
    with pytest.raises(ValueError, match="num_blocks: expected an int >= 0; got -1"):
        cache.evict(-1)
    with pytest.raises(TypeError, match="num_blocks: expected an int >= 0; got float 1.5"):
        cache.evict(1.5)
    assert cache.evict(np.int64(0)) == 0
    cache.check_invariants()


def test_append_without_room_returns_none_and_changes_nothing():
    cache = make(3)
    run(cache, "0", list(range(30)))
    run(cache, "1", [7] * 10)
    assert cache.pool.num_free == 0
    assert cache.append("0", [1, 2]) == []  # fits in block 1
    assert cache.append("0", [3]) is None  # 33 tokens need a third block
    assert cache.block_table("0") == (0, 1) and len(cache._requests.get("0").tokens) == 32
    assert cache.stats().rejected == 1
    cache.release("1")
    assert cache.append("0", [3]) == [2]
    cache.check_invariants()


def test_stats_follow_vllm_prefix_cache_stats():
    cache = make(10)
    run(cache, "0", COMMON + [5])
    run(cache, "1", COMMON + [6, 6])
    assert cache.stats() == prefixcache.CacheStats(requests=2, queries=49 + 50, hits=48)
    assert cache.stats().hit_rate == pytest.approx(48 / 99)


def test_release_frees_everything_and_rules_on_ids():
    cache = make(4)
    run(cache, "0", list(range(20)))
    with pytest.raises(ValueError, match="already live"):
        cache.admit("0", [1])
    cache.release("0")
    with pytest.raises(KeyError, match="unknown or released request '0'"):
        cache.release("0")
    with pytest.raises(KeyError):
        cache.block_table("0")
    assert cache.pool.num_pinned == 0 and cache.pool.num_cached == 1
    cache.check_invariants()


def test_bad_input_is_a_clear_error():
    cache = make(4)
    with pytest.raises(ValueError, match="at least one token"):
        cache.admit("x", [])
    with pytest.raises(TypeError, match="namespace must be a str, an Isolation or None"):
        cache.admit("x", [1], namespace=3)
    with pytest.raises(TypeError, match=r"^tokens\[1\]: expected an int token id; got str '2'$"):
        cache.admit("x", [1, "2"] * 8)
    # Ids in the unhashed tail (block_size 16) are checked too, not just hashed ones.
    with pytest.raises(TypeError, match=r"^tokens\[0\]: expected an int token id; got NoneType None$"):
        cache.admit("b", [None] * 3)
    with pytest.raises(TypeError, match=r"^tokens\[0\]: expected an int token id; got float 1.0$"):
        cache.admit("x", [1.0, 2.0])
    with pytest.raises(TypeError, match=r"^tokens\[0\]: expected an int token id; got bool True$"):
        cache.admit("x", [True, 2])
    for bad, name in ((None, "NoneType"), (5, "int"), ("abc", "str")):
        with pytest.raises(TypeError, match=rf"^tokens: expected a sequence of int token ids \(list, tuple, numpy int array\); got {name}$"):
            cache.admit("x", bad)
        with pytest.raises(TypeError, match="^tokens: expected a sequence"):
            cache.match(bad)
    run(cache, "x", [1, 2, 3])
    with pytest.raises(ValueError, match=r"num_computed_tokens=4 .* must be in \[3, 3\]"):
        cache.commit("x", 4)
    assert cache.pool.num_pinned == 1
    cache.check_invariants()


def test_admit_copies_the_prompt():
    cache = make(4)
    prompt = list(range(20))
    run(cache, "x", prompt)
    cache.append("x", [1, 2])
    assert prompt == list(range(20))


def test_config_errors():
    with pytest.raises(ConfigError, match="eviction: unknown eviction policy 'nope'"):
        make(4, eviction="nope")
    with pytest.raises(ConfigError, match="options.x: unknown option for backend hash; allowed: no_tail_cliff, retention, state_cap, state_granule, state_interval, verify_hits"):
        make(4, options={"x": 1})


def test_loads_from_yaml_and_entry_point():
    cache = prefixcache.load_cache("configs/hash.yaml")
    assert isinstance(cache, HashCache) and cache.pool.num_blocks == 4096
    assert prefixcache.resolve_backend("hash") is HashCache


@pytest.mark.parametrize("algorithm", ["sha256", "xxhash", "xxhash_cbor"])
def test_other_algorithms_hit_the_same(algorithm):
    cache = make(10, hash=HashConfig(algorithm=algorithm, seed="s"))
    run(cache, "0", COMMON + [3] * 7)
    assert run(cache, "1", COMMON + [3] * 5).num_cached_tokens == 48
    fn = hash_function(algorithm)
    assert cache.pool.key(0) == fn((none_hash(algorithm, "s"), tuple(COMMON[:16]), None))


def test_a_refused_admission_is_retried_without_hashing_again(monkeypatch):
    from prefixcache.backends import hash_base  # where both hash caches hash their chains

    calls = []
    real = hash_base.chain_digests
    monkeypatch.setattr(hash_base, "chain_digests", lambda *a: calls.append(1) or real(*a))
    cache = make(3)
    run(cache, "big", list(range(40)))
    prompt = list(range(100, 140))
    assert cache.admit("x", prompt) is None and len(calls) == 2
    cache.release("big")
    assert cache.admit("x", prompt) == prefixcache.Admission((2, 1, 0), 0)
    assert len(calls) == 2  # the retry reused the refused admission's hashes
    cache.commit("x", 40)
    assert cache.pool.key(2) == chain(prompt)[0]
    cache.release("x")
    # A different prompt (or namespace) under the same id is hashed afresh.
    assert cache.admit("x", prompt, namespace="n").num_cached_tokens == 0 and len(calls) == 3
    cache.check_invariants()


def test_a_bad_appended_token_is_refused_by_append_and_changes_nothing():
    cache = make(4)
    run(cache, "x", list(range(10)))
    before = (cache.block_table("x"), cache.pool.num_free, cache.stats())
    with pytest.raises(TypeError, match=r"^tokens\[0\]: expected an int token id; got NoneType None$"):
        cache.append("x", [None, 5.5, "x"])
    with pytest.raises(TypeError, match=r"^tokens\[1\]: expected an int token id; got str '7'$"):
        cache.append("x", [7, "7"] * 3)
    assert (cache.block_table("x"), cache.pool.num_free, cache.stats()) == before
    assert cache.append("x", [10, 11, 12, 13, 14, 15]) == []  # the request goes on as if nothing happened
    cache.commit("x", 16)
    assert cache.pool.num_cached == 1
    cache.check_invariants()
    cache.release("x")
    cache.check_invariants()


def test_pythonhashseed_seeds_the_chain_unless_the_config_does(monkeypatch):
    """vLLM 0.33 derives NONE_HASH from PYTHONHASHSEED when it is set; so do we, read
    when the cache is built. An explicit hash.seed still wins."""
    sha = hash_function("sha256_cbor")
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    for seed, root in ((None, sha("12345")), ("s", sha("s"))):
        cache = make(4, hash=HashConfig(seed=seed))
        run(cache, "0", list(range(17)))
        assert cache.pool.key(0) == sha((root, tuple(range(16)), None))


def test_numpy_ids_are_ints():
    cache = make(4)
    prompt = list(range(40))
    run(cache, "a", prompt)
    for form in (np.arange(40), np.arange(40, dtype=np.int32), [np.int64(t) for t in prompt], tuple(prompt)):
        assert cache.match(form).num_tokens == 32
        adm = cache.admit("b", form)
        assert adm.num_cached_tokens == 32
        assert cache.append("b", np.array([1, 2], dtype=np.int16)) == []
        assert type(cache._requests.get("b").tokens[-1]) is int  # hashed as Python ints, as vLLM does
        cache.release("b")
    cache.check_invariants()


def test_an_append_whose_allocation_raises_keeps_the_tokens_it_had():
    class Failing(HashCache):
        armed = False

        def _take(self, n, removed):
            if self.armed:
                raise RuntimeError("allocator bug")  # as a raising Python eviction policy would
            return super()._take(n, removed)

    cache = Failing(prefixcache.BlockPool(8), CacheConfig(block_size=BS, num_blocks=8))
    cache.admit("r", list(range(BS)))
    cache.armed = True
    with pytest.raises(RuntimeError, match="allocator bug"):
        cache.append("r", [7, 8])  # the 17th token needs a new block
    cache.check_invariants()  # one block for the BS tokens it still has
    cache.armed = False
    assert len(cache.append("r", [7])) == 1 and len(cache.block_table("r")) == 2
    cache.commit("r", BS + 1)
    cache.check_invariants()
