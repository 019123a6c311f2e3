"""BlockPool: every operation and every error path, on the native pool and its Python model."""

from __future__ import annotations

import pytest
from reference.block_pool import PyBlockPool

from prefixcache._C import BlockPool, InvariantError

POOLS = [BlockPool, PyBlockPool]


@pytest.fixture(params=POOLS, ids=["native", "python"])
def make(request):
    def build(n: int):
        return request.param(n)

    return build


def test_starts_in_id_order_all_free(make):
    pool = make(5)
    assert pool.num_blocks == 5
    assert pool.free_queue() == [0, 1, 2, 3, 4]
    assert (pool.num_free, pool.num_pinned, pool.num_cached) == (5, 0, 0)
    pool.check_invariants()


@pytest.mark.parametrize("n", [0, -1, 1 << 31])
def test_bad_size(n):
    for cls in POOLS:
        with pytest.raises(ValueError, match="num_blocks"):
            cls(n)


def test_allocate_takes_from_front(make):
    pool = make(5)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(0) == []
    assert [pool.ref_count(b) for b in range(5)] == [1, 1, 0, 0, 0]
    assert pool.free_queue() == [2, 3, 4]
    assert (pool.num_free, pool.num_pinned) == (3, 2)
    pool.check_invariants()


def test_allocate_too_many_returns_none_and_changes_nothing(make):
    pool = make(4)
    pool.allocate(3)
    pool.cache(0, b"k0")
    assert pool.allocate(2) is None
    assert pool.free_queue() == [3]
    assert pool.num_free == 1 and pool.key(0) == b"k0"
    pool.check_invariants()


@pytest.mark.parametrize("n", [-1, 5, 2**70, -(2**70), 2**63])
def test_allocate_bad_n(make, n):
    pool = make(4)
    # The value passed, not the int64 the native pool saturated it to.
    with pytest.raises(ValueError, match=rf"^allocate: n must be in \[0, num_blocks=4\], got {n}$"):
        pool.allocate(n)


def test_errors_beyond_int64_show_the_value_passed():
    with pytest.raises(ValueError, match=rf"got {2**70}$"):
        BlockPool(2**70)
    pool = BlockPool(4)
    with pytest.raises(IndexError, match=rf"block id {2**70} is out of range"):
        pool.cache(2**70, b"k")
    with pytest.raises(ValueError, match=rf"got {-(2**70)}$"):
        pool.evict_front(-(2**70))


def test_free_keyless_to_front_keyed_to_tail_in_given_order(make):
    pool = make(8)
    ids = pool.allocate(6)
    assert ids == [0, 1, 2, 3, 4, 5]
    pool.cache(1, b"a")
    pool.cache(4, b"b")
    pool.cache(2, b"c")
    # vLLM frees a request's blocks in reverse; the pool keeps the given order.
    pool.free([5, 4, 3, 2, 1, 0])
    assert pool.free_queue() == [5, 3, 0, 6, 7, 4, 2, 1]
    pool.check_invariants()


def test_free_only_at_zero(make):
    pool = make(3)
    pool.allocate(1)
    pool.touch([0])
    pool.free([0])
    assert pool.ref_count(0) == 1 and pool.free_queue() == [1, 2]
    pool.free([0])
    assert pool.ref_count(0) == 0 and pool.free_queue() == [0, 1, 2]


def test_free_errors_change_nothing(make):
    pool = make(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="block 2 is already free"):
        pool.free([0, 2])
    with pytest.raises(ValueError, match="more than once"):
        pool.free([1, 1])
    with pytest.raises(IndexError, match="block id 4 is out of range"):
        pool.free([0, 4])
    with pytest.raises(IndexError, match="block id -1 is out of range"):
        pool.free([-1])
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 0, 0]
    assert pool.free_queue() == [2, 3]
    pool.check_invariants()


def test_touch_pins_and_removes_from_middle(make):
    pool = make(5)
    pool.touch([2])
    assert pool.free_queue() == [0, 1, 3, 4] and pool.ref_count(2) == 1
    pool.touch([2, 4])
    assert pool.ref_count(2) == 2 and pool.free_queue() == [0, 1, 3]
    with pytest.raises(ValueError, match="more than once"):
        pool.touch([0, 0])
    with pytest.raises(IndexError):
        pool.touch([5])
    assert pool.free_queue() == [0, 1, 3]
    pool.check_invariants()


