"""How a cluster A/B looks to a person: a terminal table (rich) and PNG plots (matplotlib).

Owns the presentation of `prefixcache.cluster.results.ClusterResult` (the table and the
plot against N) and of a sweep (`prefixcache.cluster.sweep.SweepResult`: TTFT and
goodput against the arrival rate, so the knee shows). Must never run a simulation or
change a number. matplotlib is optional, as for `prefixcache.ab_report` (whose
`PlotUnavailable` and lazy import this reuses).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixcache.ab_report import _pyplot, arm_line, label_points
from prefixcache.cluster.config import REFERENCE_ROUTER
from prefixcache.cluster.results import SHARED, ClusterResult
from prefixcache.tables import Column, Table

if TYPE_CHECKING:
    from prefixcache.cluster.sweep import SweepResult

__all__ = ["cluster_table", "plot_cluster", "plot_sweep", "plot_capacity"]


def _per_replica(values: list[Any]) -> str:
    if len(values) <= 8:
        return " ".join(map(str, values))
    return f"{min(values)}..{max(values)} (min..max of {len(values)})"


def _fixed(digits: int) -> Any:
    return lambda v: "-" if v is None else f"{v:.{digits}f}"


# In order, with `keep` (higher stays longer in a narrow terminal; prefixcache.tables).
_COLUMNS = (
    Column("replicas", "N", keep=None),
    Column("series", "router", keep=None, left=True),
    Column("hit_ratio", "hit ratio", _fixed(4), keep=None),
    Column("vs_shared", "vs shared", _fixed(3), keep=9),
    Column("goodput", "goodput", _fixed(3), keep=None),
    Column("ttft_mean_s", "TTFT mean s", _fixed(3), keep=5),
    Column("ttft_p50_s", "TTFT p50 s", _fixed(3), keep=10),
    Column("ttft_p90_s", "TTFT p90 s", _fixed(3), keep=4),
    Column("ttft_p99_s", "TTFT p99 s", _fixed(3), keep=8),
    Column("queue_p99_s", "queue p99 s", _fixed(3), keep=6),
    Column("tpot_p50_s", "TPOT p50 ms", lambda v: "-" if v is None else f"{v * 1000:.1f}", keep=7),
    Column("tpot_p99_s", "TPOT p99 ms", lambda v: "-" if v is None else f"{v * 1000:.1f}", keep=3),
    Column("imbalance", "imbalance", _fixed(2), keep=2),
    Column("hit_ratio_per_replica", "hit ratio per replica", lambda v: _per_replica(list(v)), keep=0, left=True),
    Column("requests_per_replica", "requests per replica", lambda v: _per_replica(list(v)), keep=0, left=True),
    Column("route_us_mean", "route µs", _fixed(1), keep=1),
    Column("rejected", "rejected", lambda v: f"{v:,}", keep=4),
)


def cluster_table(result: ClusterResult) -> Table:
    """A row per run, grouped by cluster size; the reference lines are dimmed."""
    w, c = result.workload, result.config
    rows, dim, sections = [], set(), []
    source = result.rows()
    for k, row in enumerate(source):
        shared = result.run(SHARED, row["replicas"]).hit_ratio if any(
            r.kind == SHARED and r.num_replicas == row["replicas"] for r in result.runs) else None
        rows.append({**row, "vs_shared": row["hit_ratio"] / shared if shared else None,
                     "route_us_mean": None if row["kind"] == SHARED else row["route_us_mean"]})
        if row["kind"] == SHARED or row["series"] == result.reference:
            dim.add(k)
        if k + 1 == len(source) or source[k + 1]["replicas"] != row["replicas"]:
            sections.append(k)
    service, slo = c["service"], c["slo"]
    return Table(
        title=f"Cluster A/B on {w['name']}: {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens "
        f"at {c['arrival_speedup']:g}x its rate; each replica {c['cache']['backend']}/{c['cache']['block_size']}, "
        f"{c['capacity_tokens']:,} tokens, {service['max_num_seqs']} slots",
        columns=_COLUMNS, rows=tuple(rows),
        caption=f"goodput: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['itl_s'] * 1000:g} ms; reference lines: "
        f"{result.reference} and '{SHARED}' (N engines over one cache of N x capacity: the hit ceiling)",
        dim=frozenset(dim), section_after=frozenset(sections),
    )


def _style(label: str, k: int, reference: str) -> dict[str, Any]:
    if label == SHARED:
        return {"linestyle": ":", "color": "0.4", "marker": "s"}
    if label == reference:
        return {"linestyle": "--", "color": "0.6", "marker": "o"}
    return arm_line(k)


def plot_cluster(result: ClusterResult, path: str | Path) -> None:
    """Four panels against N: cluster token hit ratio and goodput (each point's value
    written beside it: `ab_report.label_points`), TTFT p50 and TTFT p99, a line per router
    (its own colour, line style and marker: `prefixcache.ab_report.arm_line`); the shared
    cache dotted, round robin dashed."""
    plt = _pyplot()
    fig, (hits, good, p50, p99) = plt.subplots(1, 4, figsize=(22, 5))
    sizes = result.replica_counts
    top = max((r.hit_ratio for r in result.runs), default=0.0)
    for k, label in enumerate(result.labels):
        runs = [result.run(label, n) for n in sizes]
        style = _style(label, k, result.reference)
        hits.plot(sizes, [r.hit_ratio for r in runs], label=label, **style)
        label_points(hits, sizes, [r.hit_ratio for r in runs], style["color"], k)
        good.plot(sizes, [r.goodput for r in runs], label=label, **style)
        label_points(good, sizes, [r.goodput for r in runs], style["color"], k)
        p50.plot(sizes, [r.ttft_p50_s for r in runs], label=label, **style)
        p99.plot(sizes, [r.ttft_p99_s for r in runs], label=label, **style)
    for panel, title, ylabel in ((hits, "cluster token hit ratio", "hit ratio"), (good, "goodput", "share of requests"),
                                 (p50, "TTFT p50", "SECONDS"), (p99, "TTFT p99", "SECONDS")):
        panel.set_xscale("log", base=2)
        panel.set_xticks(list(sizes), [str(n) for n in sizes])
        panel.set_xlabel("replicas N")
        panel.set_ylabel(ylabel)
        panel.set_title(title)
        panel.grid(True, alpha=0.3)
    p50.set_yscale("log")
    p99.set_yscale("log")
    hits.set_ylim(0, min(1.0, 1.15 * top) if top > 0 else 1.0)
    good.set_ylim(0, 1.02)
    hits.legend(fontsize=8)
    w, c = result.workload, result.config
    fig.suptitle(f"Cluster A/B on {w['name']}: {w['requests']:,} requests at {c['arrival_speedup']:g}x; each replica "
                 f"{c['cache']['backend']}/{c['cache']['block_size']}, {c['capacity_tokens']:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


Rows = list[Mapping[str, Any]]


def _draw(row: Any, rows_by_x: list[tuple[float, Rows]], xlabel: str, where: str, reference: str) -> None:
    """One row of a sweep's panels (goodput, each point's value written beside it; hit
    ratio / the shared cache's; TTFT p50 and p99) from (x, summary rows at x) pairs: a line
    per series, in the order they come."""
    good, hits, p50, p99 = row
    xs = [x for x, _ in rows_by_x]
    labels = list(dict.fromkeys(r["series"] for _, rows in rows_by_x for r in rows))
    labels.sort(key=lambda label: label == SHARED)  # the shared cache last, as the tables
    for k, label in enumerate(labels):
        style = _style(label, k, reference)
        at = [next(r for r in rows if r["series"] == label) for _, rows in rows_by_x]
        ceiling = [next(r for r in rows if r["kind"] == SHARED)["hit_ratio"] for _, rows in rows_by_x]
        good.plot(xs, [r["goodput"] for r in at], label=label, **style)
        label_points(good, xs, [r["goodput"] for r in at], style["color"], k)
        hits.plot(xs, [r["hit_ratio"] / c if c else float("nan") for r, c in zip(at, ceiling, strict=True)],
                  label=label, **style)
        p50.plot(xs, [r["ttft_p50_s"] for r in at], label=label, **style)
        p99.plot(xs, [r["ttft_p99_s"] for r in at], label=label, **style)
    for panel, title, ylabel in ((good, "goodput", "share of requests"), (hits, "hit ratio / shared cache's", "ratio"),
                                 (p50, "TTFT p50", "SECONDS"), (p99, "TTFT p99", "SECONDS")):
        panel.set_xlabel(xlabel)
        panel.set_ylabel(ylabel)
        panel.set_title(f"{title}: {where}", fontsize=10)
        panel.grid(True, alpha=0.3)
    p50.set_yscale("log")
    p99.set_yscale("log")
    good.set_ylim(0, 1.02)
    good.legend(fontsize=8)


def _sweep_data(sweep: SweepResult | Mapping[str, Any]) -> Mapping[str, Any]:
    return sweep if isinstance(sweep, Mapping) else sweep.to_dict()


def _rows(data: Mapping[str, Any], key: Callable[[Mapping[str, Any]], Any],
          x: Callable[[Mapping[str, Any]], float]) -> dict[Any, list[tuple[float, Rows]]]:
    """The sweep's rows grouped by `key` (a row of panels each), then by `x` (rising)."""
    groups: dict[Any, dict[float, Rows]] = {}
    for r in data["runs"]:
        groups.setdefault(key(r), {}).setdefault(x(r), []).append(r)
    return {k: sorted(by_x.items()) for k, by_x in groups.items()}


