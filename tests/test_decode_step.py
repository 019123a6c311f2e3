"""The native decode-step calls (`_C.append_step`, `_C.commit_blocks`): each outcome their
docstrings promise, errors before anything changed, and the `hash` backend's commit
through them equal to the Python path it replaces."""

from __future__ import annotations

import random
from array import array

import pytest

import prefixcache
from prefixcache._C import BlockPool, append_step, commit_blocks
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.hashing import chain_digests, none_hash


def test_append_step_appends_and_says_what_the_table_still_needs():
    buf, table = array("q", [1, 2, 3]), [7]
    assert append_step(buf, [4], table, 4, None, 0, 0) == []  # fits block 7
    assert list(buf) == [1, 2, 3, 4] and table == [7]
    assert append_step(buf, (5, 6), table, 4, None, 0, 0) == 2  # a block is needed, no pool given
    assert list(buf) == [1, 2, 3, 4, 5, 6] and table == [7]


def test_append_step_takes_free_blocks_from_the_pool():
    pool = BlockPool(4)
    buf, table = array("i"), []
    added = append_step(buf, [9], table, 2, pool, 1, 1)
    assert added == table and len(added) == 1 and pool.num_free == 3
    assert append_step(buf, [8], table, 2, pool, 1, 1) == [] and list(buf) == [9, 8]
    assert append_step(buf, [7, 6, 5], table, 2, pool, 1, 1) == 3  # more ids than max_tokens
    assert len(table) == 1 and pool.num_free == 3
    many = append_step(array("i"), list(range(5)), [], 2, pool, 0, 0)
    assert len(many) == 3 and pool.num_free == 0
    assert append_step(array("i"), [1], [], 2, pool, 0, 0) == 1  # none free: the caller's way


def test_append_step_min_free_holds_even_without_a_new_block():
    pool = BlockPool(1)
    pool.allocate(1)
    buf, table = array("i", [1]), [0]
    assert append_step(buf, [2], table, 4, pool, 1, 1) == 1  # radix: a page of room first
    assert append_step(buf, [3], table, 4, pool, 0, 1) == []


def test_append_step_leaves_ids_beyond_int64_and_lists_alone():
    buf = array("q", [1])
    assert append_step(buf, [2**70], [0], 4, None, 0, 0) is None and list(buf) == [1]
    held = [1, 2]
    assert append_step(held, [3], [0], 4, None, 0, 0) is None and held == [1, 2]


@pytest.mark.parametrize("bad, error, match", [
    ([True], TypeError, r"tokens\[0\]"),
    ([1.0], TypeError, r"tokens\[0\]"),
    ("ab", TypeError, "tokens"),
    ([2**31], ValueError, r"tokens\[0\]: expected an int32"),
])  # fmt: skip
def test_append_step_errors_change_nothing(bad, error, match):
    pool = BlockPool(2)
    buf, table = array("i", [1]), [pool.allocate(1)[0]]
    with pytest.raises(error, match=match):
        append_step(buf, bad, table, 1, pool, 1, 1)
    assert list(buf) == [1] and len(table) == 1 and pool.num_free == 1


def test_commit_blocks_extends_the_chain_and_keys_the_pool():
    pool = BlockPool(8)
    table = pool.allocate(3)
    tokens = array("q", range(100, 112))  # three blocks of 4
    root = none_hash("sha256_cbor")
    digests = bytearray(chain_digests(tokens[:4], 4, "sha256_cbor", root))  # block 0 hashed at admission
    assert commit_blocks(pool, digests, tokens, table, 0, 3, 4, "sha256_cbor", root) is True
    assert bytes(digests) == chain_digests(tokens, 4, "sha256_cbor", root)
    assert [pool.key(b) for b in table] == [bytes(digests[i * 32 : (i + 1) * 32]) for i in range(3)]


def test_commit_blocks_errors_change_nothing():
    pool = BlockPool(4)
    table = pool.allocate(2)
    tokens = array("q", range(8))
    root = none_hash("sha256_cbor")
    digests = bytearray()
    with pytest.raises(ValueError, match="fewer full blocks"):
        commit_blocks(pool, digests, tokens[:6], table, 0, 2, 4, "sha256_cbor", root)
    assert digests == bytearray()
    pool.free([table[1]])  # a free block cannot be keyed: the pool refuses, all or nothing
    with pytest.raises(ValueError):
        commit_blocks(pool, digests, tokens, table, 0, 2, 4, "sha256_cbor", root)
    assert pool.key(table[0]) is None and pool.num_cached == 0
    assert bytes(digests) == chain_digests(tokens, 4, "sha256_cbor", root)  # the chain, as Python grows it
    with pytest.raises(ValueError, match="allowed values"):
        commit_blocks(pool, digests, tokens, table, 0, 1, 4, "md5", root)
    assert commit_blocks(pool, digests, list(tokens), table, 0, 1, 4, "sha256_cbor", root) is False


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "sha256"])
def test_hash_commit_natively_equals_the_python_path(algorithm):
    """The same random run through a cache that commits natively and one made to take
    the Python path: identical hits, tables, hashes and pool keys."""

    def make(native: bool):
        cache = prefixcache.build_cache(
            CacheConfig(backend="hash", block_size=4, num_blocks=48, hash=HashConfig(algorithm), enable_events=False)
        )
        assert cache._commit_natively
        cache._commit_natively = native
        return cache

    rng = random.Random(7)
    prefixes = [[rng.randrange(50_000) for _ in range(rng.randint(1, 14))] for _ in range(4)]
    caches = [make(True), make(False)]
    live: list[int] = []
    for rid in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(rng.randint(1, 9))]
        steps = rng.randint(0, 11)
        outcomes = []
        for cache in caches:
            adm = cache.admit(rid, prompt)
            if adm is None:
                outcomes.append(None)
                continue
            n = len(prompt)
            cache.commit(rid, n)
            for t in range(steps):
                if cache.append(rid, [t + 1]) is None:
                    break
                n += 1
                cache.commit(rid, n)
            req = cache._requests.get(rid)
            outcomes.append((adm.num_cached_tokens, list(cache.block_table(rid)), bytes(req.digests)))
        assert outcomes[0] == outcomes[1]
        if outcomes[0] is not None:
            live.append(rid)
        while len(live) > 3:
            victim = live.pop(0)
            for cache in caches:
                cache.release(victim)
    for cache in caches:
        for rid in live:
            cache.release(rid)
        cache.check_invariants()
    keys = [[c.pool.key(b) for b in range(48)] for c in caches]
    assert keys[0] == keys[1]


def test_a_subclass_commit_is_not_bypassed_by_the_fused_call():
    from prefixcache.backends.hash import HashCache
    from prefixcache.protocol import guarded

    class Counting(HashCache):
        commits = 0

        @guarded
        def commit(self, request_id, num_computed_tokens):
            type(self).commits += 1
            return HashCache.commit.__wrapped__(self, request_id, num_computed_tokens)

    cache = Counting(BlockPool(8), CacheConfig(backend="hash", block_size=4, num_blocks=8))
    cache.admit("r", [1, 2, 3, 4, 5])
    assert cache.commit_and_append("r", 5, [6]) == [] and Counting.commits == 1
    assert len(cache.block_table("r")) == 2
    cache.release("r")
    cache.check_invariants()
