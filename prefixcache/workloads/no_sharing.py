"""No-sharing workload: every prompt is fresh, so every cache hits 0% (the control case
that measures pure bookkeeping cost).

`num_requests` prompts of `prompt_len` fresh tokens with `output_len` fresh outputs.

Analytic infinite-cache token hit ratio: 0 at every block size, exact.
"""

from __future__ import annotations

import random

from prefixcache.workloads.build import assemble
from prefixcache.workloads.checks import NonNegative, Positive, Rate, checked_params
from prefixcache.workloads.tokens import TokenSource
from prefixcache.workloads.workload import Workload

__all__ = ["no_sharing", "no_sharing_hit_ratio"]


@checked_params
def no_sharing(
    num_requests: Positive = 256,
    prompt_len: Positive = 1000,
    output_len: NonNegative = 100,
    *,
    seed: int = 0,
    request_rate: Rate = None,
) -> Workload:
    """Unrelated requests. Lengths in TOKENS; `request_rate` in requests/s."""
    src = TokenSource()
    items = [(src.fresh(prompt_len), src.fresh(output_len), f"request{i}") for i in range(num_requests)]
    params = {"num_requests": num_requests, "prompt_len": prompt_len, "output_len": output_len, "seed": seed}
    return assemble("no_sharing", params, items, rng=random.Random(seed), request_rate=request_rate,
                    analytic=no_sharing_hit_ratio)


def no_sharing_hit_ratio(*, block_size: int) -> float:
    """Infinite-cache token hit ratio of `no_sharing`: 0.0 at any `block_size`."""
    return 0.0
