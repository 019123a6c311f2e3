"""The A/B and sweep plots a researcher reads: values and differences on the bars, one
colour and line style per arm in every panel, the eviction onset marked, a title with
the workload and the capacity."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import to_rgba  # noqa: E402

from prefixcache.ab import run_ab, sweep  # noqa: E402
from prefixcache.ab_config import ABConfig, WorkloadSpec  # noqa: E402
from prefixcache.ab_report import EVICTION_ONSET, POINT_VALUE, ab_figure, arm_color, sweep_figure  # noqa: E402
from prefixcache.config import CacheConfig  # noqa: E402

ARMS = {"hash/16": CacheConfig(backend="hash", block_size=16), "radix/16": CacheConfig(backend="radix", block_size=16),
        "radix/1": CacheConfig(backend="radix", block_size=1)}
WORKLOAD = WorkloadSpec(generator="shared_prefix", params={"num_groups": 4, "prompts_per_group": 4,
                                                           "system_prompt_len": 96, "question_len": 24,
                                                           "output_len": 8, "seed": 1})


def experiment(capacity: int) -> ABConfig:
    return ABConfig(WORKLOAD, ARMS, capacity)


def test_arms_record_their_first_eviction():
    small = run_ab(experiment(256), bounds=False)
    assert all(a.evicted_blocks > 0 and 0 < a.first_eviction < 16 for a in small.arms)
    assert all(a.first_eviction is None for a in run_ab(experiment(1 << 16), bounds=False).arms)


def test_the_ab_figure(tmp_path):
    result = run_ab(experiment(256))
    fig = ab_figure(result)
    bars, cumulative, cost = fig.axes
    labels = [t.get_text() for t in bars.texts]
    rows = result.summary_rows()
    first = rows[0]["hit_ratio"]
    assert labels[0] == f"{first:.3f}"  # the first arm's value, then each other's with its difference
    assert labels[1] == f"{rows[1]['hit_ratio']:.3f} ({rows[1]['hit_ratio'] - first:+.3f})"
    assert len(labels) == 2 * len(rows)
    assert "difference from hash/16" in bars.get_title()
    arm_lines = [line for line in cumulative.get_lines() if line.get_label() in ARMS]
    assert len({(str(line.get_linestyle()), line.get_marker()) for line in arm_lines}) == 3
    onsets = [a for a in cumulative.get_children() if a.get_gid() == EVICTION_ONSET]
    assert [to_rgba(a.get_color()) for a in onsets] == [to_rgba(arm_color(i)) for i in range(3)]
    assert [a.get_xdata()[0] for a in onsets] == [arm.first_eviction + 1 for arm in result.arms]
    # one colour per arm in every panel: the bars, the curves and the boxes agree
    boxes = [p for p in cost.patches]
    for i, name in enumerate(ARMS):
        colour = to_rgba(arm_color(i))
        assert to_rgba(bars.patches[i].get_facecolor())[:3] == colour[:3]
        assert to_rgba(arm_lines[i].get_color()) == colour
        assert to_rgba(boxes[i].get_facecolor())[:3] == colour[:3]
    arm_colours = {to_rgba(arm_color(i)) for i in range(3)}
    assert not any(to_rgba(line.get_color()) in arm_colours for line in cost.get_lines())  # medians: black
    title = fig._suptitle.get_text()
    assert "shared_prefix" in title and "16 requests" in title and "pool 256 tokens" in title
    fig.savefig(tmp_path / "ab.png")


def test_the_sweep_figure_rings_the_largest_capacity_that_evicts():
    result = sweep(experiment(256), [256, 1024, 1 << 16])
    fig = sweep_figure(result)
    whole = fig.axes[0]
    rings = {line.get_label().split(" ")[0]: line.get_xdata()[0] for line in whole.get_lines()
             if line.get_gid() == EVICTION_ONSET}
    for name, points in result.series().items():
        if points[0].kind == "arm":
            evicting = [p.capacity_tokens for p in points if p.evicted_blocks > 0]
            assert rings.get(name) == (max(evicting) if evicting else None)
    arm_lines = [line for line in whole.get_lines() if line.get_label() in ARMS]
    assert len({str(line.get_linestyle()) for line in arm_lines}) == 3
    assert "256 to 65,536 tokens" in fig._suptitle.get_text()
    for panel, metric in ((whole, "hit_ratio"), (fig.axes[1], "last_half_hit_ratio")):  # every arm point's value
        written = sorted((t.xy, t.get_text()) for t in panel.texts if t.get_gid() == POINT_VALUE)
        want = sorted(((p.capacity_tokens, getattr(p, metric)), f"{getattr(p, metric):.3f}")
                      for name, points in result.series().items() if points[0].kind == "arm" for p in points)
        assert written == want


def test_a_result_with_no_requests_is_not_plotted():
    from prefixcache.ab import ABResult

    empty = ABResult({"name": "trace", "requests": 0, "prompt_tokens": 0}, 256, 1, (), ())
    with pytest.raises(ValueError, match="nothing to plot: the workload has no requests"):
        ab_figure(empty)
