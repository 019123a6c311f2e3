"""Eviction policies on the Mooncake traces: gslru against LRU and Belady, both strategies.

Sweep (default): `configs/mooncake_policies.yaml` (hash/512 and radix/512, each with lru
and gslru; prompts only, as the paper) over 10^4 ... 10^8 tokens of pool, next to
Belady at the same capacity. Per trace and capacity it prints the token hit ratio of the
whole trace and of its last 50% of requests, gslru's gain over its strategy's LRU, and
at every capacity the share of the LRU -> Belady gap it recovers; then the worst loss
against LRU anywhere (the target: none worse than -0.005) and the 3M-token verdict (the
target: a third of the gap on both traces).

Attempts (--attempts): the policies tried on the way, as real `EvictionPolicy` classes
(below) replayed through hash/512 at one capacity (default 3M tokens), so the table of
what was tried is measured by the same runner.

    python benchmarks/bench_eviction.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        ../shared/traces/mooncake_synthetic_trace.jsonl [--attempts] [--out docs]

Never commit the traces themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache import CacheConfig
from prefixcache.ab import ABResult, run_ab, sweep
from prefixcache.ab_config import load_ab_config, parse_tokens
from prefixcache.eviction import GSLRU, EvictionPolicy

ROOT = Path(__file__).resolve().parent.parent
CAPACITIES = (10_000, 100_000, 1_000_000, 3_000_000, 10_000_000, 30_000_000, 100_000_000)
TARGET_SHARE, MAX_LOSS = 1 / 3, 0.005


# ------------------------------------------------------------ policies tried on the way


class SGLangSLRU(EvictionPolicy):
    """SGLang's segmented LRU: hit twice or more is protected; no history."""

    def priority(self, c: Any) -> Any:
        return (c.hit_count >= 2, c.last_access_time)


class ProtectNoHistory(GSLRU):
    """Protect reused content (no size term), forgetting it once evicted."""

    size_weight, history = 0, 0


class ProtectOnly(GSLRU):
    """Protect reused content, counting uses across evictions (ghost), no size term."""

    size_weight = 0


class SizeOnly(GSLRU):
    """Only the size term: large one-off requests go first."""

    protect_tokens = 0


class StrictWhale(EvictionPolicy):
    """Strict segments: one-off content by size (largest first), then reused by LRU."""

    history = 4

    def priority(self, c: Any) -> Any:
        if c.use_count >= 2:
            return (1, 0, c.last_use)
        return (0, -c.request_tokens, c.last_use)


class GSLRUNoHistory(GSLRU):
    history = 0


class GSLRUProtect5M(GSLRU):
    protect_tokens = 5_000_000


class GSLRUProtect20M(GSLRU):
    protect_tokens = 20_000_000


class GSLRUSize75(GSLRU):
    size_weight = 75


class GSLRUSize300(GSLRU):
    size_weight = 300


ATTEMPTS = [
    ("lru", "lru", "the free queue (baseline)"),
    ("lfu", "lfu", "fewest hits first, then LRU"),
    ("fifo", "fifo", "oldest cached first"),
    ("slru", "__main__:SGLangSLRU", "SGLang's SLRU: hit_count >= 2 protected, no history"),
    ("protect-no-history", "__main__:ProtectNoHistory", "reused protected by 10M tokens of traffic, no ghost"),
    ("protect+ghost", "__main__:ProtectOnly", "the same, use counts kept across evictions (ghost 4x pool)"),
    ("size-only", "__main__:SizeOnly", "one-off content earlier by 150 tokens of traffic per prompt token"),
    ("strict-whale", "__main__:StrictWhale", "one-off content first, largest request first; then reused, LRU"),
    ("gslru-no-history", "__main__:GSLRUNoHistory", "gslru without the ghost table"),
    ("gslru", "gslru", "protect 10M + size 150 + ghost 4x pool (the shipped defaults)"),
    ("gslru-protect-5M", "__main__:GSLRUProtect5M", "sensitivity"),
    ("gslru-protect-20M", "__main__:GSLRUProtect20M", "sensitivity"),
    ("gslru-size-75", "__main__:GSLRUSize75", "sensitivity"),
    ("gslru-size-300", "__main__:GSLRUSize300", "sensitivity"),
]


def share(value: float, lru: float, belady: float) -> float:
    """The share of the LRU -> Belady gap that `value` recovers."""
    return (value - lru) / (belady - lru) if belady > lru else 0.0


