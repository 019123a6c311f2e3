"""Random operation sequences through the native BlockPool and its Python model.

After every step both pools must report the same results, the same queue order, the
same ref counts and keys, and pass their invariant checks. Errors must match in type
and leave both pools unchanged.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from reference.block_pool import PyBlockPool

from prefixcache._C import BlockPool

N = 8
KEYS = [bytes([k]) * 4 for k in range(5)]
ids = st.lists(st.integers(-1, N), max_size=5)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.native = BlockPool(N)
        self.model = PyBlockPool(N)

    def both(self, op: str, *args):
        results = []
        for pool in (self.native, self.model):
            try:
                results.append(("ok", getattr(pool, op)(*args)))
            except (IndexError, ValueError) as err:
                results.append((type(err), None))
        assert results[0] == results[1], (op, args, results)
        return results[0]

    @rule(n=st.integers(-1, N + 1))
    def allocate(self, n):
        kind, _ = self.both("allocate", n)
        if kind == "ok":
            assert self.native.last_removed() == self.model.last_removed()

    @rule(block_ids=ids)
    def free(self, block_ids):
        self.both("free", block_ids)

    @rule(block_ids=ids)
    def touch(self, block_ids):
        self.both("touch", block_ids)

    @rule(block_id=st.integers(-1, N), key=st.sampled_from(KEYS))
    def cache(self, block_id, key):
        self.both("cache", block_id, key)

    @rule(block_id=st.integers(-1, N))
    def uncache(self, block_id):
        self.both("uncache", block_id)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key):
        self.both("lookup", key)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def lookup_chain(self, keys):
        self.both("lookup_chain", keys)

    @rule(block_ids=ids)
    def count_free(self, block_ids):
        self.both("count_free", block_ids)

    @rule(n=st.integers(-1, N + 1))
    def evict_front(self, n):
        self.both("evict_front", n)

    @rule(block_ids=ids)
    def evict_blocks(self, block_ids):
        self.both("evict_blocks", block_ids)

    @rule(block_ids=ids, keys=st.lists(st.sampled_from(KEYS), max_size=5), key_size=st.sampled_from([0, 2, 4]))
    def cache_many_packed(self, block_ids, keys, key_size):
        self.both("cache_many_packed", block_ids, b"".join(keys), key_size)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4), key_size=st.sampled_from([1, 4]))
    def lookup_chain_packed(self, keys, key_size):
        self.both("lookup_chain_packed", b"".join(keys), key_size)

    @rule()
    def uncache_all(self):
        self.both("uncache_all")

    @invariant()
    def same_state(self):
        for pool in (self.native, self.model):
            pool.check_invariants()
        assert self.native.free_queue() == self.model.free_queue()
        for b in range(N):
            assert self.native.ref_count(b) == self.model.ref_count(b)
            assert self.native.key(b) == self.model.key(b)
        for attr in ("num_free", "num_pinned", "num_cached", "num_evicted"):
            assert getattr(self.native, attr) == getattr(self.model, attr), attr
        for key in KEYS:
            assert self.native.blocks_for(key) == self.model.blocks_for(key)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPool = PoolMachine.TestCase


def test_many_distinct_keys_agree_with_model():
    """Thousands of keys: grows the native index and exercises deletion inside probe runs."""
    import random

    rng = random.Random(1234)
    n = 3000
    native, model = BlockPool(n), PyBlockPool(n)
    live: list[int] = []
    for step in range(20000):
        op = rng.random()
        if op < 0.35 and native.num_free:
            k = rng.randint(1, min(8, native.num_free))
            got = native.allocate(k)
            assert got == model.allocate(k)
            assert native.last_removed() == model.last_removed()
            live += got
        elif op < 0.6 and live:
            b = live[rng.randrange(len(live))]
            if native.key(b) is None:
                key = rng.randrange(600).to_bytes(rng.choice([4, 16, 32]), "little")
                native.cache(b, key)
                model.cache(b, key)
        elif op < 0.9 and live:
            rng.shuffle(live)
            batch, live = live[:4], live[4:]
            native.free(batch)
            model.free(batch)
        else:
            b = rng.randrange(n)
            assert native.uncache(b) == model.uncache(b)
        if step % 2000 == 0:
            native.check_invariants()
            assert native.free_queue() == model.free_queue()
    native.check_invariants()
    assert native.free_queue() == model.free_queue()
    for size in (4, 16, 32):
        for k in range(600):
            key = k.to_bytes(size, "little")
            assert native.blocks_for(key) == model.blocks_for(key)
    assert native.num_cached == model.num_cached > 100
