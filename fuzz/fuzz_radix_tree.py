"""Fuzz harness: the native radix tree against its Python model (SGLang semantics).

Each input is a sequence of tree operations (insert, with fresh blocks, from a
protected start, or with blocks the caller does not own; match; match_prefix; lock;
unlock; evict; reset) over short token runs of a tiny alphabet (so nodes split all
the time), in namespaces that include odd strings, under one of the eviction orders or
a custom Python policy, at page size 1 to 3. After every operation both trees must
hold the same nodes and pools and pass their invariant checks (tests'
`TwoTrees.check`), and every call must give both the same result or error type.

    python fuzz/fuzz_radix_tree.py -max_total_time=600
"""

from __future__ import annotations

from harness import main
from reader import Reader
from test_radix_tree_stateful import EVICTIONS, NAMESPACES, NUM_BLOCKS, TwoTrees, fields


class Trees(TwoTrees):
    """The stateful test's pair; look-ups may be refused (ids beyond int32, odd
    namespaces), and then both trees must refuse alike."""

    def insert(self, toks, ns, priority, start_pages=0):
        key = toks[: len(toks) // self.page * self.page]
        if all(-(2**31) <= t < 2**31 for t in key) and encodable(ns):
            return super().insert(toks, ns, priority, start_pages)
        # Arguments both trees must refuse, before touching the blocks they were handed.
        ids = [pool.allocate(len(key) // self.page) for pool in self.pools]
        if ids[0] is None:
            return
        kinds = []
        for tree, blocks in zip(self.trees, ids):
            try:
                tree.insert(key, list(blocks), ns, priority, 0)
                kinds.append("ok")
            except (ValueError, TypeError) as err:
                kinds.append(type(err))
        assert kinds[0] == kinds[1] != "ok", (toks, ns, kinds)
        if kinds[0] != "ok":
            for pool, blocks in zip(self.pools, ids):
                pool.free(blocks)

    def match(self, toks, ns):
        (kind, m0), (_, m1) = self.both("match", toks, ns)
        if kind == "ok":
            names = ("num_tokens", "block_ids", "node", "unlocked_tokens")
            assert fields(m0, *names) == fields(m1, *names)

    def match_prefix(self, toks, ns):
        (kind, m0), (_, m1) = self.both("match_prefix", toks, ns)
        if kind == "ok":
            names = ("num_tokens", "block_ids", "node", "unlocked_tokens")
            assert fields(m0, *names) == fields(m1, *names)
            self.known_nodes.append(m0.node)


def encodable(ns: str | None) -> bool:
    try:
        ns is None or ns.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def namespace(r: Reader):
    return r.choice(NAMESPACES) if r.int(0, 7) else r.text(6)


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    t = Trees(page=r.int(1, 3), eviction=r.choice(EVICTIONS))

    def toks():
        return [r.token(2) if r.int(0, 63) else r.choice([2**31, -(2**31) - 1]) for _ in range(r.int(0, 9))]

    ops = [
        lambda: t.insert(toks(), namespace(r), r.int(0, 2), r.choice([0, 0, 1, 3])),
        lambda: t.match_prefix(toks(), namespace(r)),
        lambda: t.match(toks(), namespace(r)),
        lambda: t.known_nodes and t.lock(r.choice(t.known_nodes)),
        lambda: t.locks and t.unlock(r.choice(t.locks)),
        lambda: t.known_nodes and t.unlock(r.choice(t.known_nodes)),
        lambda: t.evict(r.choice([0, 1, 2, 4, 8, 32])),
        lambda: t.insert_foreign_block(toks(), namespace(r), r.int(-1, NUM_BLOCKS)),
        lambda: r.int(0, 7) == 0 and t.reset(),
    ]
    while not r.exhausted:
        r.choice(ops)()
        t.check()


if __name__ == "__main__":
    main(test_one_input)
