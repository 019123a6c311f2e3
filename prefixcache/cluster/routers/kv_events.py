"""`kv_events`: NVIDIA Dynamo's KV router (`DefaultWorkerSelector`), precise: the overlap of
each replica with the request comes from the cluster KV index, which the replicas' own
KV events keep (so it sees evictions, where a predicted cache cannot).

Cost of sending a prompt of P TOKENS to replica w, with block size B and overlap o_w
BLOCKS cached there (Dynamo's logit; lower is better):

    prefill_blocks_w = (prefill_tokens_w + max(P - o_w * B, 0)) / B
    decode_blocks_w  = active_blocks_w + max(ceil(P / B) - o_w, 0)
    cost_w           = overlap_score_weight * prefill_blocks_w + decode_blocks_w

`prefill_tokens_w` and `active_blocks_w` are the replica's load (`Candidates` columns:
prompt tokens still to prefill, KV blocks in use). Dynamo counts a request's new decode blocks
against the blocks of the worker's active sequences; we count them against its cache
(the index), which is what the replica will reuse. Temperature 0 (the default) takes
the lowest cost, ties to the replica with the fewest cached blocks, then at random;
above 0, Dynamo's softmax: costs rescaled to [0, 1], p_w ~ exp(-(cost_w - min) /
((max - min) x temperature)), uniform when all costs are equal. Defaults are Dynamo's
(`--kv-overlap-score-weight 1`, `--router-temperature 0`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixcache.cluster.registry import register_router
from prefixcache._C import kv_router_costs, kv_router_lowest
from prefixcache.cluster.router import Candidates, Ranked, Router, RouterContext, RoutingRequest
from prefixcache.config import ConfigError

__all__ = ["KVEventsRouter", "KVEventsOptions"]


@dataclass(frozen=True)
class KVEventsOptions:
    """overlap_score_weight: weight of the prefill term (0: ignore the cache, balance load)
    temperature: 0 picks the lowest cost; above 0, softmax sampling over costs"""

    overlap_score_weight: float = 1.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.overlap_score_weight < 0:
            raise ConfigError("overlap_score_weight", f"must be >= 0, got {self.overlap_score_weight!r}")
        if self.temperature < 0:
            raise ConfigError("temperature", f"must be >= 0, got {self.temperature!r}")


@register_router("kv_events")
class KVEventsRouter(Router):
    """Dynamo's cost over the event-fed KV index."""

    Options = KVEventsOptions
    needs_index = True

    def __init__(self, context: RouterContext, options: KVEventsOptions | None = None) -> None:
        super().__init__(context, options)
        self.index = context.index

    def _cost_args(self, candidates: Candidates, request: RoutingRequest) -> tuple:
        overlaps = candidates.by_position(self.index.longest_prefix(request.hashes))
        return (candidates.prefill_tokens, candidates.active_blocks, overlaps, request.num_prompt_tokens,
                self.context.block_size, self.options.overlap_score_weight)

    def costs(self, candidates: Candidates, request: RoutingRequest) -> list[float]:
        """Dynamo's cost of each candidate, in candidate order (the module docstring;
        computed natively over the load columns, csrc/kv_router_cost.h)."""
        return kv_router_costs(*self._cost_args(candidates, request))

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        if self.options.temperature > 0:
            return [[self._softmax_sample(self.costs(candidates, request))]]
        tied = kv_router_lowest(*self._cost_args(candidates, request))
        if len(tied) > 1:
            index = self.index
            sizes = [index.blocks(candidates.replicas[i]) if candidates.replicas[i] in index else 0 for i in tied]
            smallest = min(sizes)
            if smallest != max(sizes):
                return [[tied[sizes.index(smallest)]]]
            return [[self.context.rng.choice(tied)]]
        return [tied]

    def _softmax_sample(self, costs: list[float]) -> int:
        low, high = min(costs), max(costs)
        if low == high:
            return self.context.rng.randrange(len(costs))
        scale = 1.0 / ((high - low) * self.options.temperature)
        weights = [math.exp(-(cost - low) * scale) for cost in costs]
        return self.context.rng.choices(range(len(costs)), weights=weights)[0]
