"""Fuzz harness: the native TierManager against its Python model, bad arguments and Python policies included.

Each input builds one to three lower tiers (sizes, write policy, `min_hits`,
`store_threshold` with its reuse tracker, keep-on-load), keyed by hash or by lineage, each ranked by a native order
or by a Python policy through `prefixcache.tiers.PolicyRank`: well behaved, one that
raises or returns a string for some candidates, or one that calls back into the manager
from `priority()`. Then a sequence of operations: device_cached, admitted,
device_evicted, device_dropped, pin + load (promoting, or later through finish_loads),
pin + unpin, drop, persist, count_hits, chain, reset, and with lineage device_cached_named
and follow. A valid call goes to the native
manager and to the model (tests/reference/tiers.py, whose Python policies rank through
the same `PolicyRank`), which must agree after every step as in
tests/test_tiers_stateful.py. A call with a bad argument (a block or slot out of range,
keys of the wrong size, a load of an unpinned slot, a drop of a pinned one, a persist of
a tier that is not a disk's, tokens that are not whole blocks, a lineage call to a manager
keyed by hash, ...) goes to the native manager alone: it must raise
ValueError, IndexError, TypeError or OverflowError and change nothing it shows (every
tier's keys, counters and order, the device mirror, the transfer log). A Python policy
that fails ranks its slot first in both; one that calls back in is refused (a
RuntimeError inside `priority()`) and ranks first too. check_invariants after every step.

    python fuzz/fuzz_tiers.py -max_total_time=600
"""

from __future__ import annotations

from harness import main
from reader import EDGE_INTS, Reader
from reference.tiers import PyTierManager

from prefixcache._C import EvictionCandidate, TierManager
from prefixcache.eviction import EvictionPolicy
from prefixcache.registry import resolve_eviction_policy
from prefixcache.tiers import PolicyRank

BS = 2
DEVICE_BLOCKS = 6
KEYS = [bytes([k, 0, 0, 128]) for k in range(10)]  # never a name a lineage manager gives
ROOT = b"root"  # with lineage: the parent a chain's first block names
BAD = (ValueError, IndexError, TypeError, OverflowError)
NATIVE = ("lru", "lfu", "fifo", "gslru", "chain", "slru")


class Scored(EvictionPolicy):
    """Fewest hits per use first, as a float pair."""

    def priority(self, c):
        return (c.hit_count / (c.use_count + 1.0), float(c.last_access_time))


class Flaky(EvictionPolicy):
    """Raises, or returns a string, for some candidates (decided by the candidate alone,
    so the model and the native manager see the same failures)."""

    leaves_only = True

    def priority(self, c):
        if c.creation_time % 3 == 1:
            raise ValueError("flaky")
        if c.creation_time % 5 == 2:
            return "later"
        return c.last_use - c.request_tokens


class Reentrant(EvictionPolicy):
    """Calls back into the native manager from priority() (refused: ReentryError); in the
    model it fails the same way, without the manager."""

    manager: TierManager | None = None

    def priority(self, c):
        if c.creation_time % 2 == 0:
            if isinstance(c, EvictionCandidate) and Reentrant.manager is not None:
                Reentrant.manager.reset()  # must be refused: the manager is mid-call
                raise AssertionError("a tier call was re-entered from a policy")
            raise RuntimeError("as the native manager refuses it")
        return c.last_access_time


PYTHON = {"scored": Scored, "flaky": Flaky, "reentrant": Reentrant}


class _Ranked:
    """A Python policy as the model ranks it: by PolicyRank's key, as the native manager does."""

    native = None

    def __init__(self, policy: EvictionPolicy, errors: list) -> None:
        self.rank = PolicyRank(policy, "fuzz", errors)
        self.leaves_only = policy.leaves_only

    def priority(self, candidate):
        return self.rank(candidate)


