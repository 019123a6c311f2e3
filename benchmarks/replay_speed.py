"""A whole Mooncake trace through `replay_arm`, against the physical floor of `hash`: the
native hashing chain alone over the same prompts.

Owns one measurement, in one process, side by side: (1) the floor, `prefixcache._C.
chain_digests` (sha256_cbor, block 512, chained from NONE_HASH) over every prompt of the
trace given as an int64 array (its fastest input form; the arrays are expanded before the
clock starts, one request at a time); (2) `prefixcache.ab.replay_arm` of the trace through
hash/512 and radix/512 at 3M tokens of pool (configs/mooncake.yaml: prompts only, events
off), wall time of the whole replay, token expansion included. Prints each one's tokens/s
and the ratios the targets are judged by (hash <= 2x the floor, radix <= 1x),
the hit ratios (which must not move), and the command. Rounds alternate the three and the
best of `--repeat` is kept for each. Each is also timed on the thread's CPU clock
(`time.thread_time`) over the same span: on a shared host other processes inflate wall
time, not this thread's CPU time, so the CPU ratio is printed beside the wall one (the
verdict stays the wall clock's).

    python benchmarks/replay_speed.py --trace ../shared/traces/mooncake_conversation_trace.jsonl [--repeat 3]

Must never: be imported by the library or the tests (tests/test_benchmarks_load.py loads
it and runs `--limit` on a generated trace).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

from prefixcache import _C
from prefixcache.ab import replay_arm
from prefixcache.config import CacheConfig
from prefixcache.hashing import none_hash
from prefixcache.workloads import read_mooncake

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

BLOCK = 512
CAPACITY_TOKENS = 3_000_000


def hashing_floor(workload) -> tuple[float, float]:
    """(wall, CPU) seconds the native sha256_cbor chain takes over every prompt (arrays prebuilt)."""
    root = none_hash("sha256_cbor")
    wall = cpu = 0.0
    for r in workload.requests:
        prompt = r.prompt.to_array()
        c0, t0 = time.thread_time(), time.perf_counter()
        _C.chain_digests(prompt, BLOCK, "sha256_cbor", root)
        wall += time.perf_counter() - t0
        cpu += time.thread_time() - c0
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, type=Path, help="a Mooncake JSONL trace")
    parser.add_argument("--limit", type=int, default=None, help="first N requests only")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds; the best of each is kept")
    parser.add_argument("--capacity-tokens", type=int, default=CAPACITY_TOKENS)
    args = parser.parse_args(argv)

    workload = read_mooncake(args.trace, limit=args.limit, outputs=False)
    tokens = workload.prompt_tokens
    arms = {
        name: CacheConfig(backend=name.split("/")[0], block_size=BLOCK, num_blocks=args.capacity_tokens // BLOCK,
                          enable_events=False)
        for name in ("hash/512", "radix/512")
    }
    best = {"floor": float("inf"), **{name: float("inf") for name in arms}}
    cpu = dict.fromkeys(best, float("inf"))
    ratios = {}
    for _ in range(args.repeat):
        wall, cpu_s = hashing_floor(workload)
        best["floor"], cpu["floor"] = min(best["floor"], wall), min(cpu["floor"], cpu_s)
        for name, config in arms.items():
            c0 = time.thread_time()
            result = replay_arm(workload, name, config, check_invariants=False)
            cpu[name] = min(cpu[name], time.thread_time() - c0)
            best[name] = min(best[name], result.wall_s)
            ratios[name] = (result.hit_ratio, result.last_half_hit_ratio)

    print(f"# replay_speed  {datetime.date.today()}  {cpu_model()} x{os.cpu_count()}  Python {platform.python_version()}"
          f"  SHA-256 on {'the CPU SHA extensions' if _C.sha256_uses_cpu_extensions() else 'portable code'}")
    print(f"# command: python benchmarks/replay_speed.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(f"# {args.trace.name}: {len(workload):,} requests, {tokens:,} prompt tokens; pool {args.capacity_tokens:,} "
          f"tokens; best of {args.repeat} alternating rounds")
    print("| what | seconds | M tokens/s | x hashing floor | target | hit ratio | last 50% | CPU seconds | CPU x floor |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
    floor, cpu_floor = best["floor"], cpu["floor"]
    print(f"| native sha256_cbor chain alone (the floor) | {floor:.2f} | {tokens / floor / 1e6:.1f} | 1.00 | - | - | - "
          f"| {cpu_floor:.2f} | 1.00 |")
    for name, target in (("hash/512", 2.0), ("radix/512", 1.0)):
        s = best[name]
        verdict = "met" if s / floor <= target else "NOT met"
        hit, last = ratios[name]
        print(f"| replay_arm {name} | {s:.2f} | {tokens / s / 1e6:.1f} | {s / floor:.2f} | <= {target:g}x: {verdict} "
              f"| {hit:.4f} | {last:.4f} | {cpu[name]:.2f} | {cpu[name] / cpu_floor:.2f} |")
    print(f"# load average while it ran (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
