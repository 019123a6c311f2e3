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

from prefixcache.ab import ABResult, SweepResult, bound_name
from prefixcache.tables import Column, Table

__all__ = ["PlotUnavailable", "ab_table", "sweep_table", "ab_figure", "sweep_figure", "plot_ab", "plot_sweep",
           "label_points", "POINT_VALUE",
           "eviction_onset", "arm_color", "arm_line", "INSTALL_PLOT"]

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


def _fixed(digits: int) -> Any:
    return lambda v: "-" if v is None else f"{v:.{digits}f}"


def _count(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


# The A/B table's columns, in order, each with its `keep` (higher stays longer when the
# terminal is narrow: prefixcache.tables). Never dropped: the series name and its hit ratio.
_AB_COLUMNS = (
    Column("series", "series", keep=None, left=True),
    Column("backend", "backend", keep=2, left=True),
    Column("block_size", "B", keep=4),
    Column("capacity_blocks", "pool blocks", _count, keep=3),
    Column("hit_ratio", "hit ratio", _fixed(4), keep=None),
    Column("last_half_hit_ratio", "last 50%", _fixed(4), keep=8),
    Column("prefill_tokens_saved", "prefill saved", _count, keep=9),
    Column("evicted_blocks", "evicted blocks", _count, keep=7),
    Column("peak_pinned_blocks", "peak pinned", _count, keep=1),
    Column("bookkeeping_us_p50", "µs p50", _fixed(1), keep=5),
    Column("bookkeeping_us_p99", "µs p99", _fixed(1), keep=0),
    Column("events", "events", _count, keep=0),
    Column("rejected", "rejected", _count, keep=6),
    Column("waits", "waits", _count, keep=6),
    Column("layout_ceiling_hit_ratio", "layout ceiling", _fixed(4), keep=6),
    Column("of_layout_ceiling", "of it", _fixed(3), keep=6),
    Column("uncacheable_by_layout", "uncacheable by layout", _count, keep=5),
    Column("layout_belady_hit_ratio", "layout Belady", _fixed(4), keep=6),
    Column("bytes_per_token", "bytes/token per group", lambda v: "-" if v is None else v, keep=0, left=True),
)


def _tier_columns(rows: Sequence[dict[str, Any]]) -> tuple[Column, ...]:
    """The lower tiers' columns of an A/B whose arms have tiers (none otherwise): the
    device's share of the hit ratio, each tier's share, its loads and GB written, and the
    modelled prefill seconds saved."""
    if not rows or "device_hit_ratio" not in rows[0]:
        return ()
    out = [Column("device_hit_ratio", "device hit", _fixed(4), keep=4)]
    k = 0
    while f"tier{k}_hit_ratio" in rows[0]:
        medium = next((r[f"tier{k}_medium"] for r in rows if r.get(f"tier{k}_medium")), f"tier {k}")
        out += [Column(f"tier{k}_hit_ratio", f"{medium} hit", _fixed(4), keep=4),
                Column(f"tier{k}_loads", f"{medium} loads", _count, keep=2),
                Column(f"tier{k}_gb_written", f"{medium} GB written", _fixed(1), keep=3)]
        k += 1
    out.append(Column("prefill_s_saved", "prefill s saved", _fixed(1), keep=3))
    return tuple(out)


def ab_table(result: ABResult) -> Table:
    """One row per arm, then the bounds (dimmed), with the workload in the title.
    `rejected` and `waits` appear only when some series has any."""
    w = result.workload
    analytic = ", ".join(f"B={b}: {r:.4f}" for b, r in w["analytic_hit_ratio"].items() if r is not None)
    rows = result.summary_rows()
    optional = ("rejected", "waits", "layout_ceiling_hit_ratio", "of_layout_ceiling", "uncacheable_by_layout",
                "layout_belady_hit_ratio", "bytes_per_token")  # fmt: skip
    hidden = {key for key in optional if not any(r[key] is not None and r[key] != 0 for r in rows)}
    return Table(
        title=f"A/B on {w['name']}: {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens, "
        f"pool {result.capacity_tokens:,} tokens, max_concurrent {result.max_concurrent}",
        columns=tuple(c for c in _AB_COLUMNS if c.key not in hidden) + _tier_columns(rows),
        rows=tuple(rows),
        caption=f"analytic ceiling {analytic}" if analytic else None,
        dim=frozenset(k for k, r in enumerate(rows) if r["kind"] == "bound"),
        section_after=frozenset({len(result.arms) - 1}),
    )


def sweep_table(result: SweepResult) -> Table:
    """A row per series; per capacity, the whole-run hit ratio (kept) and the last-50% one
    (the first to go when the terminal is narrow)."""
    w = result.workload
    columns = [Column("series", "series", keep=None, left=True)]
    for c in result.capacities:
        columns += [Column(f"hit_ratio@{c}", f"{c:,} tok", _fixed(3), keep=1),
                    Column(f"last_half_hit_ratio@{c}", f"{c:,} last 50%", _fixed(3), keep=0)]
    rows, dim = [], set()
    for name, points in result.series().items():
        row: dict[str, Any] = {"series": name}
        for p in points:
            row[f"hit_ratio@{p.capacity_tokens}"] = p.hit_ratio
            row[f"last_half_hit_ratio@{p.capacity_tokens}"] = p.last_half_hit_ratio
        if points[0].kind == "bound":
            dim.add(len(rows))
        rows.append(row)
    return Table(title=f"Sweep on {w['name']}: token hit ratio per pool capacity (TOKENS), "
                 "whole run and last 50% of requests", columns=tuple(columns), rows=tuple(rows), dim=frozenset(dim))


def _bound_style(name: str, block_sizes: list[int]) -> dict[str, Any]:
    """Ceilings dotted, Belady dashed; one grey per block size (darkest = smallest)."""
    shade = 0.1 + 0.45 * block_sizes.index(int(name.rsplit("=", 1)[1])) / max(len(block_sizes) - 1, 1)
    return {"linestyle": ":" if name.startswith("ceiling") else "--", "color": str(round(shade, 2)), "linewidth": 1.3}


ARM_STYLES = ("-", "-.", (0, (3, 1, 1, 1, 1, 1)), (0, (8, 2, 2, 2)), (0, (6, 1, 1, 1, 1, 1, 1, 1)), (0, (10, 2, 1, 2)))
"""Line styles of arms, in arm order (cycled): solid, then dash-dot patterns only; none is
plain dotted or dashed, the reference lines' styles (the bounds', round robin's, the
shared cache's), so a reference line never looks like an arm."""
ARM_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
EVICTION_ONSET = "eviction-onset"
"""The `gid` of each artist that marks where an arm first evicts (tests find them by it)."""


def arm_color(i: int) -> str:
    """Arm i's colour in every panel (matplotlib's default cycle); bounds are greys."""
    return f"C{i % 10}"


POINT_VALUE = "point-value"
"""The gid of the text that writes a plotted point's value beside it (sweep, cluster)."""


def label_points(panel: Any, xs: Sequence[float], ys: Sequence[float], color: Any, index: int) -> None:
    """Each point's value (3 decimals) just above it in `color`, series `index` a step
    higher than the one before, so series that meet at a point stay readable."""
    for x, y in zip(xs, ys):
        if y is None or y != y:  # no value (nan)
            continue
        panel.annotate(f"{y:.3f}", (x, y), textcoords="offset points", xytext=(0, 4 + 7 * index), ha="center",
                       fontsize=6, color=color, gid=POINT_VALUE)


def arm_line(i: int) -> dict[str, Any]:
    """Colour, line style and marker of arm i: each arm distinct even where lines overlap
    (an earlier arm, drawn first, has the larger marker, so it shows as a rim around a
    later one on the same point)."""
    return {"color": arm_color(i), "linestyle": ARM_STYLES[i % len(ARM_STYLES)],
            "marker": ARM_MARKERS[i % len(ARM_MARKERS)], "markersize": 9 - 2 * (i % 3), "linewidth": 1.6}


def _check_not_empty(requests: int) -> None:
    if requests < 1:
        raise ValueError("nothing to plot: the workload has no requests")


def _bar_labels(values: Sequence[float], first: float) -> list[str]:
    """Each bar's value, and after the first its difference from the first arm's."""
    return [f"{v:.3f}" if k == 0 else f"{v:.3f} ({v - first:+.3f})" for k, v in enumerate(values)]


def ab_figure(result: ABResult) -> Any:
    """The A/B figure (see `plot_ab`), not yet saved."""
    plt = _pyplot()  # first: without matplotlib, say so whatever the result
    _check_not_empty(result.workload["requests"])
    rows = result.summary_rows()
    fig, (bars, cumulative, cost) = plt.subplots(1, 3, figsize=(18, 5.6))

    names = [r["series"] for r in rows]
    x = range(len(rows))
    colors = [arm_color(i) if r["kind"] == "arm" else "0.8" if r["backend"] == "infinite" else "0.55"
              for i, r in enumerate(rows)]
    first = result.arms[0].name
    for offset, key, extra in ((-0.2, "hit_ratio", {"label": "whole run"}),
                               (0.2, "last_half_hit_ratio", {"alpha": 0.55, "hatch": "//",
                                                             "label": "last 50% of requests"})):
        values = [r[key] for r in rows]
        drawn = bars.bar([i + offset for i in x], values, 0.4, color=colors, **extra)
        bars.bar_label(drawn, _bar_labels(values, values[0]), rotation=90, padding=2, fontsize=7)
    bars.set_xticks(list(x), names, rotation=30, ha="right")
    bars.set_ylabel("token hit ratio")
    bars.set_ylim(0, 1.45)
    bars.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    bars.set_title(f"hit ratio; (±) = difference from {first}")
    bars.legend(loc="upper right", ncol=1, fontsize=8)

    prompt_total = list(accumulate(result.prompt_tokens))
    requests = range(1, len(prompt_total) + 1)
    every = max(len(prompt_total) // 12, 1)
    for i, a in enumerate(result.arms):
        curve = [h / p if p else 0.0 for h, p in zip(accumulate(a.hits.hit_tokens), prompt_total, strict=True)]
        cumulative.plot(requests, curve, label=a.name, markevery=(i * every // max(len(result.arms), 1), every),
                        **arm_line(i))
        if a.first_eviction is not None:
            at = a.first_eviction + 1
            cumulative.axvline(at, color=arm_color(i), linestyle=":", linewidth=1, alpha=0.8, gid=EVICTION_ONSET,
                               label=f"{a.name}: first eviction, request {at:,}")
    block_sizes = sorted({b.block_size for b in result.bounds})
    for b in result.bounds:
        name = bound_name(b.bound, b.block_size)
        curve = [h / p if p else 0.0 for h, p in zip(accumulate(b.hits.hit_tokens), prompt_total, strict=True)]
        cumulative.plot(requests, curve, label=name, **_bound_style(name, block_sizes))
    cumulative.set_xlabel("requests replayed")
    cumulative.set_ylabel("cumulative token hit ratio")
    cumulative.set_ylim(0, 1)
    cumulative.set_title("hit ratio as the run goes (dotted verticals: first eviction)")
    cumulative.legend(fontsize=7)

    boxes = cost.boxplot([a.bookkeeping_us for a in result.arms], whis=(1, 99), showfliers=False,
                         patch_artist=True, medianprops={"color": "black"})
    for i, box in enumerate(boxes["boxes"]):
        box.set_facecolor(arm_color(i))
        box.set_alpha(0.7)
    cost.set_xticks(range(1, len(result.arms) + 1), [a.name for a in result.arms], rotation=30, ha="right")
    cost.set_yscale("log")
    cost.set_ylabel("bookkeeping µs per request (1st-99th pct whiskers)")
    cost.set_title("cache bookkeeping cost (median: black)")

    w = result.workload
    fig.suptitle(f"A/B on {w['name']}: {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens; "
                 f"pool {result.capacity_tokens:,} tokens per arm, max_concurrent {result.max_concurrent}")
    fig.tight_layout()
    return fig


def plot_ab(result: ABResult, path: str | Path) -> None:
    """Three panels, one colour per arm in each: hit ratios per series (values on the bars,
    differences from the first arm), cumulative hit ratio over the run (each arm's first
    eviction marked), and bookkeeping µs per request per arm. ValueError for a result
    with no requests."""
    fig = ab_figure(result)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def eviction_onset(points: Sequence[Any]) -> Any | None:
    """Of one series' sweep points (capacity order), the largest capacity that still
    evicts: below it the pool is too small to keep the workload (None: never evicts)."""
    evicting = [p for p in points if p.evicted_blocks > 0]
    return evicting[-1] if evicting else None


def sweep_figure(result: SweepResult, marks: Sequence[tuple[str, float, float]] = (), title: str = "") -> Any:
    """The sweep figure (see `plot_sweep`), not yet saved."""
    plt = _pyplot()  # first: without matplotlib, say so whatever the result
    _check_not_empty(result.workload["requests"])
    fig, panels = plt.subplots(1, 2, figsize=(13, 5.4), sharey=True)
    block_sizes = sorted({p.block_size for p in result.points})
    for panel, metric, heading in ((panels[0], "hit_ratio", "whole run"),
                                   (panels[1], "last_half_hit_ratio", "last 50% of requests")):
        arm_index = 0
        for name, points in result.series().items():
            xs = [p.capacity_tokens for p in points]
            ys = [getattr(p, metric) for p in points]
            if points[0].kind == "bound":
                panel.plot(xs, ys, label=name, **_bound_style(name, block_sizes))
                continue
            panel.plot(xs, ys, label=name, **arm_line(arm_index))
            label_points(panel, xs, ys, arm_color(arm_index), arm_index)
            onset = eviction_onset(points)
            if onset is not None:
                panel.plot([onset.capacity_tokens], [getattr(onset, metric)], marker="o", markersize=13,
                           markerfacecolor="none", markeredgecolor=arm_color(arm_index), linestyle="none",
                           gid=EVICTION_ONSET, label=f"{name} evicts at <= {onset.capacity_tokens:,} tok")
            arm_index += 1
        panel.set_xscale("log")
        split = any(p.device_tokens is not None for p in result.points)
        panel.set_xlabel("total capacity: device + lower tiers (tokens)" if split else "pool capacity (tokens)")
        panel.set_title(f"{heading} (ring: largest capacity that still evicts)")
        panel.grid(True, alpha=0.3)
    seen: dict[float, int] = {}  # labels at one capacity are stacked, not overprinted
    for label, capacity, ratio in marks:
        below = seen[capacity] = seen.get(capacity, -1) + 1
        panels[0].plot([capacity], [ratio], marker="x", markersize=9, color="crimson", linestyle="none")
        panels[0].annotate(label, (capacity, ratio), textcoords="offset points", xytext=(6, -12 - 11 * below),
                           fontsize=8, color="crimson")
    panels[0].set_ylabel("token hit ratio")
    panels[0].set_ylim(0, 1)
    panels[1].legend(fontsize=7)
    w, caps = result.workload, result.capacities
    fig.suptitle(title or f"Sweep on {w['name']}: {w['requests']:,} requests, {w['prompt_tokens']:,} prompt tokens; "
                 f"pool {min(caps):,} to {max(caps):,} tokens per arm")
    fig.tight_layout()
    return fig


def plot_sweep(
    result: SweepResult, path: str | Path, marks: Sequence[tuple[str, float, float]] = (), title: str = ""
) -> None:
    """Hit ratio against capacity (log x), whole run and last 50%, every series, one line
    style per arm, each arm's eviction onset ringed; `marks` are reference points (label,
    capacity TOKENS, whole-run ratio), e.g. published figures. ValueError for no requests."""
    fig = sweep_figure(result, marks, title)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
