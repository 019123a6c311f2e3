"""Few-shot classification workload: one long block of labelled examples, short queries,
very short answers.

`num_tasks` classification tasks. Every prompt starts with an instruction of
`instruction_len` tokens shared by ALL tasks, then its task's examples block of
`examples_len` tokens (the "one long example block": k shots written out once per task),
then a fresh query of `query_len` tokens; the answer is a fresh label of `label_len`
tokens. `queries_per_task` queries per task, shuffled with the seed.

Must never: share anything but the instruction and a task's examples block.

Analytic infinite-cache token hit ratio at block size B, exact for every seed (the
two-level case of `shared_prefix`, see its docstring): with I, E, Q the three lengths,
T tasks and M queries each,

    ratio = [(T-1)*B*floor(I/B) + T*(M-1)*B*floor((I+E)/B)] / [T*M*(I+E+Q)]

Defaults (4 tasks x 128 queries, 50 + 1500 + 40 tokens, 2-token labels): 0.9674 at B = 1,
0.9587 at B = 16 (1550 and 50 are not multiples of 16: their tails are lost).
"""

from __future__ import annotations

import random
from functools import partial

from prefixcache.workloads.build import assemble
from prefixcache.workloads.checks import NonNegative, Positive, Rate, checked_params
from prefixcache.workloads.shared_prefix import grouped_prefix_hit_ratio, grouped_prefix_items
from prefixcache.workloads.workload import Workload

__all__ = ["few_shot", "few_shot_hit_ratio"]


@checked_params
def few_shot(
    num_tasks: Positive = 4,
    queries_per_task: Positive = 128,
    instruction_len: NonNegative = 50,
    examples_len: NonNegative = 1500,
    query_len: Positive = 40,
    label_len: NonNegative = 2,
    *,
    seed: int = 0,
    request_rate: Rate = None,
) -> Workload:
    """Few-shot classification. Lengths in TOKENS; `request_rate` in requests/s."""
    rng = random.Random(seed)
    items = grouped_prefix_items(
        rng, num_groups=num_tasks, prompts_per_group=queries_per_task, instruction_len=instruction_len,
        group_prompt_len=examples_len, query_len=query_len, output_len=label_len,
    )
    shape = dict(num_tasks=num_tasks, queries_per_task=queries_per_task, instruction_len=instruction_len,
                 examples_len=examples_len, query_len=query_len)
    return assemble("few_shot", {**shape, "label_len": label_len, "seed": seed}, items, rng=rng,
                    request_rate=request_rate, analytic=partial(few_shot_hit_ratio, **shape))


def few_shot_hit_ratio(
    num_tasks: int = 4, queries_per_task: int = 128, instruction_len: int = 50, examples_len: int = 1500,
    query_len: int = 40, *, block_size: int,
) -> float:
    """Infinite-cache token hit ratio of `few_shot` at `block_size` TOKENS."""
    return grouped_prefix_hit_ratio(num_groups=num_tasks, prompts_per_group=queries_per_task,
                                    instruction_len=instruction_len, group_prompt_len=examples_len,
                                    query_len=query_len, block_size=block_size)