def _figure(data: Mapping[str, Any], groups: dict[Any, list[tuple[float, Rows]]], xlabel: str,
            where: Callable[[Any], str], title: str, path: str | Path, *, log_x: bool) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(len(groups), 4, figsize=(22, 4.6 * len(groups)), squeeze=False)
    reference = next((r["series"] for r in data["runs"] if r["router"] == REFERENCE_ROUTER), "")
    for row, (key, rows_by_x) in zip(axes, groups.items(), strict=True):
        _draw(row, rows_by_x, xlabel, where(key), reference)
        if log_x:
            for panel in row:
                panel.set_xscale("log")
    slo, w = data["slo"], data["workload"]
    fig.suptitle(f"{title} on {w['name']}: {w['requests']:,} requests; goodput: TTFT <= {slo['ttft_s']:g} s and "
                 f"TPOT <= {slo['itl_s'] * 1000:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sweep(sweep: SweepResult | Mapping[str, Any], path: str | Path) -> None:
    """Against the arrival rate (requests/s): goodput, hit ratio / the shared cache's, TTFT
    p50 and TTFT p99, a line per router; one row of panels per operating point (fleet
    size, slots, capacity). Where every router's goodput falls is the knee. `sweep`: a
    `SweepResult`, or its `to_dict()` as `write_json` saved it."""
    data = _sweep_data(sweep)
    groups = _rows(data, lambda r: (r["replicas"], r["max_num_seqs"], r["capacity_tokens"]),
                   lambda r: r["requests_per_s"])
    _figure(data, groups, "arrival rate, requests/s",
            lambda k: f"N={k[0]}, {k[1]} slots, {k[2]:,} tokens each", "Sweep", path, log_x=False)


def plot_capacity(sweep: SweepResult | Mapping[str, Any], path: str | Path) -> None:
    """Against each replica's cache capacity (TOKENS, log scale): goodput, hit ratio / the
    shared cache's, TTFT p50 and TTFT p99, a line per router; one row of panels per fleet
    size, slots and arrival rate. Where the approximate routers' hit ratio and goodput fall
    away from the precise ones' is where caches churn."""
    data = _sweep_data(sweep)
    groups = _rows(data, lambda r: (r["replicas"], r["max_num_seqs"], r["requests_per_s"]),
                   lambda r: r["capacity_tokens"])
    _figure(data, groups, "cache per replica, TOKENS",
            lambda k: f"N={k[0]}, {k[1]} slots, {k[2]:.2f} requests/s", "Capacity sweep", path, log_x=True)
