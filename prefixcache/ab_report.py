"""How A/B and sweep results look to a person: terminal tables (rich) and PNG plots (matplotlib).

Owns the presentation of `prefixcache.ab` results. Must never: run a replay or change a
number; everything shown comes from an `ABResult` / `SweepResult`. matplotlib is an
optional dependency (`pip install 'prefixcache[plot]'`): it is imported only when a plot
is drawn, and its absence is a `PlotUnavailable` that says how to install it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

from rich.table import Table

from prefixcache.ab import ABResult, SweepResult, bound_name

__all__ = ["PlotUnavailable", "ab_table", "sweep_table", "plot_ab", "plot_sweep", "INSTALL_PLOT"]

INSTALL_PLOT = "pip install 'prefixcache[plot]'  (or: pip install matplotlib)"


class PlotUnavailable(ImportError):
    """matplotlib is not installed; the message says how to install it."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"PNG plots need matplotlib, which is not installed: {INSTALL_PLOT}") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def _num(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def ab_table(result: ABResult) -> Table:
    """One row per arm, then the bounds, with the workload in the title."""
    w = result.workload
    analytic = ", ".join(f"B={b}: {r:.4f}" for b, r in w["analytic_hit_ratio"].items() if r is not None)
    table = Table(
        title=f"A/B on {w['name']}: {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens, "
        f"pool {result.capacity_tokens:,} tokens, max_concurrent {result.max_concurrent}",
        caption=f"analytic ceiling {analytic}" if analytic else None,
    )
    rows = result.summary_rows()
    show_rejected = any(r["rejected"] for r in rows)
    show_waits = any(r["waits"] for r in rows)
    columns = ["series", "backend", "B", "pool blocks", "hit ratio", "last 50%", "prefill saved",
               "evicted blocks", "peak pinned", "µs p50", "µs p99", "events"]
    columns += ["rejected"] * show_rejected + ["waits"] * show_waits
    for name in columns:
        table.add_column(name, justify="left" if name in ("series", "backend") else "right")
    for r in rows:
        cells = [r["series"], r["backend"], str(r["block_size"]), _num(r["capacity_blocks"], ","),
                 f"{r['hit_ratio']:.4f}", f"{r['last_half_hit_ratio']:.4f}", f"{r['prefill_tokens_saved']:,}",
                 f"{r['evicted_blocks']:,}", _num(r["peak_pinned_blocks"], ","), _num(r["bookkeeping_us_p50"], ".1f"),
                 _num(r["bookkeeping_us_p99"], ".1f"), _num(r["events"], ",")]
        cells += [f"{r['rejected']:,}"] * show_rejected + [_num(r["waits"], ",")] * show_waits
        table.add_row(*cells, style="dim" if r["kind"] == "bound" else None,
                      end_section=r is rows[len(result.arms) - 1])
    return table


def sweep_table(result: SweepResult) -> Table:
    """Hit ratio (whole run / last 50%) per series, one column per capacity."""
    w = result.workload
    table = Table(title=f"Sweep on {w['name']}: token hit ratio, whole run / last 50% of requests")
    table.add_column("series")
    for c in result.capacities:
        table.add_column(f"{c:,} tok", justify="right")
    for name, points in result.series().items():
        by_capacity = {p.capacity_tokens: p for p in points}
        cells = []
        for c in result.capacities:
            p = by_capacity.get(c)
            cells.append("-" if p is None else f"{p.hit_ratio:.3f} / {p.last_half_hit_ratio:.3f}")
        table.add_row(name, *cells, style="dim" if points[0].kind == "bound" else None)
    return table


def _bound_style(name: str, block_sizes: list[int]) -> dict[str, Any]:
    """Ceilings dotted, Belady dashed; one grey per block size (darkest = smallest)."""
    shade = 0.1 + 0.45 * block_sizes.index(int(name.rsplit("=", 1)[1])) / max(len(block_sizes) - 1, 1)
    return {"linestyle": ":" if name.startswith("ceiling") else "--", "color": str(round(shade, 2)), "linewidth": 1.3}


