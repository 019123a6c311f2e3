"""Soak: a million random protocol operations through each backend, every answer checked.

Drives `prefixcache.stress.stress` (admit / append / commit / release / evict / reset /
match, several namespaces and LoRA adapters sharing the same token runs, a pool small
enough that admissions are refused and blocks evicted all the time) through the `hash`
backend (under SHA-256 and under xxhash, whose hits are verified, the latter also
with `gslru` eviction, so verification meets policy eviction) and the `radix` backend.
Every hit, match, copy and commit is checked by the conformance kit's operation model
(`prefixcache.testing.CheckedCache`, with its causal KV shadow), and a wrong one raises
`RuleViolation` naming the rule; `check_invariants()` runs every `--check-every`
operations and on every live request's blocks. Prints operations per second and the invariant checks passed; exits non-zero
at the first wrong answer (with the traceback).

    python benchmarks/soak.py --ops 1000000 --backend all        # the full soak
    python benchmarks/soak.py --ops 100000 --backend all         # what CI runs
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import prefixcache
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.stress import OPERATIONS, stress

ARMS = {  # (backend, hash algorithm, eviction policy)
    "hash": [("hash", "sha256_cbor", "lru"), ("hash", "xxhash", "lru"), ("hash", "xxhash", "gslru")],
    "radix": [("radix", "sha256_cbor", "lru")],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=1_000_000, help="operations per backend arm")
    parser.add_argument("--backend", choices=[*ARMS, "all"], default="all")
    parser.add_argument("--block-size", type=int, default=4, help="tokens per block")
    parser.add_argument("--num-blocks", type=int, default=48, help="pool size in blocks (small: pressure)")
    parser.add_argument("--check-every", type=int, default=250, help="operations between check_invariants()")
    parser.add_argument("--max-live", type=int, default=8, help="live requests at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action="store_true", help="report every tenth of the run on stderr")
    args = parser.parse_args()

    arms = [arm for name, group in ARMS.items() if args.backend in (name, "all") for arm in group]
    print(f"# soak: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    print(f"# command: {' '.join(sys.argv)}")
    print(
        f"# block_size {args.block_size}, num_blocks {args.num_blocks}, max live {args.max_live}, "
        f"check_invariants every {args.check_every} operations, seed {args.seed}"
    )
    columns = [
        "backend",
        "hash",
        "eviction",
        "operations",
        "seconds",
        "ops/s",
        "invariant checks passed",
        "admitted",
        "refused",
        "hit tokens / prompt tokens",
        "evicted blocks",
        "resets done",
        "verify failures",
        *(f"{op} calls" for op in OPERATIONS),
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    started = time.perf_counter()
    for backend, algorithm, eviction in arms:
        cache = prefixcache.build_cache(
            CacheConfig(
                backend=backend,
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                hash=HashConfig(algorithm=algorithm),
                eviction=eviction,
                enable_events=False,
            )
        )

        def progress(report) -> None:
            if args.progress and report.operations % max(args.ops // 10, args.check_every) < args.check_every:
                print(
                    f"#   {backend}/{algorithm}/{eviction}: {report.operations:,} operations, {report.ops_per_second:,.0f}/s",
                    file=sys.stderr,
                    flush=True,
                )

        r = stress(
            cache,
            operations=args.ops,
            seed=args.seed,
            check_every=args.check_every,
            max_live=args.max_live,
            progress=progress,
        )
        cells = [
            backend,
            algorithm,
            eviction,
            f"{r.operations:,}",
            f"{r.seconds:.1f}",
            f"{r.ops_per_second:,.0f}",
            f"{r.invariant_checks:,}",
            f"{r.admitted:,}",
            f"{r.refused:,}",
            f"{r.hit_tokens:,} / {r.prompt_tokens:,}",
            f"{r.evicted_blocks:,}",
            r.resets,
            r.verify_failures,
            *(f"{r.counts[op]:,}" for op in OPERATIONS),
        ]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)
    print(f"# all arms passed in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
