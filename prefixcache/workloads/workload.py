"""The workload data model: `Request` (one request of a replay) and `Workload` (a stream).

Owns what a workload IS: requests in arrival order with their prompt and output tokens and
namespace, the generator's name and parameters, and the analytic infinite-cache hit ratio
where the generator has one. Must never: draw random numbers (generators do, from their
own seeded `random.Random`), touch a cache, or decide what a hit is (`bounds` does).

Not to be confused with `prefixcache.requests.Request`, a LIVE request inside a backend;
this one is an immutable record that a replay feeds to `PrefixCache.admit`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from prefixcache.requests import check_namespace
from prefixcache.workloads.checks import check_int
from prefixcache.workloads.tokens import TokenRuns

__all__ = ["Request", "Workload", "AnalyticHitRatio"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request: it arrives at `arrival_s` (SECONDS from the workload's start), sends
    `prompt`, and produces `output` (concrete token ids, so a replay can append and commit
    them and a later turn can contain them). `tag` is a human label ("conv3/turn2")."""

    arrival_s: float
    prompt: TokenRuns
    output: TokenRuns = field(default_factory=TokenRuns)
    namespace: str | None = None
    tag: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", TokenRuns.of(self.prompt))
        object.__setattr__(self, "output", TokenRuns.of(self.output))
        if not len(self.prompt):
            raise ValueError(f"request {self.tag!r}: prompt must have at least one token")
        a = self.arrival_s
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a < 0:
            raise ValueError(f"request {self.tag!r}: arrival_s must be a finite number >= 0, got {a!r}")
        check_namespace(self.namespace)

    @property
    def prompt_len(self) -> int:
        """Prompt length in TOKENS."""
        return len(self.prompt)

    @property
    def output_len(self) -> int:
        """Output length in TOKENS."""
        return len(self.output)


AnalyticHitRatio = Callable[[int], float]
"""`analytic(block_size=B)`: the infinite-cache token hit ratio at B TOKENS per block."""


@dataclass(frozen=True)
class Workload:
    """A deterministic stream of requests in arrival order.

    `generator`/`params` say how it was made (enough to make it again); `analytic`, when
    the generator has a closed form, maps a block size to the infinite-cache token hit
    ratio (hit tokens / prompt tokens) under the real-cache rules (whole blocks, hit at
    most `len(prompt) - 1`); `analytic_exact` is False where that value is an expectation
    over the random draws rather than exact for every seed.
    """

    name: str
    requests: tuple[Request, ...]
    generator: str = ""
    params: Mapping[str, object] = field(default_factory=dict)
    analytic: AnalyticHitRatio | None = field(default=None, compare=False, repr=False)
    analytic_exact: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        previous = 0.0
        for i, r in enumerate(self.requests):
            if not isinstance(r, Request):
                raise TypeError(f"workload {self.name!r}: requests[{i}] must be a Request, got {type(r).__name__}")
            if r.arrival_s < previous:
                raise ValueError(
                    f"workload {self.name!r}: requests[{i}].arrival_s={r.arrival_s} is before the previous "
                    f"request's {previous}; requests must be in arrival order"
                )
            previous = r.arrival_s

    def __len__(self) -> int:
        return len(self.requests)

    def analytic_hit_ratio(self, block_size: int) -> float | None:
        """The generator's infinite-cache token hit ratio at `block_size` TOKENS, or None."""
        check_int("block_size", block_size, 1)
        return None if self.analytic is None else self.analytic(block_size=block_size)

    @property
    def prompt_tokens(self) -> int:
        """Total prompt TOKENS (the hit ratio's denominator)."""
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        """Total output TOKENS."""
        return sum(len(r.output) for r in self.requests)

    def with_namespace(self, namespace: str | None) -> Workload:
        """The same workload with every request in `namespace` (hit ratios unchanged)."""
        check_namespace(namespace)
        return replace(self, requests=tuple(replace(r, namespace=namespace) for r in self.requests))

    def head(self, num_requests: int) -> Workload:
        """The first `num_requests` requests (no analytic ratio: it is for the whole stream)."""
        check_int("num_requests", num_requests, 0)
        return replace(self, requests=self.requests[:num_requests], analytic=None)

