"""Parallel sampling workload (n > 1): each prompt is sent `n` times and each copy samples
its own answer, as vLLM's `SamplingParams(n=...)` fans one prompt out into n requests.

`num_prompts` distinct prompts of `prompt_len` fresh tokens; for each, `n` consecutive
requests with that prompt and a fresh output of `output_len` tokens. Prompts follow each
other in order (the n copies of one prompt arrive together).

Must never: share anything between different prompts.

Analytic infinite-cache token hit ratio at block size B, exact: the first copy hits
nothing; each later copy finds the prompt's whole blocks cached but may hit at most
`len - 1` tokens, i.e. B*floor((P-1)/B). So

    ratio = (n-1) * B*floor((P-1)/B) / (n*P)

A prompt that is a whole number of blocks therefore loses its last block at every copy.
Defaults (128 prompts x n = 8, 1000 tokens, 200-token outputs): 0.8741 at B = 1,
0.8680 at B = 16.
"""

from __future__ import annotations

import random
from functools import partial

from prefixcache.workloads.build import Item, assemble, whole_blocks
from prefixcache.workloads.checks import NonNegative, Positive, Rate, checked_params
from prefixcache.workloads.tokens import TokenSource
from prefixcache.workloads.workload import Workload

__all__ = ["parallel_sampling", "parallel_sampling_hit_ratio"]


@checked_params
def parallel_sampling(
    num_prompts: Positive = 128,
    n: Positive = 8,
    prompt_len: Positive = 1000,
    output_len: NonNegative = 200,
    *,
    seed: int = 0,
    request_rate: Rate = None,
) -> Workload:
    """n samples per prompt. Lengths in TOKENS; `request_rate` in requests/s (the seed
    only drives arrival times: the structure has no other randomness)."""
    src = TokenSource()
    items: list[Item] = []
    for p in range(num_prompts):
        prompt = src.fresh(prompt_len)
        items.extend((prompt, src.fresh(output_len), f"prompt{p}/sample{i}") for i in range(n))
    shape = dict(n=n, prompt_len=prompt_len)
    return assemble("parallel_sampling", {"num_prompts": num_prompts, **shape, "output_len": output_len, "seed": seed},
                    items, rng=random.Random(seed), request_rate=request_rate,
                    analytic=partial(parallel_sampling_hit_ratio, **shape))


def parallel_sampling_hit_ratio(n: int = 8, prompt_len: int = 1000, *, block_size: int) -> float:
    """Infinite-cache token hit ratio of `parallel_sampling` at `block_size` TOKENS."""
    return (n - 1) * whole_blocks(prompt_len - 1, block_size) / (n * prompt_len)
