"""Bugs the fuzz harnesses found, each as the plain scenario it came down to.

The inputs themselves are in fuzz/regressions/<harness>/ (replayed by
test_fuzz_harnesses.py); these tests say what was wrong and what is right now.
"""

from __future__ import annotations

import pytest
from reference.block_pool import PyBlockPool
from reference.radix_tree import PyRadixTree

import prefixcache
from prefixcache.block_contents import BlockContents, PyBlockContents
from prefixcache._C import BlockPool, RadixTree
from prefixcache.config import CacheConfig, ConfigError, HashConfig
from prefixcache.config_checks import load_config
from prefixcache.hashing import chain_hashes, reference_chain_hashes

HUGE = 2**70


@pytest.mark.parametrize("Pool", [BlockPool, PyBlockPool])
def test_pool_ids_and_counts_beyond_int64(Pool):
    """fuzz_block_pool: native free([2**70]) raised OverflowError, free((2**70,)) a
    RuntimeError ("Unable to cast"), scalar arguments a TypeError ("incompatible
    function arguments"); the model raised IndexError / ValueError as documented."""
    pool = Pool(4)
    for call in (
        lambda: pool.free([HUGE]),
        lambda: pool.free((HUGE,)),
        lambda: pool.touch([-HUGE]),
        lambda: pool.count_free([HUGE]),
        lambda: pool.cache(HUGE, b"k"),
        lambda: pool.uncache(HUGE),
        lambda: pool.ref_count(HUGE),
        lambda: pool.key(-HUGE),
        lambda: pool.cache_many([HUGE], [b"k"]),
    ):
        with pytest.raises(IndexError, match="out of range"):
            call()
    for call in (
        lambda: pool.allocate(HUGE),
        lambda: pool.evict_front(-HUGE),
        lambda: pool.lookup_chain_packed(b"kk", HUGE),
        lambda: Pool(HUGE),
    ):
        with pytest.raises(ValueError):
            call()
    assert pool.evict_front(HUGE) == []  # any count is valid: "all there are"
    with pytest.raises(TypeError):
        pool.free([1.0])
    pool.check_invariants()
    assert pool.num_free == 4


@pytest.mark.parametrize("Store", [BlockContents, PyBlockContents])
def test_block_contents_arguments_beyond_int64(Store):
    store = Store(BlockPool(4), 2)
    for call in (lambda: store.record(HUGE, [0], [1, 2], 0, b""), lambda: store.depth(HUGE)):
        with pytest.raises(IndexError):
            call()
    with pytest.raises(IndexError):
        store.record(-1, [0], [1, 2], HUGE, b"")
    with pytest.raises(ValueError, match="key_size"):
        store.lookup_chain(b"kk", HUGE, [1, 2], b"")
    with pytest.raises(ValueError):
        Store(BlockPool(4), HUGE)


@pytest.mark.parametrize("Tree", [RadixTree, PyRadixTree])
def test_radix_tree_namespace_with_a_lone_surrogate(Tree):
    """fuzz_radix_tree: the native tree raised RuntimeError ("Unable to cast Python
    instance of type str") and the model accepted the namespace; both refuse it now."""
    pool = BlockPool(4) if Tree is RadixTree else PyBlockPool(4)
    tree = Tree(pool, 1, "lru")
    for call in (
        lambda: tree.match([1, 2], "\ud800"),
        lambda: tree.match_prefix([1, 2], "a\udfff"),
        lambda: tree.insert([1], pool.allocate(1), "\udc80", 0, 0),
        lambda: tree.root("\ud800"),
    ):
        with pytest.raises(ValueError, match="valid Unicode"):
            call()
    assert tree.match([1], "\u00e9t\u00e9").num_tokens == 0  # non-ASCII text is fine


def test_unencodable_extra_keys_on_a_block_that_does_not_exist():
    """fuzz_hashing: the native path CBOR-encoded extra keys up front, so a key UTF-8
    cannot encode failed a chain too short to carry it; the reference hashes nothing."""
    bad = (("cache_salt", "\udc9a"),)
    for tokens, first, later in (([], bad, None), ([1, 2], None, bad)):
        assert chain_hashes(tokens, 2, "sha256_cbor", b"p", first, later) == reference_chain_hashes(
            tokens, 2, "sha256_cbor", b"p", first, later
        )
    with pytest.raises(UnicodeEncodeError):  # a block that carries it: both refuse
        chain_hashes([1, 2], 2, "sha256_cbor", b"p", bad)


