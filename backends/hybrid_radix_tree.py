"""The radix tree of the `radix` strategy over a hybrid layout: SGLang 0.5.23's UnifiedTreeCore.

The definition, and the reference model of the native tree the cache runs
(csrc/hybrid_tree.h through `backends.hybrid_radix_native`), which must agree with it
operation for operation (tests/test_hybrid_tree_native_stateful.py).

Owns `HybridTree`: one compressed prefix tree whose nodes carry up to three components
(SGLang's `ComponentType`): FULL (the full-attention pages: every node has them), SWA
(the sliding-window pages, or a tombstone: None) and MAMBA (one recurrent-state slot
at the node's end, or None), each with its own lock refs, evictable / protected sizes
and, for SWA and MAMBA, its own LRU list. What each component does is SGLang's
(`mem_cache/unified_cache/unified_tree_core.py` and `components/{full,swa,mamba}.py`),
in the configuration our backend runs: the Python TreeCore, no HiCache, no session
radix cache, no EAGLE, LRU eviction, the static SWA pool, Mamba's extra_buffer
strategy with no per-path state cap:

- match: walk the tree; the match advances only to a node where every component's
  validator accepts (FULL: pages present; SWA: at least `window` tokens of live SWA
  since the last tombstone on the path; MAMBA: a state on the node). The full-attention
  run past the match is the branching point (SWA: page-aligned; MAMBA: aligned to the
  state grid). A match changes nothing; settling it does what SGLang's match_prefix
  does besides: split the node the walk ended inside, then SWA refreshes the window's
  ancestors in its LRU, MAMBA the matched node, FULL the path's access times.
- insert: pages already in the tree are the request's duplicates (freed, but where an
  SWA tombstone inside the request's window takes the request's pages back: "recovery");
  a new leaf holds the rest, its SWA published only from the request's window start
  (split there, the older part a tombstone) and capped at one window per node; a MAMBA
  state goes on the last node (if it already has one, the request's is freed).
- lock: FULL locks the path to the root, SWA the nodes covering one window (the
  boundary node stamped with a uuid the unlock stops at), MAMBA the node itself.
- eviction, per component: FULL pops unlocked leaves by access time (a leaf goes
  whole); SWA and MAMBA walk their LRU from the least recent unlocked node: a leaf goes
  whole, an inner node is tombstoned for that component and the components of lower
  priority on it go too (FULL 2 > SWA 1 > MAMBA 0: an SWA tombstone drops the node's
  state); a node left without FULL pages and children is deleted upward.

Beyond SGLang, `no_tail_cliff` (off: SGLang's order exactly): SWA's walk first passes
over the nodes a matchable branch end reads (its last window: SGLang PR 35515), MAMBA's
over each branch's deepest state (the one its next turn resumes from), and an evictable
leaf no match can end in (its window broken, or without a state) is deleted, then its
parent while it becomes one, whenever an eviction makes one.

Page granularity: every key is a whole number of `page_size` pages; a value is one id
per page (FULL, SWA) or one state id (MAMBA); sizes are in TOKENS (MAMBA: states).
`window` is SGLang's `sliding_window_size`: the tokens before a query it reads (the
layout's window minus one).

The tree never talks to a pool: whatever it frees goes to `free(component, ids)`, the
callback the cache gives it, at the moment SGLang's cache would drain it.

Must never: allocate, decide what a request inserts or when (the cache does, as
SGLang's scheduler and UnifiedRadixCache do), or free an id it does not own.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from heapq import heapify, heappop, heappush
from itertools import chain

__all__ = ["Component", "HybridTree", "TreeNode", "MatchOutcome", "InsertOutcome", "LockReceipt"]


class Component(IntEnum):
    """SGLang's ComponentType, in its order: the order hooks run in."""

    FULL = 0
    SWA = 1
    MAMBA = 2


FULL, SWA, MAMBA = Component.FULL, Component.SWA, Component.MAMBA
# Cascade priority on an inner node (a leaf: all 0): evicting one component of a node
# evicts the node's components of lower or equal priority.
_INNER_PRIORITY = {FULL: 2, SWA: 1, MAMBA: 0}
_NO_TOKENS = array("i")  # the root's key; keys are only ever sliced, never changed in place


def _int32_tokens(tokens: Sequence[int]) -> array:
    """`tokens` as an int32 array, the type of every node's key (`radix` stores int32
    ids; the requests' own token buffers already are: no copy)."""
    return tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", tokens)


class TreeNode:
    """A run of pages. `full` / `swa`: one id per page (`swa` None: a tombstone);
    `mamba`: the state after the node's last token (None: none); `locks[c]`: requests
    holding component c here; `swa_uuid`: the SWA lock boundary stamp; `hashes`: the
    pages' chained block hashes (events only)."""

    __slots__ = ("id", "parent", "children", "key", "full", "swa", "mamba", "locks", "swa_uuid", "last_access",
                 "prev", "next", "stamps", "hashes", "ns")  # fmt: skip

    def __init__(self, node_id: int, last_access: float) -> None:
        self.id = node_id
        self.parent: TreeNode | None = None
        self.children: dict = {}
        self.key: array = _NO_TOKENS  # int32, as the requests' tokens: compared in C, never as tuples
        self.full: list[int] | None = None
        self.swa: list[int] | None = None
        self.mamba: int | None = None
        self.locks = [0, 0, 0]
        self.swa_uuid: int | None = None
        self.last_access = last_access
        self.prev: list[TreeNode | None] = [None, None, None]  # LRU links, by component
        self.next: list[TreeNode | None] = [None, None, None]
        self.stamps = [0, 0, 0]  # by component: the LRU clock when it last became most recent
        self.hashes: list[bytes] | None = None
        self.ns = None  # the namespace key (a child of the root)

    def value(self, c: Component) -> object:
        return self.full if c == FULL else self.swa if c == SWA else self.mamba

    def __lt__(self, other: TreeNode) -> bool:  # heap ties (never: access times are unique)
        return self.last_access < other.last_access

    def __repr__(self) -> str:
        return f"TreeNode({self.id}, {len(self.key)} tokens)"