class Pair:
    def __init__(self, r: Reader) -> None:
        self.specs = []
        for _ in range(r.int(1, 3)):
            write = r.choice(("on_evict", "on_evict", "write_through", "selective"))
            threshold = r.choice((0, 0, 2, 3))
            self.specs.append((r.int(1, 5), write, r.int(1, 2) if write == "selective" else 0, r.choice(NATIVE + tuple(PYTHON)),
                               r.bool(), threshold, r.int(1, 8) if threshold >= 2 else 0))  # fmt: skip
        self.lineage = r.bool()
        self.build()

    def build(self) -> None:
        native, model = [], []
        for n, write, hits, name, keep, threshold, reuse in self.specs:
            if name in PYTHON:
                policy = PYTHON[name]()
                native.append((n, write, hits, PolicyRank(policy, "fuzz", []), policy.leaves_only, {}, keep, threshold,
                               reuse))  # fmt: skip
                model.append((n, write, hits, _Ranked(policy, []), policy.leaves_only, keep, threshold, reuse))
            else:
                policy = resolve_eviction_policy(name)()
                native.append((n, write, hits, policy.native, policy.leaves_only, policy.native_params(), keep,
                               threshold, reuse))  # fmt: skip
                model.append((n, write, hits, policy, policy.leaves_only, keep, threshold, reuse))
        self.native = TierManager(DEVICE_BLOCKS, BS, 4, native, True, False, self.lineage)
        self.model = PyTierManager(DEVICE_BLOCKS, BS, model)
        Reentrant.manager = self.native

    # -- what the native manager shows ---------------------------------------------------
    def shown(self) -> tuple:
        tiers = []
        for t in range(len(self.specs)):
            slots = [(s, self.native.slot_key(t, s)) for s in self.native.used_slots(t)]
            tiers.append((slots, self.native.counters(t), self.native.order(t)))
        device = [self.native.device_key(b) for b in range(DEVICE_BLOCKS)]
        return tuple(tiers), tuple(device), self.native.num_transfers

    def refused(self, op: str, *args) -> None:
        """A call with a bad argument: the native manager raises and changes nothing."""
        before = self.shown()
        try:
            getattr(self.native, op)(*args)
        except BAD:
            pass
        else:
            raise AssertionError(f"{op}{args!r} was accepted")
        assert self.shown() == before, (op, args)

    def agree(self) -> None:
        self.native.check_invariants()
        assert self.native.drain_transfers().tolist() == [x for t in self.model.drain_transfers() for x in t]
        for key in KEYS:
            assert self.native.locate(key) == self.model.locate(key), key
        for t, tier in enumerate(self.model.tiers):
            assert self.native.counters(t) == tier.counters, t
            assert sorted(self.native.used_slots(t)) == sorted(tier.slots), t
            for slot, s in tier.slots.items():
                assert tuple(self.native.slot_tokens(t, slot)) == s.tokens
        for b in range(DEVICE_BLOCKS):
            assert self.native.device_key(b) == (self.model.device[b][0] if b in self.model.device else None), b

    def free_blocks(self) -> list[int]:
        return [b for b in range(DEVICE_BLOCKS) if b not in self.model.device]

    def held(self) -> list[tuple[int, int]]:
        return [w for w in map(self.model.locate, KEYS) if w is not None]


def bad_block(r: Reader) -> int:
    return r.choice((-1, DEVICE_BLOCKS, DEVICE_BLOCKS + 1, *EDGE_INTS[9:]))


