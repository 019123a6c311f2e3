"""What every generator does the same way: arrival times, order-keeping interleaving, block
rounding, and assembling the `Workload`.

Must never: hold random state of its own; every draw comes from the generator's seeded
`random.Random`, passed in, so a workload is a pure function of its parameters and seed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TypeVar

from prefixcache.workloads.checks import check_rate
from prefixcache.workloads.tokens import TokenRuns
from prefixcache.workloads.workload import AnalyticHitRatio, Request, Workload

__all__ = ["Item", "poisson_arrivals", "interleave", "whole_blocks", "assemble"]

Item = tuple[TokenRuns, TokenRuns, str]
"""(prompt, output, tag) of one request before it gets an arrival time."""

T = TypeVar("T")


def poisson_arrivals(rng: random.Random, num_requests: int, request_rate: float | None) -> list[float]:
    """Arrival times in SECONDS of a Poisson process at `request_rate` requests/s, drawn
    from `rng`; all 0.0 when the rate is None (everything arrives at once, as
    `sglang.bench_serving --request-rate inf`)."""
    rate = check_rate(request_rate)
    if rate is None:
        return [0.0] * num_requests
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def interleave(rng: random.Random, streams: Sequence[Sequence[T]]) -> list[T]:
    """A uniformly random merge of `streams` that keeps each stream's own order (turn k of a
    conversation stays after turn k-1)."""
    slots = [i for i, s in enumerate(streams) for _ in range(len(s))]
    rng.shuffle(slots)
    cursors = [0] * len(streams)
    out: list[T] = []
    for i in slots:
        out.append(streams[i][cursors[i]])
        cursors[i] += 1
    return out


def whole_blocks(num_tokens: int, block_size: int) -> int:
    """`num_tokens` rounded down to whole blocks, in TOKENS (what a cache can hold of it)."""
    return num_tokens // block_size * block_size


def assemble(
    name: str,
    params: Mapping[str, object],
    items: Sequence[Item],
    *,
    rng: random.Random,
    request_rate: float | None,
    analytic: AnalyticHitRatio | None,
    analytic_exact: bool = True,
) -> Workload:
    """The workload of `items` in the given order, with Poisson arrivals from `rng`."""
    arrivals = poisson_arrivals(rng, len(items), request_rate)
    requests = tuple(Request(t, p, o, None, tag) for t, (p, o, tag) in zip(arrivals, items, strict=True))
    return Workload(
        name=name,
        requests=requests,
        generator=name,
        params={**params, "request_rate": request_rate},
        analytic=analytic,
        analytic_exact=analytic_exact,
    )
