"""Tier residency rebuilt from KV events, at scale: 10^6 random operations per strategy
through a cache with two lower tiers, every event batch carried over vLLM's wire format
to a `KVIndex(lower_media=...)`, and the index compared with the cache on every medium
after every operation (`prefixcache.cluster.tier_soak`). Zero divergence is the target;
the first one stops the run and names the operation.

    python benchmarks/soak_tier_events.py [--operations 1000000] [--check-every 1]
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache.cluster.tier_soak import soak_tier_events
from prefixcache.config import CacheConfig
from prefixcache.tier_config import TierConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--operations", type=int, default=1_000_000)
    parser.add_argument("--check-every", type=int, default=1, help="operations between full comparisons")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", nargs="+", default=["hash", "radix"])
    args = parser.parse_args()
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"# tier event soak, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()}, Python {platform.python_version()}, "
          f"load {load}")
    print(f"# command: python {shlex.join(sys.argv)}")
    for backend in args.backends:
        config = CacheConfig(backend=backend, block_size=4, num_blocks=32,
                             tiers=(TierConfig("CPU", 24), TierConfig("CPU", 48, eviction="chain")))  # fmt: skip
        t0 = time.perf_counter()
        r = soak_tier_events(config, args.operations, seed=args.seed, check_every=args.check_every)
        print(f"{backend}: {r.operations:,} operations, {r.events:,} events over the wire, {r.checks:,} full "
              f"comparisons, {r.tier_hits:,} admissions loaded from a lower tier, {r.stored_lower:,} lower-tier "
              f"BlockStored: zero divergence ({time.perf_counter() - t0:.0f} s)", flush=True)
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"# done, load {load}")


if __name__ == "__main__":
    main()
