"""Cluster A/B on a Mooncake trace: every router over N replicas of 3M tokens (512-token
blocks), next to one shared cache of N x 3M tokens (the hit ceiling) and round robin.

Runs `prefixcache.cluster.run_cluster` with configs/cluster_mooncake.yaml (service model
and routers there; `--kv-weights` replaces its kv_events arms by one per
overlap_score_weight, and per temperature with `--kv-temperatures`; `--routers` keeps
only the config's arms named) on `--trace`, prints the table, checks the targets at
`--target-replicas` (kv_events within 5% of the shared cache's hit ratio,
relative, and its TTFT p99 no worse than power_of_two's) for every kv_events arm, and
writes `<out>/cluster_<trace>.csv`, `.json` and `.png` (hit ratio and TTFT vs N).

    python benchmarks/cluster_mooncake.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --replicas 2 4 8 16 --out docs
    python benchmarks/cluster_mooncake.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --replicas 8 --routers power_of_two --kv-weights 1 4 16 64 --kv-temperatures 0 0.1   # a sweep

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from rich.console import Console  # noqa: E402

from prefixcache.cluster.config import RouterSpec, load_cluster_config  # noqa: E402
from prefixcache.cluster.report import cluster_table, plot_cluster  # noqa: E402
from prefixcache.tables import render  # noqa: E402
from prefixcache.cluster.simulate import SHARED, ClusterResult, run_cluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HIT_TARGET = 0.95  # of the shared cache's hit ratio


def check_targets(result: ClusterResult, n: int) -> list[str]:
    """One line per kv_events arm at n replicas: its hit ratio against the ceiling and its
    TTFT p99 against power_of_two's, each PASS or FAIL."""
    shared = result.run(SHARED, n)
    p2c = next((r for r in result.runs if r.router == "power_of_two" and r.num_replicas == n), None)
    lines = []
    for run in (r for r in result.runs if r.router == "kv_events" and r.num_replicas == n):
        share = run.hit_ratio / shared.hit_ratio
        line = (f"{run.label} at N={n}: hit ratio {run.hit_ratio:.4f} = {share:.3f} of the shared cache's "
                f"{shared.hit_ratio:.4f} [{'PASS' if share >= HIT_TARGET else 'FAIL'} >= {HIT_TARGET}]")
        if p2c is not None:
            ok = run.ttft_p99_s <= p2c.ttft_p99_s
            line += (f"; TTFT p99 {run.ttft_p99_s:.3f} s vs power_of_two {p2c.ttft_p99_s:.3f} s "
                     f"[{'PASS' if ok else 'FAIL'}]")
        lines.append(line)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="a Mooncake JSONL trace")
    parser.add_argument("--config", default=str(ROOT / "configs" / "cluster_mooncake.yaml"))
    parser.add_argument("--replicas", type=int, nargs="+", default=[8])
    parser.add_argument("--target-replicas", type=int, default=8)
    parser.add_argument("--kv-weights", type=float, nargs="+", help="kv_events arms, one per overlap_score_weight")
    parser.add_argument("--kv-temperatures", type=float, nargs="+", default=[0.0],
                        help="with --kv-weights: an arm per weight and temperature")
    parser.add_argument("--routers", nargs="+", help="keep only these arms of the config (labels)")
    parser.add_argument("--out", default="out/cluster_mooncake")
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu_model()}  python {platform.python_version()}")
    print(f"# python benchmarks/cluster_mooncake.py {shlex.join(sys.argv[1:])}")
    config = load_cluster_config(args.config, trace=args.trace).with_replicas(tuple(args.replicas))
    if args.routers:
        unknown = sorted(set(args.routers) - set(config.routers))
        if unknown:
            parser.error(f"--routers: {', '.join(unknown)} not in {args.config} "
                         f"(its arms: {', '.join(config.routers)})")
        config = dataclasses.replace(config, routers={k: config.routers[k] for k in args.routers})
    if args.kv_weights:
        routers = {label: s for label, s in config.routers.items() if s.router != "kv_events"}
        for w in args.kv_weights:
            for t in args.kv_temperatures:
                label = f"kv_events/w{w:g}" + (f"/t{t:g}" if t else "")
                routers[label] = RouterSpec("kv_events", {"overlap_score_weight": w, "temperature": t})
        config = dataclasses.replace(config, routers=routers)
    t0 = time.perf_counter()
    workload = config.workload.build()
    print(f"# {workload.name}: {len(workload):,} requests; {len(config.routers)} routers + the shared cache "
          f"x N = {', '.join(map(str, config.replicas))}")

    def progress(label: str, done: int, total: int) -> None:
        if done == total:
            print(f"  {label}: done at {time.perf_counter() - t0:.0f} s", flush=True)

    result = run_cluster(config, workload, progress=progress)
    Console(width=200).print(render(cluster_table(result), "table", 200))
    if args.target_replicas in config.replicas:
        print("\ntargets:")
        for line in check_targets(result, args.target_replicas):
            print("  " + line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"cluster_{Path(args.trace).stem}"
    result.write_csv(out / f"{stem}.csv")
    result.write_json(out / f"{stem}.json")
    plot_cluster(result, out / f"{stem}.png")
    print(f"wrote {out / stem}.csv, .json, .png; {time.perf_counter() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
