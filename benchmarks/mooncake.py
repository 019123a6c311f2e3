"""Replay the Mooncake traces through hash/512 and radix/512 at capacities 1e4..1e8 tokens,
next to the ceiling and Belady, and check the published figures.

Reads each `--trace` (Mooncake JSONL), runs `prefixcache.ab.sweep` with the arms of
`configs/mooncake.yaml` (LRU, events off, prompts only as the paper's replay unless
`--outputs`), and prints per capacity the token hit ratio of the whole trace and of its
last 50% of requests, evictions and wall time; then both ceilings (a real cache's, and the
published convention where partial blocks count and a whole prompt may hit), the checks
against the Mooncake paper (FAST'25, Fig. 9 and Table 2; see ../shared/traces/README.md),
the replay cost per million requests, and, when `kvcache-simulator` is installed (a dev
dependency), its LRU under the published convention, for the whole trace and its last 50%.
Writes `<out>/mooncake_<trace>.png` (hit ratio vs capacity, published points marked) and
`<out>/mooncake_<trace>.csv`.

    python benchmarks/mooncake.py --trace ../shared/traces/mooncake_synthetic_trace.jsonl \\
        ../shared/traces/mooncake_conversation_trace.jsonl --out docs

Never commit the traces themselves.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache.ab import ABResult, sweep
from prefixcache.ab_config import load_ab_config, parse_tokens
from prefixcache.workloads import MooncakeRecord, read_records, records_to_workload
from prefixcache.workloads.mooncake import published_ceiling

ROOT = Path(__file__).resolve().parent.parent

# Published figures, whole trace, prompts only, LRU, 512-token blocks: the Mooncake paper's
# Fig. 9 (hit ratio at 3M and 10M tokens of cache) and Table 2 / Fig. 9 plateau (the
# infinite-cache ratio); and, from ../shared/traces/README.md, LRU at
# 3M tokens as a fraction of the theoretical maximum. Keyed by the trace file's stem.
PUBLISHED: dict[str, dict[str, object]] = {
    "mooncake_synthetic_trace": {"lru": {3_000_000: 0.315, 10_000_000: 0.577}, "plateau": 0.651,
                                 "fraction_at_3m": 0.46},
    "mooncake_conversation_trace": {"lru": {}, "plateau": 0.374, "fraction_at_3m": 0.41},
}
TOLERANCE = 0.02  # published figures are read off a plot / rounded
LRU_VARIANTS_TOLERANCE = 0.002  # hash (vLLM free queue) vs radix (SGLang leaf LRU) at 3M tokens


def simulator_lru(records: list[MooncakeRecord], capacity_blocks: int) -> tuple[float, float | None] | None:
    """kvcache-simulator's LRU hit ratio (whole trace, last 50%) at `capacity_blocks`, under
    its convention (every hash id a block, the partial last one included; no len-1 cap);
    None when it is not installed (`pip install -e '.[dev]'`).

    The simulator measures only the last 50% of requests, and only once the cache has
    filled. For the whole trace, `n` requests of fresh junk blocks (at least the capacity
    in all) go first and are the warm-up half: LRU evicts every junk block before any real
    one, so the real requests see exactly what an empty cache of that size would give."""
    try:
        from kvcache_sim.plan import build_execution_plan
        from kvcache_sim.policies import simulate_policy
        from kvcache_sim.trace import parse_trace_lines
    except ImportError:
        return None
    real = [r.to_json() for r in records]
    n = len(real)
    per = -(-capacity_blocks // n)
    junk = [json.dumps({"hash_ids": [f"junk{i}.{j}" for j in range(per)], "input_length": per * 512})
            for i in range(n)]
    padded = simulate_policy(build_execution_plan(parse_trace_lines(junk + real, block_size=512)), "lru",
                             capacity_blocks)
    assert padded.measurementMode == "fixed_window" and padded.warmupRequests == n
    native = simulate_policy(build_execution_plan(parse_trace_lines(real, block_size=512)), "lru", capacity_blocks)
    return padded.hitRate, (native.hitRate if native.measurementMode == "fixed_window" else None)


def verdict(ok: bool) -> str:
    return "ok" if ok else "NOT REPRODUCED"


def report_checks(
    stem: str, results: dict[int, ABResult], published: tuple[float, float],
    sims: dict[int, tuple[float, float | None] | None],
) -> list[str]:
    """Lines comparing our figures with the published ones; each ends in ok / NOT REPRODUCED.
    `sims` holds kvcache-simulator's LRU (whole, last 50%) per capacity, under the published
    convention, to show where a difference comes from."""
    ref = PUBLISHED.get(stem)
    if ref is None:
        return [f"no published figures for {stem!r}; known: {', '.join(PUBLISHED)}"]
    lines = []
    largest = results[max(results)]
    ceiling = largest.bound("infinite", 512).hit_ratio
    plateau = float(ref["plateau"])  # type: ignore[arg-type]
    lines.append(f"plateau (whole trace): published {plateau:.3f}; ours: ceiling {ceiling:.4f} (real cache), "
                 f"{published[0]:.4f} (published convention); LRU at {max(results):,} tokens "
                 + ", ".join(f"{a.name} {a.hit_ratio:.4f}" for a in largest.arms)
                 + f" -> {verdict(abs(ceiling - plateau) <= TOLERANCE)}")
    for capacity, value in ref["lru"].items():  # type: ignore[union-attr]
        if capacity not in results:
            lines.append(f"LRU at {capacity:,} tokens: published {value:.3f}; not run (add it to --capacities)")
            continue
        arms = results[capacity].arms
        ok = all(abs(a.hit_ratio - value) <= TOLERANCE for a in arms)
        sim = sims.get(capacity)
        lines.append(f"LRU at {capacity:,} tokens (whole trace): published {value:.3f}; ours "
                     + ", ".join(f"{a.name} {a.hit_ratio:.4f} ({a.hit_ratio - value:+.4f})" for a in arms)
                     + (f"; kvcache-simulator (published convention) {sim[0]:.4f}" if sim else "")
                     + f" -> {verdict(ok)}")
    fraction = ref.get("fraction_at_3m")
    if fraction is not None and 3_000_000 in results:
        expected = float(fraction) * published[0]  # type: ignore[arg-type]
        arms = results[3_000_000].arms
        ok = all(abs(a.hit_ratio - expected) <= TOLERANCE for a in arms)
        sim = sims.get(3_000_000)
        lines.append(f"LRU at 3,000,000 tokens as a fraction of the maximum: published {fraction:.0%} "
                     f"(= {expected:.4f} of {published[0]:.4f}); ours "
                     + ", ".join(f"{a.name} {a.hit_ratio / published[0]:.1%} = {a.hit_ratio:.4f} "
                                 f"({a.hit_ratio - expected:+.4f})" for a in arms)
                     + (f"; kvcache-simulator {sim[0] / published[0]:.1%} = {sim[0]:.4f}" if sim else "")
                     + f" -> {verdict(ok)}")
    if 3_000_000 in results and len(results[3_000_000].arms) == 2:
        a, b = results[3_000_000].arms
        gap = abs(a.hit_ratio - b.hit_ratio)
        lines.append(f"LRU variants at 3,000,000 tokens: {a.name} {a.hit_ratio:.4f} vs {b.name} {b.hit_ratio:.4f}, "
                     f"|diff| {gap:.4f} (<= {LRU_VARIANTS_TOLERANCE}) -> {verdict(gap <= LRU_VARIANTS_TOLERANCE)}")
    return lines


def run_trace(path: Path, args: argparse.Namespace) -> None:
    config = load_ab_config(args.config).with_trace(path)
    capacities = tuple(args.capacities or config.sweep_capacities)
    t0 = time.perf_counter()
    records = read_records(path, limit=args.limit)
    workload = records_to_workload(records, name=path.stem, outputs=args.outputs)
    published = published_ceiling(records)
    n = len(workload)
    print(f"\n== {path.name}: {n:,} requests, {workload.prompt_tokens / n:,.0f} prompt tokens/request, "
          f"outputs {'committed' if args.outputs else 'dropped (prompts only, as the paper)'}; "
          f"read {time.perf_counter() - t0:.1f} s")
    arm_names = list(config.arms)
    head = f"{'capacity tokens':>15} {'blocks':>7} " + " ".join(f"{name + ' whole/last50':>24}" for name in arm_names)
    print(head + f" {'belady whole/last50':>21} {'kvsim LRU whole/last50':>23} {'evicted blocks (arms)':>22} "
          f"{'replay s (arms)':>16}")
    results: dict[int, ABResult] = {}
    sims: dict[int, tuple[float, float | None] | None] = {}

    def show(result: ABResult) -> None:
        results[result.capacity_tokens] = result
        b = result.bound("belady", 512)
        cells = " ".join(f"{a.hit_ratio:>11.4f} / {a.last_half_hit_ratio:.4f}" for a in result.arms)
        evicted = "/".join(f"{a.evicted_blocks:,}" for a in result.arms)
        wall = "/".join(f"{a.wall_s:.1f}" for a in result.arms)
        rejected = f"  ({len(b.rejected):,} requests larger than the pool)" if b.rejected else ""
        sim = sims[result.capacity_tokens] = None if args.no_simulator else simulator_lru(
            records, result.capacity_tokens // 512)
        sim_cell = "-" if sim is None else f"{sim[0]:.4f} / " + ("-" if sim[1] is None else f"{sim[1]:.4f}")
        print(f"{result.capacity_tokens:>15,} {result.capacity_tokens // 512:>7,} {cells} "
              f"{b.hit_ratio:>10.4f} / {b.last_half_hit_ratio:.4f} {sim_cell:>23} {evicted:>22} {wall:>16}{rejected}",
              flush=True)

    t1 = time.perf_counter()
    swept = sweep(config, capacities, workload, on_result=show)
    total = time.perf_counter() - t1
    ceiling = results[capacities[-1]].bound("infinite", 512)
    print(f"ceiling: {ceiling.hit_ratio:.4f} / {ceiling.last_half_hit_ratio:.4f} "
          "(real cache: full blocks, hit <= len-1); "
          f"{published[0]:.4f} / {published[1]:.4f} (published convention: partial blocks count, whole prompt may hit)")
    for line in report_checks(path.stem, results, published, sims):
        print("check: " + line)
    at = results.get(3_000_000) or results[capacities[len(capacities) // 2]]
    for name in arm_names:
        arm = at.arm(name)
        print(f"cost {name} at {at.capacity_tokens:,} tokens: {arm.wall_s / n * 1e6:,.0f} s per million requests "
              f"(replay wall time, token lists included); bookkeeping p50 {arm.us_p50:.0f} µs, "
              f"p99 {arm.us_p99:.0f} µs per request")
    print(f"sweep wall time {total:.1f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    swept.write_csv(out / f"{path.stem}.csv")
    ref = PUBLISHED.get(path.stem, {"lru": {}, "plateau": None})
    marks = [(f"paper {v:.3f}", c, v) for c, v in ref["lru"].items()]  # type: ignore[union-attr]
    if ref.get("fraction_at_3m") is not None:
        share = float(ref["fraction_at_3m"])  # type: ignore[arg-type]
        marks.append((f"{share:.0%} of max", 3_000_000, share * published[0]))
    if ref["plateau"] is not None:
        marks.append((f"paper plateau {ref['plateau']:.3f}", capacities[-1], float(ref["plateau"])))  # type: ignore
    try:
        from prefixcache.ab_report import plot_sweep

        plot_sweep(swept, out / f"{path.stem}.png", marks,
                   title=f"{path.name}: {n:,} requests, 512-token blocks, LRU vs bounds (x: published)")
        print(f"wrote {out / (path.stem + '.png')} and {out / (path.stem + '.csv')}")
    except ImportError as err:
        print(f"wrote {out / (path.stem + '.csv')}; no plot: {err}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, nargs="+", required=True, help="Mooncake JSONL trace(s)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "mooncake.yaml"), help="A/B config with the arms")
    parser.add_argument("--capacities", type=parse_tokens, nargs="+",
                        help="pool sizes in TOKENS (default: the config's sweep_capacities, 1e4 ... 1e8)")
    parser.add_argument("--outputs", action="store_true",
                        help="commit each request's output too (fresh tokens that take room, as an engine would)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N records")
    parser.add_argument("--out", default="docs", help="folder for the PNG and CSV of each trace")
    parser.add_argument("--no-simulator", action="store_true",
                        help="skip the kvcache-simulator column (it runs when the package is installed)")
    args = parser.parse_args()
    print(f"# mooncake benchmark, {time.strftime('%Y-%m-%d')}: {cpu_model()}, Python {platform.python_version()}")
    print(f"# command: python {shlex.join(sys.argv)}")
    for path in args.trace:
        run_trace(path, args)


if __name__ == "__main__":
    main()