def step(p: Pair, r: Reader) -> None:
    op = r.int(0, 16)
    free, held = p.free_blocks(), p.held()
    if op == 0 and free:  # cache a run of keys on free device blocks
        n = r.int(1, min(3, len(free)))
        blocks = [free[(r.int(0, 7) + i) % len(free)] for i in range(n)]
        if len(set(blocks)) < n:
            return
        start = r.int(0, len(KEYS) - n)
        keys = KEYS[start : start + n]
        parent = KEYS[start - 1] if start else (ROOT if p.lineage else None)
        toks = [7 * start + i for i in range(n * BS)]
        depth, tokens = r.int(0, 2), r.int(0, 40)
        p.native.device_cached(blocks, b"".join(keys), parent, toks, depth, tokens, 0)
        p.model.device_cached(blocks, keys, parent, toks, depth, tokens)
    elif op == 1 and p.model.device:
        blocks = sorted({r.choice(sorted(p.model.device)) for _ in range(r.int(0, 3))})
        tokens = r.int(0, 40)
        assert p.native.admitted(tokens, blocks, tokens) == p.model.admitted(tokens, blocks, tokens)
    elif op == 2 and p.model.device:
        blocks = sorted({r.choice(sorted(p.model.device)) for _ in range(r.int(1, 3))})
        p.native.device_evicted(blocks)
        p.model.device_evicted(blocks)
    elif op == 3 and p.model.device:
        b = r.choice(sorted(p.model.device))
        p.native.device_dropped([b])
        p.model.device.pop(b)
    elif op == 4 and held and free:  # load, promoting now or after the admission
        sources = sorted({r.choice(held) for _ in range(r.int(1, min(2, len(free))))})
        dst = free[: len(sources)]
        promote = r.bool()
        for m in (p.native, p.model):
            m.pin(sources)
        p.native.load(sources, dst, promote)
        p.model.load(sources, dst, promote)
        if not promote:
            p.native.finish_loads(sources)
            p.model.finish_loads(sources)
    elif op == 5 and held:  # an admission that pinned and gave up
        w = [r.choice(held)]
        for m in (p.native, p.model):
            m.pin(w)
            m.unpin(w)
    elif op == 6 and held:
        t, slot = r.choice(held)
        failed = r.bool()
        p.native.drop(t, slot, failed)
        p.model.drop(t, slot, failed)
    elif op == 7:
        keeping = [t for t, tier in enumerate(p.model.tiers) if tier.keep_on_load]
        if keeping:
            t = r.choice(keeping)
            assert p.native.persist(t) == p.model.persist(t)
        else:
            p.refused("persist", r.int(0, len(p.specs) - 1))
    elif op == 8:
        t, n = r.int(0, len(p.specs) - 1), r.int(0, 9)
        p.native.count_hits(t, n)
        p.model.tiers[t].counters["hits"] += n
    elif op == 9:
        start, stop = r.int(0, len(KEYS)), r.int(0, len(KEYS))
        keys = b"".join(KEYS)
        if start <= stop:
            found = p.native.chain(None, keys, start, stop)
            want = []
            for key in KEYS[start:stop]:
                w = p.model.locate(key)
                if w is None:
                    break
                want.append(w)
            assert [tuple(x) for x in found] == want
        else:
            p.refused("chain", None, keys, start, stop)
    elif op == 10:  # a bad argument to one of the calls that change the manager
        bad(p, r)
    elif op == 11 and not any(s.pins for tier in p.model.tiers for s in tier.slots.values()):
        p.native.reset()
        p.build()
    elif op == 12 and held:  # a drop of a pinned slot is refused
        w = r.choice(held)
        for m in (p.native, p.model):
            m.pin([w])
        p.refused("drop", w[0], w[1], False)
        for m in (p.native, p.model):
            m.unpin([w])
    elif op == 14 and p.lineage and free:  # the manager names a run of blocks
        n = r.int(1, min(3, len(free)))
        blocks = [free[(r.int(0, 7) + i) % len(free)] for i in range(n)]
        if len(set(blocks)) < n:
            return
        start = r.int(0, len(KEYS) - 1)
        parent = KEYS[start - 1] if start else ROOT
        toks = [7 * start + i for i in range(n * BS)]
        depth, tokens = r.int(0, 2), r.int(0, 40)
        p.native.device_cached_named(blocks, parent, toks, depth, tokens, 0)
        p.model.device_cached_named(blocks, parent, toks, depth, tokens)
    elif op == 15 and p.lineage:  # follow a chain from any key
        start, n = r.int(0, len(KEYS)), r.int(0, 4)
        parent = KEYS[start - 1] if start else ROOT
        toks = [7 * r.int(0, len(KEYS)) + i for i in range(n * BS)]
        assert p.native.follow(parent, toks) == p.model.follow(parent, toks)
    elif op == 16:  # which names a block follows; a name cut short is refused
        names = b"".join(r.choice(KEYS + [ROOT]) for _ in range(r.int(0, 4)))
        size = len(KEYS[0])
        assert p.native.parents_in_use(names) == p.model.parents_in_use(names, size)
        if r.bool():
            p.refused("parents_in_use", names + b"\x00")
        tags = p.native.tags_in_use()  # every call here passes tag 0
        holding = p.model.device or any(t.slots for t in p.model.tiers)
        assert (tags == [0]) if holding else (tags in ([], [0]))
    elif op == 13:
        t = r.int(-1, len(p.specs))
        if 0 <= t < len(p.specs):
            p.refused("count_hits", t, -1)
        else:
            p.refused("used_slots", t)


