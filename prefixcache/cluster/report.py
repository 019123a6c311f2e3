"""How a cluster A/B looks to a person: a terminal table (rich) and PNG plots (matplotlib).

Owns the presentation of `prefixcache.cluster.simulate.ClusterResult`. Must never run a
simulation or change a number. matplotlib is optional, as for `prefixcache.ab_report`
(whose `PlotUnavailable` and lazy import this reuses).
"""

from __future__ import annotations

from pathlib import Path

from typing import Any

from prefixcache.ab_report import _pyplot, arm_line, label_points
from prefixcache.cluster.simulate import SHARED, ClusterResult
from prefixcache.tables import Column, Table

__all__ = ["cluster_table", "plot_cluster"]


def _per_replica(counts: list[int]) -> str:
    if len(counts) <= 8:
        return " ".join(map(str, counts))
    return f"{min(counts)}..{max(counts)} (min..max of {len(counts)})"


def _fixed(digits: int) -> Any:
    return lambda v: "-" if v is None else f"{v:.{digits}f}"


# In order, with `keep` (higher stays longer in a narrow terminal; prefixcache.tables).
_COLUMNS = (
    Column("replicas", "N", keep=None),
    Column("series", "router", keep=None, left=True),
    Column("hit_ratio", "hit ratio", _fixed(4), keep=None),
    Column("last_half_hit_ratio", "last 50%", _fixed(4), keep=5),
    Column("vs_shared", "vs shared", _fixed(3), keep=6),
    Column("ttft_p50_s", "TTFT p50 s", _fixed(3), keep=7),
    Column("ttft_p99_s", "TTFT p99 s", _fixed(3), keep=4),
    Column("imbalance", "imbalance", _fixed(2), keep=3),
    Column("requests_per_replica", "requests per replica", lambda v: _per_replica(list(v)), keep=1, left=True),
    Column("route_us_mean", "route µs", _fixed(1), keep=2),
    Column("events", "events", lambda v: f"{v:,}", keep=0),
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
    return Table(
        title=f"Cluster A/B on {w['name']}: {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens; "
        f"each replica {c['cache']['backend']}/{c['cache']['block_size']}, {c['capacity_tokens']:,} tokens, "
        f"{c['service']['max_concurrent']} slots",
        columns=_COLUMNS, rows=tuple(rows),
        caption=f"reference lines: {result.reference} and '{SHARED}' (one cache of N x capacity: the hit ceiling)",
        dim=frozenset(dim), section_after=frozenset(sections),
    )


def plot_cluster(result: ClusterResult, path: str | Path) -> None:
    """Three panels against N: cluster token hit ratio (each point's value written
    beside it: `ab_report.label_points`), TTFT p50 and TTFT p99, a line per router (its
    own colour, line style and marker: `prefixcache.ab_report.arm_line`); the shared
    cache dotted, round robin dashed."""
    plt = _pyplot()
    fig, (hits, p50, p99) = plt.subplots(1, 3, figsize=(17, 5))
    sizes = result.replica_counts
    top = max((r.hit_ratio for r in result.runs), default=0.0)
    for k, label in enumerate(result.labels):
        runs = [result.run(label, n) for n in sizes]
        style = {"linestyle": ":", "color": "0.4", "marker": "s"} if label == SHARED else \
            {"linestyle": "--", "color": "0.6", "marker": "o"} if label == result.reference else \
            arm_line(k)
        hits.plot(sizes, [r.hit_ratio for r in runs], label=label, **style)
        label_points(hits, sizes, [r.hit_ratio for r in runs], style["color"], k)
        p50.plot(sizes, [r.ttft_p50_s for r in runs], label=label, **style)
        p99.plot(sizes, [r.ttft_p99_s for r in runs], label=label, **style)
    for panel, title, ylabel in ((hits, "cluster token hit ratio", "hit ratio"),
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
    hits.legend(fontsize=8)
    w = result.workload
    c = result.config
    fig.suptitle(f"Cluster A/B on {w['name']}: {w['requests']:,} requests; each replica {c['cache']['backend']}/"
                 f"{c['cache']['block_size']}, {c['capacity_tokens']:,} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
