"""Cluster A/B on a Mooncake trace, judged by what users feel: every router over N
replicas of an 8B model on one H100 each (configs/cluster_mooncake.yaml), next to the
shared cache and round robin, at one operating point or swept over arrival rate, fleet
size, slots and cache capacity.

Runs `prefixcache.cluster.sweep.sweep` (each router and the shared cache a job; `--jobs`
processes, each loading the trace once) and prints a table per point. With one point it
writes `<out>/cluster_<trace>.json`, `.csv`, `.png` (as `prefixcache cluster`); with
several, `<out>/sweep_<trace>.json`, `.csv` and `.png` (goodput, TTFT p50 / p99 and the
hit ratio / the shared cache's against the arrival rate, a row of panels per fleet), and
with several capacities `sweep_<trace>_capacity.png` (the same against the capacity).

Targets (issue 25), checked at `--target-replicas` for `--precise` (estimated_ttft) at
every point, each PASS or FAIL with its numbers:
- the best goodput, TTFT p50 and TTFT p99 of all routers (the shared cache is not a router);
- TTFT p50 within 25% of the shared cache's;
- hit ratio >= 0.97 of the shared cache's;
- goodput above every approximate router's (approx_tree, prefix_affinity) by
  `--churn-margin` (default 0.02) where caches churn: at a capacity given with
  `--churn-capacity` (default: every point's).

    python benchmarks/cluster_mooncake.py --trace ../shared/traces/mooncake_conversation_trace.jsonl --out docs
    python benchmarks/cluster_mooncake.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --rates 1 2 3 4 --capacity 440120 1000000 3000000 --jobs 2 --out out/sweep     # the knee, and churn
    python benchmarks/cluster_mooncake.py --replot out/a/sweep_x.json out/b/sweep_x.json --out out/ab
                                                  # saved sweeps' runs, together: json, csv, plots; nothing run
    python benchmarks/cluster_mooncake.py --trace ... --routers power_of_two kv_events --kv-weights 1 16 \\
        --kv-temperatures 0 0.1                                                           # Dynamo's knobs
    python benchmarks/cluster_mooncake.py --trace ... --config configs/cluster_mooncake_affinity.yaml \\
        --rates 1 2 --seed 0 1 2 --jobs 2 --out out/cm_affinity  # once a seed; ranges, and how many met each target

A p99 is one draw of a chaotic system: the routers' seed (ties, shuffles) moves a TTFT p99
by up to 0.3 s of 6.3 s on the conversation trace, so a target at the 1% level is judged
over seeds (`--seed` with several values: the files of each in `<out>/seed_N`; the run ends
with each router's range over the seeds, a markdown table per point and rate, and how many
seeds met each target).

Never commit the traces themselves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from rich.console import Console  # noqa: E402

from prefixcache.cluster.config import RouterSpec, load_cluster_config  # noqa: E402
from prefixcache.cluster.report import cluster_table, plot_capacity, plot_cluster, plot_sweep  # noqa: E402
from prefixcache.cluster.results import SHARED, ClusterResult, RunResult, write_json, write_rows_csv  # noqa: E402
from prefixcache.cluster.sweep import Job, SweepPoint, run_job, sweep  # noqa: E402
from prefixcache.percentiles import percentile  # noqa: E402
from prefixcache.tables import render  # noqa: E402
from prefixcache.workloads import Workload  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
APPROXIMATE = ("approx_tree", "prefix_affinity")
P50_WITHIN = 1.25  # of the shared cache's TTFT p50
HIT_TARGET = 0.97  # of the shared cache's hit ratio

# What forked workers read (inherited, never pickled: a config holds read-only mappings).
_workload: Workload | None = None
_jobs: list[Job] = []


def _run(k: int) -> RunResult:
    assert _workload is not None
    return run_job(_workload, _jobs[k])


def check_targets(result: ClusterResult, n: int, precise: str, *, churn: bool, margin: float) -> list[str]:
    """One line per target for the `precise` arm at n replicas, "<target>: <numbers> [PASS|FAIL ...]"."""
    runs = [r for r in result.runs if r.num_replicas == n]
    mine = next(r for r in runs if r.label == precise)
    others = [r for r in runs if r.kind == "router" and r.label != precise]
    shared = next(r for r in runs if r.kind == SHARED)

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    lines = []
    for name, key in (("goodput", "goodput"), ("TTFT p50", "ttft_p50_s"), ("TTFT p99", "ttft_p99_s")):
        value = getattr(mine, key)
        best = max(others, key=lambda r: r.goodput) if key == "goodput" else min(others, key=lambda r: getattr(r, key))
        ok = value >= best.goodput if key == "goodput" else value <= getattr(best, key)
        lines.append(f"best {name}: {value:.3f} vs the best other, {best.label} {getattr(best, key):.3f} "
                     f"[{verdict(ok)}]")
    ratio = mine.ttft_p50_s / shared.ttft_p50_s
    lines.append(f"TTFT p50 against the shared cache: {mine.ttft_p50_s:.3f} s = {ratio:.2f}x the shared cache's "
                 f"{shared.ttft_p50_s:.3f} s [{verdict(ratio <= P50_WITHIN)} <= {P50_WITHIN}]")
    share = mine.hit_ratio / shared.hit_ratio
    lines.append(f"hit ratio against the shared cache: {mine.hit_ratio:.4f} = {share:.3f} of the shared cache's "
                 f"{shared.hit_ratio:.4f} [{verdict(share >= HIT_TARGET)} >= {HIT_TARGET}]")
    if churn:
        for approx in (r for r in others if r.router in APPROXIMATE):
            gap = mine.goodput - approx.goodput
            lines.append(f"goodput against {approx.label}: {mine.goodput:.3f} vs {approx.goodput:.3f}, +{gap:.3f} "
                         f"[{verdict(gap >= margin)} >= {margin}]")
    return lines


def spread(values: list[float]) -> str:
    """The range of `values`, to 3 decimals ("a-b", or one value where both ends print alike)."""
    low, high = f"{min(values):.3f}", f"{max(values):.3f}"
    return low if low == high else f"{low}-{high}"


def seed_table(results: list[ClusterResult]) -> list[str]:
    """Markdown rows: per router, each figure's range over `results` (one per seed, same
    arms), the TTFT p99's median beside its range."""
    rows = ["| router | hit / shared | goodput | TTFT p50 s | TTFT p99 s (median) | queue p99 s |",
            "|---|---|---|---|---|---|"]
    summaries = [{r.label: r.summary() for r in at.runs} for at in results]
    shared = [next(r.hit_ratio for r in at.runs if r.kind == SHARED) for at in results]
    for label in (r.label for r in results[0].runs if r.kind == "router"):
        rows_of = [by_label[label] for by_label in summaries]
        share = [r["hit_ratio"] / s if s else float("nan") for r, s in zip(rows_of, shared)]
        p99 = [r["ttft_p99_s"] for r in rows_of]
        rows.append(f"| {label} | {spread(share)} | {spread([r['goodput'] for r in rows_of])} | "
                    f"{spread([r['ttft_p50_s'] for r in rows_of])} | {spread(p99)} ({percentile(p99, 50):.3f}) | "
                    f"{spread([r['queue_p99_s'] for r in rows_of])} |")
    return rows


