"""The native hybrid tree (`prefixcache._C.HybridTree`, csrc/hybrid_tree.h) against the
pure-Python reference model (`HybridTree` of backends/hybrid_radix_tree.py): random
sequences of match / settle / lock / unlock / insert / evict / drop_states / reset on
both, every result compared after each step (hits, paths, split points, branching
points, lock costs, receipts, insert outcomes, eviction trackers, the ids freed and
the events recorded, in order) and then the whole tree (every node's id, key, pages,
state, locks, uuid, access time, LRU stamps and children, in the model's `nodes()`
order; both LRU orders; the sizes) and both trees' `check_invariants`."""

from __future__ import annotations

from array import array

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache._C import HybridTree as NativeTree
from prefixcache.backends.hybrid_radix_tree import Component, HybridTree

FULL, SWA, MAMBA = Component.FULL, Component.SWA, Component.MAMBA
LAYOUTS = [(FULL,), (FULL, SWA), (FULL, MAMBA), (FULL, SWA, MAMBA)]


def _opt(v):
    return None if v is None else int(v)


class NativeAgainstModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.receipts: list = []  # (model receipt, native receipt)
        self.next_id = 0
        self.seen: list[list[int]] = []  # keys inserted: later keys extend or branch off them

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        page=st.sampled_from([1, 2, 4]),
        window=st.integers(1, 12),
        grid_pages=st.sampled_from([1, 2]),
        no_tail_cliff=st.booleans(),
        every_state=st.booleans(),
    )
    def build(self, layout, page, window, grid_pages, no_tail_cliff, every_state) -> None:
        self.page, self.layout, self.window = page, layout, window
        self.has_swa, self.has_mamba = SWA in layout, MAMBA in layout
        self.model_freed: list = []
        self.model_events: list = []
        self.reach: dict = {}
        self.freed_units = [0, 0, 0]

        def free(c, ids):
            ids = [int(i) for i in ids]
            if ids:
                self.model_freed.append((int(c), ids))
                self.freed_units[c] += len(ids) * (1 if c == MAMBA else page)

        def hook(stored):
            def record(node, c, first, end):
                first = end - 1 if c == MAMBA else first  # a state is the page it ends on
                self.model_events.append((stored, node.id, int(c), first, end))

            return record

        self.model = HybridTree(page, layout, free, window=window if self.has_swa else None,
                                state_grid=grid_pages * page, on_store=hook(True), on_remove=hook(False),
                                no_tail_cliff=no_tail_cliff)  # fmt: skip
        self.native = NativeTree(page, self.has_swa, self.has_mamba, window if self.has_swa else None, grid_pages * page,
                                 no_tail_cliff, True)  # fmt: skip
        if every_state and no_tail_cliff:
            # The tests-only switch against what it stands for: the model's first walk
            # asking every state of the LRU, skipping each branch's deepest.
            def walk_every_state(tree, c, quota, tracker, done):
                tree._walk_aux(c, quota, tracker, done, skip=tree._in_branch_tail if c == SWA else tree._deepest_state)
                tree._walk_aux(c, quota, tracker, done)

            self.model._evict_aux = walk_every_state.__get__(self.model, HybridTree)
            self.native.set_walk_every_state(True)

    # -- helpers -------------------------------------------------------------------------
    def fresh(self, n: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return out

    def tokens(self, data, num: int) -> list[int]:
        """`num` tokens: a cut of a key inserted before (or none), then fresh ones; a
        small alphabet, so that keys share pages and split nodes."""
        base = data.draw(st.sampled_from(self.seen)) if self.seen and data.draw(st.booleans()) else []
        cut = min(data.draw(st.integers(0, len(base))), num)
        return base[:cut] + data.draw(st.lists(st.integers(0, 2), min_size=num - cut, max_size=num - cut))

    def logs_agree(self) -> None:
        assert self.native.take_freed() == [(c, ids) for c, ids in self.model_freed]
        assert [e[:5] for e in self.native.take_events()] == self.model_events
        self.model_freed.clear()
        self.model_events.clear()

    def same_match(self, m, n) -> None:
        assert (m.num_tokens, m.node.id, m.full_hit) == (n.num_tokens, n.node.id, n.full_hit)
        assert (_opt(m.swa_branching), _opt(m.mamba_branching)) == (n.swa_branching, n.mamba_branching)
        assert [(node.id, k) for node, k in m.path] == [(node.id, k) for node, k in n.path]
        inside = None if m.inside is None else (m.inside[0].id, m.inside[1])
        assert inside == (None if n.inside is None else (n.inside[0].id, n.inside[1]))

    def node_pair(self, model_node):
        for ref in self.native.nodes():
            if ref.id == model_node.id:
                return ref
        raise AssertionError(f"node {model_node.id} missing from the native tree")

    # -- rules ---------------------------------------------------------------------------
    @rule(data=st.data(), ns=st.integers(0, 1), settle=st.booleans(), lock=st.integers(0, 2))
    def match(self, data, ns, settle, lock) -> None:
        tokens = self.tokens(data, data.draw(st.integers(0, 10 * self.page)))
        m = self.model.match(tokens, ns)
        n = self.native.match(array("i", tokens), ns)
        self.same_match(m, n)
        cost = self.model.lock_cost(m)
        assert tuple(cost.get(c, 0) for c in Component) == self.native.lock_cost(n)
        if settle:
            m, n = self.model.settle(m), self.native.settle(n)
            self.same_match(m, n)
            if lock == 0:  # a third: the tree stays mostly evictable
                self.receipts.append((self.model.lock(m.node), self.native.lock(n.node)))

    @rule(
        data=st.data(),
        ns=st.integers(0, 1),
        pages=st.integers(0, 10),
        lock=st.integers(0, 2),
        branching=st.one_of(st.none(), st.integers(0, 8)),
    )
    def insert(self, data, ns, pages, lock, branching) -> None:
        page = self.page
        tokens = self.tokens(data, pages * page)
        self.seen.append(tokens)
        # As the cache inserts: the request owns its pages past its hit, and keeps its
        # last window's SWA (its floor trails its end by a window, page-ceiled).
        hit = self.model.match(tokens, ns).num_tokens
        prev = data.draw(st.integers(0, hit // page)) * page
        keep = -(-self.window // page) * page
        floor = data.draw(st.integers(0, max(0, pages * page - keep) // page)) * page if self.has_swa else 0
        full = self.fresh(pages)
        swa = [-1 if i * page < floor else b for i, b in enumerate(self.fresh(pages))] if self.has_swa else None
        state = self.fresh(1)[0] if self.has_mamba else None
        swa_branching = branching * page if branching is not None else None
        o = self.model.insert(tokens, ns, full, swa, prev_prefix_len=prev, swa_evicted=floor,
                              swa_branching=swa_branching, mamba_value=state)  # fmt: skip
        n = self.native.insert(array("i", tokens), ns, full, swa, prev_prefix_len=prev, swa_evicted=floor,
                               swa_branching=swa_branching, mamba_value=state)  # fmt: skip
        assert (o.prefix_len, o.node.id, o.mamba_exist, o.swa_branch_inserted) == (
            n.prefix_len, n.node.id, n.mamba_exist, n.swa_branch_inserted)  # fmt: skip
        if lock == 0:
            self.receipts.append((self.model.lock(o.node), self.native.lock(n.node)))

    @precondition(lambda self: self.receipts)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        m, n = self.receipts.pop(data.draw(st.integers(0, len(self.receipts) - 1)))
        assert (m.node.id, _opt(m.swa_uuid)) == (n.node.id, n.swa_uuid)
        self.model.unlock(m)
        self.native.unlock(n)

    @rule(
        want=st.tuples(st.integers(0, 16), st.integers(0, 24), st.integers(0, 3)),
        targeted=st.sets(st.sampled_from(list(Component))),
    )
    def evict(self, want, targeted) -> None:
        requests = {c: want[c] for c in Component if want[c]}
        reach = {c: want[c] for c in targeted}
        self.freed_units = [0, 0, 0]
        got = self.model.evict(requests, lambda c: self.freed_units[c] >= reach[c], tuple(reach))
        native = self.native.evict(want, tuple(reach.get(c, -1) for c in Component))
        assert tuple(got.get(c, 0) for c in Component) == native

    @precondition(lambda self: self.has_mamba)
    @rule(data=st.data())
    def drop_states(self, data) -> None:
        # As `state_cap` drops them: states on a path, never a branch's deepest (a leaf's).
        candidates = [n for n in self.model.nodes() if n.mamba is not None and not n.locks[MAMBA] and n.children]
        if not candidates:
            return
        chosen = data.draw(st.lists(st.sampled_from(candidates), unique_by=lambda n: n.id, max_size=3))
        refs = [self.node_pair(n) for n in chosen]
        self.model.drop_states(chosen)
        self.native.drop_states(refs)

    @precondition(lambda self: not self.receipts)
    @rule(now=st.integers(0, 9))
    def reset(self, now) -> None:
        if now:  # rarely: a reset empties what the other rules built
            return
        self.model.reset()
        self.native.reset()

    # -- the whole tree, after every step -------------------------------------------------
    @invariant()
    def trees_agree(self) -> None:
        if not hasattr(self, "model"):
            return
        self.logs_agree()
        model_nodes = list(self.model.nodes())
        native_refs = self.native.nodes()
        assert [n.id for n in model_nodes] == [r.id for r in native_refs]
        for node, ref in zip(model_nodes, native_refs):
            want = (node.id, -1 if node.parent is None else node.parent.id, list(node.key),
                    list(node.full) if node.full is not None else [], None if node.swa is None else list(node.swa),
                    node.mamba, tuple(node.locks), node.swa_uuid, node.last_access, tuple(node.stamps),
                    0 if node.ns is None else node.ns, [ch.id for ch in node.children.values()])  # fmt: skip
            got = self.native.view(ref)
            assert got[:6] == want[:6] and tuple(got[6]) == want[6] and got[7:9] == want[7:9], (want, got)
            assert tuple(got[9]) == want[9] and got[10:] == want[10:], (want, got)
        for c in (SWA, MAMBA):
            if c in self.model.lru:
                assert [n.id for n in self.model.lru[c].order()] == self.native.lru_order(c)
        for c in self.layout:
            assert (self.model.evictable[c], self.model.protected[c]) == (
                self.native.evictable(c), self.native.protected_size(c))  # fmt: skip
        assert self.model.num_nodes == self.native.num_nodes
        errors = []
        for check in (lambda: self.model.check_invariants([m for m, _ in self.receipts]),
                      lambda: self.native.check_invariants([n for _, n in self.receipts])):  # fmt: skip
            try:
                check()
                errors.append(None)
            except AssertionError as err:  # InvariantError is one
                errors.append(str(err))
        assert errors[0] == errors[1], errors
        assert errors[0] is None, errors[0]


NativeAgainstModel.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestNativeAgainstModel = NativeAgainstModel.TestCase


def test_a_stale_node_is_refused_not_read() -> None:
    tree = NativeTree(2, False, False, None, 2, False, False)
    tree.insert(array("i", [1, 2, 3, 4]), 0, [10, 11], None, prev_prefix_len=0)
    node = tree.match(array("i", [1, 2, 3, 4]), 0).node
    assert tree.evict((4, 0, 0), (-1, -1, -1)) == (4, 0, 0)
    assert tree.take_freed() == [(0, [10, 11])]
    import pytest

    with pytest.raises(ValueError, match="not in the tree"):
        tree.lock(node)
    stale = tree.match(array("i", [1, 2]), 0)
    tree.insert(array("i", [5, 6]), 0, [12], None, prev_prefix_len=0)
    with pytest.raises(ValueError, match="changed since"):
        tree.settle(stale)
    tree.check_invariants([])