def test_config_file_that_is_not_utf8(tmp_path):
    """fuzz_config: a file of non-UTF-8 bytes escaped as UnicodeDecodeError."""
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"cache:\n  backend: h\xe8sh\n")
    with pytest.raises(
        ConfigError, match=r"bad\.yaml: config file is not UTF-8 text \(byte 19: invalid continuation byte\)"
    ):
        load_config(path)


def test_verified_cache_with_a_token_beyond_int64():
    """fuzz_backends: under xxhash a block holding an id beyond int64 is recorded as
    unprovable (never hit), and check_invariants took that for a lie."""
    cache = prefixcache.build_cache(CacheConfig(block_size=1, num_blocks=6, hash=HashConfig("xxhash")))
    prompt = [-(2**63) - 1, 5]
    cache.admit("r", prompt)
    cache.commit("r", 2)
    cache.check_invariants()
    cache.release("r")
    assert cache.admit("again", prompt).num_cached_tokens == 0  # hashed alike, never proved
    assert cache.stats().verify_failures == 0  # a plain miss, not a collision
    cache.check_invariants()


@pytest.mark.parametrize("Tree", [RadixTree, PyRadixTree])
def test_radix_evict_of_more_than_int64_tokens(Tree):
    pool = BlockPool(4) if Tree is RadixTree else PyBlockPool(4)
    tree = Tree(pool, 1, "lru")
    tree.insert([1, 2], pool.allocate(2), None, 0, 0)
    assert tree.evict(2**64) == 2 and pool.num_free == 4


def test_radix_backend_evict_of_a_huge_count():
    """fuzz_backends (a 300 s run): `evict(2**63)` made the radix backend ask the tree for
    more than int64 tokens; pybind11 refused the argument with a TypeError, and the
    backend's clean-up then replayed the previous call's evictions: evictions counted
    twice and a KeyError for a page hash already dropped. It evicts everything now."""
    cache = prefixcache.build_cache(CacheConfig(backend="radix", block_size=2, num_blocks=8))
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [7, 8, 9])):
        cache.admit(rid, prompt)
        cache.commit(rid, len(prompt))
        cache.release(rid)
    first = cache.evict(1)  # a whole leaf: one or two pages
    assert cache.evict(2**63) == 3 - first and cache.evict(2**200) == 0
    assert cache.stats().evictions == 3 and cache.pool.num_free == 8
    assert sum(isinstance(e, prefixcache.BlockRemoved) for e in cache.drain_events()) == 3
    cache.check_invariants()


def test_hybrid_ids_beyond_the_strategy_range():
    """fuzz_hybrid (its first replay): over a hybrid layout, `radix` let an id beyond
    int64 reach its tree's int64 keys (OverflowError from `match`, `admit` and `append`),
    and `hash` appended one to the request's int64 buffer (OverflowError). `radix` refuses
    ids beyond int32 by name, as over full attention; `hash` keeps the request's ids as
    ints from then on and hashes them (CBOR bignums)."""
    from prefixcache.layout import LayerGroup

    layout = (LayerGroup("full_attention"), LayerGroup("sliding_window", window=8), LayerGroup("mamba"))
    radix = prefixcache.build_cache(CacheConfig(backend="radix", block_size=2, num_blocks=64, layout=layout))
    assert radix.admit("r", [1, 2, 3]) is not None
    for call in (lambda: radix.match([1, HUGE]), lambda: radix.admit("s", [1, HUGE]), lambda: radix.append("r", [HUGE])):
        with pytest.raises(ValueError, match=r"tokens\[\d\]: expected an int32 token id"):
            call()
    radix.release("r")
    radix.check_invariants()
    hashed = prefixcache.build_cache(CacheConfig(block_size=2, num_blocks=64, layout=layout,
                                                 options={"retention": "dense"}))  # fmt: skip
    adm = hashed.admit("r", [1, 2, 3])
    for c in adm.checkpoints:
        hashed.commit("r", c)
        hashed.append("r", [])
    hashed.commit("r", 3)
    assert hashed.append("r", [HUGE]) == []  # inside the last block
    hashed.commit("r", 4)
    hashed.release("r")
    assert hashed.match([1, 2, 3, HUGE, 5]).num_tokens == 4  # both blocks kept, the bignum's too
    hashed.check_invariants()
