"""What a run measured: per-request latencies and token counts, per-run totals, tables.

Owns `RequestMetrics` (one request: cached tokens, prefill tokens computed, TTFT, time
per output token), `RunStats` (one run: prefill tokens computed vs saved, cache stats,
time inside cache calls), `percentile`, and the plain-text tables the CLI and the
benchmark print. Times are SECONDS from `time.perf_counter()`.

Must never: time anything itself or decide what a hit is; the scheduler and the cache do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.stats import CacheStats

__all__ = ["RequestMetrics", "RunStats", "percentile", "format_table", "request_table", "run_summary"]


@dataclass
class RequestMetrics:
    """One request. Token counts in TOKENS, times in SECONDS (perf_counter clock).

    cached_tokens:          prompt tokens hit at its first admission
    computed_prompt_tokens: prompt tokens computed by prefill, over every admission (a
                            preempted request recomputes what it lost on re-admission)
    """

    arrival_s: float
    prompt_tokens: int
    cached_tokens: int = 0
    computed_prompt_tokens: int = 0
    output_tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        """Arrival to first token."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if self.first_token_s is None or self.finish_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def latency_s(self) -> float | None:
        """Arrival to the last token."""
        return None if self.finish_s is None else self.finish_s - self.arrival_s


@dataclass(frozen=True)
class RunStats:
    """Totals of an engine since it was built (or since `Engine.reset_stats`).

    prefill_tokens_saved: prompt tokens served from the cache (sum of admission hits)
    cache_s:              time spent inside the cache's calls (admit, append, commit,
                          release, block_table): the bookkeeping cost of caching
    """

    requests: int
    prompt_tokens: int
    prefill_tokens_computed: int
    prefill_tokens_saved: int
    output_tokens: int
    steps: int
    preemptions: int
    wall_s: float
    cache_s: float
    cache: CacheStats

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; nan for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable in a terminal); floats with 3 decimals."""

    def cell(v: object) -> str:
        if isinstance(v, float):
            return "-" if math.isnan(v) else f"{v:.3f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def request_table(ids: Sequence[str], metrics: Sequence[RequestMetrics]) -> str:
    """One row per request: tokens, cached, computed, TTFT, TPOT (ms), preemptions."""
    rows = []
    for rid, m in zip(ids, metrics):
        ttft, tpot = m.ttft_s, m.tpot_s
        rows.append(
            [
                rid,
                m.prompt_tokens,
                m.cached_tokens,
                m.computed_prompt_tokens,
                m.output_tokens,
                None if ttft is None else round(ttft * 1000, 1),
                None if tpot is None else round(tpot * 1000, 1),
                m.preemptions,
            ]
        )
    return format_table(
        ["request", "prompt", "cached", "computed", "output", "TTFT ms", "TPOT ms", "preempted"], rows
    )


def run_summary(stats: RunStats) -> str:
    """The run's totals as a two-column table."""
    c = stats.cache
    rows = [
        ["requests", stats.requests],
        ["prompt tokens", stats.prompt_tokens],
        ["prefill tokens computed", stats.prefill_tokens_computed],
        ["prefill tokens saved (cache hits)", stats.prefill_tokens_saved],
        ["output tokens", stats.output_tokens],
        ["steps", stats.steps],
        ["preemptions", stats.preemptions],
        ["wall time s", round(stats.wall_s, 3)],
        ["time in cache calls ms", round(stats.cache_s * 1000, 3)],
        ["output tokens/s", round(stats.output_tokens_per_s, 2)],
        ["cache hit rate", round(c.hit_rate, 4)],
        ["cache evictions (blocks)", c.evictions],
        ["cache refusals", c.rejected],
    ]
    return format_table(["run", "value"], rows)
