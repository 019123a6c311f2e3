"""The statistics of a `prefixcache bench` run, in vLLM's benchmark terms.

Owns `Distribution` (mean, median, p90, p99 of a latency, SECONDS) and `BenchSummary`:
completed and failed requests, throughput (requests/s, output and total TOKENS/s over
the run's duration: first send to last completion), TTFT, TPOT (per request, its output
after the first token), ITL (every gap between streamed chunks, pooled) and end-to-end
latency, and the server's prefix hit ratio: the sum of `cached_tokens` over the sum of
prompt tokens of completed requests (None when the server reported no cached tokens).

Must never: time anything (the client does) or print (report does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from prefixcache.loadgen.client import RequestResult
from prefixcache.percentiles import percentiles

__all__ = ["Distribution", "BenchSummary", "summarize"]


@dataclass(frozen=True)
class Distribution:
    """A latency over `count` samples, SECONDS (nan without samples)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        return cls(len(values), sum(values) / len(values), *percentiles(values, (50, 90, 99)))


@dataclass(frozen=True)
class BenchSummary:
    """A run's totals (module docstring). `not_sent`: requests the limits cut off
    (`--duration`, Ctrl-C) before they were sent or while in flight."""

    completed: int
    failed: int
    not_sent: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int | None
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2e: Distribution

    @property
    def request_throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def total_token_throughput(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.duration_s if self.duration_s > 0 else math.nan

    @property
    def hit_ratio(self) -> float | None:
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(request_throughput=self.request_throughput, output_throughput=self.output_throughput,
                   total_token_throughput=self.total_token_throughput, hit_ratio=self.hit_ratio)
        return out


def summarize(results: Sequence[RequestResult], planned: int, duration_s: float) -> BenchSummary:
    """The summary of `results` out of `planned` requests over `duration_s` SECONDS."""
    done = [r for r in results if r.ok]
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    return BenchSummary(
        completed=len(done),
        failed=len(results) - len(done),
        not_sent=planned - len(results),
        duration_s=duration_s,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=sum(r.output_tokens for r in done),
        cached_tokens=sum(cached) if cached else None,
        ttft=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot=Distribution.of([t for r in done if (t := r.tpot_s) is not None]),
        itl=Distribution.of([g for r in done for g in r.itl_s]),
        e2e=Distribution.of([r.latency_s for r in done if r.latency_s is not None]),
    )