class _LRU:
    """One component's LRU list over tree nodes (SGLang's UnifiedLRUList): head side
    most recent, tail side least. O(1) insert / remove / move, O(locked) to find the
    least recent unlocked node."""

    def __init__(self, c: Component) -> None:
        self.c = c
        self.head = TreeNode(-1, 0.0)
        self.tail = TreeNode(-2, 0.0)
        self.head.next[c] = self.tail
        self.tail.prev[c] = self.head
        self.members: set[int] = set()
        self.clock = 0

    def __contains__(self, node: TreeNode | None) -> bool:
        return node is not None and node.id in self.members

    def __len__(self) -> int:
        return len(self.members)

    def _link_after(self, prev: TreeNode, node: TreeNode) -> None:
        c = self.c
        nxt = prev.next[c]
        node.prev[c], node.next[c] = prev, nxt
        nxt.prev[c] = node  # type: ignore[union-attr]
        prev.next[c] = node

    def _unlink(self, node: TreeNode) -> None:
        c = self.c
        node.prev[c].next[c] = node.next[c]  # type: ignore[union-attr]
        node.next[c].prev[c] = node.prev[c]  # type: ignore[union-attr]
        node.prev[c] = node.next[c] = None

    def _stamp(self, node: TreeNode) -> None:
        self.clock += 1
        node.stamps[self.c] = self.clock

    def insert_mru(self, node: TreeNode) -> None:
        assert node.id not in self.members
        self.members.add(node.id)
        self._link_after(self.head, node)
        self._stamp(node)

    def insert_after(self, prev: TreeNode, node: TreeNode) -> None:
        assert prev.id in self.members and node.id not in self.members
        self.members.add(node.id)
        self._link_after(prev, node)

    def remove(self, node: TreeNode) -> None:
        self.members.remove(node.id)
        self._unlink(node)

    def move_to_mru(self, node: TreeNode) -> None:
        assert node.id in self.members
        self._unlink(node)
        self._link_after(self.head, node)
        self._stamp(node)

    def refresh_window(self, node: TreeNode, root: TreeNode, span: int, has: Callable[[TreeNode], bool]) -> None:
        """The node and its ancestors covering `span` TOKENS, most recent first, the node
        the most recent of all (SGLang's reset_node_and_window_ancestors_mru)."""
        prev = self.head
        covered = 0
        while node is not root and covered < span:
            if has(node):
                self._unlink(node)
                self._link_after(prev, node)
                prev = node
            covered += len(node.key)
            node = node.parent  # type: ignore[assignment]

    def prev_unlocked(self, node: TreeNode) -> TreeNode | None:
        """The next more recent node than `node` that this component has not locked."""
        c = self.c
        x = node.prev[c]
        while x is not self.head and x.locks[c] > 0:  # type: ignore[union-attr]
            x = x.prev[c]  # type: ignore[union-attr]
        return None if x is self.head else x

    def lru_unlocked(self) -> TreeNode | None:
        return self.prev_unlocked(self.tail)

    def order(self) -> Iterator[TreeNode]:
        """Most recent first."""
        x = self.head.next[self.c]
        while x is not self.tail:
            yield x  # type: ignore[misc]
            x = x.next[self.c]  # type: ignore[union-attr]


@dataclass
class LockReceipt:
    """What an unlock replays: the node, and where the SWA segment stopped (None: the root)."""

    node: TreeNode
    swa_uuid: int | None = None


@dataclass
class MatchOutcome:
    """A match: `num_tokens` hit (TOKENS) ending at `node`; `full_hit` the full-attention
    run (TOKENS, past the hit where another component refused); the branching points
    SGLang derives from it (None: none)."""

    num_tokens: int
    node: TreeNode
    full_hit: int
    swa_branching: int | None = None
    mamba_branching: int | None = None
    #: (node, TOKENS of it the hit covers), root's child .. the hit's node; a match that
    #: ends inside a node lists that node with the part it covers.
    path: list[tuple[TreeNode, int]] = field(default_factory=list)
    #: The node the walk ended inside (past or at the hit) and the TOKENS of it matched:
    #: what settling the match splits. None when the walk ended at a node's end.
    inside: tuple[TreeNode, int] | None = None

    def pages(self, c: Component, page_size: int) -> list[int]:
        """The hit's pages of FULL or SWA (NULL_BLOCK, -1, for an SWA tombstone)."""
        out: list[int] = []
        for node, covered in self.path:
            v = node.full if c == FULL else node.swa
            k = covered // page_size
            out.extend(v[:k] if v is not None else [-1] * k)
        return out


@dataclass
class InsertOutcome:
    """An insert: `prefix_len` TOKENS were already in the tree; `node` holds the key's
    end; `mamba_exist`: that node already had a state (the request's was not taken);
    `swa_branch_inserted`: the insert reached the SWA branching point."""

    prefix_len: int
    node: TreeNode
    mamba_exist: bool = False
    swa_branch_inserted: bool = False