def test_cache_lookup_and_duplicate_keys(make):
    pool = make(6)
    pool.allocate(4)
    pool.cache(2, b"h")
    pool.cache(0, b"h")
    pool.cache(1, b"g")
    assert pool.lookup(b"h") == 2  # earliest cached holder
    assert pool.blocks_for(b"h") == [2, 0]
    assert pool.lookup(b"nope") is None
    assert pool.lookup_chain([b"g", b"h", b"x", b"g"]) == [1, 2]
    assert pool.num_cached == 3
    assert pool.uncache(2) == b"h"
    assert pool.lookup(b"h") == 0
    assert pool.uncache(2) is None
    assert pool.uncache_all() == 2
    assert pool.num_cached == 0 and pool.lookup(b"g") is None
    pool.check_invariants()


def test_cache_errors(make):
    pool = make(3)
    pool.allocate(1)
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.cache(1, b"k")
    with pytest.raises(ValueError, match="non-empty"):
        pool.cache(0, b"")
    pool.cache(0, b"k")
    with pytest.raises(ValueError, match="already holds a key"):
        pool.cache(0, b"j")
    with pytest.raises(IndexError):
        pool.cache(3, b"k")
    with pytest.raises(IndexError):
        pool.uncache(-2)
    with pytest.raises(IndexError):
        pool.ref_count(3)
    with pytest.raises(IndexError):
        pool.key(3)


def test_cached_block_stays_hittable_until_reused(make):
    pool = make(3)
    pool.allocate(2)
    pool.cache(0, b"a")
    pool.cache(1, b"b")
    pool.free([1, 0])
    assert pool.free_queue() == [2, 1, 0]
    assert pool.lookup(b"a") == 0 and pool.num_cached == 2
    # Reusing pops keyless block 2 first, then the LRU cached one.
    assert pool.allocate(2) == [2, 1]
    assert pool.last_removed() == [b"b"]
    assert pool.lookup(b"b") is None and pool.key(1) is None
    assert pool.num_evicted == 1
    pool.check_invariants()


def test_reused_duplicate_drops_only_its_own_entry(make):
    pool = make(3)
    pool.allocate(2)
    pool.cache(0, b"h")
    pool.cache(1, b"h")
    pool.free([0, 1])
    pool.allocate(2)  # 2 (keyless), then 0
    assert pool.last_removed() == [b"h"]
    assert pool.lookup(b"h") == 1


def test_touch_a_free_cached_block_protects_it(make):
    # vLLM test_computed_blocks_not_evicted, at the pool level.
    pool = make(2)
    pool.allocate(2)
    pool.cache(0, b"a")
    pool.cache(1, b"b")
    pool.free([0])
    pool.free([1])
    hit = pool.lookup(b"a")
    pool.touch([hit])
    assert pool.allocate(1) == [1]
    assert pool.key(0) == b"a"


def test_keys_are_bytes_only():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(TypeError):
        pool.cache(0, "text")
    with pytest.raises(TypeError):
        pool.free(["0"])


def test_invariant_error_is_an_assertion_error():
    assert issubclass(InvariantError, AssertionError)


def test_cache_many_is_all_or_nothing(make):
    pool = make(4)
    pool.allocate(3)
    with pytest.raises(ValueError, match="block 3 is free"):
        pool.cache_many([0, 1, 3], [b"a", b"b", b"c"])
    with pytest.raises(ValueError, match="2 ids but 1 keys"):
        pool.cache_many([0, 1], [b"a"])
    with pytest.raises(ValueError, match="more than once"):
        pool.cache_many([0, 0], [b"a", b"b"])
    assert pool.num_cached == 0
    pool.cache_many([0, 2], [b"a", b"b"])
    assert (pool.key(0), pool.key(2), pool.num_cached) == (b"a", b"b", 2)
    pool.check_invariants()


def test_count_free_counts_what_touch_would_take(make):
    pool = make(4)
    pool.allocate(2)
    assert pool.count_free([0, 1, 2, 3]) == 2
    assert pool.count_free([]) == 0
    with pytest.raises(IndexError, match="count_free: block id 4 is out of range"):
        pool.count_free([0, 4])
    before = pool.num_free
    pool.touch([1, 2, 3])
    assert before - pool.num_free == 2  # 2 and 3 left the queue; 1 was pinned already


def test_evict_front_drops_lru_keys_in_queue_order(make):
    pool = make(6)
    pool.allocate(5)
    for b, key in zip([0, 1, 2, 3], [b"a", b"b", b"c", b"d"]):
        pool.cache(b, key)
    pool.free([4, 3, 2])  # queue: 4 (keyless, front), 5, then 3, 2 at the tail
    pool.free([1, 0])
    assert pool.free_queue() == [4, 5, 3, 2, 1, 0]
    assert pool.evict_front(3) == [b"d", b"c", b"b"]
    # Evicted blocks keep their place and lose their key; the rest stay hittable.
    assert pool.free_queue() == [4, 5, 3, 2, 1, 0]
    assert [pool.key(b) for b in (3, 2, 1, 0)] == [None, None, None, b"a"]
    assert pool.lookup(b"d") is None and pool.lookup(b"a") == 0
    assert (pool.num_cached, pool.num_evicted) == (1, 3)
    assert pool.evict_front(5) == [b"a"]
    assert pool.evict_front(5) == [] and pool.evict_front(0) == []
    pool.check_invariants()