def parallel(jobs_n: int, workload: Workload):
    """A `run_all` for `sweep` over `jobs_n` forked processes that share the workload."""
    def run_all(jobs: list[Job]) -> Iterable[RunResult]:
        global _workload, _jobs
        _workload, _jobs = workload, jobs
        with ProcessPoolExecutor(jobs_n, mp_context=multiprocessing.get_context("fork")) as pool:
            yield from pool.map(_run, range(len(jobs)))
    return run_all


def replot(parser: argparse.ArgumentParser, paths: list[Path], out: Path) -> int:
    """The runs of saved sweeps of one workload and SLO, together: `out`/sweep_<workload>.json,
    .csv, .png, and _capacity.png where they span several capacities."""
    saved = []
    for p in paths:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError) as err:
            parser.error(f"--replot: {p}: {err}")
        if not isinstance(data, dict) or not {"workload", "slo", "runs"} <= data.keys() or \
                not all("capacity_tokens" in r for r in data["runs"]):
            parser.error(f"--replot: {p} is not a saved sweep (sweep_<trace>.json: workload, slo and runs at "
                         f"their points; a single point's cluster_<trace>.json is not one)")
        saved.append(data)
    for p, data in zip(paths[1:], saved[1:]):
        if (data["workload"], data["slo"]) != (saved[0]["workload"], saved[0]["slo"]):
            parser.error(f"--replot: {p} is a sweep of another workload or SLO than {paths[0]}")
    data = {**saved[0], "runs": [r for d in saved for r in d["runs"]]}
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"sweep_{data['workload']['name']}"
    write_json(stem.with_suffix(".json"), data)
    write_rows_csv(stem.with_suffix(".csv"), data["runs"])
    plot_sweep(data, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .csv, .png")
    if len({r["capacity_tokens"] for r in data["runs"]}) > 1:
        plot_capacity(data, out / f"{stem.name}_capacity.png")
        print(f"wrote {stem}_capacity.png")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="a Mooncake JSONL trace (required unless --replot)")
    parser.add_argument("--replot", type=Path, nargs="+", metavar="SWEEP_JSON",
                        help="saved sweeps (sweep_<trace>.json) of one workload: their runs together in --out "
                             "(json, csv and plots; nothing is run)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "cluster_mooncake.yaml"))
    parser.add_argument("--replicas", type=int, nargs="+", help="fleet sizes N (default: the config's)")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0],
                        help="arrival speed-ups: 2 replays the trace at twice its rate")
    parser.add_argument("--slots", type=int, nargs="+", help="max_num_seqs per replica (default: the config's)")
    parser.add_argument("--capacity", type=int, nargs="+", help="TOKENS of cache per replica (default: the config's)")
    parser.add_argument("--routers", nargs="+", help="keep only these arms of the config (labels)")
    parser.add_argument("--kv-weights", type=float, nargs="+", help="replace the kv_events arms: one per weight")
    parser.add_argument("--kv-temperatures", type=float, nargs="+", default=[0.0],
                        help="with --kv-weights: an arm per weight and temperature")
    parser.add_argument("--set", dest="options", action="append", default=[], metavar="LABEL.OPTION=VALUE",
                        help="an arm's option (a YAML value), e.g. estimated_ttft.load_weight=2")
    parser.add_argument("--seed", type=int, nargs="+",
                        help="every router's random source (default: the config's); several: the sweep once "
                             "a seed, its files in <out>/seed_N, and how many seeds met each target")
    parser.add_argument("--precise", default="estimated_ttft", help="the arm the targets are checked for")
    parser.add_argument("--target-replicas", type=int, default=8)
    parser.add_argument("--churn-capacity", type=int, nargs="+",
                        help="capacities where caches churn (the approximate-router target; default: every point's)")
    parser.add_argument("--churn-margin", type=float, default=0.02)
    parser.add_argument("--jobs", type=int, default=1, help="processes (forked: they share the trace)")
    parser.add_argument("--out", default="out/cluster_mooncake")
    args = parser.parse_args()
    if args.replot is not None:
        return replot(parser, args.replot, Path(args.out))
    if args.trace is None:
        parser.error("--trace is required (or --replot SWEEP_JSON)")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {cpu_model()}  python {platform.python_version()}"
          f"  loadavg {' '.join(open('/proc/loadavg').read().split()[:3]) if os.path.exists('/proc/loadavg') else '?'}")
    print(f"# python benchmarks/cluster_mooncake.py {shlex.join(sys.argv[1:])}")
    config = load_cluster_config(args.config, trace=args.trace)
    if args.routers:
        unknown = sorted(set(args.routers) - set(config.routers))
        if unknown:
            parser.error(f"--routers: {', '.join(unknown)} not in {args.config} (its arms: {', '.join(config.routers)})")
        config = dataclasses.replace(config, routers={k: config.routers[k] for k in args.routers})
    if args.kv_weights:
        routers = {label: s for label, s in config.routers.items() if s.router != "kv_events"}
        for w in args.kv_weights:
            for t in args.kv_temperatures:
                label = f"kv_events/w{w:g}" + (f"/t{t:g}" if t else "")
                routers[label] = RouterSpec("kv_events", {"overlap_score_weight": w, "temperature": t})
        config = dataclasses.replace(config, routers=routers)
    for option in args.options:
        key, _, value = option.partition("=")
        label, _, name = key.rpartition(".")
        if label not in config.routers or not name or not value:
            parser.error(f"--set {option!r}: expected LABEL.OPTION=VALUE with a label among {', '.join(config.routers)}")
        spec = config.routers[label]
        routers = dict(config.routers)
        routers[label] = RouterSpec(spec.router, {**spec.options, name: yaml.safe_load(value)})
        config = dataclasses.replace(config, routers=routers)
    points = [SweepPoint(n, s, c) for n in (args.replicas or config.replicas)
              for s in (args.slots or [config.service.max_num_seqs])
              for c in (args.capacity or [config.capacity_tokens])]
    t0 = time.perf_counter()
    workload = config.workload.build()
    print(f"# {workload.name}: {len(workload):,} requests; {len(config.routers)} routers + the shared cache at "
          f"{len(points)} point(s) x {len(args.rates)} rate(s); {args.jobs} process(es)", flush=True)
    run_all = parallel(args.jobs, workload) if args.jobs > 1 else None
    seeds = args.seed or [config.seed]
    verdicts: dict[tuple[str, str], list[bool]] = {}  # (the point and rate, the target) -> met, per seed
    by_point: dict[str, list[ClusterResult]] = {}  # the point and rate -> its result, per seed
    for seed in seeds:
        if len(seeds) > 1:
            print(f"\n# seed {seed}", flush=True)
        out = Path(args.out) / f"seed_{seed}" if len(seeds) > 1 else Path(args.out)
        seeded = dataclasses.replace(config, seed=seed)
        result = sweep(seeded, workload, points, args.rates, run_all=run_all)
        for where, line in report(result, args):
            verdicts.setdefault((where, line.partition(":")[0]), []).append("[PASS" in line)
        for point, speedup, rate, at in result.runs:
            by_point.setdefault(describe(point, speedup, rate), []).append(at)
        stem = write(result, points, out, Path(args.trace).stem)
    if len(seeds) > 1:
        for where, results in by_point.items():
            print(f"\nover seeds {', '.join(map(str, seeds))}, {where}:")
            print("\n".join(seed_table(results)))
        print(f"\ntargets over seeds {', '.join(map(str, seeds))} (met in how many):")
        for where in dict.fromkeys(w for w, _ in verdicts):
            print(f"  {where}")
            for (w, target), met in verdicts.items():
                if w == where:
                    print(f"    {target}: {sum(met)} of {len(met)}")
    print(f"\nwrote {stem}.csv, .json, .png{' (one folder a seed)' if len(seeds) > 1 else ''}; "
          f"{time.perf_counter() - t0:.0f} s in all")
    return 0


