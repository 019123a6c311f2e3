"""How long a call takes, as the benchmarks report it: the fastest of several runs.

Must never: print, or decide how many runs a benchmark makes (its `--repeat` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["best_of"]


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of `repeat` runs of fn(), SECONDS of wall time."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best
