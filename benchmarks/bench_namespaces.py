"""Memory and invariant-check cost of a `radix` cache under many namespaces.

Owns two measurements:

  memory            A cache (block 16, a 1,024-block pool) serves N one-request
                    namespaces: tenant i admits, commits and releases a 3-page prompt of
                    its own, and the pool evicts older tenants as it fills. Then all is
                    evicted. One run per arm (`--arms`): `radix`; `radix` over a 2,048-block
                    host tier (lineage: root names per namespace); `radix` and `hash` with
                    that tier and KV events (a namespace tag per block); `radix` over a
                    full + sliding-window layout (the hybrid tree's namespaces). Memory is
                    read at the start (cache built and the first 1,024 tenants served and
                    evicted, so Python's and malloc's pools are warm),
                    at the peak (sampled every 10% of the run) and at the end, as the
                    process's resident set after glibc's malloc_trim hands freed pages
                    back, and as the bytes malloc holds in use (mallinfo2, C and C++
                    heap; Python objects live in pymalloc arenas inside it). Target: the
                    end within 10% of the start.
  check_invariants  K namespaces cached at once (K one-page entries, one per namespace,
                    in a pool of K + 2 blocks), then one `cache.check_invariants()` timed:
                    µs per tree node at K = 1k, 10k, 80k. O(nodes) keeps the column flat;
                    a per-node scan of the roots grows it with K.

    python benchmarks/bench_namespaces.py [--tenants 1000000] [--sizes 1000 10000 80000] [--arms radix ...]
    python benchmarks/bench_namespaces.py --quick   # 100k tenants, sizes 1k and 10k
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import platform
import resource
import sys
import time
from array import array
from pathlib import Path

from prefixcache import build_cache
from prefixcache.config import CacheConfig
from prefixcache.layout import LayerGroup
from prefixcache.tier_config import TierConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

BS = 16
POOL = 1024
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def memory() -> tuple[int, int]:
    """(resident bytes after malloc_trim, bytes malloc holds in use)."""
    _LIBC.malloc_trim(0)
    info = _LIBC.mallinfo2()
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * PAGE_SIZE
    return resident, info.uordblks + info.hblkhd


HOST = (TierConfig("CPU", 2 * POOL),)
ARMS = {
    "radix": {},
    "radix+host": {"tiers": HOST},
    "radix+host+events": {"tiers": HOST, "enable_events": True},
    "hash+host+events": {"backend": "hash", "tiers": HOST, "enable_events": True},
    "radix full+swa": {"layout": (LayerGroup("full_attention"), LayerGroup("sliding_window", window=32, pool_ratio=0.8))},
}


def build(arm: str):
    options = {"backend": "radix", "block_size": BS, "num_blocks": POOL, "enable_events": False, **ARMS[arm]}
    return build_cache(CacheConfig(**options))


def serve(cache, tenant: int) -> None:
    ns = f"tenant-{tenant}"
    prompt = array("q", range(tenant * 64, tenant * 64 + 3 * BS))
    adm = cache.admit(tenant, prompt, namespace=ns)
    for at in adm.checkpoints:
        cache.commit(tenant, at)
    cache.commit(tenant, len(prompt))
    cache.release(tenant)
    cache.drain_events()
    cache.drain_transfers()


def evict_all(cache) -> None:
    """Everything out of the device pool and the tiers below it (a reset empties both)."""
    if getattr(cache, "tiers", None) is not None:
        cache.reset()
    else:
        cache.evict(POOL)


def memory_run(arm: str, tenants: int) -> None:
    cache = build(arm)
    for t in range(POOL):  # warm-up: the same kind of work, evicted
        serve(cache, t)
    evict_all(cache)
    start = memory()
    peak = start
    started = time.perf_counter()
    for t in range(POOL, POOL + tenants):
        serve(cache, t)
        if (t - POOL) % max(1, tenants // 10) == 0:
            peak = max(peak, memory())
    seconds = time.perf_counter() - started
    peak = max(peak, memory())
    tables = namespace_tables(cache)
    evict_all(cache)
    cache.check_invariants()
    end = memory()
    mib = 1 << 20
    print(f"\n{arm}: {tenants:,} one-request namespaces through a {POOL:,}-block pool in {seconds:.1f} s "
          f"({seconds / tenants * 1e6:.1f} µs a request); per-namespace entries before the final evict: "
          f"{tables}, after: {namespace_tables(cache)}")
    print("| memory | start MiB | peak MiB | end MiB | end / start |")
    print("|---|---:|---:|---:|---:|")
    for i, what in enumerate(("resident set (after malloc_trim)", "malloc in use")):
        print(f"| {what} | {start[i] / mib:.1f} | {peak[i] / mib:.1f} | {end[i] / mib:.1f} | {end[i] / start[i]:.3f} |")
    print(f"# max RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f} MiB")
    met = all(end[i] <= 1.10 * start[i] for i in range(2))
    print(f"# target: end within 10% of start: {'met' if met else 'NOT met'}")


def namespace_tables(cache) -> str:
    """The sizes of the tables a cache keeps per namespace."""
    sizes = {}
    if hasattr(cache, "tree") and hasattr(cache.tree, "namespaces"):
        sizes["tree roots"] = len(cache.tree.namespaces())
    if getattr(cache, "tiers", None) is not None:
        sizes["tier tags"] = len(cache.tiers._tags)
        if getattr(cache, "_lineage", False):
            sizes["root names"] = len(cache._roots)
    if cache.config.layout:
        sizes["hybrid namespaces"] = len(cache._namespaces)
    return ", ".join(f"{k} {v:,}" for k, v in sizes.items())


def check_run(sizes: list[int]) -> None:
    print("\n| namespaces cached | tree nodes | check_invariants s | µs per node |")
    print("|---:|---:|---:|---:|")
    for k in sizes:
        cache = build_cache(CacheConfig(backend="radix", block_size=BS, num_blocks=k + 2, enable_events=False))
        for t in range(k):
            prompt = array("q", range(t * 32, t * 32 + BS + 1))  # one page cached, a tail freed
            cache.admit(t, prompt, namespace=f"tenant-{t}")
            cache.commit(t, len(prompt))
            cache.release(t)
        nodes = cache.tree.num_nodes
        started = time.perf_counter()
        cache.check_invariants()
        seconds = time.perf_counter() - started
        print(f"| {k:,} | {nodes:,} | {seconds:.3f} | {seconds / nodes * 1e6:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=1_000_000)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 80_000])
    parser.add_argument("--quick", action="store_true", help="100k tenants, sizes 1k and 10k")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    args = parser.parse_args(argv)
    if args.quick:
        args.tenants, args.sizes = 100_000, [1_000, 10_000]
    print(f"# bench_namespaces  {datetime.date.today()}  {cpu_model()} x{os.cpu_count()}  "
          f"Python {platform.python_version()}")
    print(f"# command: python benchmarks/bench_namespaces.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    if not args.skip_memory:
        for arm in args.arms:
            memory_run(arm, args.tenants)
    check_run(args.sizes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
