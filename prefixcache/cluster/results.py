"""What a cluster A/B measured: one run per router and cluster size, in what users feel.

Owns `SLO` (the latency objective goodput is judged by), `RunResult` (one router, or the
shared cache, at one cluster size: every request's hit, TTFT, queueing delay and time per
output token, and every replica's load) and `ClusterResult` (every run of an experiment,
as rows, JSON and CSV). Must never: simulate, print or plot; percentiles come from
`prefixcache.percentiles`, the one definition every report uses.

Per request (SECONDS, nan for a request that never ran):
- TTFT: arrival to the first output token;
- queueing delay: arrival until the step that first schedules it (vLLM's
  `request_queue_time`): its TTFT less its own prefill (from that step to its first
  token, vLLM's `request_prefill_time`, which includes the steps it shares with others);
- TPOT: (last token - first token) / (output tokens - 1), the mean inter-token latency of
  the request (AIPerf's `inter_token_latency`, which its `--goodput` judges; nan with
  fewer than 2 output tokens);
- good: TTFT <= slo.ttft_s and TPOT <= slo.itl_s (a request with one output token has no
  inter-token latency to miss); a rejected request is never good.

Goodput is the share of requests that are good (Dynamo's A/B of its KV router on the
Mooncake trace judges `time_to_first_token:2000 inter_token_latency:25`, the default SLO).
`cluster.json` names each run's figures with these fixed keys (read by tests outside the
repository): `hit_ratio`, `goodput`, `ttft_mean_s`, `ttft_p50_s`, `ttft_p90_s`,
`ttft_p99_s`, `queue_p99_s`, and the others `RunResult.summary` lists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.ab import write_csv
from prefixcache.config import ConfigError
from prefixcache.percentiles import mean, percentile, percentiles
from prefixcache.workloads import HitCounts
from prefixcache.workloads.metrics import HitRatios

__all__ = ["SLO", "RunResult", "ClusterResult", "SHARED", "write_json", "write_rows_csv"]

SHARED = "shared"
"""The series name and kind of the shared-cache reference line."""


@dataclass(frozen=True)
class SLO:
    """ttft_s: TTFT a good request stays within, SECONDS
    itl_s:  mean inter-token latency (TPOT) a good request stays within, SECONDS"""

    ttft_s: float = 2.0
    itl_s: float = 0.025

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(name, f"must be a number of SECONDS > 0, got {value!r}")

    def good(self, ttft_s: float, tpot_s: float) -> bool:
        """Whether a request with this TTFT and TPOT meets the objective (nan TTFT: it
        never ran; nan TPOT: it had one output token)."""
        return ttft_s <= self.ttft_s and not tpot_s > self.itl_s


def _finite(values: tuple[float, ...]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


@dataclass(frozen=True)
class RunResult(HitRatios):
    """One router (or the shared cache) at one cluster size (module docstring). Per
    request in arrival order, SECONDS; per simulated replica (engine) in replica order.

    kind:        "router", or "shared" for the shared-cache reference line
    replica_of:  the replica each request went to (-1: rejected before it could run)
    busy_s:      per replica, SECONDS of steps it ran
    prefilled:   per replica, prompt TOKENS it computed
    route_us:    per request, MICROSECONDS in the router's calls (empty for the shared cache)
    duration_s:  first arrival to last finish
    """

    label: str
    kind: str
    router: str
    num_replicas: int
    hits: HitCounts
    ttft_s: tuple[float, ...]
    queue_s: tuple[float, ...]
    tpot_s: tuple[float, ...]
    finish_s: tuple[float, ...]
    replica_of: tuple[int, ...]
    busy_s: tuple[float, ...]
    prefilled: tuple[int, ...]
    route_us: tuple[float, ...]
    rejected: tuple[int, ...]
    events: int
    duration_s: float
    wall_s: float
    slo: SLO = SLO()

    # -- latency ----------------------------------------------------------------------
    @property
    def ttft_mean_s(self) -> float:
        return mean(_finite(self.ttft_s))

    @property
    def ttft_p50_s(self) -> float:
        return percentile(_finite(self.ttft_s), 50)

    @property
    def ttft_p90_s(self) -> float:
        return percentile(_finite(self.ttft_s), 90)

    @property
    def ttft_p99_s(self) -> float:
        return percentile(_finite(self.ttft_s), 99)

    @property
    def goodput(self) -> float:
        """Share of requests meeting the SLO (rejected ones never do)."""
        n = len(self.ttft_s)
        good = sum(self.slo.good(t, p) for t, p in zip(self.ttft_s, self.tpot_s, strict=True))
        return good / n if n else math.nan

    # -- load -------------------------------------------------------------------------
    @property
    def imbalance(self) -> float:
        """max / mean busy time over replicas (1.0: perfectly even)."""
        average = sum(self.busy_s) / len(self.busy_s)
        return max(self.busy_s) / average if average > 0 else 1.0

    @property
    def requests_per_replica(self) -> tuple[int, ...]:
        """Requests each simulated replica ran."""
        counts = [0] * len(self.busy_s)
        for r in self.replica_of:
            if r >= 0:
                counts[r] += 1
        return tuple(counts)

    @property
    def hit_ratio_per_replica(self) -> tuple[float, ...]:
        """Token hit ratio of the requests each replica ran (0.0 for one that ran none)."""
        hit, prompt = [0] * len(self.busy_s), [0] * len(self.busy_s)
        for r, h, p in zip(self.replica_of, self.hits.hit_tokens, self.hits.prompt_tokens, strict=True):
            if r >= 0:
                hit[r] += h
                prompt[r] += p
        return tuple(h / p if p else 0.0 for h, p in zip(hit, prompt, strict=True))

    @property
    def utilization_per_replica(self) -> tuple[float, ...]:
        """Share of the run each replica spent running steps."""
        return tuple(b / self.duration_s if self.duration_s > 0 else 0.0 for b in self.busy_s)

    def summary(self) -> dict[str, Any]:
        """One row: what the table, the CSV, the JSON and the plots show."""
        queue = _finite(self.queue_s)
        tpot = _finite(self.tpot_s)
        q50, q90, q99 = percentiles(queue, (50, 90, 99))
        t50, t90, t99 = percentiles(tpot, (50, 90, 99))
        return {
            "series": self.label, "kind": self.kind, "router": self.router, "replicas": self.num_replicas,
            "hit_ratio": self.hit_ratio, "last_half_hit_ratio": self.last_half_hit_ratio,
            "goodput": self.goodput,
            "ttft_mean_s": self.ttft_mean_s, "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
            "ttft_p99_s": self.ttft_p99_s,
            "queue_mean_s": mean(queue), "queue_p50_s": q50, "queue_p90_s": q90, "queue_p99_s": q99,
            "tpot_mean_s": mean(tpot), "tpot_p50_s": t50, "tpot_p90_s": t90, "tpot_p99_s": t99,
            "imbalance": self.imbalance,
            "requests_per_replica": list(self.requests_per_replica),
            "hit_ratio_per_replica": [round(h, 4) for h in self.hit_ratio_per_replica],
            "utilization_per_replica": [round(u, 4) for u in self.utilization_per_replica],
            "busy_s": list(self.busy_s), "prefilled_tokens": list(self.prefilled),
            "route_us_mean": mean(self.route_us) if self.route_us else 0.0,
            "route_us_p99": percentile(self.route_us, 99) if self.route_us else 0.0,
            "rejected": len(self.rejected), "events": self.events, "duration_s": self.duration_s,
            "wall_s": self.wall_s,
        }


@dataclass(frozen=True)
class ClusterResult:
    """Every run of a cluster experiment on one workload."""

    workload: Mapping[str, Any]
    config: Mapping[str, Any]
    reference: str  # the round-robin reference line's label
    runs: tuple[RunResult, ...]

    def run(self, label: str, num_replicas: int) -> RunResult:
        for r in self.runs:
            if r.label == label and r.num_replicas == num_replicas:
                return r
        raise KeyError(f"no run {label!r} at {num_replicas} replicas")

    @property
    def replica_counts(self) -> tuple[int, ...]:
        return tuple(sorted({r.num_replicas for r in self.runs}))

    @property
    def labels(self) -> tuple[str, ...]:
        """Series names, routers first (in config order), the shared cache last."""
        seen = dict.fromkeys(r.label for r in self.runs if r.kind == "router")
        return (*seen, *(dict.fromkeys(r.label for r in self.runs if r.kind == SHARED)))

    def rows(self) -> list[dict[str, Any]]:
        """One summary row per run, by cluster size then series; a figure with no sample
        (a TPOT where no request had two output tokens) is None."""
        order = {label: i for i, label in enumerate(self.labels)}
        runs = sorted(self.runs, key=lambda r: (r.num_replicas, order[r.label]))
        return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.summary().items()}
                for r in runs]

    def to_dict(self) -> dict[str, Any]:
        return {"workload": dict(self.workload), "config": dict(self.config), "reference": self.reference,
                "runs": self.rows()}

    def write_json(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    def write_csv(self, path: str | Path) -> None:
        """A row per run; per-replica lists joined by spaces."""
        write_rows_csv(path, self.rows())


def write_json(path: str | Path, data: Mapping[str, Any]) -> None:
    """`data` as indented JSON: what `ClusterResult` and `SweepResult` save."""
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def write_rows_csv(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """Summary rows as CSV, a list value (per-replica figures) joined by spaces."""
    write_csv(path, [{k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items()} for row in rows])
