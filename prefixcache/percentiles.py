"""The one definition of a percentile that every report uses.

Owns `percentile` and `percentiles`: numpy's `percentile` with its default method,
"linear" (Hyndman and Fan's type 7: the order statistics interpolated linearly), which
is what vLLM's `benchmark_serving`, SGLang's `bench_serving` and AIPerf report. The A/B
tables (`prefixcache.ab`), the engine's run summary (`prefixcache.engine.metrics`), the
cluster A/B (`prefixcache.cluster`) and `prefixcache bench` (`prefixcache.loadgen`) all
read it from here, so a p99 means the same thing in every table of the project.

Must never: round, drop or reorder values, or import anything of the project.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["percentile", "percentiles", "mean"]


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0 <= q <= 100) of `values`, interpolated linearly (numpy's
    default); nan for no values. ValueError for q outside [0, 100]."""
    return percentiles(values, (q,))[0]


def percentiles(values: Sequence[float], qs: Iterable[float]) -> tuple[float, ...]:
    """`percentile(values, q)` for each q, sorting `values` once."""
    qs = tuple(qs)
    for q in qs:
        if not 0 <= q <= 100:  # also refuses nan
            raise ValueError(f"a percentile is in [0, 100], got {q!r}")
    if len(values) == 0:
        return tuple(math.nan for _ in qs)
    return tuple(float(v) for v in np.percentile(np.asarray(values, dtype=np.float64), qs))


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean; nan for no values."""
    return math.fsum(values) / len(values) if len(values) else math.nan