def test_evict_front_never_touches_pinned_blocks(make):
    pool = make(3)
    pool.allocate(2)
    pool.cache(0, b"a")
    pool.cache(1, b"b")
    pool.free([1])
    assert pool.evict_front(2) == [b"b"]
    assert pool.key(0) == b"a"
    with pytest.raises(ValueError, match="evict_front: n must be >= 0"):
        pool.evict_front(-1)


def test_evict_blocks_uncaches_and_moves_to_front_in_given_order(make):
    pool = make(6)
    pool.allocate(5)
    for b, key in zip([0, 1, 2, 3], [b"a", b"b", b"c", b"d"]):
        pool.cache(b, key)
    pool.free([4, 3, 2, 1, 0])  # queue: 4 (keyless), 5, then 3, 2, 1, 0
    assert pool.evict_blocks([1, 3]) == [b"b", b"d"]
    # The victims are next to be reused, in the order given, ahead of the keyless blocks.
    assert pool.free_queue() == [1, 3, 4, 5, 2, 0]
    assert [pool.key(b) for b in range(4)] == [b"a", None, b"c", None]
    assert (pool.num_cached, pool.num_evicted) == (2, 2)
    assert pool.allocate(2) == [1, 3] and pool.last_removed() == []
    assert pool.evict_blocks([]) == []
    pool.check_invariants()


def test_evict_blocks_refuses_pinned_keyless_or_repeated_blocks_and_changes_nothing(make):
    pool = make(4)
    pool.allocate(3)
    pool.cache(0, b"a")
    pool.cache(1, b"b")
    pool.free([1, 2])
    before = (pool.free_queue(), pool.num_cached, pool.num_evicted)
    for ids, error, message in (
        ([1, 0], ValueError, "evict_blocks: block 0 is in use"),
        ([1, 2], ValueError, "evict_blocks: block 2 holds no key"),
        ([1, 1], ValueError, "evict_blocks: block 1 appears more than once"),
        ([1, 4], IndexError, "evict_blocks: block id 4 is out of range"),
    ):
        with pytest.raises(error, match=message):
            pool.evict_blocks(ids)
        assert (pool.free_queue(), pool.num_cached, pool.num_evicted) == before


def test_packed_keys_are_the_same_as_a_list(make):
    pool = make(6)
    pool.allocate(4)
    pool.cache_many_packed([2, 0, 1], b"aabbaa", 2)
    assert [pool.key(b) for b in (2, 0, 1)] == [b"aa", b"bb", b"aa"]
    assert pool.blocks_for(b"aa") == [2, 1]
    assert pool.lookup_chain_packed(b"aabbccaa", 2) == [2, 0]
    assert pool.lookup_chain_packed(b"", 4) == []
    pool.check_invariants()


def test_packed_keys_with_a_suffix_are_the_suffixed_keys(make):
    """A layer group's keys: each packed key followed by the group's mark."""
    pool = make(6)
    pool.allocate(4)
    pool.cache_many_packed([2, 0], b"aabb", 2, b"#1")
    pool.cache_many_packed([1], b"aa", 2)
    assert [pool.key(b) for b in (2, 0, 1)] == [b"aa#1", b"bb#1", b"aa"]
    assert pool.lookup_chain_packed(b"aabbcc", 2, b"#1") == [2, 0]
    assert pool.lookup_chain_packed(b"aabb", 2) == [1]
    assert pool.lookup_chain_packed(b"aabb", 2, b"") == [1]
    with pytest.raises(TypeError, match="suffix"):
        pool.lookup_chain_packed(b"aa", 2, "#1")
    pool.check_invariants()


def test_packed_keys_errors_change_nothing(make):
    pool = make(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="cache_many_packed: key_size must be >= 1 and divide the 5 key bytes, got 2"):
        pool.cache_many_packed([0, 1], b"aabbc", 2)
    with pytest.raises(ValueError, match="lookup_chain_packed: key_size must be >= 1"):
        pool.lookup_chain_packed(b"aa", 0)
    with pytest.raises(ValueError, match="2 ids but 3 keys"):
        pool.cache_many_packed([0, 1], b"aabbcc", 2)
    with pytest.raises(ValueError, match="block 3 is free"):
        pool.cache_many_packed([0, 3], b"aabb", 2)
    with pytest.raises(TypeError):
        pool.lookup_chain_packed([b"aa"], 2)
    assert pool.num_cached == 0
    pool.check_invariants()
