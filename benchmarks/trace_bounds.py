"""Reference bounds on a Mooncake trace: the infinite-cache ceiling and Belady by capacity.

Reads a Mooncake JSONL trace, expands it into a workload (`prefixcache.workloads`), and
prints, at block size 512: the ceiling under a real cache's rules (full blocks only, hit at
most len-1 tokens) for the whole trace and the last 50% of requests, the ceiling under the
published convention (partial last blocks hit too) for comparison with the paper and
`kvcache-simulator`, and Belady at each capacity, with wall time per step. Outputs are
committed and cached as the A/B replay does, unless `--no-outputs`.

    python benchmarks/trace_bounds.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl
    python benchmarks/trace_bounds.py --trace T.jsonl --capacities 3e6 1e7 --limit 1000
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import time

from prefixcache.workloads import BlockPlan, belady, infinite_cache, read_records, records_to_workload
from prefixcache.workloads.mooncake import MOONCAKE_BLOCK_SIZE, published_ceiling


def tokens(text: str) -> int:
    """A capacity in TOKENS, written as an int or like 1e6."""
    value = float(text)
    if not value.is_integer() or value < 1:
        raise argparse.ArgumentTypeError(f"capacity must be a whole number of tokens >= 1, got {text!r}")
    return int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    parser.add_argument("--capacities", type=tokens, nargs="+", default=[10**k for k in range(4, 9)],
                        help="pool sizes in TOKENS (default 1e4 1e5 1e6 1e7 1e8)")
    parser.add_argument("--limit", type=int, default=None, help="read only the first N records")
    parser.add_argument("--no-outputs", action="store_true",
                        help="replay prompts only (as the paper and kvcache-simulator do); by default each "
                             "request's output is committed too and its blocks take room")
    args = parser.parse_args()
    block = MOONCAKE_BLOCK_SIZE

    print(f"# trace_bounds: {platform.machine()} {platform.processor() or ''}, Python {platform.python_version()}")
    print(f"# command: python {shlex.join(sys.argv)}")
    t0 = time.perf_counter()
    records = read_records(args.trace, limit=args.limit)
    t_read = time.perf_counter()
    workload = records_to_workload(records, outputs=not args.no_outputs)
    plan = BlockPlan.of(workload, block)
    t_plan = time.perf_counter()
    n = len(records)
    print(f"{args.trace}: {n} requests, {workload.prompt_tokens / max(n, 1):,.0f} prompt tokens/request on average, "
          f"{plan.num_keys:,} distinct full blocks, largest request {plan.max_footprint} blocks, "
          f"outputs {'dropped' if args.no_outputs else 'committed'}")
    print(f"read {t_read - t0:.2f} s, expand + block plan {t_plan - t_read:.2f} s")

    published = published_ceiling(records)
    t1 = time.perf_counter()
    ceiling = infinite_cache(plan)
    t_ceiling = time.perf_counter() - t1
    print()
    print(f"{'bound':<34} {'capacity tokens':>15} {'blocks':>8} {'whole':>7} {'last 50%':>8} "
          f"{'evictions':>10} {'rejected':>8} {'wall s':>7}")
    print(f"{'ceiling, published convention':<34} {'inf':>15} {'inf':>8} {published[0]:>7.4f} {published[1]:>8.4f} "
          f"{'':>10} {'':>8} {'':>7}")
    print(f"{'ceiling, real cache (full blocks)':<34} {'inf':>15} {'inf':>8} {ceiling.hit_ratio:>7.4f} "
          f"{ceiling.last_half_hit_ratio:>8.4f} {0:>10} {0:>8} {t_ceiling:>7.2f}")
    for capacity in args.capacities:
        blocks = capacity // block
        if blocks < 1:
            print(f"{'belady':<34} {capacity:>15,} {'< 1 block: skipped':>27}")
            continue
        t1 = time.perf_counter()
        result = belady(plan, blocks)
        wall = time.perf_counter() - t1
        print(f"{'belady':<34} {capacity:>15,} {blocks:>8,} {result.hit_ratio:>7.4f} "
              f"{result.last_half_hit_ratio:>8.4f} "
              f"{result.evictions:>10,} {len(result.rejected):>8,} {wall:>7.2f}")
    print(f"\ntotal wall time {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