class HybridTree:
    """SGLang's unified radix tree (see the module docstring). `free(component, ids)`
    takes back what the tree lets go of (FULL / SWA page ids, a MAMBA state id)."""

    def __init__(
        self,
        page_size: int,
        components: Sequence[Component],
        free: Callable[[Component, list[int]], None],
        *,
        window: int | None = None,
        state_grid: int = 1,
        on_store: Callable[[TreeNode, Component, int, int], None] | None = None,
        on_remove: Callable[[TreeNode, Component, int, int], None] | None = None,
        no_tail_cliff: bool = False,
    ) -> None:
        self.page = page_size
        self.no_tail_cliff = no_tail_cliff
        self.components = tuple(sorted(components))
        assert self.components[0] == FULL
        self.has_swa = SWA in self.components
        self.has_mamba = MAMBA in self.components
        if self.has_swa and not (window and window > 0):
            raise ValueError("an SWA component needs a positive window")
        self.window = window or 0
        self.state_grid = state_grid
        self._free = free
        # Event hooks: (node, component, first page, end page) stored / removed.
        self._on_store = on_store
        self._on_remove = on_remove
        self._next_id = 0
        self._next_uuid = 0
        self._clock = 1.0
        self.reset()

    # -- bookkeeping -------------------------------------------------------------------
    def reset(self) -> None:
        """An empty tree (the caller has freed what it held)."""
        self.root = self._new_node()
        self.root.full = []
        self.root.last_access = float("-inf")
        for c in self.components:
            self.root.locks[c] = 1
        self.evictable = {c: 0 for c in self.components}
        self.protected = {c: 0 for c in self.components}
        self.lru = {c: _LRU(c) for c in self.components if c != FULL}
        self.leaves: set[TreeNode] = set()
        self.num_nodes = 1
        #: Nodes with a state and a child: the only states `no_tail_cliff`'s first MAMBA
        #: walk may take (a leaf's state is its branch's deepest), walked in LRU order.
        self.inner_states: set[TreeNode] = set()

    def _tick(self) -> float:
        t = self._clock
        self._clock += 1.0
        return t

    def _new_node(self) -> TreeNode:
        node = TreeNode(self._next_id, self._tick())
        self._tick()  # SGLang stamps a creation time too: two ticks a node
        self._next_id += 1
        return node

    def _pages(self, tokens: int) -> int:
        return tokens // self.page

    def _size(self, node: TreeNode, c: Component) -> int:
        """What evicting component c of `node` gives back: TOKENS (FULL, SWA), states (MAMBA)."""
        if c == MAMBA:
            return 1 if node.mamba is not None else 0
        v = node.full if c == FULL else node.swa
        return len(v) * self.page if v is not None else 0

    def _child_key(self, node: TreeNode, tokens: Sequence[int], offset: int, ns: object) -> object:
        page = tuple(tokens[offset : offset + self.page])
        return (ns, page) if node is self.root else page

    def is_leaf(self, node: TreeNode) -> bool:
        """SGLang's device leaf: FULL pages, no lock on any component, no child with pages."""
        if node is self.root or node.full is None or any(node.locks):
            return False
        # Every child has pages: a node loses them only as it leaves the tree (check_invariants).
        return not node.children

    def _refresh_leaf(self, node: TreeNode) -> None:
        if self.is_leaf(node):
            self.leaves.add(node)
        else:
            self.leaves.discard(node)

    def _set_value(self, node: TreeNode, c: Component, value: object) -> None:
        """An SWA or MAMBA value lands on a node (SGLang's set_component_device_value):
        it enters the component's LRU as most recent and its size is protected or
        evictable by the node's lock."""
        if c == SWA:
            node.swa = value  # type: ignore[assignment]
        else:
            node.mamba = value  # type: ignore[assignment]
            if node.children:
                self.inner_states.add(node)
        self.lru[c].insert_mru(node)
        (self.protected if node.locks[c] else self.evictable)[c] += self._size(node, c)
        if self._on_store is not None:
            self._on_store(node, c, 0, len(node.key) // self.page)

    # -- matching ----------------------------------------------------------------------
    def _match_len(self, node_key: array, tokens: array, offset: int) -> int:
        """Tokens of `node_key` that `tokens[offset:]` starts with, whole pages (two
        int32 arrays: each comparison is one typed loop in C)."""
        n = min(len(node_key), len(tokens) - offset)
        if tokens[offset : offset + n] == node_key[:n]:
            m = n
        else:
            lo, hi = 0, n  # first mismatch lies in [lo, hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if tokens[offset + lo : offset + mid] == node_key[lo:mid]:
                    lo = mid
                else:
                    hi = mid
            m = lo
        return m // self.page * self.page

    def match(self, tokens: Sequence[int], ns: object) -> MatchOutcome:
        """The longest prefix of `tokens` (page-aligned, already capped by the caller)
        every component accepts (module docstring); changes nothing (`settle` does what
        SGLang's match_prefix does besides)."""
        tokens = _int32_tokens(tokens)
        n = len(tokens) // self.page * self.page
        node = self.root
        best, best_len, full_hit = self.root, 0, 0
        swa_len = float("inf")  # live SWA tokens since the last tombstone (SGLang's validator)
        path: list[tuple[TreeNode, int]] = []
        best_path = 0
        offset = 0
        partial = False
        while offset < n:
            child = node.children.get(self._child_key(node, tokens, offset, ns))
            if child is None or child.full is None:
                break
            m = self._match_len(child.key, tokens, offset)
            full_hit += m
            partial = m < len(child.key)
            # Inside a node, the validators see the head a split makes: its pages, no state.
            has_swa, has_state = child.swa is not None, child.mamba is not None and not partial
            # Every validator sees every node (SGLang calls them all, no short cut).
            ok = True
            if self.has_swa:
                if has_swa:
                    swa_len += m
                    ok = swa_len >= self.window
                else:
                    swa_len = 0
                    ok = False
            if self.has_mamba and not has_state:
                ok = False
            path.append((child, m))
            if ok:
                best, best_len, best_path = child, offset + m, len(path)
            if partial:
                break
            node = child
            offset += m
        out = MatchOutcome(best_len, best, full_hit, path=path[:best_path], inside=path[-1] if partial else None)
        if self.has_swa:
            aligned = full_hit // self.page * self.page
            out.swa_branching = aligned if aligned > best_len else None
        if self.has_mamba:
            aligned = full_hit // self.state_grid * self.state_grid
            out.mamba_branching = aligned if aligned > best_len else None
        return out

    def settle(self, out: MatchOutcome) -> MatchOutcome:
        """What SGLang's match_prefix does besides the match `out` (made on this tree as
        it is now): split the node the walk ended inside, then refresh recency. Returns
        the match as match_prefix would: the same hit, on the split's head."""
        best, path = out.node, out.path
        if out.inside is not None:
            child, m = out.inside
            head = self._split(child, m)
            best = head if best is child else best
            path = [(head if node is child else node, covered) for node, covered in path]
        self._touch_match(best)
        return MatchOutcome(out.num_tokens, best, out.full_hit, out.swa_branching, out.mamba_branching, path=path)

    def _touch_match(self, best: TreeNode) -> None:
        """SGLang's match post-processing: SWA refreshes the matched window, MAMBA the
        matched node; access times fall by 1e-5 a level up the path."""
        if self.has_swa:
            self.lru[SWA].refresh_window(best, self.root, self.window + self.page, lambda n: n.swa is not None)
        if self.has_mamba and best.mamba is not None:
            self.lru[MAMBA].move_to_mru(best)
        t = self._tick()
        node: TreeNode | None = best
        while node is not None:
            node.last_access = t
            t -= 0.00001
            node = node.parent

    def path_pages(self, node: TreeNode) -> list[int]:
        """FULL pages root .. node, in token order."""
        chunks = []
        while node is not self.root:
            chunks.append(node.full)
            node = node.parent  # type: ignore[assignment]
        return list(chain.from_iterable(reversed(chunks)))  # type: ignore[arg-type]

    def path_nodes(self, node: TreeNode) -> list[TreeNode]:
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent  # type: ignore[assignment]
        return out[::-1]

    # -- structure ---------------------------------------------------------------------
    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after `split_len` TOKENS; the new parent takes the head (SGLang's
        _split_node). Locks are copied to the head; the SWA uuid (the segment's older
        edge) moves to it; the state stays on the tail; the head sits just behind the
        tail in the SWA LRU."""
        p = self._pages(split_len)
        new = self._new_node()
        parent = child.parent
        assert parent is not None
        first = self._child_key(parent, child.key, 0, child.ns)
        new.parent, new.key, new.ns = parent, child.key[:split_len], child.ns
        child.parent, child.key = new, child.key[split_len:]
        new.children = {self._child_key(new, child.key, 0, child.ns): child}
        new.full, child.full = child.full[:p], child.full[p:]  # type: ignore[index]
        new.locks[FULL] = child.locks[FULL]
        if self.has_swa:
            new.locks[SWA] = child.locks[SWA]
            if child.swa is not None:
                new.swa, child.swa = child.swa[:p], child.swa[p:]
            new.swa_uuid, child.swa_uuid = child.swa_uuid, None
        if child.hashes is not None:
            new.hashes, child.hashes = child.hashes[:p], child.hashes[p:]
        parent.children[first] = new
        if self.has_swa and new.swa is not None:
            self.lru[SWA].insert_after(child, new)
        child.last_access = self._tick()
        self.num_nodes += 1
        self._refresh_leaf(new)
        self._refresh_leaf(child)
        return new

    def _add_leaf(self, parent: TreeNode, key: array, pages: list[int], ns: object,
                  hashes: list[bytes] | None) -> TreeNode:  # fmt: skip
        node = self._new_node()
        node.parent, node.key, node.full, node.ns, node.hashes = parent, key, pages, ns, hashes
        if parent.mamba is not None:
            self.inner_states.add(parent)
        parent.children[self._child_key(parent, key, 0, ns)] = node
        self.evictable[FULL] += len(key)
        self.num_nodes += 1
        self._refresh_leaf(node)
        self._refresh_leaf(parent)
        if self._on_store is not None:
            self._on_store(node, FULL, 0, len(pages))
        return node

    # -- locks -------------------------------------------------------------------------
    def lock(self, node: TreeNode) -> LockReceipt:
        """SGLang's inc_lock_ref: FULL on the path, SWA on one window, MAMBA on the node."""
        receipt = LockReceipt(node)
        cur = node
        while cur is not self.root:
            if cur.locks[FULL] == 0 and cur.full is not None:
                n = len(cur.key)
                self.evictable[FULL] -= n
                self.protected[FULL] += n
            cur.locks[FULL] += 1
            self.leaves.discard(cur)
            cur = cur.parent  # type: ignore[assignment]
        if self.has_swa:
            cur, covered = node, 0
            while cur is not self.root and covered < self.window:
                if cur.locks[SWA] == 0 and cur.swa is not None:
                    n = len(cur.key)
                    self.evictable[SWA] -= n
                    self.protected[SWA] += n
                cur.locks[SWA] += 1
                covered += len(cur.key)
                if covered >= self.window:
                    if cur.swa_uuid is None:
                        self._next_uuid += 1
                        cur.swa_uuid = self._next_uuid
                    receipt.swa_uuid = cur.swa_uuid
                cur = cur.parent  # type: ignore[assignment]
        if self.has_mamba and node is not self.root:
            if node.locks[MAMBA] == 0 and node.mamba is not None:
                self.evictable[MAMBA] -= 1
                self.protected[MAMBA] += 1
            node.locks[MAMBA] += 1
        self._refresh_leaf(node)
        return receipt

    def lock_cost(self, hit: MatchOutcome) -> dict[Component, int]:
        """What `lock` on a (pure) match's node would move from evictable to protected,
        per component (TOKENS; MAMBA: states), the node a split would make included."""
        cost = {c: 0 for c in self.components}
        for node, covered in hit.path:
            if node.locks[FULL] == 0:
                cost[FULL] += covered
        if self.has_swa:
            covered_swa = 0
            for node, covered in reversed(hit.path):
                if covered_swa >= self.window:
                    break
                if node.locks[SWA] == 0 and node.swa is not None:
                    cost[SWA] += covered
                covered_swa += covered
        if self.has_mamba and hit.path:
            node, covered = hit.path[-1]
            if covered == len(node.key) and node.mamba is not None and node.locks[MAMBA] == 0:
                cost[MAMBA] = 1
        return cost

    def unlock(self, receipt: LockReceipt) -> None:
        """SGLang's dec_lock_ref: MAMBA, SWA, then FULL, each over what its lock covered."""
        node = receipt.node
        if self.has_mamba and node is not self.root:
            assert node.locks[MAMBA] > 0, f"node {node.id}: MAMBA unlocked more than locked"
            if node.locks[MAMBA] == 1 and node.mamba is not None:
                self.evictable[MAMBA] += 1
                self.protected[MAMBA] -= 1
            node.locks[MAMBA] -= 1
            if node.locks[MAMBA] == 0:
                self._refresh_leaf(node)
        if self.has_swa and node is not self.root:
            cur = node
            while cur is not self.root:
                ref = cur.locks[SWA]
                assert ref > 0, f"node {cur.id}: SWA unlocked more than locked"
                if ref == 1 and cur.swa is not None:
                    n = len(cur.key)
                    self.evictable[SWA] += n
                    self.protected[SWA] -= n
                cur.locks[SWA] = ref - 1
                if ref == 1:
                    self._refresh_leaf(cur)
                if receipt.swa_uuid is not None and cur.swa_uuid == receipt.swa_uuid:
                    break
                cur = cur.parent  # type: ignore[assignment]
        cur = node
        while cur is not self.root:
            assert cur.locks[FULL] > 0, f"node {cur.id}: FULL unlocked more than locked"
            if cur.locks[FULL] == 1 and cur.full is not None:
                n = len(cur.key)
                self.evictable[FULL] += n
                self.protected[FULL] -= n
            cur.locks[FULL] -= 1
            if cur.locks[FULL] == 0:
                self._refresh_leaf(cur)
            cur = cur.parent  # type: ignore[assignment]
        self._refresh_leaf(node)

    # -- insertion ---------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        ns: object,
        pages: Sequence[int],
        swa_pages: Sequence[int] | None,
        *,
        prev_prefix_len: int,
        swa_evicted: int = 0,
        swa_branching: int | None = None,
        mamba_value: int | None = None,
        hashes: Sequence[bytes] | None = None,
    ) -> InsertOutcome:
        """SGLang's insert of `tokens` (page-aligned) whose pages in the request's row are
        `pages` (FULL) and `swa_pages` (SWA, -1 where the request freed them); the
        request owns its pages from `prev_prefix_len` (TOKENS) on, and freed its SWA
        below `swa_evicted`. Duplicates are freed through `free`; pages the tree keeps
        are the tree's from now on."""
        page = self.page
        tokens = _int32_tokens(tokens)
        n = len(tokens) // page * page
        self.root.last_access = self._tick()
        if n == 0:
            return InsertOutcome(0, self.root, mamba_exist=True)
        node, total = self.root, 0
        while total < n:
            child = node.children.get(self._child_key(node, tokens, total, ns))
            if child is None:
                break
            child.last_access = self._tick()
            m = self._match_len(child.key, tokens, total)
            if m < len(child.key):
                child = self._split(child, m)
            consumed = m
            if self.has_swa:
                consumed = self._swa_overlap(child, total, m, pages, swa_pages, prev_prefix_len, swa_evicted)
            dup_start = max(0, prev_prefix_len - total)
            if dup_start < consumed:
                a, b = self._pages(total + dup_start), self._pages(total + consumed)
                self._free(FULL, list(pages[a:b]))
                if self.has_swa and swa_pages is not None:
                    # Below the request's SWA eviction floor only FULL is still its own.
                    live = [s for i, s in enumerate(swa_pages[a:b], a) if i * page >= swa_evicted]
                    assert all(s >= 0 for s in live), "the request's SWA pages above its eviction floor are live"
                    if live:
                        self._free(SWA, live)
            node = child
            total += m
        out = InsertOutcome(total, node)
        if total < n:
            a = self._pages(total)
            leaf = self._add_leaf(node, tokens[total:n], list(pages[a : self._pages(n)]), ns,
                                  list(hashes[a : self._pages(n)]) if hashes is not None else None)  # fmt: skip
            target, new_leaf = leaf, True
        else:
            target, new_leaf = node, False
        out.node = target
        if self.has_swa:
            if swa_branching is not None:
                out.swa_branch_inserted = n >= swa_branching
            if new_leaf:
                self._swa_publish(target, total, total + len(target.key), swa_pages, swa_evicted)
        if self.has_mamba:
            assert mamba_value is not None, "a tree with MAMBA inserts a state with every key"
            if new_leaf:
                target.mamba = mamba_value
                self.lru[MAMBA].insert_mru(target)
                self.evictable[MAMBA] += 1
                if self._on_store is not None:
                    self._on_store(target, MAMBA, 0, len(target.key) // page)
            elif target.mamba is None:
                self._set_value(target, MAMBA, mamba_value)
                target.last_access = self._tick()
            else:
                self.lru[MAMBA].move_to_mru(target)
                target.last_access = self._tick()
                out.mamba_exist = True
        if target is not self.root and self.has_swa:
            self.lru[SWA].refresh_window(target, self.root, self.window + page, lambda x: x.swa is not None)
        return out

    def _swa_span(self, node: TreeNode, start: int, end: int, window_start: int) -> tuple[TreeNode, int] | None:
        """The part of `node` (tokens [start, end) of the key) at or past the request's
        window start, if the node is an SWA tombstone: split there, the older part stays
        a tombstone (SGLang's _clip_to_window)."""
        if node.swa is not None:
            return None
        assert window_start % self.page == 0
        live = max(start, window_start)
        if live >= end:
            return None
        if live > start:
            self._split(node, live - start)
        return node, live

    def _swa_overlap(self, node: TreeNode, total: int, m: int, pages: Sequence[int], swa_pages, prev_prefix_len: int,
                     window_start: int) -> int:  # fmt: skip
        """SGLang's SWAComponent.update_component_on_insert_overlap: an SWA tombstone the
        request's key covers inside its window takes the request's pages back. Returns
        where (TOKENS into the overlap) the request's own pages stop being duplicates."""
        if prev_prefix_len >= total + m:
            return m
        span = self._swa_span(node, total, total + m, window_start)
        if span is None:
            return m
        node, live = span
        a, b = self._pages(live), self._pages(total + m)
        incoming_swa = list(swa_pages[a:b]) if swa_pages is not None else []
        assert all(s >= 0 for s in incoming_swa), "an SWA recovery takes live pages"
        if node.locks[FULL] > 0:
            # RecoverSWAWithLockedFull: the node keeps its pages, takes the request's
            # SWA, and the request's FULL pages there are freed.
            self._free(FULL, list(pages[a:b]))
        else:
            # The node takes the request's FULL pages; its old ones go (their SWA went before).
            old = node.full
            node.full = list(pages[a:b])
            self._free(FULL, list(old))  # type: ignore[arg-type]
        self._set_value(node, SWA, incoming_swa)
        return live - total

    def _swa_publish(self, leaf: TreeNode, start: int, end: int, swa_pages, window_start: int) -> None:
        """SGLang's SWAComponent.commit_insert_component_data for a new leaf: SWA from the
        request's window start on (older part a tombstone), a node at most one window."""
        span = self._swa_span(leaf, start, end, window_start)
        if span is None:
            return
        node, live = span
        parent = None
        if node.locks[SWA] == 0:
            tail = -(-self.window // self.page) * self.page
            if len(node.key) > tail:
                parent = self._split(node, len(node.key) - tail)
        end_page = self._pages(end)
        if parent is not None:
            a = end_page - self._pages(len(node.key)) - self._pages(len(parent.key))
            self._set_value(parent, SWA, list(swa_pages[a : a + self._pages(len(parent.key))]))
        a = end_page - self._pages(len(node.key))
        self._set_value(node, SWA, list(swa_pages[a:end_page]))

    # -- eviction ----------------------------------------------------------------------
    def _evict_component(self, node: TreeNode, c: Component, tracker: dict[Component, int]) -> None:
        """Free component c of `node` (SWA, MAMBA: tombstone), out of its LRU."""
        v = node.value(c)
        if v is None:
            return
        size = self._size(node, c)
        self.evictable[c] -= size
        tracker[c] = tracker.get(c, 0) + size
        if self._on_remove is not None:
            self._on_remove(node, c, 0, len(node.key) // self.page)
        if c == FULL:
            self._free(FULL, list(node.full))  # type: ignore[arg-type]
        elif c == SWA:
            self._free(SWA, list(node.swa))  # type: ignore[arg-type]
            node.swa = None
        else:
            self._free(MAMBA, [node.mamba])  # type: ignore[list-item]
            node.mamba = None
            self.inner_states.discard(node)
        if c != FULL and node in self.lru[c]:
            self.lru[c].remove(node)

    def drop_states(self, nodes: Sequence[TreeNode]) -> None:
        """Evict the MAMBA component of each of `nodes` (unlocked for it): a state
        tombstone, as MAMBA eviction leaves on an inner node; the rest of the node stays."""
        for node in nodes:
            assert node.locks[MAMBA] == 0, f"node {node.id}: dropping a locked state"
            self._evict_component(node, MAMBA, {})

    def _delete_leaf(self, node: TreeNode, tracker: dict[Component, int]) -> None:
        """Free every component of an evictable leaf and delete it (SGLang's
        _delete_unbacked_device_leaf); childless ancestors without pages go too."""
        for c in self.components:
            self._evict_component(node, c, tracker)
        node.full = None
        self.leaves.discard(node)
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(parent, node.key, 0, node.ns)]
        if not parent.children:
            self.inner_states.discard(parent)
        self.num_nodes -= 1
        self._refresh_leaf(parent)
        # Childless tombstone ancestors (FULL never leaves an inner node, so: none).
        cur = parent
        while cur is not self.root and not cur.children and not any(cur.locks):
            if cur.full is not None:
                self._refresh_leaf(cur)
                break
            raise AssertionError(f"node {cur.id} lost its FULL pages while inner")

    def _cascade(self, node: TreeNode, trigger: Component, tracker: dict[Component, int]) -> None:
        """An inner node lost `trigger`: its components of lower priority go too."""
        for c in self.components:
            if c != trigger and _INNER_PRIORITY[c] < _INNER_PRIORITY[trigger] and node.value(c) is not None:
                assert node.locks[c] == 0, f"node {node.id}: cascading into a locked {c.name}"
                self._evict_component(node, c, tracker)
        self._refresh_leaf(node)

    def evict(self, requests: dict[Component, int], reached: Callable[[Component], bool] | None = None,
              targeted: Sequence[Component] = ()) -> dict[Component, int]:  # fmt: skip
        """SGLang's _evict_components: for each component in order, walk its eviction
        order until it freed `requests[c]` (TOKENS; MAMBA: states) or `reached(c)` (the
        allocation it evicts for can be served). A FULL request in `targeted` runs to its
        target instead of its count. Returns what each component freed."""
        tracker: dict[Component, int] = {c: 0 for c in self.components}

        def done(c: Component) -> bool:
            return reached is not None and c in targeted and reached(c)

        for c in self.components:
            want = requests.get(c, 0)
            to_target = c == FULL and want > 0 and c in targeted
            if done(c) or (not to_target and tracker[c] >= want):
                continue
            quota = max(want, tracker[c] + self.evictable[FULL]) if to_target else want
            if c == FULL:
                self._evict_full(quota, tracker, lambda: done(FULL))
            else:
                self._evict_aux(c, quota, tracker, lambda c=c: done(c))  # type: ignore[misc]
        return tracker

    def _evict_full(self, quota: int, tracker: dict[Component, int], done: Callable[[], bool]) -> None:
        """FULL's walk: unlocked leaves, least recently accessed first; a parent that
        becomes a leaf joins the heap."""
        heap = [(n.last_access, n) for n in self.leaves]
        heapify(heap)
        parent: TreeNode | None = None
        while True:
            if parent is not None and parent in self.leaves:
                heappush(heap, (parent.last_access, parent))
            parent = None
            victim = None
            while tracker[FULL] < quota and heap:
                _, x = heappop(heap)
                if x in self.leaves:
                    victim = x
                    break
            if victim is None:
                return
            parent = victim.parent
            self._delete_leaf(victim, tracker)
            if self.no_tail_cliff:
                parent = self._prune_dead(parent, tracker)  # type: ignore[arg-type]
            if done():
                return

    def _evict_aux(self, c: Component, quota: int, tracker: dict[Component, int], done: Callable[[], bool]) -> None:
        """SWA's or MAMBA's walk, least recent unlocked first: a leaf goes whole, an inner
        node is tombstoned for c (and what ranks below c on it). With `no_tail_cliff` the
        walk runs twice: first past what a branch's end needs (SWA: the nodes its last
        window reads; MAMBA: its deepest state), then over all."""
        if self.no_tail_cliff and c == SWA:
            self._walk_aux(c, quota, tracker, done, skip=self._in_branch_tail)
        elif self.no_tail_cliff and self.inner_states:
            self._walk_inner_states(quota, tracker, done)
        self._walk_aux(c, quota, tracker, done)

    def _walk_aux(self, c: Component, quota: int, tracker: dict[Component, int], done: Callable[[], bool],
                  skip: Callable[[TreeNode], bool] | None = None) -> None:  # fmt: skip
        lru = self.lru[c]
        passed: set[int] = set()  # ids `skip` kept, not asked again when a walk restarts
        cursor = lru.lru_unlocked()
        while True:
            if cursor is not None and cursor not in lru:
                cursor = lru.lru_unlocked()
            if tracker[c] >= quota or done() or cursor is None or cursor not in lru:
                return
            x = cursor
            cursor = lru.prev_unlocked(x)
            if skip is not None and (x.id in passed or skip(x)):
                passed.add(x.id)
                continue
            if x in self.leaves:
                parent = x.parent
                self._delete_leaf(x, tracker)
                if self.no_tail_cliff:
                    self._prune_dead(parent, tracker)  # type: ignore[arg-type]
            else:
                self._evict_component(x, c, tracker)
                self._cascade(x, c, tracker)
                if self.no_tail_cliff and c == SWA:
                    for leaf in self._leaves_reading(x):
                        self._prune_dead(leaf, tracker)

    # -- no_tail_cliff (beyond SGLang 0.5.23) ---------------------------------------------
    def _walk_inner_states(self, quota: int, tracker: dict[Component, int], done: Callable[[], bool]) -> None:
        """MAMBA's first walk: `_walk_aux` with `_deepest_state` as its skip, over the
        only nodes it would not skip at sight (a leaf's state is its branch's deepest):
        the states on inner nodes, least recent first (MAMBA's LRU order is its stamps').
        Evicting makes no node an inner state, so each is asked once, at its turn."""
        for x in sorted(self.inner_states, key=lambda n: n.stamps[MAMBA]):
            if tracker[MAMBA] >= quota or done():
                return
            if x in self.inner_states and not x.locks[MAMBA] and not self._deepest_state(x):
                self._evict_component(x, MAMBA, tracker)
                self._cascade(x, MAMBA, tracker)

    def _viable(self, node: TreeNode) -> bool:
        """Whether a match can end at `node`'s end: every component's validator accepts
        it there (SWA: `window` live tokens since the last tombstone, or none on the path)."""
        if self.has_mamba and node.mamba is None:
            return False
        live = 0
        x = node
        while self.has_swa and x is not self.root and live < self.window:
            if x.swa is None:
                return False
            live += len(x.key)
            x = x.parent  # type: ignore[assignment]
        return True

    def _prune_dead(self, node: TreeNode, tracker: dict[Component, int]) -> TreeNode:
        """Delete `node`, then each parent, while it is an evictable leaf no match can end
        in: KV that no request can hit until its windows or states are recomputed, which
        would bring their own. Returns the first node kept."""
        while node in self.leaves and not self._viable(node):
            parent = node.parent
            self._delete_leaf(node, tracker)
            node = parent  # type: ignore[assignment]
        return node

    def _leaves_reading(self, node: TreeNode) -> list[TreeNode]:
        """The structural leaves below `node` whose end is less than `window` TOKENS past
        `node`'s: the matches that end there read `node`'s SWA."""
        out = []
        stack = [(child, len(child.key)) for child in node.children.values()]
        while stack:
            x, dist = stack.pop()
            if dist >= self.window:
                continue
            if not x.children:
                out.append(x)
            stack.extend((child, dist + len(child.key)) for child in x.children.values())
        return out

    def _deepest_state(self, node: TreeNode) -> bool:
        """Whether `node`'s state is the deepest on the path to some leaf: the one a
        continuation of that branch resumes from."""
        stack = list(node.children.values())
        if not stack:
            return True
        while stack:
            x = stack.pop()
            if x.mamba is None:
                if not x.children:
                    return True
                stack.extend(x.children.values())
        return False

    def _in_branch_tail(self, node: TreeNode) -> bool:
        """Whether `node`'s SWA is in the last window of a branch a match can end at (a
        leaf, viable): the only SWA a branch needs to be matched whole (SGLang PR 35515)."""
        if not node.children:
            return self._viable(node)
        return any(self._viable(leaf) for leaf in self._leaves_reading(node))

    # -- inspection ----------------------------------------------------------------------
    def nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self, locks: Sequence[LockReceipt]) -> None:
        """The tree's structure, sizes, LRUs, leaf set and lock counts (given every live
        lock); raises AssertionError naming the first broken one."""
        page = self.page
        want = {}  # node id -> expected locks per component
        for r in locks:
            cur = r.node
            while cur is not self.root:
                want.setdefault(cur.id, [0, 0, 0])[FULL] += 1
                cur = cur.parent  # type: ignore[assignment]
            if self.has_swa:
                cur = r.node
                while cur is not self.root:
                    want.setdefault(cur.id, [0, 0, 0])[SWA] += 1
                    if r.swa_uuid is not None and cur.swa_uuid == r.swa_uuid:
                        break
                    cur = cur.parent  # type: ignore[assignment]
            if self.has_mamba and r.node is not self.root:
                want.setdefault(r.node.id, [0, 0, 0])[MAMBA] += 1
        evictable = {c: 0 for c in self.components}
        protected = {c: 0 for c in self.components}
        count = 0
        for node in self.nodes():
            count += 1
            if node is self.root:
                continue
            nid = f"node {node.id}"
            if not node.key or len(node.key) % page:
                raise AssertionError(f"{nid}: key of {len(node.key)} tokens is not whole pages")
            if node.full is None or len(node.full) != len(node.key) // page:
                raise AssertionError(f"{nid}: FULL holds {node.full!r} for {len(node.key)} tokens")
            if node.swa is not None and len(node.swa) != len(node.full):
                raise AssertionError(f"{nid}: SWA holds {len(node.swa)} pages for {len(node.full)}")
            if not self.has_swa and node.swa is not None or not self.has_mamba and node.mamba is not None:
                raise AssertionError(f"{nid}: a value for a component the tree does not have")
            for key, ch in node.children.items():
                if ch.parent is not node or key != tuple(ch.key[:page]):
                    raise AssertionError(f"{nid}: child {ch.id} is linked wrong")
            got = node.locks
            exp = want.get(node.id, [0, 0, 0])
            for c in self.components:
                if got[c] != exp[c]:
                    raise AssertionError(f"{nid}: {c.name} lock {got[c]}, live requests hold {exp[c]}")
                size = self._size(node, c)
                (protected if got[c] else evictable)[c] += size
                if c != FULL and (node.value(c) is not None) != (node in self.lru[c]):
                    raise AssertionError(f"{nid}: {c.name} value and LRU membership disagree")
            if self.is_leaf(node) != (node in self.leaves):
                raise AssertionError(f"{nid}: the evictable-leaf set is wrong about it")
            if self.no_tail_cliff and node in self.leaves and not self._viable(node):
                raise AssertionError(f"{nid}: an evictable leaf no match can end in (no_tail_cliff prunes those)")
        for root_key, ch in self.root.children.items():
            if root_key != (ch.ns, tuple(ch.key[:page])):
                raise AssertionError(f"root child {ch.id} is keyed wrong")
        if count != self.num_nodes:
            raise AssertionError(f"{count} nodes reachable, {self.num_nodes} counted")
        inner = {n for n in self.nodes() if n is not self.root and n.mamba is not None and n.children}
        if inner != self.inner_states:
            raise AssertionError(f"{len(inner)} nodes hold a state and a child, {len(self.inner_states)} listed")
        if self.has_mamba:
            stamps = [n.stamps[MAMBA] for n in self.lru[MAMBA].order()]
            if stamps != sorted(stamps, reverse=True):
                raise AssertionError("MAMBA's LRU order is not its stamps' order")
        for c in self.components:
            if evictable[c] != self.evictable[c] or protected[c] != self.protected[c]:
                raise AssertionError(
                    f"{c.name} sizes: evictable {self.evictable[c]} / protected {self.protected[c]}, "
                    f"nodes say {evictable[c]} / {protected[c]}"
                )
            if c != FULL and len(list(self.lru[c].order())) != len(self.lru[c]):
                raise AssertionError(f"{c.name} LRU list and membership disagree")
