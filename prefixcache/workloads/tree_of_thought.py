"""Tree-of-thought workload: a search tree of reasoning steps, each step a request whose
prompt is the problem plus the thoughts on its path.

`num_problems` problems of `problem_len` fresh tokens. For each, a tree of `depth`
levels with `branching` children per node: expanding a node at depth l (the root is the
bare problem, l = 0) sends `branching` requests whose prompt is the problem + the l
thoughts on the path to that node, and each request's OUTPUT (`thought_len` fresh tokens)
is one child thought. Expansion is breadth-first within a problem; problems are
interleaved at random (seeded), each keeping its own order, so a node is expanded only
after the request that produced it.

Must never: share content between problems.

Analytic infinite-cache token hit ratio at block size B, exact for every seed. The
request expanding a node at depth l has P_l = p + l*t prompt tokens; the request that
produced that node cached the whole blocks of exactly those tokens, and the hit is capped
at P_l - 1, so each of the b requests hits B*floor((P_l - 1)/B) for l >= 1; at the root
the first request hits nothing and the other b - 1 hit B*floor((p-1)/B). Per problem

    hits   = (b-1)*B*floor((p-1)/B) + sum_{l=1}^{D-1} b^(l+1) * B*floor((p + l*t - 1)/B)
    prompt = sum_{l=0}^{D-1} b^(l+1) * (p + l*t)

Defaults (16 problems, 500 tokens, 3 x 3 levels, 100-token thoughts): 0.9791 at B = 1,
0.9650 at B = 16.
"""

from __future__ import annotations

import random
from functools import partial

from prefixcache.workloads.build import Item, assemble, interleave, whole_blocks
from prefixcache.workloads.checks import NonNegative, Positive, Rate, checked_params
from prefixcache.workloads.tokens import TokenSource
from prefixcache.workloads.workload import Workload

__all__ = ["tree_of_thought", "tree_of_thought_hit_ratio"]


@checked_params
def tree_of_thought(
    num_problems: Positive = 16,
    problem_len: Positive = 500,
    branching: Positive = 3,
    depth: Positive = 3,
    thought_len: NonNegative = 100,
    *,
    seed: int = 0,
    request_rate: Rate = None,
) -> Workload:
    """Tree-of-thought search. Lengths in TOKENS; `request_rate` in requests/s;
    `branching**1 + ... + branching**depth` requests per problem."""
    rng, src = random.Random(seed), TokenSource()
    problems: list[list[Item]] = []
    for p in range(num_problems):
        frontier, items = [(src.fresh(problem_len), f"problem{p}")], []
        for _ in range(depth):
            children = []
            for path, name in frontier:
                for c in range(branching):
                    thought = src.fresh(thought_len)
                    items.append((path, thought, f"{name}/{c}"))
                    children.append((path + thought, f"{name}/{c}"))
            frontier = children
        problems.append(items)
    shape = dict(problem_len=problem_len, branching=branching, depth=depth, thought_len=thought_len)
    return assemble("tree_of_thought", {"num_problems": num_problems, **shape, "seed": seed},
                    interleave(rng, problems), rng=rng, request_rate=request_rate,
                    analytic=partial(tree_of_thought_hit_ratio, **shape))


def tree_of_thought_hit_ratio(
    problem_len: int = 500, branching: int = 3, depth: int = 3, thought_len: int = 100, *, block_size: int,
) -> float:
    """Infinite-cache token hit ratio of `tree_of_thought` at `block_size` TOKENS."""
    p, b, d, t = problem_len, branching, depth, thought_len
    hits = (b - 1) * whole_blocks(p - 1, block_size)
    hits += sum(b ** (lvl + 1) * whole_blocks(p + lvl * t - 1, block_size) for lvl in range(1, d))
    prompt = sum(b ** (lvl + 1) * (p + lvl * t) for lvl in range(d))
    return hits / prompt
