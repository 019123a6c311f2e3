"""The generator catalog: workload generators by name, with their analytic hit ratios.

Owns the name -> (generator, analytic formula) table that a config file, the CLI and
`files.load_workload` use to build a workload or re-attach its formula. Must never:
generate anything itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Any, NamedTuple

from prefixcache.workloads.checks import MAX_PROMPT_TOKENS, MAX_REQUESTS
from prefixcache.workloads.few_shot import few_shot, few_shot_hit_ratio
from prefixcache.workloads.multi_turn import multi_turn, multi_turn_hit_ratio
from prefixcache.workloads.no_sharing import no_sharing, no_sharing_hit_ratio
from prefixcache.workloads.parallel_sampling import parallel_sampling, parallel_sampling_hit_ratio
from prefixcache.workloads.rag import rag, rag_hit_ratio
from prefixcache.workloads.shared_prefix import shared_prefix, shared_prefix_hit_ratio
from prefixcache.workloads.tree_of_thought import tree_of_thought, tree_of_thought_hit_ratio
from prefixcache.workloads.workload import AnalyticHitRatio, Workload

__all__ = ["Generator", "GENERATORS", "generate", "num_requests", "too_many_requests", "analytic_for"]


class Generator(NamedTuple):
    """A workload generator, its infinite-cache hit-ratio formula (block_size keyword),
    and how many requests it makes: `num_requests(args, cap)` from its full arguments
    (defaults applied), exact, or cap + 1 for any number past cap."""

    make: Callable[..., Workload]
    hit_ratio: Callable[..., float]
    num_requests: Callable[[Mapping[str, Any], int], int]


def _tree_requests(a: Mapping[str, Any], cap: int) -> int:
    """num_problems * (branching + branching**2 + ... + branching**depth), or cap + 1
    once that is past cap (the powers are not computed: depth may be huge)."""
    if a["branching"] < 2:
        return a["num_problems"] * a["depth"]
    per, level = 0, 1
    for _ in range(a["depth"]):
        level *= a["branching"]
        per += level
        if per * a["num_problems"] > cap:
            return cap + 1
    return a["num_problems"] * per


GENERATORS: Mapping[str, Generator] = MappingProxyType({
    "shared_prefix": Generator(shared_prefix, shared_prefix_hit_ratio,
                               lambda a, cap: a["num_groups"] * a["prompts_per_group"]),
    "few_shot": Generator(few_shot, few_shot_hit_ratio, lambda a, cap: a["num_tasks"] * a["queries_per_task"]),
    "multi_turn": Generator(multi_turn, multi_turn_hit_ratio, lambda a, cap: a["num_conversations"] * a["turns"]),
    "parallel_sampling": Generator(parallel_sampling, parallel_sampling_hit_ratio,
                                   lambda a, cap: a["num_prompts"] * a["n"]),
    "rag": Generator(rag, rag_hit_ratio, lambda a, cap: a["num_requests"]),
    "tree_of_thought": Generator(tree_of_thought, tree_of_thought_hit_ratio, _tree_requests),
    "no_sharing": Generator(no_sharing, no_sharing_hit_ratio, lambda a, cap: a["num_requests"]),
})


def _lookup(name: str) -> Generator:
    try:
        return GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload generator {name!r}; known: {', '.join(GENERATORS)}") from None


def num_requests(name: str, **params: object) -> int | None:
    """How many requests generator `name` would make with `params`, without making them
    (exact, or MAX_REQUESTS + 1 for any number past it); None when a parameter the count
    needs is not an int (the generator itself then says which)."""
    generator = _lookup(name)
    bound = inspect.signature(generator.make).bind_partial(**params)
    bound.apply_defaults()
    args = bound.arguments
    if any(isinstance(v, bool) or not isinstance(v, int) for k, v in args.items() if k not in ("seed", "request_rate")):
        return None
    return generator.num_requests(args, MAX_REQUESTS)


def generate(name: str, **params: object) -> Workload:
    """The workload of generator `name` with `params` (its keyword arguments, seed included).
    An unknown name or parameter is a ValueError that lists what is allowed; so is a
    workload past MAX_REQUESTS requests (checked before anything is generated) or
    MAX_PROMPT_TOKENS prompt tokens."""
    make = _lookup(name).make
    allowed = inspect.signature(make).parameters
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"workload {name!r}: unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    count = num_requests(name, **params)
    if count is not None and count > MAX_REQUESTS:
        raise ValueError(too_many_requests(name, count))
    workload = make(**params)
    if workload.prompt_tokens > MAX_PROMPT_TOKENS:
        raise ValueError(
            f"workload {name!r} holds {workload.prompt_tokens:.3g} prompt tokens; at most {MAX_PROMPT_TOKENS:.0e} "
            "are allowed"
        )
    return workload


def too_many_requests(name: str, count: int) -> str:
    """The message for generator `name` making `count` (> MAX_REQUESTS) requests."""
    shown = f"more than {MAX_REQUESTS:,}" if count == MAX_REQUESTS + 1 or count >= 10**18 else f"{count:,}"
    return f"generator {name!r} would make {shown} requests; at most {MAX_REQUESTS:,} are allowed"


def analytic_for(name: str, params: Mapping[str, object]) -> AnalyticHitRatio | None:
    """Generator `name`'s hit-ratio formula bound to `params` (None for a name not in the
    catalog, such as a trace)."""
    if name not in GENERATORS:
        return None
    formula = GENERATORS[name].hit_ratio
    accepted = [p for p in inspect.signature(formula).parameters if p != "block_size"]
    return partial(formula, **{p: params[p] for p in accepted if p in params})
