"""What hit verification costs the `hash` backend, measured side by side.

Replays bench_hash.py's deterministic workloads (shared system prompts; multi-turn
chat) through `HashCache` with each block-hash algorithm, once trusting its hits
(`options: {verify_hits: never}`: vLLM's behaviour, and our default under SHA-256) and
once proving every hit against the exact block contents (`verify_hits: always`: our
default under xxhash / xxhash_cbor). The arms alternate and each request is timed by
its best replay (bench_hash.best_times), so machine load hits every arm alike.
µs/request = hashing + admit + the prompt's commit + release; µs/decode step = one
append + commit. The SHA-256 rows isolate verification itself (same hashing both
sides). Every run also checks that verification changed no hit: with no collision in
sight, verified and trusted replays must hit the same tokens for every request.

    python benchmarks/bench_verify.py [--repeat 5] [--num-blocks 1024] [--workload all]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hash import BLOCK_SIZE, WORKLOADS, best_times, replay_ours  # noqa: E402
from machine import cpu_model  # noqa: E402

import prefixcache  # noqa: E402
from prefixcache.config import CacheConfig, HashConfig  # noqa: E402

ALGORITHMS = ("sha256_cbor", "xxhash", "xxhash_cbor")


def make_cache(algorithm: str, verify: str, num_blocks: int):
    return prefixcache.build_cache(
        CacheConfig(
            backend="hash",
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            hash=HashConfig(algorithm=algorithm),
            enable_events=False,
            options={"verify_hits": verify},
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=4, help="live requests kept before releasing")
    parser.add_argument("--repeat", type=int, default=5, help="replays per arm; each request's best time is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    args = parser.parse_args()

    print(f"# bench_verify: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(
        f"# block_size {BLOCK_SIZE}, num_blocks {args.num_blocks}, concurrency {args.concurrency}, "
        f"best of {args.repeat}"
    )
    print(f"# command: {' '.join(sys.argv)}")
    columns = [
        "workload",
        "algorithm",
        "trusted µs/request",
        "verified µs/request",
        "cost µs/request",
        "cost %",
        "trusted µs/decode step",
        "verified µs/decode step",
        "hits",
        "verify failures",
        "content nodes",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    ok = True
    for name, make in WORKLOADS.items():
        if args.workload not in ("all", name):
            continue
        reqs = make(random.Random(args.seed))
        runs: dict[tuple[str, str], list] = {(a, v): [] for a in args.algorithms for v in ("never", "always")}
        caches = {}
        for _ in range(args.repeat):
            for algorithm, verify in runs:
                cache = make_cache(algorithm, verify, args.num_blocks)
                runs[algorithm, verify].append(replay_ours(reqs, args.num_blocks, args.concurrency, cache=cache))
                caches[algorithm, verify] = cache
        for algorithm in args.algorithms:
            trusted, verified = runs[algorithm, "never"], runs[algorithm, "always"]
            t_req, t_step = best_times(trusted)
            v_req, v_step = best_times(verified)
            same = trusted[0].hits == verified[0].hits and trusted[0].tables == verified[0].tables
            ok &= same
            checked = caches[algorithm, "always"]
            cells = [
                name,
                algorithm,
                f"{t_req:.1f}",
                f"{v_req:.1f}",
                f"{v_req - t_req:+.1f}",
                f"{(v_req - t_req) / t_req:+.1%}",
                f"{t_step:.2f}",
                f"{v_step:.2f}",
                "identical" if same else "DIFFER",
                checked.stats().verify_failures,
                checked._verifier.num_nodes,
            ]
            print("| " + " | ".join(map(str, cells)) + " |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
