"""Per-request hit counts and the token hit ratios computed from them.

Owns `HitCounts`: what one replay of a workload yields per request (hit TOKENS and prompt
TOKENS, in arrival order), and the two ratios every comparison reports: the whole run and
the last 50% of requests (after the cache has warmed up). The bounds return it, and a
replay through a real cache builds the same thing, so the two compare request by request.

Must never: replay anything or decide what a hit is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["HitCounts", "HitRatios"]


@dataclass(frozen=True)
class HitCounts:
    """`hit_tokens[i]` of `prompt_tokens[i]` prompt tokens of request i were served from cache."""

    hit_tokens: tuple[int, ...]
    prompt_tokens: tuple[int, ...]

    def __init__(self, hit_tokens: Sequence[int], prompt_tokens: Sequence[int]) -> None:
        hits, prompts = tuple(hit_tokens), tuple(prompt_tokens)
        if len(hits) != len(prompts):
            raise ValueError(f"hit_tokens has {len(hits)} entries but prompt_tokens has {len(prompts)}")
        for i, (h, p) in enumerate(zip(hits, prompts, strict=True)):
            if not 0 <= h < p:
                raise ValueError(f"request {i}: hit_tokens={h} must be in [0, prompt_tokens={p})")
        object.__setattr__(self, "hit_tokens", hits)
        object.__setattr__(self, "prompt_tokens", prompts)

    def __len__(self) -> int:
        return len(self.hit_tokens)

    def ratio(self, first_request: int = 0) -> float:
        """Token hit ratio over requests `first_request`.. (0.0 when there are none)."""
        total = sum(self.prompt_tokens[first_request:])
        return sum(self.hit_tokens[first_request:]) / total if total else 0.0

    @property
    def hit_ratio(self) -> float:
        """Token hit ratio of the whole run."""
        return self.ratio(0)

    @property
    def last_half_hit_ratio(self) -> float:
        """Token hit ratio of the last 50% of requests (from index n // 2)."""
        return self.ratio(len(self) // 2)

    @property
    def total_hit_tokens(self) -> int:
        """Prefill TOKENS saved over the whole run."""
        return sum(self.hit_tokens)


class HitRatios:
    """The two ratios of a result that carries `hits: HitCounts` (a bound, an A/B arm)."""

    hits: HitCounts

    @property
    def hit_ratio(self) -> float:
        """Token hit ratio of the whole run."""
        return self.hits.hit_ratio

    @property
    def last_half_hit_ratio(self) -> float:
        """Token hit ratio of the last 50% of requests."""
        return self.hits.last_half_hit_ratio
