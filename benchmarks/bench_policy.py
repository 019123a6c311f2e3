"""What an eviction policy written in Python costs, next to the same policy run natively.

Replays one workload under heavy eviction through both strategies, each with:
  lru            the native default (hash: the pool's free queue, no evictor at all)
  gslru          a native ordering (hash: the C++ BlockEvictor; radix: the C++ tree)
  gslru (python) the same GSLRU class with `native = None`: the backend calls its
                 priority() once per candidate (a freed cached block for hash; a leaf
                 for radix, and again after a walk changes it) and keeps the key
  lru (python)   LRU with `native = None`: the same ranking work on hash, where native
                 LRU needs none
and reports the hit ratio (a Python policy must decide exactly as its native twin),
evictions, priority() calls per request, and bookkeeping µs per request (every cache
call, timed by prefixcache.ab.replay_arm), best of --repeat runs, arms interleaved.

    python benchmarks/bench_policy.py [--trace ../shared/traces/mooncake_conversation_trace.jsonl]
                                      [--capacity 3000000] [--repeat 3] [--limit N]

Default workload: generated multi-turn chat (256 conversations x 8 turns), block 16,
a pool of 16,384 tokens (about 1/20 of what the workload caches). With --trace: the
Mooncake trace at block 512, prompts only.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache import CacheConfig
from prefixcache.ab import replay_arm
from prefixcache.eviction import GSLRU, LRU
from prefixcache.workloads import generate, read_mooncake


class PythonGSLRU(GSLRU):
    """GSLRU decided in Python: priority() is called once per candidate."""

    native = None
    calls = 0

    def priority(self, candidate):
        PythonGSLRU.calls += 1
        return super().priority(candidate)


class PythonLRU(LRU):
    """LRU decided in Python (hash: instead of the free queue)."""

    native = None
    calls = 0

    def priority(self, candidate):
        PythonLRU.calls += 1
        return candidate.last_access_time


ARMS = [
    ("lru", "lru", None),
    ("gslru", "gslru", None),
    ("gslru (python)", "__main__:PythonGSLRU", PythonGSLRU),
    ("lru (python)", "__main__:PythonLRU", PythonLRU),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, help="a Mooncake JSONL trace (block 512, prompts only)")
    parser.add_argument("--capacity", type=int, default=None, help="pool size in TOKENS")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N trace records")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"# policy cost benchmark, {time.strftime('%Y-%m-%d')}: {cpu_model()}, Python {platform.python_version()}")
    print(f"# command: python {shlex.join(sys.argv)}")
    if args.trace:
        workload, bs = read_mooncake(args.trace, limit=args.limit, outputs=False), 512
        capacity = args.capacity or 3_000_000
    else:
        workload = generate("multi_turn", num_conversations=256, turns=8, seed=0)
        bs, capacity = 16, args.capacity or 16_384
    print(f"# workload {workload.name}: {len(workload):,} requests, block {bs}, pool {capacity:,} tokens "
          f"({capacity // bs:,} blocks), best of {args.repeat}")
    best: dict[tuple[str, str], object] = {}
    calls: dict[tuple[str, str], int] = {}
    for _ in range(args.repeat):
        for backend in ("hash", "radix"):
            for name, eviction, counter in ARMS:
                if counter is not None:
                    counter.calls = 0
                config = CacheConfig(backend=backend, block_size=bs, num_blocks=capacity // bs, eviction=eviction,
                                     enable_events=False)
                arm = replay_arm(workload, f"{backend}/{name}", config, check_invariants=False)
                key = (backend, name)
                if key not in best or sum(arm.bookkeeping_us) < sum(best[key].bookkeeping_us):  # type: ignore[attr-defined]
                    best[key] = arm
                calls[key] = counter.calls if counter is not None else 0
    n = len(workload)
    print(f"{'arm':<22} {'hit ratio':>9} {'evicted':>9} {'priority() / req':>16} {'µs/req mean':>12} "
          f"{'p50':>7} {'vs native lru':>13} {'vs native gslru':>15}")
    for backend in ("hash", "radix"):
        base_lru = statistics.fmean(best[(backend, "lru")].bookkeeping_us)  # type: ignore[attr-defined]
        base_gslru = statistics.fmean(best[(backend, "gslru")].bookkeeping_us)  # type: ignore[attr-defined]
        for name, _, _ in ARMS:
            arm = best[(backend, name)]
            mean = statistics.fmean(arm.bookkeeping_us)  # type: ignore[attr-defined]
            print(f"{backend + '/' + name:<22} {arm.hit_ratio:>9.4f} {arm.evicted_blocks:>9,} "  # type: ignore[attr-defined]
                  f"{calls[(backend, name)] / n:>16.1f} {mean:>12.1f} {arm.us_p50:>7.1f} "  # type: ignore[attr-defined]
                  f"{mean / base_lru:>12.2f}x {mean / base_gslru:>14.2f}x")
    for backend in ("hash", "radix"):
        same = best[(backend, "gslru")].hits.hit_tokens == best[(backend, "gslru (python)")].hits.hit_tokens  # type: ignore
        print(f"check {backend}: gslru (python) hits == gslru (native) hits, request by request: {same}")
    same = best[("hash", "lru")].hits.hit_tokens == best[("hash", "lru (python)")].hits.hit_tokens  # type: ignore
    print(f"check hash: lru (python, ranked blocks) hits == lru (free queue) hits, request by request: {same}")


if __name__ == "__main__":
    main()
