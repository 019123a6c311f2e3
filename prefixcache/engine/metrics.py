"""What a run measured: per-request latencies and token counts, per-run totals, tables.

Owns `RequestMetrics` (one request: cached tokens, prefill tokens computed, TTFT, time
per output token), `RunStats` (one run: prefill tokens computed vs saved, cache stats,
time inside cache calls), the tables `prefixcache generate` prints (as
`prefixcache.tables.Table`s, in any --format) and the plain-text one the benchmark
prints. Times are SECONDS from `time.perf_counter()`.

Must never: time anything itself or decide what a hit is; the scheduler and the cache do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.stats import CacheStats
from prefixcache.tables import Column, Table

__all__ = ["RequestMetrics", "RunStats", "format_table", "request_table", "run_summary"]


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
    paced_s:              SECONDS slept to pace steps (`engine.pace`)
    overrun_steps:        paced steps whose own work took longer than the model gives
                          them (the host too slow for the pace: those steps ran late)
    prefix_waits:         steps a waiting request was passed over while a running
                          request computed the prefix it shares (`in_batch_prefix_tokens`)
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
    paced_s: float = 0.0
    overrun_steps: int = 0
    prefix_waits: int = 0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def _cell(v: object) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.3f}"
    return "-" if v is None else str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable in a terminal); floats with 3 decimals."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


_REQUEST_COLUMNS = (
    Column("request", "request", keep=None, left=True),
    Column("prompt_tokens", "prompt", keep=5),
    Column("cached_tokens", "cached", keep=None),
    Column("computed_prompt_tokens", "computed", keep=4),
    Column("output_tokens", "output", keep=3),
    Column("ttft_ms", "TTFT ms", keep=2),
    Column("tpot_ms", "TPOT ms", keep=1),
    Column("preemptions", "preempted", keep=0),
)


def request_table(ids: Sequence[str], metrics: Sequence[RequestMetrics], title: str = "Requests") -> Table:
    """One row per request: tokens, cached, computed, TTFT, TPOT (ms), preemptions."""
    rows = []
    for rid, m in zip(ids, metrics):
        ttft, tpot = m.ttft_s, m.tpot_s
        rows.append(
            {
                "request": rid,
                "prompt_tokens": m.prompt_tokens,
                "cached_tokens": m.cached_tokens,
                "computed_prompt_tokens": m.computed_prompt_tokens,
                "output_tokens": m.output_tokens,
                "ttft_ms": None if ttft is None else round(ttft * 1000, 1),
                "tpot_ms": None if tpot is None else round(tpot * 1000, 1),
                "preemptions": m.preemptions,
            }
        )
    return Table(title=title, columns=_REQUEST_COLUMNS, rows=tuple(rows))


def run_summary(stats: RunStats) -> Table:
    """The run's totals as a two-column table."""
    c = stats.cache
    rows = [
        ("requests", stats.requests),
        ("prompt tokens", stats.prompt_tokens),
        ("prefill tokens computed", stats.prefill_tokens_computed),
        ("prefill tokens saved (cache hits)", stats.prefill_tokens_saved),
        ("output tokens", stats.output_tokens),
        ("steps", stats.steps),
        ("preemptions", stats.preemptions),
        ("waits for a shared prefix (steps)", stats.prefix_waits),
        ("wall time s", round(stats.wall_s, 3)),
        ("time in cache calls ms", round(stats.cache_s * 1000, 3)),
        ("output tokens/s", round(stats.output_tokens_per_s, 2)),
        ("cache hit rate", round(c.hit_rate, 4)),
        ("cache evictions (blocks)", c.evictions),
        ("cache refusals", c.rejected),
    ]
    columns = (Column("run", "run", keep=None, left=True), Column("value", "value", _cell, keep=None))
    return Table(title="Run", columns=columns, rows=tuple({"run": k, "value": v} for k, v in rows))
