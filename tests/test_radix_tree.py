"""RadixTree: SGLang's radix-cache unit scenarios, on the native tree and its Python model.

Expected values are SGLang's own (test/srt/test_radix_cache_unit.py and the values
measured by running its RadixCache, catalogued in shared/reference/sglang_tests.md
section 6.3). SGLang stores one KV index per token; we store one block per page, so
where SGLang checks indices we check the blocks the tree hands back.
"""

from __future__ import annotations

from array import array

import pytest
from reference.block_pool import PyBlockPool
from reference.radix_tree import PyRadixTree

from prefixcache._C import BlockPool, InvariantError, RadixTree

TREES = {"native": (RadixTree, BlockPool), "python": (PyRadixTree, PyBlockPool)}


class Tree:
    """A tree and its pool, with the one helper every scenario needs: insert fresh blocks."""

    def __init__(self, kind: str, page: int, eviction: str | None = "lru", num_blocks: int = 256) -> None:
        tree_cls, pool_cls = TREES[kind]
        self.pool = pool_cls(num_blocks)
        self.t = tree_cls(self.pool, page, eviction)
        self.page = page

    def insert(self, tokens, namespace=None, priority=0):
        """Insert `tokens` with freshly allocated blocks; free what the tree displaces."""
        blocks = self.pool.allocate(len(tokens) // self.page)
        result = self.t.insert(tokens, blocks, namespace, priority)
        self.pool.free(result.displaced)
        return result, blocks

    def check(self, locked=None):
        self.t.check_invariants(locked)
        self.pool.check_invariants()


@pytest.fixture(params=list(TREES))
def kind(request):
    return request.param


def test_insert_and_match_basic(kind):
    tr = Tree(kind, page=1)
    result, blocks = tr.insert([1, 2, 3])
    assert result.prefix_len == 0
    assert (tr.t.total_size, tr.t.evictable_size, tr.t.protected_size) == (3, 3, 0)
    assert tr.t.match([1, 2, 3]).block_ids == blocks
    m = tr.t.match([1, 2])
    assert (m.num_tokens, m.block_ids) == (2, blocks[:2])
    assert tr.t.match([]).num_tokens == 0
    tr.check()


@pytest.mark.parametrize("page", [1, 2])
def test_advanced_prefix_match_with_node_splits(kind, page):
    tr = Tree(kind, page)
    _, b1 = tr.insert([1, 2, 3, 4, 5, 6, 7, 8])
    result, b2 = tr.insert([1, 2, 9, 10])
    assert result.prefix_len == 2
    assert b2[: 2 // page] == b1[: 2 // page]  # re-pointed to the tree's blocks
    assert tr.t.total_size == 10
    m = tr.t.match([1, 2, 3, 4, 999, 1000])
    assert (m.num_tokens, m.block_ids) == (4, b1[: 4 // page])
    assert tr.t.total_size == 10  # a look-up never grows the tree
    assert tr.t.match([1, 2, 3, 4, 5, 6, 7, 8]).block_ids == b1
    assert tr.t.match([1, 2, 3, 4, 5, 6, 777, 888]).num_tokens == 6
    assert tr.t.match([1, 2, 9, 10]).block_ids == b2
    tr.check()


def test_paged_structure_page_4(kind):
    tr = Tree(kind, page=4)
    _, b1 = tr.insert([1, 2, 3, 4, 5, 6, 7, 8])
    assert tr.t.match([1, 2, 3, 4, 5, 6, 7]).num_tokens == 4
    m = tr.t.match_prefix([1, 2, 3, 4, 5, 6, 7, 9])  # splits at 4
    assert m.num_tokens == 4
    assert tr.t.node(m.node).tokens == (1, 2, 3, 4)
    result, b2 = tr.insert([1, 2, 3, 4, 9, 9, 9, 9])
    assert result.prefix_len == 4
    root = tr.t.node(tr.t.root())
    assert list(root.children) == [(1, 2, 3, 4)]
    head = tr.t.node(root.children[(1, 2, 3, 4)])
    assert list(head.children) == [(5, 6, 7, 8), (9, 9, 9, 9)]
    assert tr.t.total_size == 12
    assert tr.t.match([1, 2, 3, 4, 9, 9, 9, 9, 1]).block_ids == [b1[0], b2[1]]
    # A difference inside a page misses that whole page.
    assert tr.t.match([1, 2, 3, 4, 5, 6, 0, 0]).num_tokens == 4
    tr.check()


@pytest.mark.parametrize("page,length,expected", [(1, 5, 5), (2, 5, 4), (4, 6, 4), (16, 15, 0), (16, 33, 32)])
def test_page_alignment_boundary(kind, page, length, expected):
    tr = Tree(kind, page)
    tokens = list(range(length))
    tr.insert(tokens[: length // page * page])
    assert tr.t.match(tokens).num_tokens == expected


def test_lock_ref_operations(kind):
    tr = Tree(kind, page=1)
    tr.insert([1, 2, 3])
    node = tr.t.match_prefix([1, 2, 3]).node
    tr.t.lock(node)
    assert (tr.t.evictable_size, tr.t.protected_size) == (0, 3)
    tr.check([node])
    tr.t.unlock(node)
    assert (tr.t.evictable_size, tr.t.protected_size) == (3, 0)
    # A split of a locked node keeps the lock on both halves: no size moves.
    tr.t.lock(node)
    head = tr.t.match_prefix([1, 2, 9]).node
    assert (tr.t.evictable_size, tr.t.protected_size) == (0, 3)
    assert tr.t.node(head).tokens == (1, 2)
    assert tr.t.node(head).lock_ref == 1
    tr.check([node])
    tr.t.unlock(node)
    with pytest.raises(ValueError, match="not locked"):
        tr.t.unlock(node)
    tr.check([])


def test_lru_eviction(kind):
    tr = Tree(kind, page=1)
    _, b12 = tr.insert([1, 2])
    _, b34 = tr.insert([3, 4])
    assert tr.t.evict(2) == 2
    assert tr.t.last_evicted() == b12
    assert tr.t.total_size == 2
    assert tr.t.match([1, 2]).num_tokens == 0
    assert tr.t.match([3, 4]).block_ids == b34
    assert tr.pool.num_free == 256 - 2
    tr.check()


def test_evict_cascades_to_parents_and_spares_locks(kind):
    tr = Tree(kind, page=1)
    _, b123 = tr.insert([1, 2, 3])
    _, b124 = tr.insert([1, 2, 4])
    assert tr.t.evict(3) == 4  # [3], [4], then their parent [1, 2]: leaves go whole
    assert tr.t.last_evicted() == [b123[2], b124[2], *b123[:2]]
    assert tr.t.total_size == 0

    tr = Tree(kind, page=1)
    _, b123 = tr.insert([1, 2, 3])
    tr.insert([1, 2, 4])
    node = tr.t.match_prefix([1, 2, 4]).node
    tr.t.lock(node)
    assert tr.t.evict(10) == 1
    assert tr.t.last_evicted() == [b123[2]]
    assert (tr.t.total_size, tr.t.evictable_size, tr.t.protected_size) == (3, 0, 3)
    tr.check([node])


@pytest.mark.parametrize(
    "policy,victim",
    [("lru", [2]), ("lfu", [2]), ("fifo", [1]), ("mru", [1]), ("filo", [3]), ("priority", [2]), ("slru", [2]),
     ("tlru", [2])],
)
def test_policy_victims(kind, policy, victim):
    tr = Tree(kind, page=1, eviction=policy)
    for t in (1, 2, 3):
        tr.insert([t])
    tr.t.match_prefix([1])  # touch [1]
    tr.t.evict(1)
    assert [t for t in (1, 2, 3) if tr.t.match([t]).num_tokens == 0] == victim
    tr.check()


def test_priority_keeps_high_priority(kind):
    tr = Tree(kind, page=1, eviction="priority")
    tr.insert([1], priority=5)
    tr.insert([2], priority=0)
    tr.t.match_prefix([2])  # the most recent, yet lower priority
    tr.t.evict(1)
    assert (tr.t.match([1]).num_tokens, tr.t.match([2]).num_tokens) == (1, 0)


def test_lfu_counts_hits_at_insert_as_sglang(kind):
    # SGLang 0.5.23: a request counts a hit on each node its insert walks past what it
    # inserted before (here each insert is a new request), and on the node it creates;
    # match_prefix counts none.
    tr = Tree(kind, page=1, eviction="lfu")
    tr.insert([1])
    tr.insert([2])
    for _ in range(3):
        tr.insert([1])
        tr.t.match_prefix([1])
    tr.t.match_prefix([2])  # more recent but inserted once
    assert tr.t.node(tr.t.match([1]).node).hit_count == 4
    assert tr.t.node(tr.t.match([2]).node).hit_count == 1
    tr.t.evict(1)
    assert (tr.t.match([1]).num_tokens, tr.t.match([2]).num_tokens) == (1, 0)


def test_insert_counts_hits_past_what_the_caller_inserted(kind):
    tr = Tree(kind, page=1, eviction="lfu")
    tr.insert([1, 2, 3, 4])
    blocks = tr.pool.allocate(2)
    # The caller inserted [1, 2] before: the node [1..4] ends past it and counts; a split's
    # upper half copies the count.
    result = tr.t.insert([1, 2, 3, 4, 5, 6], blocks, None, 0, 4, 2)
    assert result.prefix_len == 4
    upper = tr.t.node(tr.t.match([1, 2, 3, 4]).node)
    assert upper.hit_count == 2
    leaf = tr.t.node(result.node)
    assert leaf.hit_count == 1 and leaf.cached_prefix_len == 6 and upper.history_len == 6
    node = tr.t.match_prefix([1, 2]).node  # splits [1..4]: the upper half copies its count
    assert tr.t.node(node).hit_count == 2 and tr.t.node(node).cached_prefix_len == 2
    tr.check()


def test_namespaces_are_separate_subtrees(kind):
    tr = Tree(kind, page=1)
    blocks = {ns: tr.insert([1, 2, 3], namespace=ns)[1] for ns in ("key1", "key2", None)}
    for ns, b in blocks.items():
        assert tr.t.match([1, 2, 3], ns).block_ids == b
    assert tr.t.match([1, 2, 3], "nonexistent").num_tokens == 0
    assert tr.t.namespaces() == [None, "key1", "key2"]
    for ns in blocks:
        root = tr.t.node(tr.t.root(ns))
        assert list(root.children) == [(1,)]
        assert tr.t.node(root.children[(1,)]).namespace == ns
    assert tr.t.total_size == 9
    tr.check()


def test_match_is_pure_and_match_prefix_splits_and_touches(kind):
    tr = Tree(kind, page=1)
    tr.insert([1, 2, 3, 4])
    nodes, clock = tr.t.num_nodes, tr.t.clock
    m = tr.t.match([1, 2, 9])
    assert (m.num_tokens, tr.t.num_nodes, tr.t.clock) == (2, nodes, clock)
    m = tr.t.match_prefix([1, 2, 9])
    assert m.num_tokens == 2
    assert tr.t.num_nodes == nodes + 1
    head = tr.t.node(m.node)
    assert (head.tokens, head.hit_count) == ((1, 2), 1)
    assert head.last_access_time > clock


def test_insert_adopts_blocks_and_returns_duplicates(kind):
    tr = Tree(kind, page=2)
    _, first = tr.insert([1, 2, 3, 4])
    blocks = tr.pool.allocate(3)
    mine = list(blocks)
    result = tr.t.insert([1, 2, 3, 4, 5, 6], blocks)
    assert (result.prefix_len, result.displaced) == (4, mine[:2])
    assert list(blocks) == [*first, mine[2]]  # re-pointed in place
    tr.pool.free(result.displaced)
    # An int32 array is re-pointed in place too (what the backend passes).
    again = array("i", tr.pool.allocate(3))
    dup = list(again)
    assert tr.t.insert([1, 2, 3, 4, 5, 6], again).displaced == dup
    assert list(again) == [*first, mine[2]]
    tr.pool.free(dup)
    tr.check()


def test_insert_from_start_takes_only_the_callers_own_pages(kind):
    tr = Tree(kind, page=2)
    _, first = tr.insert([1, 2, 3, 4])
    own = tr.pool.allocate(2)  # pages [3, 4] (a duplicate) and [5, 6]; [1, 2] is held from the tree
    mine = list(own)
    result = tr.t.insert([1, 2, 3, 4, 5, 6], own, None, 0, 2)
    assert (result.prefix_len, result.displaced) == (4, mine[:1])
    assert own == [first[1], mine[1]]
    tr.pool.free(result.displaced)
    assert tr.t.match([1, 2, 3, 4, 5, 6]).block_ids == [*first, mine[1]]
    with pytest.raises(ValueError, match="only the first 6 tokens"):
        tr.t.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 9], [0], None, 0, 8)
    with pytest.raises(ValueError, match="start=3 must be a multiple"):
        tr.t.insert([1, 2, 3, 4], [0], None, 0, 3)
    tr.check()


def test_custom_policy_is_called_once_per_candidate(kind):
    calls = []

    def biggest_first(c):
        calls.append(c.node)
        return (-c.num_tokens, c.last_access_time)

    tr = Tree(kind, page=1, eviction=None)
    for run in ([1], [2, 2], [3, 3, 3], [4, 4, 4, 4], [5, 5, 5, 5, 5]):
        tr.insert(run)
    tr.insert([1, 7])  # [1] now has a child: 5 leaves, one of them under [1]
    assert tr.t.evict(9, biggest_first) == 9  # [5]*5 then [4]*4
    assert len(calls) == 5  # each initial leaf once; no parent became a leaf
    assert tr.t.match([5, 5, 5, 5, 5]).num_tokens == 0 and tr.t.match([4]).num_tokens == 0
    calls.clear()
    assert tr.t.evict(100, biggest_first) == 1 + 2 + 3 + 1
    assert len(calls) == 4  # [2,2], [3,3,3], [7], then [1] once its child went
    with pytest.raises(ValueError, match="no native eviction order"):
        tr.t.evict(1)


def test_custom_policy_raising_keeps_what_was_evicted(kind):
    tr = Tree(kind, page=1, eviction=None)
    for t in range(4):
        tr.insert([t])
    seen = []

    def flaky(c):
        seen.append(c.node)
        if len(seen) > 4:
            raise RuntimeError("policy bug")
        return c.creation_time

    # Ranks the 4 leaves, evicts the oldest; no parent becomes a leaf, so no 5th call.
    assert tr.t.evict(1, flaky) == 1
    assert tr.t.match([0]).num_tokens == 0 and tr.t.total_size == 3
    with pytest.raises(RuntimeError, match="policy bug"):
        tr.t.evict(10, flaky)
    assert tr.t.last_evicted() == [] and tr.t.total_size == 3
    tr.check()


def test_reset_frees_everything_unless_locked(kind):
    tr = Tree(kind, page=1)
    tr.insert([1, 2, 3])
    tr.insert([7, 8], namespace="a")
    node = tr.t.match_prefix([1, 2]).node
    tr.t.lock(node)
    with pytest.raises(ValueError, match="locked"):
        tr.t.reset()
    tr.t.unlock(node)
    tr.t.reset()
    assert (tr.t.total_size, tr.t.num_nodes, tr.pool.num_free) == (0, 0, 256)
    assert tr.t.namespaces() == []
    tr.check()


def test_bad_arguments_raise_and_change_nothing(kind):
    tr = Tree(kind, page=2, num_blocks=8)
    _, owned = tr.insert([1, 2, 3, 4])
    before = (tr.t.total_size, tr.t.num_nodes, tr.t.clock, tr.pool.num_free)
    free_block = tr.pool.free_queue()[0]
    with pytest.raises(ValueError, match="multiple of page_size"):
        tr.t.insert([1, 2, 3], [0])
    with pytest.raises(ValueError, match="one per page"):
        tr.t.insert([5, 6], [])
    with pytest.raises(IndexError, match="out of range"):
        tr.t.insert([5, 6], [99])
    with pytest.raises(ValueError, match="free in the pool"):
        tr.t.insert([5, 6], [free_block])
    with pytest.raises(ValueError, match="already belongs to the tree"):
        tr.t.insert([5, 6], [owned[0]])
    extra = tr.pool.allocate(1)
    with pytest.raises(ValueError, match="more than once"):
        tr.t.insert([5, 6, 7, 8], [extra[0], extra[0]])
    with pytest.raises(TypeError, match="blocks must be"):
        tr.t.insert([5, 6], (extra[0],))
    with pytest.raises(TypeError, match="namespace"):
        tr.t.match([1, 2], 3)
    with pytest.raises(ValueError, match="int32"):
        tr.t.match([1 << 40])
    with pytest.raises(ValueError, match="does not exist"):
        tr.t.lock(12345)
    with pytest.raises(ValueError, match="num_tokens"):
        tr.t.evict(-1)
    tr.pool.free(extra)
    assert (tr.t.total_size, tr.t.num_nodes, tr.t.clock, tr.pool.num_free) == before
    tr.check()
    assert tr.t.evict(1) == 4 and tr.t.last_evicted() == owned
    with pytest.raises(ValueError, match="num_tokens"):
        tr.t.evict(-1)
    assert tr.t.last_evicted() == []  # a refused call evicted nothing
    with pytest.raises(ValueError, match="page_size"):
        TREES[kind][0](tr.pool, 0, "lru")
    with pytest.raises(ValueError, match="allowed values"):
        TREES[kind][0](tr.pool, 1, "random")


def test_check_invariants_reports_lock_mismatch(kind):
    tr = Tree(kind, page=1)
    tr.insert([1, 2])
    node = tr.t.match_prefix([1, 2]).node
    tr.t.lock(node)
    with pytest.raises(InvariantError, match="lock_ref 1 but live requests hold 0"):
        tr.t.check_invariants([])
    tr.t.check_invariants([node])


def test_extend_from_a_locked_node_reads_as_a_reinsert_of_the_whole_path(kind):
    """A commit of a running request: extend() adds the pages after the node it locks,
    and the tree then reads exactly as if the whole sequence had been inserted again
    (path stamps, priority, use), while the native tree walked only the new pages."""
    trees = [Tree(kind, page=2), Tree(kind, page=2)]
    for tr in trees:
        first, _ = tr.insert([1, 2, 3, 4])
        tr.t.lock(first.node)
        tr.insert([1, 2, 9, 9])  # a sibling branch under [1, 2]: the path has two nodes
    extended, reinserted = trees
    blocks = extended.pool.allocate(1)
    r = extended.t.extend(extended.t.match([1, 2, 3, 4]).node, [5, 6], blocks, 3)
    full = reinserted.pool.allocate(1)
    r2 = reinserted.t.insert([1, 2, 3, 4, 5, 6], full, None, 3, 4, 4)
    assert (r.prefix_len, r.displaced) == (r2.prefix_len, r2.displaced) == (4, [])

    def nodes(tr):
        out = []
        for n in range(1, tr.t.num_nodes + 1):
            i = tr.t.node(n)
            out.append((i.tokens, i.last_access_time, i.priority, i.hit_count, i.use_count, i.last_use,
                        i.request_tokens, i.history_len, i.lock_ref))
        return out

    assert nodes(extended) == nodes(reinserted)
    mid = extended.t.node(extended.t.match([1, 2]).node)
    assert (mid.priority, mid.request_tokens, mid.history_len) == (3, 6, 6)  # stamped through the lock
    for tr, res in ((extended, r), (reinserted, r2)):
        tr.t.relock(tr.t.match([1, 2, 3, 4]).node, res.node)
        tr.check([res.node])
        tr.t.unlock(res.node)  # folds the stamps owed into the path
        tr.check([])
    assert nodes(extended) == nodes(reinserted)


def test_extend_matches_what_another_request_inserted_and_hands_back_duplicates(kind):
    tr = Tree(kind, page=2)
    base, _ = tr.insert([1, 2])
    tr.t.lock(base.node)
    _, theirs = tr.insert([1, 2, 3, 4, 5, 6])  # another request's continuation
    mine = tr.pool.allocate(2)
    ids = list(mine)
    r = tr.t.extend(base.node, [3, 4, 7, 8], ids, 0)
    assert r.prefix_len == 4 and r.displaced == [mine[0]]
    assert ids == [theirs[1], mine[1]]  # re-pointed to the tree's block in place
    tr.pool.free(r.displaced)
    assert tr.t.match([1, 2, 3, 4, 5, 6]).num_tokens == 6  # the split kept both branches
    tr.t.relock(base.node, r.node)
    tr.check([r.node])


def test_relock_moves_a_lock_down_or_the_long_way(kind):
    tr = Tree(kind, page=1)
    a, _ = tr.insert([1, 2])
    b, _ = tr.insert([1, 2, 3, 4])
    c, _ = tr.insert([7])
    tr.t.lock(a.node)
    tr.t.relock(a.node, b.node)  # down: only [3, 4] gets locked
    assert (tr.t.protected_size, tr.t.node(a.node).lock_ref) == (4, 1)
    tr.check([b.node])
    tr.t.relock(b.node, c.node)  # elsewhere: lock c, unlock the whole old path
    assert tr.t.protected_size == 1
    tr.check([c.node])
    with pytest.raises(ValueError, match="not locked"):
        tr.t.relock(b.node, c.node)
    tr.check([c.node])


def test_a_python_policy_given_to_the_tree_ranks_each_leaf_once_until_it_changes(kind):
    """A policy without a native order (a plugin's priority) given to the tree: each leaf
    is ranked when it becomes a candidate or changes, and its key is kept in the leaf
    order, so evictions do not ask about unchanged leaves again (SGLang asks about every
    leaf on every eviction)."""
    calls = []

    def biggest_first(c):
        calls.append(c.node)
        return (-c.num_tokens, c.last_access_time)

    tr = Tree(kind, page=1, eviction=biggest_first)
    for run in ([1], [2, 2], [3, 3, 3], [4, 4, 4, 4]):
        tr.insert(run)
    assert tr.t.evict(1) == 4 and len(calls) == 4  # every leaf once
    assert tr.t.evict(1) == 3 and len(calls) == 4  # nothing changed: no call
    tr.t.match_prefix([1])  # touches [1]: ranked again before the next eviction
    tr.insert([5, 5])
    assert tr.t.evict(1) == 2 and len(calls) == 4 + 2  # [1] and [5, 5]; [2, 2] kept its key
    assert tr.t.match([2, 2]).num_tokens == 0 and tr.t.match([5, 5]).num_tokens == 2  # ties: older first
    tr.check()


def test_a_python_policy_given_to_the_tree_that_raises_keeps_it_consistent(kind):
    fail = {"on": False}

    def flaky(c):
        if fail["on"]:
            raise RuntimeError("policy failed")
        return c.last_access_time

    tr = Tree(kind, page=1, eviction=flaky)
    tr.insert([1])
    tr.insert([2])
    fail["on"] = True
    with pytest.raises(RuntimeError, match="policy failed"):
        tr.t.evict(1)  # ranking the new leaves fails: nothing evicted, still ranked later
    assert tr.t.last_evicted() == [] and tr.t.total_size == 2
    tr.check()
    fail["on"] = False
    assert tr.t.evict(1) == 1 and tr.t.match([1]).num_tokens == 0
    tr.check()
