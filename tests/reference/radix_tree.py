"""The radix tree: the readable reference for `prefixcache._C.RadixTree`.

Owns SGLang's RadixAttention prefix tree (`mem_cache/radix_cache.py`, v0.5.23) over a
block pool: token runs and the blocks that store them, one pool reference per block
held, lock refs that protect the paths of live requests, exact evictable / protected
sizes (TOKENS), a logical clock, and eviction of unlocked leaves by policy priority.
The native `RadixTree` is what the `radix` backend uses; `PyRadixTree` is the same
semantics in plain Python, written the way SGLang's tree is.
Tests drive both with the same operations and require identical results.

Must never: allocate blocks, hash, record events, or know about requests. The caller
allocates a request's blocks, hands them over with `insert`, and frees the duplicates
`insert` gives back (SGLang's `cache_finished_req` / `cache_unfinished_req`).

The contract both trees keep:

- Shape. Each namespace (SGLang's `extra_key`; `None` is one of its own) has its own
  root, so equal tokens in two namespaces never share a node. A non-root node holds a
  run of tokens, a positive multiple of `page_size`, and one block per page. Children
  are keyed by their first page (a tuple; `(token,)` at page size 1). Pages compare
  whole: a difference anywhere in a page is a miss for that page.
- Roots. A namespace's root exists only while it has children or locks: `insert`
  creates it, and it is dropped when its last child is evicted and no lock is held
  through it, so memory follows what is cached however many namespaces come and go.
  `match_prefix` never creates one: a match in a namespace without a root names node
  0, "no node", which `lock` and `unlock` take as a no-op. `node(id)` is O(1).
- `match(tokens, namespace)` is a pure look-up of the longest cached prefix of
  `tokens` cut to whole pages. `match_prefix` is SGLang's: a match ending inside a
  node splits it and every node walked gets a fresh `last_access_time`.
- `hit_count` is SGLang 0.5.23's: counted at insert, not at match. An insert walk counts
  a hit on each node that ends past `inserted` (TOKENS the caller inserted before,
  SGLang's `cache_inserted_len`; default `start`) and on the node it creates, so a
  request counts each node once; a split's upper half copies the count.
- tlru's inputs: `cached_prefix_len` (TOKENS root -> end of the node) and
  `history_len` (the deepest `cached_prefix_len` its branch ever reached, raised on
  the way up when a leaf is created, copied by a split's upper half; never shrinks).
- `insert(tokens, blocks, namespace, priority, start)` returns `prefix_len`, the
  leading tokens already present. `blocks` hold the pages from token `start` on: the
  caller already holds the first `start` tokens from the tree (SGLang's
  `cache_protected_len`), so only new pages cost a conversion. Pages already present
  keep the tree's blocks: their entries in `blocks` are re-pointed in place, and the
  caller's ids that differed come back as `displaced` (still the caller's to free).
  The new pages' blocks now belong to the tree.
- `extend(node, tokens, blocks, priority)` is `insert` continued from `node`: the
  tokens of root -> node followed by `tokens`, with start = inserted = the node's
  depth (a request's commit after its first insert; `blocks`: one per page of
  `tokens`). The native tree walks only `tokens` when `node` is locked: what the
  re-walk would write on the path above (tick, traffic, request length, priority,
  tlru's depth) is owed to the path and folded in when the node's lock drops; only
  unlocked leaves are ranked and every fold is a max, so nothing reads the
  difference, and `node()` reports the folded values. This model re-inserts.
  `relock(from, to)` is `lock(to)` then `unlock(from)`, in O(nodes between them)
  natively when `to` is below `from`.
- A split keeps `lock_ref` (and priority and hit count) on both halves, so neither
  size moves; the new upper node is stamped as a new node, as SGLang's `_split_node`.
- `lock` / `unlock` walk root -> node, the root included (its `lock_ref` counts the
  locks held in its namespace; it holds no tokens). `lock_ref(parent) >=
  lock_ref(child)`, so every unlocked node is reachable by evicting leaves.
- `evict(num_tokens)` pops unlocked leaves, lowest priority first (ties: older node
  first), freeing whole leaves (it may free more than asked); a parent whose last
  child goes, and that is unlocked, becomes a candidate. With the tree's own order (a
  native one, or a callable given as `eviction`: a Python policy's priority) the
  leaves sit in a persistent order (the native tree: an ordered set; this model: a
  heap with stale entries skipped), re-keyed only when a walk touches them: O(log n)
  per evicted leaf, and a callable is asked once per leaf and change. A `priority`
  function passed to `evict` is called once per candidate per call (it may differ
  from call to call), never per comparison. `last_evicted()` lists the blocks the
  latest call freed, even if a policy raised halfway.
- Clock: a counter, not wall time, so replays are reproducible. Each match or insert
  takes one tick for the nodes it walks; each node it creates takes a tick of its own
  (SGLang stamps new nodes with `time.monotonic()` after the walk; same order).
- Use history (for policies that count reuse, `gslru`): `traffic` counts the TOKENS
  (whole pages) `match_prefix` was asked for. Each node keeps `use_count` (+1 per
  `match_prefix` that hits it, per `insert` that walks it beyond the caller's own
  prefix `start`, and 1 for the insert that creates it), `last_use` (traffic at the
  latest insert through it) and `request_tokens` (that insert's length). With
  `ghost_capacity > 0`, pages have 64-bit content keys chained from the namespace
  (`chain_page_key`, in ghost_table.py): an evicted leaf leaves its use count under
  each page's key in a `GhostTable`, and a new leaf starts at 1 + the largest count its
  pages left, so content that comes back is known to be reused.

Inspection (both trees): `total_size`, `evictable_size`, `protected_size` (tokens),
`num_nodes` (roots included), `clock`, `root(namespace)` (id or None),
`namespaces()`, `node(id)` (a copy: tokens, block_ids, children by first page, lock
ref, times, hit count, priority), `check_invariants(locked_nodes)`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache._C import InvariantError, int32_array
from prefixcache.registry import resolve_eviction_policy

from .candidate import CandidateRecord
from .ghost_table import GhostTable, chain_page_key, namespace_key

__all__ = ["NATIVE_ORDERS", "PyRadixTree", "RadixMatch", "RadixInsert", "NodeInfo", "Candidate"]

NATIVE_ORDERS = ("lru", "lfu", "fifo", "mru", "filo", "priority", "gslru", "slru", "tlru")

Namespace = str | None
"""A tree namespace: one root per value. The `radix` backend passes
`prefixcache.isolation.exact_key(namespace)`, so a LoRA namespace is a str here too."""


@dataclass(frozen=True)
class RadixMatch:
    """A look-up: `num_tokens` matched (whole pages) in `block_ids`."""

    num_tokens: int
    block_ids: list[int]
    node: int  # last node reached (0 if the namespace has no root)
    unlocked_tokens: int  # matched tokens in nodes with lock_ref 0


@dataclass(frozen=True)
class RadixInsert:
    """An insert: `prefix_len` tokens were already present."""

    prefix_len: int
    node: int  # the node ending at the key's end
    displaced: list[int]  # caller ids replaced by the tree's blocks


@dataclass(frozen=True)
class NodeInfo:
    """A copy of one node (`RadixNodeInfo` in the native tree)."""

    id: int
    parent: int | None
    namespace: Namespace
    tokens: tuple[int, ...]
    block_ids: tuple[int, ...]
    lock_ref: int
    last_access_time: int
    creation_time: int
    hit_count: int
    priority: int
    use_count: int
    last_use: int
    request_tokens: int
    children: dict[tuple[int, ...], int]
    cached_prefix_len: int = 0
    history_len: int = 0


Candidate = CandidateRecord  # what a policy reads about a leaf (`EvictionCandidate` natively)


@dataclass(eq=False)
class _Node:
    id: int
    parent: _Node | None  # None for a namespace root
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access_time: int = 0
    creation_time: int = 0
    hit_count: int = 0
    priority: int = 0
    use_count: int = 0
    last_use: int = 0
    request_tokens: int = 0
    tail_key: int = 0  # content key of the last page (a root: of its namespace); ghost only
    cached_prefix_len: int = 0  # TOKENS root -> end of this node (tlru)
    history_len: int = 0  # deepest cached_prefix_len of its branch (tlru)
    order_stamp: int = 0  # the heap entry with this stamp is its live one
    root: _Node | None = None  # its namespace's root (itself for a root)
    namespace: Namespace = None  # a root's namespace

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def evictable_leaf(self) -> bool:
        return self.parent is not None and self.lock_ref == 0 and not self.children

    def candidate(self) -> Candidate:
        return Candidate(
            self.id,
            len(self.tokens),
            self.last_access_time,
            self.creation_time,
            self.hit_count,
            self.priority,
            self.use_count,
            self.last_use,
            self.request_tokens,
            self.cached_prefix_len,
            self.history_len,
        )


@dataclass
class _Walk:
    """A key's path, found without changing anything: nodes matched whole, then the
    node the match ends inside (if any) with the tokens matched there."""

    root: _Node | None
    path: list[_Node] = field(default_factory=list)
    partial: _Node | None = None
    partial_len: int = 0
    matched: int = 0

    @property
    def last(self) -> _Node | None:
        if self.partial is not None:
            return self.partial
        return self.path[-1] if self.path else self.root


def _check_namespace(namespace: object) -> Namespace:
    if namespace is not None and not isinstance(namespace, str):
        raise TypeError(f"namespace must be a str or None, got {type(namespace).__name__}")
    if namespace is not None and not namespace.isascii():
        try:
            namespace.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                f"namespace must be valid Unicode (a lone surrogate cannot be encoded), got {namespace!r}"
            ) from None
    return namespace


def _int32s(values: Sequence[int], what: str) -> list[int]:
    # The native tree's argument rule (csrc/py_args.h), so both refuse alike, in the same words.
    return int32_array(values, what).tolist()


class PyRadixTree:
    """Pure-Python model of `RadixTree`: same API, results and errors. For tests."""

    def __init__(
        self,
        pool: Any,
        page_size: int,
        eviction: str | Callable[[Any], Any] | None = "lru",
        protect_tokens: int = 0,
        size_weight: int = 0,
        ghost_capacity: int = 0,
        protected_threshold: int = 2,
        tlru_threshold: int = 0,
        next_prompt_estimate: int = 0,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if isinstance(eviction, str) and eviction not in NATIVE_ORDERS:
            raise ValueError(
                f"eviction order '{eviction}' is not native; allowed values: {', '.join(NATIVE_ORDERS)}"
            )
        if not (eviction is None or isinstance(eviction, str) or callable(eviction)):
            raise TypeError(f"eviction must be a native order's name, a callable or None, got {type(eviction).__name__}")
        if ghost_capacity < 0:
            raise ValueError(f"ghost_capacity must be >= 0, got {ghost_capacity}")
        self.pool = pool
        self.page_size = page_size
        # The reference ranks with the registered policy classes themselves.
        self._order: Callable[[Any], Any] | None = None
        if callable(eviction):  # a Python policy: kept in the same persistent order
            self._order = eviction
        elif eviction is not None:
            policy = resolve_eviction_policy(eviction)()
            # The native tree takes its orders' parameters as arguments.
            given = {"protect_tokens": protect_tokens, "size_weight": size_weight,
                     "protected_threshold": protected_threshold, "threshold": tlru_threshold,
                     "next_prompt_estimate": next_prompt_estimate}
            for name in ("protect_tokens", "size_weight", "protected_threshold", "threshold", "next_prompt_estimate"):
                if hasattr(policy, name):
                    setattr(policy, name, given[name])
            self._order = policy.priority
        self._ghost = GhostTable(ghost_capacity)
        self.traffic = 0
        self._nodes: dict[int, _Node] = {}
        self._roots: dict[Namespace, _Node] = {}
        self._in_tree: set[int] = set()
        self.evictable_size = 0
        self.protected_size = 0
        self.clock = 0
        self._next_id = 1
        self._last_evicted: list[int] = []
        # The persistent leaf order of the tree's own policy: (key, id, stamp) entries,
        # stale ones (an old stamp, a node gone or no longer an evictable leaf) skipped.
        self._order_heap: list[tuple[Any, int, int]] = []
        self._dirty: dict[int, _Node] = {}  # nodes to (re)enter the order before the next eviction

    # -- inspection ------------------------------------------------------------------
    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def root(self, namespace: Namespace = None) -> int | None:
        r = self._roots.get(_check_namespace(namespace))
        return None if r is None else r.id

    def namespaces(self) -> list[Namespace]:
        named = sorted(ns for ns in self._roots if ns is not None)
        return ([None] if None in self._roots else []) + named

    def node(self, id: int) -> NodeInfo:
        n = self._node(id, "node")
        assert n.root is not None
        namespace = n.root.namespace
        children = sorted(n.children.items(), key=lambda kv: kv[1].id)
        return NodeInfo(
            id=n.id,
            parent=None if n.parent is None else n.parent.id,
            namespace=namespace,
            tokens=tuple(n.tokens),
            block_ids=tuple(n.blocks),
            lock_ref=n.lock_ref,
            last_access_time=n.last_access_time,
            creation_time=n.creation_time,
            hit_count=n.hit_count,
            priority=n.priority,
            use_count=n.use_count,
            last_use=n.last_use,
            request_tokens=n.request_tokens,
            children={key: child.id for key, child in children},
            cached_prefix_len=n.cached_prefix_len,
            history_len=n.history_len,
        )

    def last_evicted(self) -> list[int]:
        return list(self._last_evicted)

    @property
    def ghost_size(self) -> int:
        return len(self._ghost)

    # -- look-up -------------------------------------------------------------------
    def _page_key(self, tokens: Sequence[int], at: int = 0) -> tuple[int, ...]:
        return tuple(tokens[at : at + self.page_size])

    def _shared_len(self, node: _Node, key: list[int], at: int) -> int:
        """Tokens of `node` that `key[at:]` matches, in whole pages."""
        n = min(len(node.tokens), len(key) - at)
        same = 0
        while same < n and node.tokens[same] == key[at + same]:
            same += 1
        if same == len(node.tokens):
            return same
        return same // self.page_size * self.page_size

    def _walk(self, key: list[int], root: _Node | None) -> _Walk:
        w = _Walk(root)
        if root is None:
            return w
        node, at = root, 0
        while at < len(key):
            child = node.children.get(self._page_key(key, at))
            if child is None:
                break
            same = self._shared_len(child, key, at)
            at += same
            if same < len(child.tokens):
                w.partial, w.partial_len = child, same
                break
            w.path.append(child)
            node = child
        w.matched = at
        return w

    def _collect(self, w: _Walk) -> RadixMatch:
        blocks: list[int] = []
        unlocked = 0
        for n in w.path:
            blocks += n.blocks
            unlocked += len(n.tokens) if n.lock_ref == 0 else 0
        if w.partial is not None:
            blocks += w.partial.blocks[: w.partial_len // self.page_size]
            unlocked += w.partial_len if w.partial.lock_ref == 0 else 0
        last = w.last
        return RadixMatch(w.matched, blocks, 0 if last is None else last.id, unlocked)

    def _whole_pages(self, tokens: Sequence[int]) -> list[int]:
        key = _int32s(tokens, "tokens")
        return key[: len(key) // self.page_size * self.page_size]

    def match(self, tokens: Sequence[int], namespace: Namespace = None) -> RadixMatch:
        """Pure look-up of the longest cached whole-page prefix; changes nothing."""
        return self._collect(self._walk(self._whole_pages(tokens), self._roots.get(_check_namespace(namespace))))

    def match_prefix(self, tokens: Sequence[int], namespace: Namespace = None) -> RadixMatch:
        """SGLang's match_prefix: split at the match's end, refresh recency, count a hit."""
        key = self._whole_pages(tokens)
        root = self._roots.get(_check_namespace(namespace))  # none is made: an empty match is node 0
        w = self._walk(key, root)
        out = self._collect(w)
        self.clock += 1
        self.traffic += len(key)
        now = self.clock
        if root is not None:
            root.last_access_time = now
        for n in w.path:
            n.last_access_time = now
            n.use_count += 1
            self._touched(n)
        if w.partial is not None:
            w.partial.last_access_time = now  # SGLang refreshes it, then splits it
            self._touched(w.partial)
            mid = self._split(w.partial, w.partial_len)
            mid.use_count += 1
            out = RadixMatch(out.num_tokens, out.block_ids, mid.id, out.unlocked_tokens)
        return out

    # -- insert ----------------------------------------------------------------------
    def insert(
        self,
        tokens: Sequence[int],
        blocks: MutableSequence[int],
        namespace: Namespace = None,
        priority: int = 0,
        start: int = 0,
        inserted: int = -1,
    ) -> RadixInsert:
        """Insert whole pages. `blocks` hold the pages from token `start` on (the caller
        already holds the first `start` tokens from the tree); entries of pages already
        in the tree are re-pointed to the tree's blocks in place. `inserted`: TOKENS the
        caller inserted before, for hit counting (-1: `start`)."""
        if inserted < 0:
            inserted = start
        key = _int32s(tokens, "tokens")
        namespace = _check_namespace(namespace)
        if isinstance(blocks, (tuple, str, bytes)) or not hasattr(blocks, "__setitem__"):
            raise TypeError(
                f"blocks must be a list or a writable int32 buffer (array('i')), got {type(blocks).__name__}"
            )
        ids = _int32s(blocks, "blocks")
        page = self.page_size
        if len(key) % page:
            raise ValueError(f"insert: tokens has {len(key)} tokens, not a multiple of page_size {page}")
        if not 0 <= start <= len(key) or start % page:
            raise ValueError(f"insert: start={start} must be a multiple of page_size {page} in [0, {len(key)}]")
        first = start // page  # the page of blocks[0]
        if len(ids) != len(key) // page - first:
            raise ValueError(
                f"insert: blocks has {len(ids)} ids but tokens[{start}:{len(key)}] need "
                f"{len(key) // page - first} (one per page)"
            )
        w = self._walk(key, self._roots.get(namespace))
        if w.matched < start:
            raise ValueError(f"insert: start={start} but only the first {w.matched} tokens are in the tree")
        dup_pages = w.matched // page
        present = self._collect(w).block_ids

        # Validate everything before changing anything.
        caller_owned = []
        for p, b in enumerate(ids, start=first):
            if not 0 <= b < self.pool.num_blocks:
                raise IndexError(f"insert: block id {b} is out of range [0, {self.pool.num_blocks})")
            if p < dup_pages and b == present[p]:
                continue
            # A duplicate to hand back, or a new page to adopt: the caller must own it.
            if b in self._in_tree:
                raise ValueError(f"insert: block {b} (page {p}) already belongs to the tree at another position")
            if self.pool.ref_count(b) < 1:
                raise ValueError(f"insert: block {b} is free in the pool")
            caller_owned.append(b)
        if len(set(caller_owned)) != len(caller_owned):
            dup = next(b for i, b in enumerate(caller_owned) if b in caller_owned[:i])
            raise ValueError(f"insert: block {dup} appears more than once")

        root = w.root
        if root is None and w.matched < len(key):  # a root only to hold a leaf
            root = self._root_or_create(namespace)
        self.clock += 1
        now = self.clock
        if root is not None:
            root.last_access_time = now
        offset = 0  # tokens before the node: the caller's own prefix counted its use already
        for n in w.path:
            n.last_access_time = now
            n.priority = max(n.priority, priority)
            self._stamp_use(n, offset >= start, len(key))
            offset += len(n.tokens)
            if offset > inserted:  # ends past what the caller inserted: SGLang counts a hit
                n.hit_count += 1
            self._touched(n)
        node = w.last or root
        if w.partial is not None:
            w.partial.last_access_time = now
            self._touched(w.partial)
            node = self._split(w.partial, w.partial_len)
            node.priority = max(node.priority, priority)
            self._stamp_use(node, offset >= start, len(key))
            if offset + w.partial_len > inserted:
                node.hit_count += 1
        displaced = []
        for p in range(first, dup_pages):
            if ids[p - first] != present[p]:
                displaced.append(ids[p - first])
                blocks[p - first] = present[p]
        if w.matched < len(key):
            leaf = self._new_node(node)
            leaf.tokens = key[w.matched :]
            leaf.blocks = ids[dup_pages - first :]
            leaf.priority = priority
            leaf.last_use, leaf.request_tokens = self.traffic, len(key)
            history = 0
            if self._ghost.enabled:
                keys = self._page_keys(node.tail_key, leaf)
                history = max(self._ghost.take(k) for k in keys)
                leaf.tail_key = keys[-1]
            leaf.use_count = 1 + history
            leaf.hit_count = 1 if len(key) > inserted else 0
            leaf.cached_prefix_len = node.cached_prefix_len + len(leaf.tokens)
            self._raise_history(leaf)
            node.children[self._page_key(leaf.tokens)] = leaf
            self._touched(leaf)
            self._in_tree.update(leaf.blocks)
            self.evictable_size += len(leaf.tokens)
            node = leaf
        return RadixInsert(w.matched, 0 if node is None else node.id, displaced)

    def extend(self, node: int, tokens: Sequence[int], blocks: MutableSequence[int], priority: int = 0) -> RadixInsert:
        """`insert` continued from `node`: the tokens of root -> node followed by `tokens`,
        with start = inserted = the node's depth (a caller that holds and inserted the
        path adds the pages after it; `blocks`: one per page of `tokens`). prefix_len
        counts from the root. The native tree walks only `tokens` when `node` is locked."""
        n = self._node(node, "extend")
        key = _int32s(tokens, "tokens")
        if len(key) % self.page_size:
            raise ValueError(f"extend: tokens has {len(key)} tokens, not a multiple of page_size {self.page_size}")
        if len(blocks) != len(key) // self.page_size:
            raise ValueError(
                f"extend: blocks has {len(blocks)} ids but {len(key)} tokens need {len(key) // self.page_size} (one per page)"
            )
        path: list[list[int]] = []
        top = n
        while top.parent is not None:
            path.append(top.tokens)
            top = top.parent
        namespace = next(ns for ns, r in self._roots.items() if r is top)
        prefix = [t for run in reversed(path) for t in run]
        return self.insert(prefix + key, blocks, namespace, priority, len(prefix), len(prefix))

    def _touched(self, n: _Node) -> None:
        """`n`'s policy inputs or leaf status changed: re-key it before the next eviction."""
        if self._order is not None and not n.is_root:
            self._dirty[n.id] = n

    def _raise_history(self, leaf: _Node) -> None:
        leaf.history_len = max(leaf.history_len, leaf.cached_prefix_len)
        up = leaf.parent
        while up is not None and up.history_len < leaf.cached_prefix_len:
            up.history_len = leaf.cached_prefix_len
            self._touched(up)
            up = up.parent

    def _stamp_use(self, n: _Node, counts: bool, request_tokens: int) -> None:
        n.last_use, n.request_tokens = self.traffic, request_tokens
        if counts:
            n.use_count += 1

    def _page_keys(self, parent_key: int, n: _Node) -> list[int]:
        """Content keys of `n`'s pages, chained from its parent's tail key."""
        keys, key, page = [], parent_key, self.page_size
        for at in range(0, len(n.tokens), page):
            key = chain_page_key(key, n.tokens[at : at + page])
            keys.append(key)
        return keys

    def _new_node(self, parent: _Node | None) -> _Node:
        self.clock += 1
        n = _Node(self._next_id, parent, last_access_time=self.clock, creation_time=self.clock)
        n.root = parent.root if parent is not None else n
        self._next_id += 1
        self._nodes[n.id] = n
        return n

    def _split(self, child: _Node, split_len: int) -> _Node:
        """child -> mid + child; mid keeps lock_ref, priority and hit count."""
        parent = child.parent
        assert parent is not None
        mid = self._new_node(parent)
        pages = split_len // self.page_size
        mid.tokens, child.tokens = child.tokens[:split_len], child.tokens[split_len:]
        mid.blocks, child.blocks = child.blocks[:pages], child.blocks[pages:]
        mid.lock_ref, mid.priority, mid.hit_count = child.lock_ref, child.priority, child.hit_count
        mid.use_count, mid.last_use, mid.request_tokens = child.use_count, child.last_use, child.request_tokens
        mid.cached_prefix_len = parent.cached_prefix_len + split_len
        mid.history_len = child.history_len
        if self._ghost.enabled:
            mid.tail_key = self._page_keys(parent.tail_key, mid)[-1]
        parent.children[self._page_key(mid.tokens)] = mid
        mid.children[self._page_key(child.tokens)] = child
        child.parent = mid
        return mid

    # -- locks -----------------------------------------------------------------------
    def _node(self, id: int, what: str) -> _Node:
        try:
            return self._nodes[id]
        except KeyError:
            raise ValueError(f"{what}: node {id} does not exist (evicted, or never created)") from None

    def lock(self, node: int) -> None:
        """Lock root -> node, the root included (node 0: no node, a no-op)."""
        if node == 0:
            return
        n: _Node | None = self._node(node, "lock")
        while n is not None:
            if n.lock_ref == 0:
                self.evictable_size -= len(n.tokens)
                self.protected_size += len(n.tokens)
            n.lock_ref += 1
            n = n.parent

    def relock(self, from_node: int, to_node: int) -> None:
        """lock(to_node) then unlock(from_node) (0: no node); nothing changes if an
        argument is bad."""
        self._node(to_node, "relock")
        if from_node == 0:
            self.lock(to_node)
            return
        start = self._node(from_node, "relock")
        if start.lock_ref == 0:
            raise ValueError(f"relock: node {from_node} is not locked")
        self.lock(to_node)
        self.unlock(from_node)

    def unlock(self, node: int) -> None:
        """Unlock root -> node (node 0: a no-op); a root left without children or
        locks is dropped."""
        if node == 0:
            return
        n: _Node | None = self._node(node, "unlock")
        assert n is not None
        if n.lock_ref == 0:
            raise ValueError(f"unlock: node {node} is not locked")
        while n is not None:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_size += len(n.tokens)
                self.protected_size -= len(n.tokens)
                self._touched(n)
            if n.is_root:
                self._drop_root_if_empty(n)
            n = n.parent

    # -- eviction --------------------------------------------------------------------
    def _evictable_leaves(self) -> list[_Node]:
        # Registration order is creation order, so the heap sees leaves the same way
        # however they became leaves; the id tie-break makes the order total anyway.
        return [n for n in self._nodes.values() if not n.is_root and n.lock_ref == 0 and not n.children]

    def evict(self, num_tokens: int, priority: Callable[[Any], Any] | None = None) -> int:
        """Evict unlocked leaves until `num_tokens` are freed; returns tokens evicted."""
        self._last_evicted = []  # first: a call that raises has evicted nothing
        if num_tokens < 0:
            raise ValueError(f"evict: num_tokens must be >= 0, got {num_tokens}")
        rank = priority if priority is not None else self._order
        if rank is None:
            raise ValueError("evict: this tree has no native eviction order; rank candidates with a priority function")
        if priority is None:
            return self._evict_in_order(num_tokens)
        heap = [(rank(leaf.candidate()), leaf.id, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            # Rank the parent before changing anything, so a raising policy leaves this
            # step undone.
            parent_next = not parent.is_root and len(parent.children) == 1 and parent.lock_ref == 0
            parent_key = rank(parent.candidate()) if parent_next else None
            evicted += len(leaf.tokens)
            self._delete_leaf(leaf)
            if parent_next:
                heapq.heappush(heap, (parent_key, parent.id, parent))
        return evicted

    def _enter_order(self, n: _Node) -> None:
        n.order_stamp += 1
        heapq.heappush(self._order_heap, (self._order(n.candidate()), n.id, n.order_stamp))  # type: ignore[misc]

    def _evict_in_order(self, num_tokens: int) -> int:
        """evict() by the tree's own policy, from the persistent leaf order. A policy that
        raises leaves the node it was ranking (and those after it) dirty."""
        while self._dirty:
            id, n = next(iter(self._dirty.items()))
            if self._nodes.get(n.id) is n and n.evictable_leaf:
                self._enter_order(n)
            del self._dirty[id]
        heap, evicted = self._order_heap, 0
        while evicted < num_tokens and heap:
            _, id, stamp = heapq.heappop(heap)
            leaf = self._nodes.get(id)
            if leaf is None or leaf.order_stamp != stamp or not leaf.evictable_leaf:
                continue  # stale: re-keyed since, gone, or no longer an evictable leaf
            parent = leaf.parent
            assert parent is not None
            evicted += len(leaf.tokens)
            self._delete_leaf(leaf)
            if parent.evictable_leaf:
                self._touched(parent)  # dirty until ranked, so a raising policy ranks it next time
                self._enter_order(parent)
                self._dirty.pop(parent.id, None)
        return evicted

    def _delete_leaf(self, leaf: _Node) -> None:
        self.pool.free(list(leaf.blocks))  # first: if the pool refuses, nothing changed
        assert leaf.parent is not None
        if self._ghost.enabled:
            for key in self._page_keys(leaf.parent.tail_key, leaf):
                self._ghost.put(key, leaf.use_count)
        self._in_tree.difference_update(leaf.blocks)
        self._last_evicted += leaf.blocks
        self.evictable_size -= len(leaf.tokens)
        assert leaf.parent is not None
        del leaf.parent.children[self._page_key(leaf.tokens)]
        del self._nodes[leaf.id]
        if leaf.parent.is_root:
            self._drop_root_if_empty(leaf.parent)

    def _drop_root_if_empty(self, root: _Node) -> None:
        if not root.children and not root.lock_ref:
            del self._roots[root.namespace]
            del self._nodes[root.id]

    def reset(self) -> None:
        """Free every block and drop every node; ValueError if any is locked (a root included)."""
        if self.protected_size > 0:
            raise ValueError(f"reset: {self.protected_size} tokens are locked")
        for root in self._roots.values():
            if root.lock_ref:
                raise ValueError(f"reset: namespace root node {root.id} is locked {root.lock_ref} times")
        self.pool.free([b for n in self._nodes.values() for b in n.blocks])
        self._nodes.clear()
        self._roots.clear()
        self._in_tree.clear()
        self.evictable_size = self.protected_size = 0
        self._last_evicted = []
        self._ghost.clear()
        self._order_heap.clear()
        self._dirty.clear()

    def _root_or_create(self, namespace: Namespace) -> _Node:
        root = self._roots.get(namespace)
        if root is None:
            root = _Node(self._next_id, None, last_access_time=self.clock, creation_time=self.clock)
            root.root, root.namespace = root, namespace
            if self._ghost.enabled:
                root.tail_key = namespace_key(namespace)
            self._next_id += 1
            self._nodes[root.id] = root
            self._roots[namespace] = root
        return root

    # -- invariants ------------------------------------------------------------------
    def check_invariants(self, locked_nodes: Sequence[int] | None = None) -> None:
        """Raise InvariantError naming the first broken invariant."""

        def fail(msg: str) -> None:
            raise InvariantError(f"RadixTree: {msg}")

        expected: dict[int, int] = {}
        for id in locked_nodes or ():
            if id == 0:
                continue  # no node: nothing locked
            n = self._nodes.get(id)
            if n is None:
                fail(f"a live lock names node {id}, which does not exist")
            while n is not None:
                expected[n.id] = expected.get(n.id, 0) + 1
                n = n.parent
        seen_blocks: set[int] = set()
        reachable = evictable = protected = 0
        for namespace, root in self._roots.items():
            if root.tokens or root.blocks:
                fail(f"namespace root node {root.id} holds tokens or blocks")
            if not root.children and not root.lock_ref:
                fail(f"namespace root node {root.id} is kept with no child and no lock")
            if root.root is not root or root.namespace != namespace:
                fail(f"namespace root node {root.id} does not name itself and its namespace")
            if locked_nodes is not None and root.lock_ref != expected.get(root.id, 0):
                fail(f"namespace root node {root.id} has lock_ref {root.lock_ref} but live requests hold "
                     f"{expected.get(root.id, 0)}")
            stack = [root]
            while stack:
                n = stack.pop()
                reachable += 1
                if self._nodes.get(n.id) is not n:
                    fail(f"node {n.id} is not registered under its id")
                if max(n.last_access_time, n.creation_time) > self.clock:
                    fail(f"node {n.id} is stamped after the clock")
                for key, child in n.children.items():
                    if child.parent is not n:
                        fail(f"node {child.id} parent link does not point to node {n.id}")
                    if child.root is not root:
                        fail(f"node {child.id} does not name its namespace's root")
                    if key != self._page_key(child.tokens):
                        fail(f"node {child.id} is keyed by a stale page")
                    stack.append(child)
                if n.is_root:
                    continue
                assert n.parent is not None
                if not n.tokens:
                    fail(f"node {n.id} is an empty non-root node")
                if len(n.tokens) % self.page_size:
                    fail(f"node {n.id} holds {len(n.tokens)} tokens, not whole pages")
                if len(n.blocks) != len(n.tokens) // self.page_size:
                    fail(f"node {n.id} holds {len(n.blocks)} blocks for {len(n.tokens)} tokens")
                if n.lock_ref < 0:
                    fail(f"node {n.id} has negative lock_ref")
                if n.parent.lock_ref < n.lock_ref:
                    fail(f"node {n.id} is locked more than its parent")
                if locked_nodes is not None and n.lock_ref != expected.get(n.id, 0):
                    fail(f"node {n.id} has lock_ref {n.lock_ref} but live requests hold {expected.get(n.id, 0)}")
                if n.lock_ref == 0:
                    evictable += len(n.tokens)
                else:
                    protected += len(n.tokens)
                for b in n.blocks:
                    if b in seen_blocks:
                        fail(f"block {b} is held twice")
                    seen_blocks.add(b)
                    if self.pool.ref_count(b) < 1:
                        fail(f"block {b} is in the tree but free in the pool")
        if reachable != len(self._nodes):
            fail(f"{len(self._nodes)} nodes registered but {reachable} reachable")
        if evictable != self.evictable_size:
            fail(f"evictable_size is {self.evictable_size}, nodes hold {evictable}")
        if protected != self.protected_size:
            fail(f"protected_size is {self.protected_size}, nodes hold {protected}")
        if seen_blocks != self._in_tree:
            fail(f"{len(self._in_tree)} blocks flagged as the tree's but nodes hold {len(seen_blocks)}")