def run_sweep(path: Path, capacities: tuple[int, ...], out: Path | None) -> dict[str, Any]:
    config = load_ab_config(ROOT / "configs" / "mooncake_policies.yaml").with_trace(path)
    print(f"\n== {path.name}: sweep, prompts only, block 512 (whole trace / last 50% of requests)")
    print(f"{'capacity':>11} {'blocks':>7} | {'hash lru':>15} {'hash gslru':>15} {'gain':>15} | "
          f"{'radix lru':>15} {'radix gslru':>15} {'gain':>15} | {'belady':>15} | {'gap share (hash/radix)':>22}")
    worst: list[tuple[float, str]] = []
    at3m: dict[str, float] = {}

    def show(result: ABResult) -> None:
        b = result.bound("belady", 512)
        cells, shares = [], []
        for backend in ("hash", "radix"):
            lru, gslru = result.arm(f"{backend}/lru"), result.arm(f"{backend}/gslru")
            gains = (gslru.hit_ratio - lru.hit_ratio, gslru.last_half_hit_ratio - lru.last_half_hit_ratio)
            cells.append(f"{lru.hit_ratio:.4f}/{lru.last_half_hit_ratio:.4f} "
                         f"{gslru.hit_ratio:.4f}/{gslru.last_half_hit_ratio:.4f} {gains[0]:+.4f}/{gains[1]:+.4f}")
            worst.append((min(gains), f"{backend} at {result.capacity_tokens:,}"))
            s = share(gslru.hit_ratio, lru.hit_ratio, b.hit_ratio)
            shares.append(f"{s:.0%}" if b.hit_ratio > lru.hit_ratio + 1e-9 else "-")
            if result.capacity_tokens == 3_000_000:
                at3m[backend] = s
                at3m[backend + "_last50"] = share(gslru.last_half_hit_ratio, lru.last_half_hit_ratio,
                                                  b.last_half_hit_ratio)
        print(f"{result.capacity_tokens:>11,} {result.capacity_tokens // 512:>7,} | {cells[0]} | {cells[1]} | "
              f"{b.hit_ratio:.4f}/{b.last_half_hit_ratio:.4f} | {' / '.join(shares):>22}", flush=True)

    swept = sweep(config, capacities, on_result=show)
    loss, where = min(worst)
    print(f"worst change vs LRU (whole or last 50%, either strategy): {loss:+.4f} ({where}) -> "
          f"{'ok' if loss >= -MAX_LOSS else 'LOSES MORE THAN 0.005'}")
    if at3m:
        print("at 3M tokens, share of the LRU->Belady gap recovered (whole / last 50%): "
              + ", ".join(f"{k} {at3m[k]:.1%} / {at3m[k + '_last50']:.1%}" for k in ("hash", "radix"))
              + f" -> {'target met' if min(at3m['hash'], at3m['radix']) >= TARGET_SHARE else 'target (1/3) NOT met'}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        swept.write_csv(out / f"eviction_{path.stem}.csv")
        print(f"wrote {out / f'eviction_{path.stem}.csv'}")
    return at3m


def run_attempts(path: Path, capacity: int) -> None:
    base = load_ab_config(ROOT / "configs" / "mooncake_policies.yaml").with_trace(path)
    arms = {name: CacheConfig(backend="hash", block_size=512, enable_events=False, eviction=spec)
            for name, spec, _ in ATTEMPTS}
    config = dataclasses.replace(base, arms=arms, capacity_tokens=capacity)
    t0 = time.perf_counter()
    result = run_ab(config)
    b = result.bound("belady", 512)
    lru = result.arm("lru")
    print(f"\n== {path.name}: attempts on hash/512 at {capacity:,} tokens ({time.perf_counter() - t0:.0f} s); "
          f"Belady {b.hit_ratio:.4f} / {b.last_half_hit_ratio:.4f}")
    print(f"{'policy':<20} {'whole':>7} {'last50':>7} {'vs lru':>8} {'gap share':>9}  what")
    for name, _, what in ATTEMPTS:
        a = result.arm(name)
        print(f"{name:<20} {a.hit_ratio:>7.4f} {a.last_half_hit_ratio:>7.4f} {a.hit_ratio - lru.hit_ratio:>+8.4f} "
              f"{share(a.hit_ratio, lru.hit_ratio, b.hit_ratio):>9.1%}  {what}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, nargs="+", required=True, help="Mooncake JSONL trace(s)")
    parser.add_argument("--capacities", type=parse_tokens, nargs="+", default=list(CAPACITIES), help="TOKENS")
    parser.add_argument("--attempts", action="store_true", help="also replay every policy tried, on hash/512")
    parser.add_argument("--attempts-capacity", type=parse_tokens, default=3_000_000, help="TOKENS")
    parser.add_argument("--no-sweep", action="store_true", help="only the attempts")
    parser.add_argument("--out", type=Path, default=None, help="folder for eviction_<trace>.csv")
    args = parser.parse_args()
    print(f"# eviction benchmark, {time.strftime('%Y-%m-%d')}: {cpu_model()}, Python {platform.python_version()}")
    print(f"# command: python {shlex.join(sys.argv)}")
    for path in args.trace:
        if not args.no_sweep:
            run_sweep(path, tuple(args.capacities), args.out)
        if args.attempts:
            run_attempts(path, args.attempts_capacity)


if __name__ == "__main__":
    main()
