"""BlockEvictor (policy-ordered eviction for the hash strategy): the native evictor
against its Python model under random operations, and what each policy evicts."""

from __future__ import annotations

import dataclasses
import random

import pytest
from reference.block_evictor import PyBlockEvictor
from reference.block_pool import PyBlockPool

from prefixcache._C import CANDIDATE_FIELDS, BlockEvictor, BlockPool, CallbackBlockEvictor, InvariantError
from prefixcache.eviction import GSLRU, LFU, Candidate

N = 10


def small_gslru():
    policy = GSLRU()
    policy.protect_tokens, policy.size_weight = 6, 1
    return policy


def odd_blocks_first(c):
    return (c.block % 2 == 0, -c.use_count, c.last_access_time)


# (name, native evictor factory, model priority function)
SETUPS = {
    "lfu": (lambda pool: BlockEvictor(pool, 4, "lfu", ghost_capacity=0), LFU().priority, 0),
    "gslru": (lambda pool: BlockEvictor(pool, 4, "gslru", protect_tokens=6, size_weight=1, ghost_capacity=5),
              small_gslru().priority, 5),
    "python": (lambda pool: CallbackBlockEvictor(pool, 4, odd_blocks_first, 5), odd_blocks_first, 5),
}


class Twins:
    """The native pool + evictor and the Python pool + model, driven alike."""

    def __init__(self, setup: str) -> None:
        make, rank, ghost = SETUPS[setup]
        self.pools = (BlockPool(N), PyBlockPool(N))
        self.evictors = (make(self.pools[0]), PyBlockEvictor(self.pools[1], 4, rank, ghost))
        self.pinned: list[int] = []  # one entry per reference we hold

    def both(self, op, *args):
        out = []
        for ev in self.evictors:
            try:
                out.append(("ok", getattr(ev, op)(*args)))
            except (ValueError, IndexError) as err:
                out.append((type(err), None))
        assert out[0] == out[1], (op, args, out)
        return out[0]

    def allocate(self, n):
        if n > self.pools[0].num_free:
            return
        self.both("make_room", n)
        ids = [pool.allocate(n) for pool in self.pools]
        assert ids[0] == ids[1] and self.pools[0].last_removed() == []
        self.pinned += ids[0]

    def cache(self, rng):
        keyless = sorted({b for b in self.pinned if self.pools[0].key(b) is None})
        chosen = rng.sample(keyless, k=min(len(keyless), rng.randint(0, 3)))
        keys = b"".join(bytes([rng.randint(0, 6)]) * 8 for _ in chosen)  # repeats: duplicates and ghost hits
        for pool in self.pools:
            pool.cache_many_packed(chosen, keys, 8)
        self.both("cached", chosen, keys, 8, rng.randint(0, 2))

    def admit(self, rng):
        keyed = [b for b in range(N) if self.pools[0].key(b) is not None]
        hits = rng.sample(keyed, k=min(len(keyed), rng.randint(0, 3)))
        kind, _ = self.both("admit", hits, rng.choice([0, 4, 8]), rng.randint(0, 2))
        if kind == "ok":
            self.pinned += hits

    def free(self, rng):
        distinct = sorted(set(self.pinned))
        chosen = rng.sample(distinct, k=min(len(distinct), rng.randint(0, 4)))
        kind, _ = self.both("free", chosen, rng.choice([0, 4, 12]))
        if kind == "ok":
            for b in chosen:
                self.pinned.remove(b)

    def check(self):
        native, model = self.evictors
        assert native.order() == model.order()
        for attr in ("clock", "traffic", "num_candidates", "ghost_size"):
            assert getattr(native, attr) == getattr(model, attr), attr
        for b in range(N):
            assert [getattr(native.candidate(b), f) for f in CANDIDATE_FIELDS] == [
                getattr(model.candidate(b), f) for f in CANDIDATE_FIELDS
            ]
        assert self.pools[0].free_queue() == self.pools[1].free_queue()
        assert [self.pools[0].key(b) for b in range(N)] == [self.pools[1].key(b) for b in range(N)]
        for ev in self.evictors:
            ev.check_invariants()


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_native_evictor_matches_model(setup):
    for seed in range(12):
        rng = random.Random(seed)
        t = Twins(setup)
        for _ in range(150):
            op = rng.choices(["allocate", "cache", "admit", "free", "evict", "reset", "bad"],
                             weights=[4, 4, 3, 5, 2, 0.3, 0.5])[0]
            if op == "allocate":
                t.allocate(rng.randint(0, 4))
            elif op == "evict":
                t.both("evict", rng.randint(0, 3))
            elif op == "reset":
                for pool in t.pools:
                    pool.uncache_all()
                t.both("reset")
            elif op == "bad":  # refused alike, nothing changed
                t.both(rng.choice(["free", "admit"]), rng.choice([[-1], [N], [0, 0], [1, 2, 1]]), 4)
            else:
                getattr(t, op)(rng)
            t.check()