def describe(point: SweepPoint, speedup: float, rate: float) -> str:
    """A point and rate of the sweep, as its table's heading names it."""
    return f"{point.describe()}; {speedup:g}x the trace's rate ({rate:.2f} requests/s)"


def report(result, args) -> list[tuple[str, str]]:
    """Print a table per point and rate, and the targets where they are checked; returns
    (the point and rate, a target's line) for each target checked."""
    console = Console(width=230)
    checked = []
    for point, speedup, rate, at in result.runs:
        where = describe(point, speedup, rate)
        print(f"\n## {where}")
        console.print(render(cluster_table(at), "table", 230))
        if point.replicas != args.target_replicas:
            continue
        if not any(r.label == args.precise for r in at.runs):
            print(f"targets: none checked (no arm {args.precise})")
            continue
        churn = args.churn_capacity is None or point.capacity_tokens in args.churn_capacity
        print("targets:")
        for line in check_targets(at, point.replicas, args.precise, churn=churn, margin=args.churn_margin):
            print("  " + line)
            checked.append((where, line))
    return checked


def write(result, points: list[SweepPoint], out: Path, trace: str) -> Path:
    """The sweep's files in `out` (module docstring); returns their stem."""
    out.mkdir(parents=True, exist_ok=True)
    if len(result.runs) == 1:
        stem = out / f"cluster_{trace}"
        at = result.runs[0][3]
        at.write_csv(stem.with_suffix(".csv"))
        at.write_json(stem.with_suffix(".json"))
        plot_cluster(at, stem.with_suffix(".png"))
    else:
        stem = out / f"sweep_{trace}"
        result.write_csv(stem.with_suffix(".csv"))
        result.write_json(stem.with_suffix(".json"))
        plot_sweep(result, stem.with_suffix(".png"))
        if len({p.capacity_tokens for p in points}) > 1:
            plot_capacity(result, out / f"sweep_{trace}_capacity.png")
    return stem


if __name__ == "__main__":
    sys.exit(main())
