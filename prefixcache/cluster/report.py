"""How a cluster A/B looks to a person: a terminal table (rich) and PNG plots (matplotlib).

Owns the presentation of `prefixcache.cluster.simulate.ClusterResult`. Must never run a
simulation or change a number. matplotlib is optional, as for `prefixcache.ab_report`
(whose `PlotUnavailable` and lazy import this reuses).
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from prefixcache.ab_report import _pyplot
from prefixcache.cluster.simulate import SHARED, ClusterResult

__all__ = ["cluster_table", "plot_cluster"]


def _per_replica(counts: list[int]) -> str:
    if len(counts) <= 8:
        return " ".join(map(str, counts))
    return f"{min(counts)}..{max(counts)} (min..max of {len(counts)})"


def cluster_table(result: ClusterResult) -> Table:
    """A row per run, grouped by cluster size; the reference lines are dimmed."""
    w, c = result.workload, result.config
    table = Table(
        title=f"Cluster A/B on {w['name']}: {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens; "
        f"each replica {c['cache']['backend']}/{c['cache']['block_size']}, {c['capacity_tokens']:,} tokens, "
        f"{c['service']['max_concurrent']} slots",
        caption=f"reference lines: {result.reference} and '{SHARED}' (one cache of N x capacity: the hit ceiling)",
    )
    for name in ("N", "router", "hit ratio", "last 50%", "vs shared", "TTFT p50 s", "TTFT p99 s", "imbalance",
                 "requests per replica", "route µs", "events", "rejected"):
        table.add_column(name, justify="left" if name in ("router", "requests per replica") else "right")
    rows = result.rows()
    for k, row in enumerate(rows):
        shared = result.run(SHARED, row["replicas"]).hit_ratio if any(
            r.kind == SHARED and r.num_replicas == row["replicas"] for r in result.runs) else None
        vs = "-" if not shared else f"{row['hit_ratio'] / shared:.3f}"
        last = k + 1 == len(rows) or rows[k + 1]["replicas"] != row["replicas"]
        reference = row["kind"] == SHARED or row["series"] == result.reference
        table.add_row(
            str(row["replicas"]), row["series"], f"{row['hit_ratio']:.4f}", f"{row['last_half_hit_ratio']:.4f}", vs,
            f"{row['ttft_p50_s']:.3f}", f"{row['ttft_p99_s']:.3f}", f"{row['imbalance']:.2f}",
            _per_replica(row["requests_per_replica"]), "-" if row["kind"] == SHARED else f"{row['route_us_mean']:.1f}",
            f"{row['events']:,}", f"{row['rejected']:,}", style="dim" if reference else None, end_section=last,
        )
    return table


def plot_cluster(result: ClusterResult, path: str | Path) -> None:
    """Three panels against N: cluster token hit ratio, TTFT p50 and TTFT p99, a line
    per router; the shared cache dotted, round robin dashed."""
    plt = _pyplot()
    fig, (hits, p50, p99) = plt.subplots(1, 3, figsize=(17, 5))
    sizes = result.replica_counts
    top = max((r.hit_ratio for r in result.runs), default=0.0)
    for k, label in enumerate(result.labels):
        runs = [result.run(label, n) for n in sizes]
        style = {"linestyle": ":", "color": "0.4", "marker": "s"} if label == SHARED else \
            {"linestyle": "--", "color": "0.6", "marker": "o"} if label == result.reference else \
            {"marker": "o", "color": f"C{k}"}
        hits.plot(sizes, [r.hit_ratio for r in runs], label=label, **style)
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
    fig.suptitle(f"{w['name']}: {w['requests']:,} requests, {result.config['capacity_tokens']:,} tokens per replica")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
