"""Fuzz harness: the native BlockPool against its Python model, packed variants included.

Each input is a sequence of pool operations (allocate, free, touch, count_free, cache,
cache_many, cache_many_packed, uncache, uncache_all, lookup, lookup_chain,
lookup_chain_packed, evict_front) with arguments that are often wrong: ids out of
range or beyond int64, duplicates, keys of odd sizes, a key size that does not divide
the bytes. Both pools must answer alike (same result or same error type), a refused
call must change neither, and both must pass check_invariants after every operation.

    python fuzz/fuzz_block_pool.py -max_total_time=600     # longer runs: any libFuzzer flags
"""

from __future__ import annotations

from harness import main
from reader import EDGE_INTS, Reader
from test_block_pool_stateful import KEYS, N, PoolMachine


class Pools(PoolMachine):
    """The stateful test's pair, with every argument error type compared."""

    def both(self, op: str, *args):
        results = []
        for pool in (self.native, self.model):
            try:
                results.append(("ok", getattr(pool, op)(*args)))
            except (IndexError, ValueError, TypeError) as err:
                results.append((type(err), None))
        assert results[0] == results[1], (op, args, results)
        return results[0]


def block_id(r: Reader) -> int:
    return r.choice(EDGE_INTS) if r.int(0, 31) == 0 else r.int(-2, N + 1)


def ids(r: Reader) -> list[int]:
    return [block_id(r) for _ in range(r.int(0, 6))]


def key(r: Reader) -> bytes:
    return r.choice(KEYS) if r.bool() else r.raw(6)


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    pools = Pools()
    ops = {
        "allocate": lambda: pools.allocate(r.int(-2, N + 2)),
        "free": lambda: pools.free(ids(r)),
        "touch": lambda: pools.touch(ids(r)),
        "count_free": lambda: pools.count_free(ids(r)),
        "cache": lambda: pools.cache(block_id(r), key(r)),
        "cache_many": lambda: pools.both("cache_many", ids(r), [key(r) for _ in range(r.int(0, 6))]),
        "cache_many_packed": lambda: pools.both("cache_many_packed", ids(r), r.raw(24), r.int(-1, 6)),
        "uncache": lambda: pools.uncache(block_id(r)),
        "uncache_all": lambda: pools.uncache_all(),
        "lookup": lambda: pools.lookup(key(r)),
        "lookup_chain": lambda: pools.lookup_chain([key(r) for _ in range(r.int(0, 5))]),
        "lookup_chain_packed": lambda: pools.both("lookup_chain_packed", r.raw(24), r.int(-1, 6)),
        "evict_front": lambda: pools.evict_front(r.int(-2, N + 2)),
    }
    names = list(ops)
    while not r.exhausted:
        ops[r.choice(names)]()
        pools.same_state()


if __name__ == "__main__":
    main(test_one_input)
