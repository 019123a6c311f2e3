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
from typing import NamedTuple

from prefixcache.workloads.few_shot import few_shot, few_shot_hit_ratio
from prefixcache.workloads.multi_turn import multi_turn, multi_turn_hit_ratio
from prefixcache.workloads.no_sharing import no_sharing, no_sharing_hit_ratio
from prefixcache.workloads.parallel_sampling import parallel_sampling, parallel_sampling_hit_ratio
from prefixcache.workloads.rag import rag, rag_hit_ratio
from prefixcache.workloads.shared_prefix import shared_prefix, shared_prefix_hit_ratio
from prefixcache.workloads.tree_of_thought import tree_of_thought, tree_of_thought_hit_ratio
from prefixcache.workloads.workload import AnalyticHitRatio, Workload

__all__ = ["Generator", "GENERATORS", "generate", "analytic_for"]


class Generator(NamedTuple):
    """A workload generator and its infinite-cache hit-ratio formula (block_size keyword)."""

    make: Callable[..., Workload]
    hit_ratio: Callable[..., float]


GENERATORS: Mapping[str, Generator] = MappingProxyType({
    "shared_prefix": Generator(shared_prefix, shared_prefix_hit_ratio),
    "few_shot": Generator(few_shot, few_shot_hit_ratio),
    "multi_turn": Generator(multi_turn, multi_turn_hit_ratio),
    "parallel_sampling": Generator(parallel_sampling, parallel_sampling_hit_ratio),
    "rag": Generator(rag, rag_hit_ratio),
    "tree_of_thought": Generator(tree_of_thought, tree_of_thought_hit_ratio),
    "no_sharing": Generator(no_sharing, no_sharing_hit_ratio),
})


def _lookup(name: str) -> Generator:
    try:
        return GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload generator {name!r}; known: {', '.join(GENERATORS)}") from None


def generate(name: str, **params: object) -> Workload:
    """The workload of generator `name` with `params` (its keyword arguments, seed included).
    An unknown name or parameter is a ValueError that lists what is allowed."""
    make = _lookup(name).make
    allowed = inspect.signature(make).parameters
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"workload {name!r}: unknown parameter(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return make(**params)


def analytic_for(name: str, params: Mapping[str, object]) -> AnalyticHitRatio | None:
    """Generator `name`'s hit-ratio formula bound to `params` (None for a name not in the
    catalog, such as a trace)."""
    if name not in GENERATORS:
        return None
    formula = GENERATORS[name].hit_ratio
    accepted = [p for p in inspect.signature(formula).parameters if p != "block_size"]
    return partial(formula, **{p: params[p] for p in accepted if p in params})
