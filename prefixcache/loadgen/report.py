"""What a `prefixcache bench` run prints and writes.

Owns the terminal table (rich) of a `BenchSummary`, and the JSON file: `metadata`
(prefixcache version, git commit, UTC date, host, CPU, Python, the command line, every
option, the seed, the model, why the run stopped early if it did), `summary` (the
`BenchSummary` with its throughputs and hit ratio) and `requests` (one object per
finished or failed request). Latencies print in milliseconds; the JSON keeps SECONDS.

Must never: compute a statistic (summary does) or send anything.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

import prefixcache
from prefixcache.loadgen.options import BenchOptions
from prefixcache.loadgen.runner import RunResult
from prefixcache.loadgen.summary import BenchSummary
from prefixcache.machine import cpu_model

__all__ = ["summary_tables", "metadata", "write_json"]


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.1f}"


def summary_tables(summary: BenchSummary, run: RunResult, options: BenchOptions) -> tuple[Table, Table]:
    """The run's totals, and its latencies (mean, median, p90, p99 in ms)."""
    totals = Table(title=f"prefixcache bench: {options.source} -> {options.base_url} ({run.model})")
    totals.add_column("run")
    totals.add_column("value", justify="right")
    stopped = f" (stopped: {run.stopped_by})" if run.stopped_by else ""
    hit = summary.hit_ratio
    rows = [
        ("requests completed / failed / not sent", f"{summary.completed} / {summary.failed} / {summary.not_sent}{stopped}"),
        ("duration s", f"{summary.duration_s:.2f}"),
        ("request throughput req/s", f"{summary.request_throughput:.2f}"),
        ("output token throughput tok/s", f"{summary.output_throughput:.1f}"),
        ("total token throughput tok/s", f"{summary.total_token_throughput:.1f}"),
        ("prompt tokens / cached tokens", f"{summary.prompt_tokens:,} / {summary.cached_tokens or 0:,}"),
        ("server prefix hit ratio", "-" if hit is None else f"{hit:.4f}"),
    ]
    for row in rows:
        totals.add_row(*row)
    latency = Table(title="latency, ms")
    for name in ("", "mean", "median", "p90", "p99"):
        latency.add_column(name, justify="left" if not name else "right")
    for name, dist in (("TTFT", summary.ttft), ("TPOT", summary.tpot), ("ITL", summary.itl),
                       ("E2E latency", summary.e2e)):
        latency.add_row(name, _ms(dist.mean), _ms(dist.median), _ms(dist.p90), _ms(dist.p99))
    return totals, latency


def _git_commit() -> str | None:
    root = Path(prefixcache.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None



def metadata(options: BenchOptions, run: RunResult) -> dict[str, Any]:
    """Where, when and how the run was made."""
    config = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    config["workload_args"] = dict(options.workload_args)
    config["request_rate"] = None if math.isinf(options.request_rate) else options.request_rate
    return {
        "prefixcache_version": prefixcache.__version__,
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "command": list(options.command) or sys.argv,
        "options": config,
        "seed": options.seed,
        "source": options.source,
        "model": run.model,
        "stopped_by": run.stopped_by,
    }


def _finite(value: Any) -> Any:
    """nan -> None, recursively (JSON has no nan)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | Path, summary: BenchSummary, run: RunResult, options: BenchOptions) -> None:
    """The run as JSON (module docstring)."""
    requests = [{**dataclasses.asdict(r), "tpot_s": r.tpot_s} for r in sorted(run.results, key=lambda r: r.index)]
    doc = {"metadata": metadata(options, run), "summary": summary.as_dict(), "requests": requests}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(_finite(doc), indent=1) + "\n", encoding="utf-8")

