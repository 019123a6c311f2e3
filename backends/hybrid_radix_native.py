"""The `radix` strategy's hybrid tree, native: `prefixcache._C.HybridTree` as the cache drives it.

Owns `NativeHybridTree`: the tree of `backends.hybrid_radix_tree` (whose `HybridTree`
stays the definition and the reference model the native one is proven against,
tests/test_hybrid_tree_native_stateful.py) run by csrc/hybrid_tree.h, with the Python
face the cache and its tests read: namespaces (any hashable tree key) as the small ints
the native tree keys its roots by; what the native tree frees and the events it records,
drained after each call that changes it, in its order, to the cache's `free` and event
hooks; node views (`NodeView`) for inspection, the same object for the same node while
one is held.

The cache's hot path (admission) takes the native objects as they are: `probe`,
`settle`, `lock_cost`, `lock`, `unlock` pass `HybridMatch` / `HybridReceipt` /
`HybridNodeRef` through, and `native.admit_hit` (which frees nothing) is called
directly; `match` wraps a match for inspection (`NodeMatch`).

Must never: keep a node's values on the Python side (a view reads the tree when asked),
or reorder what the native tree frees.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from weakref import WeakValueDictionary

from prefixcache._C import HybridMatch, HybridNodeRef, HybridReceipt
from prefixcache._C import HybridTree as _Native

from .hybrid_radix_tree import Component

__all__ = ["NativeHybridTree", "NodeView", "NodeMatch"]

FULL, SWA, MAMBA = Component.FULL, Component.SWA, Component.MAMBA
_NO_REACH = (-1, -1, -1)


class NodeView:
    """A node of the native tree, read when an attribute is (the model's TreeNode
    attributes: id, parent, key, full, swa, mamba, locks, swa_uuid, ns, children)."""

    __slots__ = ("_tree", "ref", "__weakref__")

    def __init__(self, tree: NativeHybridTree, ref: HybridNodeRef) -> None:
        self._tree = tree
        self.ref = ref

    def _get(self, i: int):
        return self._tree.native.view(self.ref)[i]

    @property
    def id(self) -> int:
        return self.ref.id

    @property
    def parent(self) -> NodeView | None:
        p = self._tree.native.parent(self.ref)
        return None if p is None else self._tree.view(p)

    @property
    def key(self) -> array:
        return array("i", self._get(2))

    @property
    def full(self) -> list[int]:
        return self._get(3)

    @property
    def swa(self) -> list[int] | None:
        return self._get(4)

    @property
    def mamba(self) -> int | None:
        return self._tree.native.state(self.ref)

    @property
    def locks(self) -> list[int]:
        return list(self._get(6))

    @property
    def swa_uuid(self) -> int | None:
        return self._get(7)

    @property
    def ns(self) -> object:
        return self._tree.ns_key(self._get(10))

    @property
    def children(self) -> dict:
        """Keyed as the model keys them: (namespace, first page) at the root, else the first page."""
        tree = self._tree
        out = {}
        for child in tree.native.nodes_below(self.ref):
            v = tree.view(child)
            page = tuple(v.key[: tree.page])
            out[(v.ns, page) if self.ref == tree.root.ref else page] = v
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeView) and other.ref == self.ref

    def __hash__(self) -> int:
        return hash(self.ref)

    def __repr__(self) -> str:
        return f"NodeView({self.ref.id})"


class NodeMatch:
    """A native match with its nodes as views (the model's MatchOutcome, for inspection)."""

    __slots__ = ("raw", "_tree")

    def __init__(self, tree: NativeHybridTree, raw: HybridMatch) -> None:
        self._tree, self.raw = tree, raw

    num_tokens = property(lambda self: self.raw.num_tokens)
    full_hit = property(lambda self: self.raw.full_hit)
    swa_branching = property(lambda self: self.raw.swa_branching)
    mamba_branching = property(lambda self: self.raw.mamba_branching)

    @property
    def node(self) -> NodeView:
        return self._tree.view(self.raw.node)

    @property
    def path(self) -> list[tuple[NodeView, int]]:
        return [(self._tree.view(r), k) for r, k in self.raw.path]

    @property
    def inside(self) -> tuple[NodeView, int] | None:
        got = self.raw.inside
        return None if got is None else (self._tree.view(got[0]), got[1])

    def pages(self, c: Component, page_size: int) -> list[int]:
        return self._tree.native.hit_pages(self.raw, int(c))


class _LRUView:
    def __init__(self, tree: NativeHybridTree, c: Component) -> None:
        self._tree, self._c = tree, c

    def order(self) -> Iterator[NodeView]:
        """Most recent first."""
        by_id = {r.id: r for r in self._tree.native.nodes()}
        return iter([self._tree.view(by_id[i]) for i in self._tree.native.lru_order(int(self._c))])


class NativeHybridTree:
    """`HybridTree`'s interface over the native tree (module docstring). `free(component,
    ids)` and the event hooks (`on_store(event)` / `on_remove(event)`, an event the
    native log's tuple) are called after the native call that made them returns."""

    def __init__(
        self,
        page_size: int,
        components: Sequence[Component],
        free: Callable[[Component, list[int]], None],
        *,
        window: int | None = None,
        state_grid: int = 1,
        on_store: Callable[[tuple], None] | None = None,
        on_remove: Callable[[tuple], None] | None = None,
        no_tail_cliff: bool = False,
    ) -> None:
        self.page = page_size
        self.components = tuple(sorted(components))
        self.has_swa, self.has_mamba = SWA in self.components, MAMBA in self.components
        if self.has_swa and not (window and window > 0):
            raise ValueError("an SWA component needs a positive window")
        self.window = window or 0
        self.no_tail_cliff = no_tail_cliff
        self._free = free
        self._on_store, self._on_remove = on_store, on_remove
        self.native = _Native(page_size, self.has_swa, self.has_mamba, window, state_grid, no_tail_cliff,
                              on_store is not None or on_remove is not None)  # fmt: skip
        self._ns_ids: dict[object, int] = {}
        self._ns_keys: dict[int, object] = {}
        self._next_ns = 0
        self._views: WeakValueDictionary[int, NodeView] = WeakValueDictionary()
        self.lru = {c: _LRUView(self, c) for c in self.components if c != FULL}
        self.root = self.view(self.native.root)

    # -- namespaces, views, logs ----------------------------------------------------------
    def ns_id(self, key: object) -> int:
        """The native tree's int for a tree key (interned while a node or request has it)."""
        got = self._ns_ids.get(key)
        if got is None:
            got = self._ns_ids[key] = self._next_ns
            self._ns_keys[got] = key
            self._next_ns += 1
        return got

    def ns_key(self, ns: int) -> object:
        return self._ns_keys.get(ns)

    def namespaces(self) -> set:
        """The tree keys the root's children hold."""
        return {self._ns_keys[self.native.view(r)[10]] for r in self.native.nodes_below(self.native.root)}

    def keep_namespaces(self, keys: set) -> None:
        """Forget the ints of tree keys outside `keys` (no node may hold one)."""
        self._ns_ids = {k: i for k, i in self._ns_ids.items() if k in keys}
        self._ns_keys = {i: k for k, i in self._ns_ids.items()}

    def view(self, ref: HybridNodeRef) -> NodeView:
        got = self._views.get(ref.id)
        if got is None or got.ref != ref:
            got = NodeView(self, ref)
            self._views[ref.id] = got
        return got

    def _drain(self) -> None:
        native = self.native
        for c, ids in native.take_freed():
            self._free(Component(c), ids)
        if self._on_store is not None or self._on_remove is not None:
            for event in native.take_events():
                hook = self._on_store if event[0] else self._on_remove
                if hook is not None:
                    hook(event)

    @staticmethod
    def _ref(node: NodeView | HybridNodeRef) -> HybridNodeRef:
        return node.ref if isinstance(node, NodeView) else node

    # -- the cache's calls ----------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return self.native.num_nodes

    @property
    def evictable(self) -> dict[Component, int]:
        return {c: self.native.evictable(c) for c in self.components}

    @property
    def protected(self) -> dict[Component, int]:
        return {c: self.native.protected_size(c) for c in self.components}

    def evictable_size(self, c: Component) -> int:
        return self.native.evictable(c)

    def probe(self, tokens: Sequence[int], ns: object) -> HybridMatch:
        """The match of `tokens` (an int32 buffer, read in place), changing nothing (a tree
        key the tree never held gets no int: it matches nothing)."""
        return self.native.match(tokens, self._ns_ids.get(ns, -1))

    def match(self, tokens: Sequence[int], ns: object) -> NodeMatch:
        return NodeMatch(self, self.probe(tokens, ns))

    def settle(self, out: HybridMatch | NodeMatch) -> HybridMatch | NodeMatch:
        if isinstance(out, NodeMatch):
            return NodeMatch(self, self.native.settle(out.raw))
        return self.native.settle(out)

    def lock_cost(self, hit: HybridMatch) -> tuple[int, int, int]:
        return self.native.lock_cost(hit)

    def lock(self, node: NodeView | HybridNodeRef) -> HybridReceipt:
        return self.native.lock(self._ref(node))

    def unlock(self, receipt: HybridReceipt) -> None:
        self.native.unlock(receipt)

    def state(self, node: HybridNodeRef) -> int | None:
        return self.native.state(node)

    def hit_pages(self, hit: HybridMatch, c: Component) -> list[int]:
        return self.native.hit_pages(hit, int(c))

    def path_pages(self, node: NodeView | HybridNodeRef) -> list[int]:
        return self.native.path_pages(self._ref(node))

    def path_swa(self, node: NodeView | HybridNodeRef) -> list[int]:
        return self.native.path_swa(self._ref(node))

    def path_nodes(self, node: NodeView | HybridNodeRef) -> list[NodeView]:
        return [self.view(r) for r in self.native.path_nodes(self._ref(node))]

    def nodes(self) -> Iterator[NodeView]:
        return iter([self.view(r) for r in self.native.nodes()])

    def insert(self, tokens, ns: object, pages: Sequence[int], swa_pages: Sequence[int] | None, *, prev_prefix_len: int,
               swa_evicted: int = 0, swa_branching: int | None = None, mamba_value: int | None = None,
               hashes: Sequence[bytes] | None = None):  # fmt: skip
        try:
            return self.native.insert(tokens, self.ns_id(ns), pages, swa_pages, prev_prefix_len=prev_prefix_len,
                                       swa_evicted=swa_evicted, swa_branching=swa_branching, mamba_value=mamba_value,
                                       hashes=hashes)  # fmt: skip
        finally:
            self._drain()

    def evict(self, requests: dict[Component, int], reach: dict[Component, int] | None = None) -> dict[Component, int]:
        """Each component's walk until it freed `requests[c]` (TOKENS; MAMBA: states); a
        component in `reach` stops once it freed that much, a FULL one runs to it."""
        want = tuple(requests.get(c, 0) for c in Component)
        to = _NO_REACH if not reach else tuple(reach.get(c, -1) for c in Component)
        try:
            got = self.native.evict(want, to)
        finally:
            self._drain()
        return {c: got[c] for c in self.components}

    def drop_states(self, nodes: Sequence[NodeView | HybridNodeRef]) -> None:
        try:
            self.native.drop_states([self._ref(n) for n in nodes])
        finally:
            self._drain()

    def reset(self) -> None:
        self.native.reset()
        self.native.take_freed()
        self.native.take_events()
        self._ns_ids.clear()
        self._ns_keys.clear()
        self._views = WeakValueDictionary()
        self.root = self.view(self.native.root)

    def check_invariants(self, locks: Sequence[HybridReceipt]) -> None:
        self.native.check_invariants(list(locks))

    def walk_every_state(self, on: bool) -> None:
        """Tests only: no_tail_cliff's first state walk asks every state (csrc/hybrid_tree.h)."""
        self.native.set_walk_every_state(on)
