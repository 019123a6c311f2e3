"""One percentile for every report: numpy's linear interpolation, defined once
(`prefixcache.percentiles`) and read by the A/B, the engine, the cluster and the load
generator alike."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from prefixcache.percentiles import mean, percentile, percentiles

ROOT = Path(__file__).resolve().parent.parent


def test_a_percentile_is_numpys_linear_interpolation():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)  # 0.9 x 4 = 3.6: between the 4th and 5th
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentiles(values, (0, 100)) == (1.0, 5.0)
    rng = np.random.default_rng(0)
    sample = rng.exponential(size=1001).tolist()
    for q in (1, 25, 50, 90, 99, 99.9):
        assert percentile(sample, q) == float(np.percentile(sample, q))


def test_no_values_and_bad_ranks():
    assert math.isnan(percentile([], 50)) and math.isnan(mean([]))
    assert percentile([7.0], 99) == 7.0 and mean([1.0, 2.0]) == 1.5
    for q in (-1, 101, math.nan):
        with pytest.raises(ValueError, match=r"a percentile is in \[0, 100\]"):
            percentile([1.0], q)


def test_no_module_defines_a_percentile_of_its_own():
    """Every report reads `prefixcache.percentiles`; a second definition would let two
    tables disagree about what p99 means."""
    own = []
    for path in sorted([*(ROOT / "prefixcache").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        if path == ROOT / "prefixcache" / "percentiles.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("percentile"):
                own.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert own == []
