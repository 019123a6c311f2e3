"""A sweep of the cluster A/B over operating points: arrival rate, fleet size, slots and
cache capacity, every router at each, so TTFT and goodput can be read against the rate
and the knee shows.

Owns `SweepPoint` (one fleet: replicas, slots per replica, TOKENS of cache per replica),
`SweepResult` (a `ClusterResult` per point and rate, as rows, JSON and CSV) and `sweep`
(every router and the shared cache at every point and rate, as jobs a caller may run in
other processes).
The arrival rate is the config's `arrival_speedup` (the workload's own arrival times
divided by it; `--set arrival_speedup=2` on the command line), reported as requests per
second over the workload's span. Must never: print or plot (`prefixcache.cluster.report`
draws `plot_sweep`), or change how a run is simulated (`simulate` does each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.ab import describe_workload
from prefixcache.cluster.config import ClusterConfig
from prefixcache.cluster.results import SHARED, SLO, ClusterResult, RunResult, write_json, write_rows_csv
from prefixcache.cluster.simulate import simulate, simulate_shared
from prefixcache.workloads import Workload

__all__ = ["SweepPoint", "SweepResult", "Job", "sweep", "run_job", "arrival_rate"]


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

    def to_dict(self) -> dict[str, Any]:
        """The workload, the SLO and `rows()`: what `write_json` writes and the sweep plots
        draw (`prefixcache.cluster.report.plot_sweep` takes this or a loaded file)."""
        return {"workload": self.workload, "slo": {"ttft_s": self.slo.ttft_s, "itl_s": self.slo.itl_s},
                "runs": self.rows()}

    def write_json(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    def write_csv(self, path: str | Path) -> None:
        write_rows_csv(path, self.rows())


Job = tuple[ClusterConfig, str]
"""One run of a sweep: a config at one point (one cluster size) and a router label, or
`SHARED` for the shared-cache line."""


def run_job(workload: Workload, job: Job) -> RunResult:
    """One job of a sweep, in this process."""
    config, label = job
    n = config.replicas[0]
    if label == SHARED:
        return simulate_shared(workload, config, n)
    return simulate(workload, config, label, config.routers[label], n)


def sweep(config: ClusterConfig, workload: Workload, points: Sequence[SweepPoint], speedups: Sequence[float], *,
          run_all: Callable[[list[Job]], Iterable[RunResult]] | None = None) -> SweepResult:
    """Every router and the shared cache at every point and speed-up. `run_all` runs the
    jobs and yields their results in order (default: one after another, here; a caller may
    spread them over processes, each holding the workload)."""
    jobs: list[Job] = []
    keys: list[tuple[SweepPoint, float]] = []
    for point in points:
        for speedup in speedups:
            at = config.with_replicas((point.replicas,)).with_point(
                arrival_speedup=speedup, max_num_seqs=point.max_num_seqs, capacity_tokens=point.capacity_tokens)
            for label in (*at.routers, SHARED):
                jobs.append((at, label))
                keys.append((point, speedup))
    results = list(run_all(jobs) if run_all is not None else (run_job(workload, job) for job in jobs))
    described = describe_workload(workload, [config.block_size])
    runs: list[tuple[SweepPoint, float, float, ClusterResult]] = []
    for k in range(0, len(jobs), len(config.routers) + 1):
        at, _ = jobs[k]
        point, speedup = keys[k]
        chunk = tuple(results[k:k + len(at.routers) + 1])
        runs.append((point, speedup, arrival_rate(workload, speedup),
                     ClusterResult(described, at.plain(), at.reference_label, chunk)))
    return SweepResult(described, config.slo, tuple(runs))
