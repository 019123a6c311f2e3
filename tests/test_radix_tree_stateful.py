"""Random operation sequences through the native RadixTree and its Python model.

Both trees get the same operations on their own pools (native `BlockPool`, Python
`PyBlockPool`). After every step they must return the same results, hold the same
nodes (ids, tokens, blocks, children, lock refs, clock stamps, hit counts,
priorities, use counts with their ghost history, traffic stamps), leave the pools identical, and pass their invariant checks with the
locks the test holds. Errors must match in type and change nothing.

Two drivers share the operations of `TwoTrees`: a hypothesis state machine (short
runs, shrunk to a minimal failing sequence) and seeded long random walks (deep
states: splits of hit, locked, prioritised nodes; cascading evictions).
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference.block_pool import PyBlockPool
from reference.radix_tree import NATIVE_ORDERS, PyRadixTree

from prefixcache._C import CANDIDATE_FIELDS, BlockPool, RadixTree

NUM_BLOCKS = 24
NAMESPACES = [None, "a", "b"]
# None: the custom Python policy below, passed per evict() call; "kept": the same policy
# given to the tree, which keeps its keys in the leaf order.
EVICTIONS = [*NATIVE_ORDERS, None, "kept"]
# A node's shape, then every candidate field but its size (csrc/eviction_order.h's stamps).
NODE_FIELDS = (
    "id", "parent", "namespace", "tokens", "block_ids", "lock_ref", "children",
    *(f for f in CANDIDATE_FIELDS if f != "num_tokens"),
)  # fmt: skip
# gslru at this scale: a little protection, a strong size penalty, a ghost smaller
# than the pool so that history is both remembered and forgotten. The custom Python
# policy keeps a ghost too, so use counts with history are compared on both.
GSLRU_ARGS = {"protect_tokens": 4, "size_weight": 1}
GHOST_PAGES = 10


def odd_sizes_first(c):
    """A custom Python policy (native=None): odd-length leaves first, then most used."""
    return (c.num_tokens % 2 == 0, -c.use_count, -c.hit_count, c.creation_time)


def dump(tree) -> list:
    out = []
    for ns in tree.namespaces():
        stack = [tree.root(ns)]
        while stack:
            info = tree.node(stack.pop())
            out.append(tuple(getattr(info, f) for f in NODE_FIELDS))
            stack.extend(reversed(list(info.children.values())))
    return out


def fields(result, *names):
    return tuple(getattr(result, n) for n in names)


class TwoTrees:
    """The native tree and the model side by side; every operation runs on both."""

    def __init__(self, page: int, eviction: str | None) -> None:
        self.page = page
        self.rank = None if eviction is not None else odd_sizes_first
        self.pools = (BlockPool(NUM_BLOCKS), PyBlockPool(NUM_BLOCKS))
        kwargs = dict(GSLRU_ARGS) if eviction == "gslru" else {}
        if eviction in ("gslru", None, "kept"):
            kwargs["ghost_capacity"] = GHOST_PAGES
        if eviction == "kept":
            eviction = odd_sizes_first
        self.trees = (
            RadixTree(self.pools[0], page, eviction, **kwargs),
            PyRadixTree(self.pools[1], page, eviction, **kwargs),
        )
        self.known_nodes: list[int] = []  # ids seen; some may since be gone
        self.locks: list[int] = []  # one entry per lock the test holds

    def both(self, op: str, *args):
        """(kind, result) of each tree; kinds ("ok" or the error type) must agree."""
        results = []
        for tree in self.trees:
            try:
                results.append(("ok", getattr(tree, op)(*args)))
            except (ValueError, IndexError, TypeError) as err:
                results.append((type(err), None))
        assert results[0][0] == results[1][0], (op, args, results)
        return results

    def with_fresh_blocks(self, num_pages, call):
        """`call(tree, blocks)` on both trees with the same fresh blocks: (kind, result),
        or (None, None) if the pools are full. Results and re-pointed blocks must agree;
        displaced blocks (and all of them on an error) go back to the pools."""
        ids = [pool.allocate(num_pages) for pool in self.pools]
        assert ids[0] == ids[1]
        if ids[0] is None:
            return None, None
        copies = (list(ids[0]), list(ids[1]))
        results = []
        for tree, blocks in zip(self.trees, copies):
            try:
                results.append(("ok", call(tree, blocks)))
            except ValueError as err:
                results.append((type(err), None))
        (k0, r0), (k1, r1) = results
        assert k0 == k1, results
        if k0 != "ok":
            for pool, blocks in zip(self.pools, ids):
                pool.free(blocks)
            return k0, None
        assert fields(r0, "prefix_len", "node", "displaced") == fields(r1, "prefix_len", "node", "displaced")
        assert copies[0] == copies[1]  # both re-pointed the same way
        for pool in self.pools:
            pool.free(r0.displaced)
        self.known_nodes.append(r0.node)
        return k0, r0

    def insert(self, toks, ns, priority, start_pages=0):
        """Insert with fresh blocks for the pages from `start` on (a start past what the
        tree holds must be refused by both)."""
        key = toks[: len(toks) // self.page * self.page]
        start = min(start_pages * self.page, len(key))
        pages = len(key) // self.page - start // self.page
        kind, r = self.with_fresh_blocks(pages, lambda tree, blocks: tree.insert(key, blocks, ns, priority, start))
        if kind is not None and kind != "ok":
            assert start > self.trees[0].match(key, ns).num_tokens
        elif r is not None:
            assert r.prefix_len % self.page == 0

    def extend(self, node, toks, priority):
        """Pages after `node` with fresh blocks. From a node the test holds a lock on,
        the native tree stamps the path above lazily; the model re-inserts the whole
        path (its definition), and every node must still read the same. An error: the
        node is gone."""
        key = toks[: len(toks) // self.page * self.page]
        _, r = self.with_fresh_blocks(len(key) // self.page, lambda tree, blocks: tree.extend(node, key, blocks, priority))
        return None if r is None else r.node

    def relock(self, held, to):
        """Move a lock the test holds from `held` to `to` (a commit's new end, or anywhere)."""
        (kind, _), _ = self.both("relock", held, to)
        if kind == "ok":
            self.locks.remove(held)
            self.locks.append(to)  # a root counts its locks too

    def commit(self, toks, priority):
        """A request's commit: extend from a node the test holds, then move the lock there."""
        held = self.locks[-1]
        end = self.extend(held, toks, priority)
        if end is not None:
            self.relock(held, end)

    def insert_foreign_block(self, toks, ns, bad):
        """Blocks the caller does not own (free, the tree's, out of range) are refused."""
        key = toks[: len(toks) // self.page * self.page]
        if key:
            self.both("insert", key, [bad] * (len(key) // self.page), ns, 0)

    def match(self, toks, ns):
        (_, m0), (_, m1) = self.both("match", toks, ns)
        names = ("num_tokens", "block_ids", "node", "unlocked_tokens")
        assert fields(m0, *names) == fields(m1, *names)

    def match_prefix(self, toks, ns):
        (_, m0), (_, m1) = self.both("match_prefix", toks, ns)
        names = ("num_tokens", "block_ids", "node", "unlocked_tokens")
        assert fields(m0, *names) == fields(m1, *names)
        self.known_nodes.append(m0.node)

    def lock(self, node):
        (kind, _), _ = self.both("lock", node)
        if kind == "ok" and node != 0:  # node 0 (an empty match with no root) locks nothing; a root counts
            self.locks.append(node)

    def unlock(self, node):
        if node not in self.locks and self.lock_ref(node) > 0:
            return  # locked through a descendant we hold: unlocking it is a caller bug
        (kind, _), _ = self.both("unlock", node)
        if node in self.locks:
            assert kind == "ok"
            self.locks.remove(node)

    def lock_ref(self, node) -> int:
        try:
            return self.trees[0].node(node).lock_ref
        except ValueError:
            return 0  # evicted

    def evict(self, num_tokens):
        (_, n0), (_, n1) = self.both("evict", num_tokens, self.rank)
        assert n0 == n1
        assert self.trees[0].last_evicted() == self.trees[1].last_evicted()
        assert n0 == len(self.trees[0].last_evicted()) * self.page

    def reset(self):
        (kind, _), _ = self.both("reset")
        assert (kind == "ok") == (not self.locks)

    def check(self):
        native, model = self.trees
        for attr in ("total_size", "evictable_size", "protected_size", "num_nodes", "clock", "traffic", "ghost_size"):
            assert getattr(native, attr) == getattr(model, attr), attr
        assert native.namespaces() == model.namespaces()
        assert dump(native) == dump(model)
        assert self.pools[0].free_queue() == self.pools[1].free_queue()
        for tree, pool in zip(self.trees, self.pools):
            tree.check_invariants(self.locks)
            pool.check_invariants()


# A small alphabet, so that prefixes are shared and nodes split often.
tokens = st.lists(st.integers(0, 1), max_size=8)
namespaces = st.sampled_from(NAMESPACES)


class TreeMachine(RuleBasedStateMachine):
    @initialize(page=st.sampled_from([1, 2, 3]), eviction=st.sampled_from(EVICTIONS))
    def setup(self, page, eviction):
        self.t = TwoTrees(page, eviction)

    @rule(toks=tokens, ns=namespaces, priority=st.integers(0, 2), start_pages=st.sampled_from([0, 0, 1, 2]))
    def insert(self, toks, ns, priority, start_pages):
        self.t.insert(toks, ns, priority, start_pages)

    @precondition(lambda self: self.t.known_nodes)
    @rule(data=st.data(), toks=tokens, priority=st.integers(0, 2))
    def extend(self, data, toks, priority):
        self.t.extend(data.draw(st.sampled_from(self.t.known_nodes)), toks, priority)

    @precondition(lambda self: self.t.locks)
    @rule(toks=tokens, priority=st.integers(0, 2))
    def commit(self, toks, priority):
        self.t.commit(toks, priority)

    @precondition(lambda self: self.t.locks and self.t.known_nodes)
    @rule(data=st.data())
    def relock(self, data):
        self.t.relock(data.draw(st.sampled_from(self.t.locks)), data.draw(st.sampled_from(self.t.known_nodes)))

    @rule(toks=tokens, ns=namespaces, bad=st.integers(-1, NUM_BLOCKS))
    def insert_foreign_block(self, toks, ns, bad):
        self.t.insert_foreign_block(toks, ns, bad)

    @rule(toks=tokens, ns=namespaces)
    def match(self, toks, ns):
        self.t.match(toks, ns)

    @rule(toks=tokens, ns=namespaces)
    def match_prefix(self, toks, ns):
        self.t.match_prefix(toks, ns)

    @precondition(lambda self: self.t.known_nodes)
    @rule(data=st.data())
    def lock(self, data):
        self.t.lock(data.draw(st.sampled_from(self.t.known_nodes)))

    @precondition(lambda self: self.t.known_nodes)
    @rule(data=st.data())
    def unlock(self, data):
        self.t.unlock(data.draw(st.sampled_from(self.t.known_nodes)))

    @rule(num_tokens=st.integers(0, 12))
    def evict(self, num_tokens):
        self.t.evict(num_tokens)

    @rule()
    def reset(self):
        self.t.reset()

    @invariant()
    def same_trees(self):
        if hasattr(self, "t"):
            self.t.check()


TreeMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_radix_tree_matches_model = TreeMachine.TestCase


def test_long_random_walks_match_model():
    """Seeded walks of 250 steps, weighted towards inserts and matches."""
    for seed in range(28):
        rng = random.Random(seed)
        t = TwoTrees(page=rng.choice([1, 2, 3]), eviction=EVICTIONS[seed % len(EVICTIONS)])

        def toks():
            return [rng.randint(0, 1) for _ in range(rng.randint(0, 9))]

        ops = [
            (6, lambda: t.insert(toks(), rng.choice(NAMESPACES), rng.randint(0, 2), rng.choice([0, 0, 1, 3]))),
            (4, lambda: t.match_prefix(toks(), rng.choice(NAMESPACES))),
            (2, lambda: t.match(toks(), rng.choice(NAMESPACES))),
            (2, lambda: t.known_nodes and t.lock(rng.choice(t.known_nodes))),
            (2, lambda: t.locks and t.unlock(rng.choice(t.locks))),
            (1, lambda: t.known_nodes and t.unlock(rng.choice(t.known_nodes))),
            (3, lambda: t.evict(rng.choice([0, 1, 2, 4, 8, 32]))),
            (1, lambda: t.insert_foreign_block(toks(), rng.choice(NAMESPACES), rng.randint(-1, NUM_BLOCKS))),
            (1, lambda: rng.random() < 0.2 and t.locks and t.unlock(t.locks[0])),
            (1, lambda: rng.random() < 0.1 and t.reset()),
            (3, lambda: t.locks and t.commit(toks(), rng.randint(0, 2))),
            (1, lambda: t.known_nodes and t.extend(rng.choice(t.known_nodes), toks(), rng.randint(0, 2))),
            (1, lambda: t.locks and t.known_nodes and t.relock(rng.choice(t.locks), rng.choice(t.known_nodes))),
        ]
        weights = [w for w, _ in ops]
        for _ in range(250):
            rng.choices(ops, weights)[0][1]()
            t.check()
