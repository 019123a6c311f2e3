"""Shared system prompt workload (SGLang `bench_serving --dataset-name generated-shared-prefix`).

`num_groups` groups; each group has its own system prompt of `system_prompt_len` tokens and
`prompts_per_group` requests = system prompt + a fresh question of `question_len` tokens,
each answered with `output_len` fresh tokens. Requests are shuffled with the seed (SGLang
shuffles too). Defaults are SGLang's: 64 x 16, 2048, 128, 256.

The same builder, with an optional instruction shared by EVERY group in front of the
group's block, serves the few-shot workload (`few_shot.py`).

Must never: share content other than the instruction and the group prompts; every other
token is fresh (see `tokens.TokenSource`), which is what makes the hit ratio exact.

Analytic infinite-cache token hit ratio, at any block size B (exact for every seed):
the first request overall hits nothing; the first request of each other group hits the
instruction, `B*floor(I/B)` tokens; every later request of a group hits instruction +
group prompt, `B*floor((I+S)/B)` (the block holding the question's first token is never
cached, and a question of >= 1 token keeps that under the `len - 1` cap). So

    ratio = [(G-1)*B*floor(I/B) + G*(M-1)*B*floor((I+S)/B)] / [G*M*(I+S+Q)]

With I = 0 this is (M-1)/M * B*floor(S/B)/(S+Q): 0.882 for the defaults at B = 1 and
B = 16 (2048 is a multiple of 16); a non-aligned S loses its tail block at B > 1.
"""

from __future__ import annotations

import random
from functools import partial

from prefixcache.workloads.build import Item, assemble, whole_blocks
from prefixcache.workloads.checks import NonNegative, Positive, Rate, checked_params
from prefixcache.workloads.tokens import TokenSource
from prefixcache.workloads.workload import Workload

__all__ = ["shared_prefix", "shared_prefix_hit_ratio", "grouped_prefix_items", "grouped_prefix_hit_ratio"]


def grouped_prefix_hit_ratio(
    *, num_groups: int, prompts_per_group: int, instruction_len: int, group_prompt_len: int, query_len: int,
    block_size: int,
) -> float:
    """Infinite-cache token hit ratio of `grouped_prefix_items` (module docstring)."""
    g, m, i, s, q, b = num_groups, prompts_per_group, instruction_len, group_prompt_len, query_len, block_size
    hits = (g - 1) * whole_blocks(i, b) + g * (m - 1) * whole_blocks(i + s, b)
    return hits / (g * m * (i + s + q))


@checked_params
def grouped_prefix_items(
    rng: random.Random,
    *,
    num_groups: Positive,
    prompts_per_group: Positive,
    instruction_len: NonNegative,
    group_prompt_len: NonNegative,
    query_len: Positive,
    output_len: NonNegative,
) -> list[Item]:
    """Instruction (shared by all) + group prompt (shared in a group) + fresh query, with a
    fresh output; shuffled with `rng`. Lengths in TOKENS."""
    src = TokenSource()
    instruction = src.fresh(instruction_len)
    items: list[Item] = []
    for g in range(num_groups):
        head = instruction + src.fresh(group_prompt_len)
        for k in range(prompts_per_group):
            items.append((head + src.fresh(query_len), src.fresh(output_len), f"group{g}/prompt{k}"))
    rng.shuffle(items)
    return items


@checked_params
def shared_prefix(
    num_groups: Positive = 64,
    prompts_per_group: Positive = 16,
    system_prompt_len: NonNegative = 2048,
    question_len: Positive = 128,
    output_len: NonNegative = 256,
    *,
    seed: int = 0,
    request_rate: Rate = None,
) -> Workload:
    """SGLang's generated-shared-prefix workload. Lengths in TOKENS; `request_rate` in
    requests/s (None: all arrive at 0)."""
    rng = random.Random(seed)
    items = grouped_prefix_items(
        rng, num_groups=num_groups, prompts_per_group=prompts_per_group, instruction_len=0,
        group_prompt_len=system_prompt_len, query_len=question_len, output_len=output_len,
    )
    shape = dict(num_groups=num_groups, prompts_per_group=prompts_per_group, system_prompt_len=system_prompt_len,
                 question_len=question_len)
    return assemble("shared_prefix", {**shape, "output_len": output_len, "seed": seed}, items, rng=rng,
                    request_rate=request_rate, analytic=partial(shared_prefix_hit_ratio, **shape))


def shared_prefix_hit_ratio(
    num_groups: int = 64, prompts_per_group: int = 16, system_prompt_len: int = 2048, question_len: int = 128,
    *, block_size: int,
) -> float:
    """Infinite-cache token hit ratio of `shared_prefix` at `block_size` TOKENS."""
    return grouped_prefix_hit_ratio(num_groups=num_groups, prompts_per_group=prompts_per_group, instruction_len=0,
                                    group_prompt_len=system_prompt_len, query_len=question_len, block_size=block_size)
