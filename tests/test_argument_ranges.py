"""Every argument range is checked before anything changes.

`radix` took `admit(..., priority=2**70)`; `commit` and `release` then failed with
pybind11's "incompatible function arguments" after `release` had dropped the request,
so its blocks stayed pinned forever while `reset()` said True. Priorities are int64 on
both backends (numpy integers accepted, bools not), refused at `admit` with the
argument named; `commit` takes numpy integers like every other count; and no int out
of int64 reaches a native call as pybind11's TypeError, from the backends or from the
native tree and evictor themselves.
"""

from __future__ import annotations

import pytest

import prefixcache
from prefixcache._C import BlockEvictor, BlockPool, RadixTree
from prefixcache.config import CacheConfig

np = pytest.importorskip("numpy")

BACKENDS = [("radix", "lru"), ("hash", "lru"), ("hash", "priority"), ("radix", "priority")]
HUGE = (2**70, -(2**70), 2**63, -(2**63) - 1)


def build(backend, eviction):
    return prefixcache.build_cache(CacheConfig(backend=backend, block_size=2, num_blocks=8, eviction=eviction))


def drained(cache):
    """Nothing live: everything evicts, nothing stays pinned, reset succeeds."""
    cache.check_invariants()
    cache.evict(cache.pool.num_blocks)
    assert cache.pool.num_free == cache.pool.num_blocks
    assert cache.reset() is True


@pytest.mark.parametrize("backend,eviction", BACKENDS)
@pytest.mark.parametrize("priority", HUGE)
def test_priority_beyond_int64_is_refused_at_admit(backend, eviction, priority):
    cache = build(backend, eviction)
    with pytest.raises(ValueError, match=r"priority: expected an int64 in \[-2\*\*63, 2\*\*63 - 1\]"):
        cache.admit("r", [1, 2, 3], priority=priority)
    with pytest.raises(KeyError):
        cache.release("r")  # never admitted
    assert cache.pool.num_pinned == 0
    assert cache.reset() is True
    cache.check_invariants()


@pytest.mark.parametrize("backend,eviction", BACKENDS)
def test_priorities_at_the_int64_limits_live_a_whole_request(backend, eviction):
    cache = build(backend, eviction)
    for i, priority in enumerate((2**63 - 1, -(2**63), np.int64(7), np.int32(-3))):
        assert cache.admit(i, [1, 2, 3, 4, 10 + i], priority=priority) is not None
        cache.commit(i, 5)
        cache.release(i)
    drained(cache)


@pytest.mark.parametrize("backend,eviction", BACKENDS)
@pytest.mark.parametrize("priority", [True, 1.0, "2", None])
def test_priority_of_another_type_is_refused(backend, eviction, priority):
    cache = build(backend, eviction)
    with pytest.raises(TypeError, match="priority: expected an int64"):
        cache.admit("r", [1, 2, 3], priority=priority)
    assert cache.reset() is True


@pytest.mark.parametrize("backend,eviction", BACKENDS)
def test_commit_takes_numpy_integers(backend, eviction):
    cache = build(backend, eviction)
    cache.admit("r", [1, 2, 3, 4, 5])
    cache.commit("r", np.int64(2))
    cache.commit("r", np.int32(4))
    cache.commit("r", np.uint8(5))
    cache.release("r")
    assert cache.match([1, 2, 3, 4]).num_tokens == 4
    with pytest.raises(TypeError, match="num_computed_tokens"):
        cache.admit("s", [1, 2]) and cache.commit("s", np.float64(1))
    with pytest.raises(ValueError, match="num_computed_tokens"):
        cache.commit("s", np.int64(2**62))


@pytest.mark.parametrize("backend,eviction", BACKENDS)
def test_no_int_reaches_pybind11_unchecked(backend, eviction):
    """Each int argument of each call, at values beyond int64: the call's own error."""
    cache = build(backend, eviction)
    cache.admit("live", [1, 2, 3])
    calls = []
    for v in HUGE:
        calls += [
            lambda v=v: cache.commit("live", v),
            lambda v=v: cache.evict(v),
            lambda v=v: cache.admit("x", [1, v]),
            lambda v=v: cache.append("live", [v]),
            lambda v=v: cache.match([v]),
            lambda v=v: cache.admit("x", [1], priority=v),
        ]
    for call in calls:
        try:
            call()
        except (TypeError, ValueError, KeyError, IndexError) as err:
            assert "incompatible function arguments" not in str(err), err
    cache.release("live")
    try:
        cache.release("x")  # hash admits ids beyond int64 (CBOR bignums); radix refuses them
    except KeyError:
        assert backend == "radix"
    drained(cache)


def test_native_tree_and_evictor_arguments_beyond_int64():
    pool = BlockPool(8)
    tree = RadixTree(pool, 1, "lru")
    node = tree.insert([1, 2], pool.allocate(2), None, 0, 0).node
    for v in HUGE:
        for call in (lambda: tree.lock(v), lambda: tree.unlock(v), lambda: tree.node(v)):
            with pytest.raises(ValueError, match="does not exist"):
                call()
        with pytest.raises(ValueError, match="priority: expected an int64"):
            tree.insert([1, 2, 3], pool.allocate(1), None, v, 2)
        with pytest.raises(ValueError, match="start"):
            tree.insert([1, 2], [], None, 0, v)
    assert pool.num_pinned == 2 + 4  # the tree's two, and the four refused blocks the test holds
    tree.lock(node)
    tree.unlock(node)
    tree.check_invariants([])

    evictor = BlockEvictor(BlockPool(4), 2, "lfu")
    for v in HUGE:
        with pytest.raises(ValueError, match="priority: expected an int64"):
            evictor.admit([], 0, v)
        with pytest.raises(IndexError):
            evictor.candidate(v)
    assert evictor.make_room(2**70) == [] and evictor.evict(2**70) == []
    with pytest.raises(ValueError):
        evictor.evict(-(2**70))
    evictor.check_invariants()