def bad(p: Pair, r: Reader) -> None:
    free, held = p.free_blocks(), p.held()
    kind = r.int(0, 10)
    if kind == 0:
        p.refused("device_cached", [bad_block(r)], KEYS[0], None, [0] * BS, 0, 0, 0)
    elif kind == 1 and free:
        keys = r.raw(7)
        p.refused("device_cached", [free[0]], keys + b"\x00" if len(keys) == 4 else keys, None, [0] * BS, 0, 0, 0)
    elif kind == 2 and free:
        p.refused("device_cached", [free[0]], KEYS[0], b"\x00", [0] * BS, 0, 0, 0)  # a parent of the wrong size
    elif kind == 3:
        p.refused("admitted", -1 - r.int(0, 3), [], 0)
    elif kind == 4:
        p.refused(r.choice(("device_evicted", "device_dropped")), [bad_block(r)])
    elif kind == 5 and free:  # a load of a slot nobody pinned, or into a block that holds a key
        if held:
            p.refused("load", [r.choice(held)], [free[0]], True)
    elif kind == 6 and held:
        p.refused("unpin", [r.choice(held)])  # not pinned
    elif kind == 7:
        t = r.int(0, len(p.specs) - 1)
        empty = [s for s in range(p.native.num_slots(t)) if s not in p.model.tiers[t].slots]
        p.refused("pin", [(t, empty[0] if empty else p.native.num_slots(t))])
    elif kind == 8 and held and p.model.device:
        w = r.choice(held)
        for m in (p.native, p.model):
            m.pin([w])
        p.refused("load", [w], [r.choice(sorted(p.model.device))], True)  # the block still holds a key
        for m in (p.native, p.model):
            m.unpin([w])
    elif kind == 9:  # lineage calls: to a manager keyed by hash, a parent of the wrong size, part of a block
        op = r.choice(("follow", "device_cached_named"))
        parent = KEYS[0] if p.lineage and r.bool() else b"\x00"
        toks = [0] * (BS * r.int(0, 2) + (r.int(1, BS - 1) if parent == KEYS[0] else 0))
        if op == "follow":
            p.refused(op, parent, toks)
        elif free:
            p.refused(op, [free[0]], parent, toks, 0, 0, 0)
    elif kind == 10:
        if p.lineage and free:  # a chain start without the root it follows
            p.refused("device_cached", [free[0]], KEYS[0], None, [0] * BS, 0, 0, 0)
        elif not p.lineage:
            p.refused("new_name")


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    p = Pair(r)
    while not r.exhausted:
        step(p, r)
        p.agree()
    Reentrant.manager = None


if __name__ == "__main__":
    main(test_one_input)