def plot_ab(result: ABResult, path: str | Path) -> None:
    """Three panels: hit ratios per series, cumulative hit ratio over the run, and
    bookkeeping µs per request per arm."""
    plt = _pyplot()
    rows = result.summary_rows()
    fig, (bars, cumulative, cost) = plt.subplots(1, 3, figsize=(17, 5.2))

    names = [r["series"] for r in rows]
    x = range(len(rows))
    colors = [f"C{i}" if r["kind"] == "arm" else "0.8" if r["backend"] == "infinite" else "0.55"
              for i, r in enumerate(rows)]
    bars.bar([i - 0.2 for i in x], [r["hit_ratio"] for r in rows], 0.4, color=colors, label="whole run")
    bars.bar([i + 0.2 for i in x], [r["last_half_hit_ratio"] for r in rows], 0.4, color=colors, alpha=0.55,
             hatch="//", label="last 50% of requests")
    bars.set_xticks(list(x), names, rotation=30, ha="right")
    bars.set_ylabel("token hit ratio")
    bars.set_ylim(0, 1.15)
    bars.set_title(f"hit ratio at {result.capacity_tokens:,} tokens of pool")
    bars.legend(loc="upper center", ncol=2, fontsize=8)

    prompt_total = list(accumulate(result.prompt_tokens))
    requests = range(1, len(prompt_total) + 1)
    for i, a in enumerate(result.arms):
        cumulative.plot(requests, [h / p for h, p in zip(accumulate(a.hits.hit_tokens), prompt_total, strict=True)],
                        color=f"C{i}", label=a.name)
    block_sizes = sorted({b.block_size for b in result.bounds})
    for b in result.bounds:
        name = bound_name(b.bound, b.block_size)
        cumulative.plot(requests, [h / p for h, p in zip(accumulate(b.hits.hit_tokens), prompt_total, strict=True)],
                        label=name, **_bound_style(name, block_sizes))
    cumulative.set_xlabel("requests replayed")
    cumulative.set_ylabel("cumulative token hit ratio")
    cumulative.set_ylim(0, 1)
    cumulative.set_title("hit ratio as the run goes")
    cumulative.legend(fontsize=8)

    cost.boxplot([a.bookkeeping_us for a in result.arms], whis=(1, 99), showfliers=False)
    cost.set_xticks(range(1, len(result.arms) + 1), [a.name for a in result.arms], rotation=30, ha="right")
    cost.set_yscale("log")
    cost.set_ylabel("bookkeeping µs per request (1st-99th pct whiskers)")
    cost.set_title("cache bookkeeping cost")

    fig.suptitle(f"{result.workload['name']}: {result.workload['requests']:,} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(
    result: SweepResult, path: str | Path, marks: Sequence[tuple[str, float, float]] = (), title: str = ""
) -> None:
    """Hit ratio against capacity (log x), whole run and last 50%, every series; `marks`
    are reference points (label, capacity TOKENS, whole-run ratio), e.g. published figures."""
    plt = _pyplot()
    fig, panels = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    block_sizes = sorted({p.block_size for p in result.points})
    for panel, metric, heading in ((panels[0], "hit_ratio", "whole run"),
                                 (panels[1], "last_half_hit_ratio", "last 50% of requests")):
        arm_index = 0
        for name, points in result.series().items():
            xs = [p.capacity_tokens for p in points]
            ys = [getattr(p, metric) for p in points]
            if points[0].kind == "bound":
                panel.plot(xs, ys, label=name, **_bound_style(name, block_sizes))
            else:
                panel.plot(xs, ys, marker="o", color=f"C{arm_index}", label=name)
                arm_index += 1
        panel.set_xscale("log")
        panel.set_xlabel("pool capacity (tokens)")
        panel.set_title(heading)
        panel.grid(True, alpha=0.3)
    seen: dict[float, int] = {}  # labels at one capacity are stacked, not overprinted
    for label, capacity, ratio in marks:
        below = seen[capacity] = seen.get(capacity, -1) + 1
        panels[0].plot([capacity], [ratio], marker="x", markersize=9, color="crimson", linestyle="none")
        panels[0].annotate(label, (capacity, ratio), textcoords="offset points", xytext=(6, -12 - 11 * below),
                           fontsize=8, color="crimson")
    panels[0].set_ylabel("token hit ratio")
    panels[0].set_ylim(0, 1)
    panels[1].legend(fontsize=8)
    fig.suptitle(title or f"{result.workload['name']}: hit ratio vs capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
