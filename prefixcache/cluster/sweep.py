"""A sweep of the cluster A/B over operating points: arrival rate, fleet size, slots and
cache capacity, every router at each, so TTFT and goodput can be read against the rate
and the knee shows.

Owns `SweepPoint` (one fleet: replicas, slots per replica, TOKENS of cache per replica),
`SweepResult` (a `ClusterResult` per point and rate, as rows, JSON and CSV) and `sweep`.
The arrival rate is the config's `arrival_speedup` (the workload's own arrival times
divided by it; `--set arrival_speedup=2` on the command line), reported as requests per
second over the workload's span. Must never: print or plot (`prefixcache.cluster.report`
draws `plot_sweep`), or change how a run is simulated (`run_cluster` does each).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.ab import Progress, write_csv
from prefixcache.cluster.config import ClusterConfig
from prefixcache.cluster.results import SLO, ClusterResult
from prefixcache.cluster.simulate import run_cluster
from prefixcache.workloads import Workload

__all__ = ["SweepPoint", "SweepResult", "sweep", "arrival_rate"]


@dataclass(frozen=True)
class SweepPoint:
    """One fleet: `replicas` replicas of `max_num_seqs` slots and `capacity_tokens` TOKENS
    of cache each."""

    replicas: int
    max_num_seqs: int
    capacity_tokens: int

    def describe(self) -> str:
        return f"N={self.replicas}, {self.max_num_seqs} slots, {self.capacity_tokens:,} tokens each"


def arrival_rate(workload: Workload, speedup: float) -> float:
    """Requests per second of `workload` replayed at `speedup` x its arrival times (its
    requests over the span from the first arrival to the last)."""
    requests = workload.requests
    span = (requests[-1].arrival_s - requests[0].arrival_s) / speedup if len(requests) > 1 else 0.0
    return len(requests) / span if span > 0 else float("inf")


@dataclass(frozen=True)
class SweepResult:
    """Every (point, speed-up) of a sweep: `runs[k]` = (point, speedup, requests/s, result)."""

    workload: dict[str, Any]
    slo: SLO
    runs: tuple[tuple[SweepPoint, float, float, ClusterResult], ...]

    def groups(self) -> dict[SweepPoint, list[tuple[float, ClusterResult]]]:
        """Per point, its (requests/s, result) by rising rate."""
        out: dict[SweepPoint, list[tuple[float, ClusterResult]]] = {}
        for point, _, rate, result in self.runs:
            out.setdefault(point, []).append((rate, result))
        return {p: sorted(rs, key=lambda x: x[0]) for p, rs in out.items()}

    def rows(self) -> list[dict[str, Any]]:
        """One row per router (and the shared cache) per point and rate: the point, the
        rate, then the run's summary (`RunResult.summary`)."""
        out = []
        for point, speedup, rate, result in self.runs:
            for row in result.rows():
                out.append({"replicas": point.replicas, "max_num_seqs": point.max_num_seqs,
                            "capacity_tokens": point.capacity_tokens, "arrival_speedup": speedup,
                            "requests_per_s": rate, **{k: v for k, v in row.items() if k != "replicas"}})
        return out

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"workload": self.workload, "slo": {"ttft_s": self.slo.ttft_s,
                                                                              "itl_s": self.slo.itl_s},
                                          "runs": self.rows()}, indent=1) + "\n")

    def write_csv(self, path: str | Path) -> None:
        rows = [{k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items()} for row in self.rows()]
        write_csv(path, rows)


def sweep(config: ClusterConfig, workload: Workload, points: Sequence[SweepPoint], speedups: Sequence[float], *,
          progress: Progress | None = None, on_point: Callable[[SweepResult], None] | None = None) -> SweepResult:
    """`run_cluster` at every point and speed-up (every router, the shared cache). `on_point`
    sees the result so far after each (point, speed-up)."""
    runs: list[tuple[SweepPoint, float, float, ClusterResult]] = []
    described: dict[str, Any] = {}
    for point in points:
        for speedup in speedups:
            at = config.with_replicas((point.replicas,)).with_point(
                arrival_speedup=speedup, max_num_seqs=point.max_num_seqs, capacity_tokens=point.capacity_tokens)
            result = run_cluster(at, workload, progress=progress)
            described = dict(result.workload)
            runs.append((point, speedup, arrival_rate(workload, speedup), result))
            if on_point is not None:
                on_point(SweepResult(described, config.slo, tuple(runs)))
    return SweepResult(described, config.slo, tuple(runs))
