"""Namespace roots go when their subtree empties.

Every namespace a radix cache had ever seen kept a root, so a million one-request
tenants kept a million roots (+447 MB) after all their content was evicted, and
`RadixTree.node()` scanned every root to name a node's namespace, which made
`check_invariants()` O(nodes x namespaces). Now a root lives only while it has a child
or a lock (a live request in its namespace), an empty match in a namespace without one
makes none, and `node()` is O(1). The memory and time figures at scale are
benchmarks/bench_namespaces.py's.
"""

from __future__ import annotations

import pytest
from reference.block_pool import PyBlockPool
from reference.radix_tree import PyRadixTree

import prefixcache
from prefixcache._C import BlockPool, RadixTree
from prefixcache.config import CacheConfig


def radix(num_blocks=16, block_size=1):
    return prefixcache.build_cache(CacheConfig(backend="radix", block_size=block_size, num_blocks=num_blocks))


def test_one_request_tenants_leave_no_root_behind():
    cache = radix(num_blocks=16)
    for i in range(400):
        ns = f"tenant-{i}"
        assert cache.admit(i, [i, i + 1, i + 2], namespace=ns) is not None
        cache.commit(i, 3)
        cache.release(i)
    # The pool holds a few tenants' content at a time: the rest were evicted, roots too.
    assert len(cache.tree.namespaces()) <= 16
    cache.check_invariants()
    cache.evict(16)
    assert cache.tree.namespaces() == [] and cache.tree.num_nodes == 0
    cache.check_invariants()


def test_a_live_request_keeps_its_namespace_root():
    cache = radix(num_blocks=8)
    cache.admit("a", [1, 2, 3], namespace="t")
    cache.commit("a", 3)
    cache.release("a")
    # A miss in a namespace that has a root: the request holds the root, locked.
    assert cache.admit("b", [7, 8], namespace="t").num_cached_tokens == 0
    root = cache.tree.root("t")
    assert cache.tree.node(root).lock_ref == 1
    cache.evict(8)  # the cached [1, 2] goes; the root stays for "b"
    assert cache.match([1, 2], namespace="t").num_tokens == 0
    assert cache.tree.namespaces() == ["t"] and cache.tree.node(root).children == {}
    cache.check_invariants()
    cache.commit("b", 2)
    cache.release("b")  # its computed [7, 8] is cached under the root
    assert cache.match([7, 8], namespace="t").num_tokens == 2
    cache.evict(8)
    assert cache.tree.namespaces() == []
    cache.check_invariants()


def test_a_miss_in_a_namespace_without_a_root_makes_none():
    cache = radix(num_blocks=8)
    adm = cache.admit("a", [1], namespace="new")  # a one-token prompt: nothing to insert on release
    assert adm.num_cached_tokens == 0 and cache.tree.namespaces() == []
    cache.check_invariants()
    cache.release("a")
    assert cache.tree.namespaces() == [] and cache.tree.num_nodes == 0
    assert cache.reset()


@pytest.mark.parametrize("Tree,Pool", [(RadixTree, BlockPool), (PyRadixTree, PyBlockPool)])
def test_tree_roots_follow_children_and_locks(Tree, Pool):
    pool = Pool(8)
    tree = Tree(pool, 1, "lru")
    m = tree.match_prefix([1, 2], "x")
    assert m.node == 0 and tree.namespaces() == []  # no root, and node 0 locks nothing
    tree.lock(0)
    tree.unlock(0)
    node = tree.insert([1, 2], pool.allocate(2), "x", 0, 0).node
    root = tree.root("x")
    tree.lock(root)  # a request whose match stopped at the root
    assert tree.node(root).lock_ref == 1
    tree.check_invariants([root])
    assert tree.evict(8) == 2
    assert tree.namespaces() == ["x"]  # kept for its lock
    tree.unlock(root)
    assert tree.namespaces() == [] and tree.num_nodes == 0
    with pytest.raises(ValueError, match="does not exist"):
        tree.node(node)
    tree.check_invariants([])
    # A locked root refuses a reset, as any locked node does.
    tree.insert([5], pool.allocate(1), "y", 0, 0)
    tree.lock(tree.root("y"))
    with pytest.raises(ValueError, match="locked"):
        tree.reset()
    tree.unlock(tree.root("y"))
    tree.reset()
    assert pool.num_free == 8


def test_node_names_its_namespace_among_many():
    pool = BlockPool(64)
    tree = RadixTree(pool, 1, "lru")
    ids = {f"n{i}": tree.insert([i, i], pool.allocate(2), f"n{i}", 0, 0).node for i in range(30)}
    assert all(tree.node(node).namespace == ns for ns, node in ids.items())
    tree.check_invariants([])
