"""Block pool throughput: native `_C.BlockPool` vs the pure-Python reference model.

Both pools run the same batched operations side by side in one process (the model is
written the way vLLM's FreeKVCacheBlockQueue is: Python objects with prev/next
pointers). Reported per call, with the native/Python speed ratio. Target: >= 10x on
batched calls of 16 blocks.

    python benchmarks/bench_pool.py [--blocks 16] [--num-blocks 65536] [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from prefixcache._C import BlockPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference.block_pool import PyBlockPool  # noqa: E402


def scenarios(batch: int, num_blocks: int) -> dict[str, Callable[[object], Callable[[], None]]]:
    """name -> (pool -> one timed call). Each setup leaves the pool as it found it."""

    def alloc_free(pool):
        def step():
            ids = pool.allocate(batch)
            pool.free(ids[::-1])

        return step

    def touch_free(pool):
        # Cached free blocks in the middle of the queue: touch pins (O(1) removal), free
        # re-appends them at the tail, as a prefix hit and its release do.
        ids = pool.allocate(num_blocks // 2)
        for i, b in enumerate(ids):
            pool.cache(b, i.to_bytes(32, "little"))
        pool.free(ids)
        hits = ids[len(ids) // 2 : len(ids) // 2 + batch]

        def step():
            pool.touch(hits)
            pool.free(hits)

        return step

    def lookup_chain(pool):
        ids = pool.allocate(batch)
        keys = [(i + 7).to_bytes(32, "little") for i in range(batch)]
        for b, k in zip(ids, keys):
            pool.cache(b, k)

        def step():
            assert len(pool.lookup_chain(keys)) == batch

        return step

    def evict_reuse(pool):
        # Allocation that pops cached blocks: drops their keys (lazy eviction).
        keys = [[(i * batch + j).to_bytes(32, "little") for j in range(batch)] for i in range(4096)]
        rounds = iter(range(1 << 62))

        def step():
            ids = pool.allocate(batch)
            pool.cache_many(ids, keys[next(rounds) % len(keys)])
            pool.free(ids[::-1])

        return step

    return {
        f"allocate({batch})+free": alloc_free,
        f"touch({batch})+free": touch_free,
        f"lookup_chain({batch})": lookup_chain,
        f"allocate({batch})+cache_many+free (evicting)": evict_reuse,
    }


def time_per_call(step: Callable[[], None], min_seconds: float = 0.2) -> float:
    """Best-of-3 seconds per call over loops of at least `min_seconds`."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            break
        n *= 2
    best = dt / n
    for _ in range(2):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per call")
    parser.add_argument("--num-blocks", type=int, default=65536, help="pool size")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds per scenario")
    args = parser.parse_args()

    print(f"# bench_pool: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"pool {args.num_blocks} blocks, {args.blocks} blocks per call")
    print(f"{'operation':<42} {'native us':>10} {'python us':>10} {'ratio':>8}")
    ratios = []
    for name, make in scenarios(args.blocks, args.num_blocks).items():
        native_step = make(BlockPool(args.num_blocks))
        python_step = make(PyBlockPool(args.num_blocks))
        native, python = float("inf"), float("inf")
        for _ in range(args.repeat):  # alternate so drift hits both sides alike
            native = min(native, time_per_call(native_step))
            python = min(python, time_per_call(python_step))
        ratios.append(python / native)
        print(f"{name:<42} {native * 1e6:>10.2f} {python * 1e6:>10.2f} {python / native:>7.1f}x")
    geo = 1.0
    for r in ratios:
        geo *= r
    geo **= 1 / len(ratios)
    print(f"{'geometric mean':<42} {'':>10} {'':>10} {geo:>7.1f}x  (target >= 10x)")


if __name__ == "__main__":
    main()
