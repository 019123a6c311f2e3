"""Workloads for prefix-cache experiments, and the reference bounds a replay is judged by.

A workload is a deterministic (seeded) stream of requests (arrival time, prompt tokens,
output tokens, namespace). This package owns the data model (`workload`, `tokens`), the
generators (one module each, listed in `catalog`), the Mooncake trace reader and writer
(`mooncake`), its own save format (`files`), and the block-level replay model with the
infinite-cache ceiling and Belady's rule (`blocks`, `bounds`, `metrics`), and Belady's rule
over a hybrid layout's units (`layout_bounds`).

Must never: import a backend or the engine; it talks to caches only through what a replay
hands to `PrefixCache`, and the bounds model that replay without any cache.

    from prefixcache.workloads import BlockPlan, belady, infinite_cache, shared_prefix
    w = shared_prefix(seed=0)                    # 1024 requests; w.analytic_hit_ratio(16) = 0.882
    plan = BlockPlan.of(w, block_size=16)
    infinite_cache(plan).hit_ratio                # 0.882, the ceiling
    belady(plan, capacity_blocks=2048).hits       # per-request hit tokens at 32k tokens of pool
"""

from __future__ import annotations

from prefixcache.workloads.blocks import BlockPlan
from prefixcache.workloads.bounds import BoundResult, belady, infinite_cache
from prefixcache.workloads.catalog import GENERATORS, analytic_for, generate
from prefixcache.workloads.few_shot import few_shot
from prefixcache.workloads.files import load_workload, save_workload
from prefixcache.workloads.layout_bounds import layout_belady
from prefixcache.workloads.metrics import HitCounts
from prefixcache.workloads.mooncake import (
    MooncakeRecord,
    read_mooncake,
    read_records,
    records_to_workload,
    synthetic_records,
    workload_to_records,
    write_records,
)
from prefixcache.workloads.multi_turn import multi_turn
from prefixcache.workloads.no_sharing import no_sharing
from prefixcache.workloads.parallel_sampling import parallel_sampling
from prefixcache.workloads.rag import rag
from prefixcache.workloads.shared_prefix import shared_prefix
from prefixcache.workloads.tokens import TokenRuns, TokenSource
from prefixcache.workloads.tree_of_thought import tree_of_thought
from prefixcache.workloads.workload import Request, Workload

__all__ = [
    "Request",
    "Workload",
    "TokenRuns",
    "TokenSource",
    "GENERATORS",
    "generate",
    "analytic_for",
    "shared_prefix",
    "few_shot",
    "multi_turn",
    "parallel_sampling",
    "rag",
    "tree_of_thought",
    "no_sharing",
    "MooncakeRecord",
    "read_mooncake",
    "read_records",
    "write_records",
    "records_to_workload",
    "workload_to_records",
    "synthetic_records",
    "save_workload",
    "load_workload",
    "BlockPlan",
    "BoundResult",
    "HitCounts",
    "infinite_cache",
    "belady",
    "layout_belady",
]