def test_ranking_happens_once_per_candidate_and_a_raising_policy_changes_nothing():
    calls = []

    def rank(c):
        calls.append(c.block)
        if c.block == 3:
            raise RuntimeError("policy bug")
        return c.last_access_time

    pool = BlockPool(6)
    ev = CallbackBlockEvictor(pool, 4, rank, 0)
    blocks = pool.allocate(5)
    pool.cache_many_packed(blocks, b"".join(bytes([i]) * 8 for i in range(5)), 8)
    ev.cached(blocks, b"".join(bytes([i]) * 8 for i in range(5)), 8)
    ev.free([0, 1, 2])
    assert calls == [0, 1, 2]
    ev.make_room(3)  # 1 keyless free block: evicts 0 and 1, and never ranks again
    assert calls == [0, 1, 2] and pool.key(0) is None and pool.key(2) is not None
    before = (pool.free_queue(), [pool.ref_count(b) for b in range(6)], ev.clock, ev.num_candidates)
    with pytest.raises(RuntimeError, match="policy bug"):
        ev.free([4, 3])
    assert (pool.free_queue(), [pool.ref_count(b) for b in range(6)], ev.clock, ev.num_candidates) == before
    ev.check_invariants()


def test_check_invariants_names_a_block_cached_behind_its_back():
    pool = BlockPool(4)
    ev = BlockEvictor(pool, 4, "lfu")
    pool.allocate(1)
    pool.cache(0, b"k" * 8)
    with pytest.raises(InvariantError, match="block 0 was cached behind the evictor's back"):
        ev.check_invariants()


def test_bad_arguments():
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="eviction order 'nope' is not native; allowed values: lru, .*gslru"):
        BlockEvictor(pool, 4, "nope")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockEvictor(pool, 0, "lfu")
    ev = BlockEvictor(pool, 4, "lfu")
    with pytest.raises(ValueError, match="make_room: n must be >= 0"):
        ev.make_room(-1)
    with pytest.raises(ValueError, match="admit: tokens must be >= 0"):
        ev.admit([], -1)
    with pytest.raises(IndexError, match="candidate: block id 9 is out of range"):
        ev.candidate(9)
    pool.allocate(1)
    pool.cache(0, b"x" * 8)
    with pytest.raises(ValueError, match="needs a pool that holds no key"):
        BlockEvictor(pool, 4, "lfu")


def test_candidate_fields_are_the_native_definition():
    """csrc/eviction_order.h defines the fields once: the native candidate exposes exactly
    them, `Candidate` spells them in that order, and the twins' records carry them."""
    from reference.candidate import CandidateRecord

    assert tuple(Candidate.__annotations__) == CANDIDATE_FIELDS
    pool = BlockPool(2)
    native = BlockEvictor(pool, 4, "lfu").candidate(1)
    exposed = {name for name in dir(native) if not name.startswith("_")}
    assert exposed == {"node", "block", *CANDIDATE_FIELDS}
    assert [f.name for f in dataclasses.fields(CandidateRecord)] == ["id", *CANDIDATE_FIELDS]
