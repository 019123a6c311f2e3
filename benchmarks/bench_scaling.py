"""Costs that must not grow with the cache: radix misses under eviction pressure, decode
steps at long context, and each hash algorithm per request.

Owns three measurements, each printed with the ratio its target is judged by:

  radix miss     A `radix` cache (block 16) holding N unlocked cached entries (N distinct
                 2-page prompts of one release each, pool exactly full), then M admissions
                 of fresh 2-page prompts, each a miss that must evict: µs per admission +
                 release, at N = 1k, 10k, 100k; and again at 100k entries in a pool of 1M
                 blocks (the rest filled by one long cached prompt). Target: 100k <= 2x 1k.
  decode step    One request with a context of C tokens (block 16), then S decode steps of
                 `append([t])` + `commit(n)`: µs per step at C = 1k and 64k, both backends.
                 Target: 64k <= 2x 1k.
  hash per req   `hash` (block 16) admitting + committing + releasing bench_hash's
                 shared-prefix requests under each algorithm: µs per request. Targets:
                 xxhash <= 1x sha256_cbor, sha256 (pickle) <= 1.5x sha256_cbor.

Every row is the best of `--repeat` rounds, rounds alternating the cases.

    python benchmarks/bench_scaling.py [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
from array import array
from pathlib import Path

from prefixcache import build_cache
from prefixcache.config import CacheConfig, HashConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

BS = 16


def radix_miss_us(entries: int, pool_blocks: int, misses: int, eviction: str = "lru") -> float:
    """µs per missing admission + release once `entries` cached 2-page prompts fill the pool."""
    cache = build_cache(CacheConfig(backend="radix", block_size=BS, num_blocks=pool_blocks, enable_events=False,
                                    eviction=eviction))
    next_id = 1
    filler = pool_blocks - 2 * entries - 1
    if filler > 0:  # one long cached prompt takes the rest of the pool
        ids = array("q", range(10**9, 10**9 + filler * BS + 1))
        cache.admit("filler", ids)
        cache.commit("filler", len(ids))
        cache.release("filler")
    for i in range(entries):
        prompt = array("q", range(next_id, next_id + 2 * BS + 1))
        next_id += 2 * BS + 1
        cache.admit(i, prompt)
        cache.commit(i, len(prompt))
        cache.release(i)
    prompts = []
    for _ in range(misses):
        prompts.append(array("q", range(next_id, next_id + 2 * BS + 1)))
        next_id += 2 * BS + 1
    t0 = time.perf_counter()
    for j, prompt in enumerate(prompts):
        cache.admit(("m", j), prompt)
        cache.commit(("m", j), len(prompt))
        cache.release(("m", j))
    seconds = time.perf_counter() - t0
    assert cache.stats().evictions >= misses, "the misses did not evict"
    return seconds / misses * 1e6


def decode_step_us(backend: str, context: int, steps: int) -> float:
    """µs per decode step (append one token + commit) at `context` tokens."""
    cache = build_cache(CacheConfig(backend=backend, block_size=BS, num_blocks=(context + steps) // BS + 8,
                                    enable_events=False))
    prompt = array("q", range(1, context + 1))
    cache.admit("r", prompt)
    n = context
    cache.commit("r", n)
    tokens = [[t] for t in range(10**6, 10**6 + steps)]
    t0 = time.perf_counter()
    for tok in tokens:
        cache.append("r", tok)
        n += 1
        cache.commit("r", n)
    seconds = time.perf_counter() - t0
    cache.release("r")
    return seconds / steps * 1e6


def hash_request_us(algorithm: str, reqs: list[array]) -> float:
    """µs per request (admit + prompt commit + release) under `algorithm`."""
    cache = build_cache(CacheConfig(backend="hash", block_size=BS, num_blocks=1024, enable_events=False,
                                    hash=HashConfig(algorithm=algorithm, seed="bench"),
                                    options={"verify_hits": "never"}))
    t0 = time.perf_counter()
    for i, prompt in enumerate(reqs):
        cache.admit(i, prompt)
        cache.commit(i, len(prompt))
        cache.release(i)
    return (time.perf_counter() - t0) / len(reqs) * 1e6


def shared_prefix(rng: random.Random, n: int = 400) -> list[array]:
    """bench_hash's shared-prefix prompts: one of 4 system prompts + a unique question."""
    prefixes = [[rng.randrange(128_256) for _ in range(1024)] for _ in range(4)]
    return [array("q", rng.choice(prefixes) + [rng.randrange(128_256) for _ in range(rng.randint(64, 512))])
            for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    print(f"# bench_scaling  {datetime.date.today()}  {cpu_model()} x{os.cpu_count()}  Python {platform.python_version()}"
          f"  best of {args.repeat} alternating rounds")
    print(f"# command: python benchmarks/bench_scaling.py {' '.join(argv if argv is not None else sys.argv[1:])}")

    miss_cases = [(1_000 // scale, None), (10_000 // scale, None), (100_000 // scale, None),
                  (100_000 // scale, 1_000_000 // scale)]
    decode_cases = [(b, c) for b in ("hash", "radix") for c in (1024, 65536 // scale)]
    algorithms = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")
    reqs = shared_prefix(random.Random(0), 400 // scale)
    miss = {c: float("inf") for c in miss_cases}
    decode = {c: float("inf") for c in decode_cases}
    per_req = {a: float("inf") for a in algorithms}
    for _ in range(args.repeat):
        for entries, pool in miss_cases:
            miss[(entries, pool)] = min(miss[(entries, pool)],
                                        radix_miss_us(entries, pool or 2 * entries + 1, 2_000 // scale))
        for case in decode_cases:
            decode[case] = min(decode[case], decode_step_us(*case, 2_000 // scale))
        for a in algorithms:
            per_req[a] = min(per_req[a], hash_request_us(a, reqs))

    base = miss[miss_cases[0]]
    print("\n| radix, misses under eviction pressure | pool blocks | µs per miss | x the 1k row |")
    print("|---|---:|---:|---:|")
    for entries, pool in miss_cases:
        us = miss[(entries, pool)]
        print(f"| {entries:,} cached entries | {pool or 2 * entries + 1:,} | {us:.1f} | {us / base:.2f} |")
    print(f"# target: 100k entries <= 2x 1k: {'met' if max(miss[c] for c in miss_cases[2:]) <= 2 * base else 'NOT met'}")

    print("\n| decode step (append + commit) | context tokens | µs per step | x the 1k row |")
    print("|---|---:|---:|---:|")
    for backend in ("hash", "radix"):
        small, big = decode[(backend, 1024)], decode[(backend, 65536 // scale)]
        print(f"| {backend} | 1,024 | {small:.2f} | 1.00 |")
        print(f"| {backend} | {65536 // scale:,} | {big:.2f} | {big / small:.2f} |")
        print(f"# target {backend}: 64k <= 2x 1k: {'met' if big <= 2 * small else 'NOT met'}")

    ref = per_req["sha256_cbor"]
    print("\n| hash algorithm | µs per request | x sha256_cbor | target |")
    print("|---|---:|---:|---|")
    for a, target in (("sha256_cbor", None), ("sha256", 1.5), ("xxhash", 1.0), ("xxhash_cbor", None)):
        ratio = per_req[a] / ref
        verdict = "-" if target is None else f"<= {target}x: {'met' if ratio <= target else 'NOT met'}"
        print(f"| {a} | {per_req[a]:.1f} | {ratio:.2f} | {verdict} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
