"""`kv_events`: NVIDIA Dynamo's KV router (`DefaultWorkerSelector` over its
`ActiveSequences`), precise: the overlap of each replica with the request comes from the
cluster KV index, which the replicas' own KV events keep (so it sees evictions, where a
predicted cache cannot).

Cost of sending a prompt of P TOKENS, F = floor(P / B) full blocks, to replica w, with
block size B and o_w of the prompt's leading blocks in the index for w (Dynamo's logit;
lower is better):

    prefill_blocks_w = max((prefill_tokens_w + P) / B - o_w, 0)
    decode_blocks_w  = active_blocks_w + F - a_w
    cost_w           = overlap_score_weight * prefill_blocks_w + decode_blocks_w

`prefill_tokens_w` and `active_blocks_w` are the replica's load (`Candidates` columns),
the two sums Dynamo's `ActiveSequences` keeps per worker: prompt tokens not yet
prefilled (each request's P - o * B at routing, until its first token) and distinct full
prompt blocks of requests routed there and not finished (a block they share counts once;
no output blocks: Dynamo's `router_track_output_blocks` is off by default).

`a_w` is how many of the prompt's leading blocks are already among w's active blocks
(Dynamo's `new_blocks` adds only the others): read from the active sequences the cluster
keeps (`RouterContext.active`, Dynamo's `ActiveSequences`: the router there sees each
request start and finish; a cluster that keeps none gives a_w = 0). The blocks are
chained hashes, so a block of the prompt is active on w only if every block before it is:
the leading run is the whole count. The clamp at 0 is Dynamo's; with o_w <= F it never
binds.

With lower tiers (replicas whose caches have `cache.tiers`, an index that keeps their
residency: `KVIndex(lower_media=...)`), a prompt block a replica holds only on CPU or
STORAGE saves a recompute but costs a load: it counts toward o_w by what it saves,
1 - load_s / compute_s, where compute_s = B / prefill_tokens_per_s and load_s = the
block's bytes over the medium's bandwidth plus its latency spread over the blocks
loaded from it (the options' cost model: the same defaults as `cache.cost_model` and
`cache.tiers`), never below 0 (a block slower to load than to compute counts nothing).
Dynamo weighs every overlap block alike; its KVBM tiers are not in its router's cost.

Temperature 0 (the default) takes the lowest cost, ties at random (as Dynamo); above 0,
Dynamo's softmax: costs rescaled to [0, 1], p_w ~ exp(-(cost_w - min) / ((max - min) x
temperature)), uniform when all costs are equal. Defaults are Dynamo's: weight 1.0
(Dynamo's `prefill_load_scale`, which its deprecated `--kv-overlap-score-weight` sets,
with `overlap_score_credit` 1.0), temperature 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefixcache._C import kv_router_costs
from prefixcache.cluster.registry import register_router
from prefixcache.cluster.router import Candidates, Ranked, Router, RouterContext, RoutingRequest
from prefixcache.config import ConfigError
from prefixcache.tier_config import DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US, EVENT_MEDIUM, CostModel

__all__ = ["KVEventsRouter", "KVEventsOptions"]


@dataclass(frozen=True)
class KVEventsOptions:
    """overlap_score_weight: weight of the prefill term (0: ignore the cache, balance load)
    temperature: 0 picks the lowest cost; above 0, softmax sampling over costs
    cost_model: KV bytes per token and prefill speed, to credit a lower-tier block by
    what loading it costs (module docstring)
    tier_bandwidth_gbps / tier_latency_us: per event medium (CPU, STORAGE); unset ones take
    the `cache.tiers` defaults"""

    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    cost_model: CostModel = CostModel()
    tier_bandwidth_gbps: dict[str, float] | None = None
    tier_latency_us: dict[str, float] | None = None

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

    def costs(self, candidates: Candidates, request: RoutingRequest) -> list[float]:
        """Dynamo's cost of each candidate, in candidate order (the module docstring;
        computed natively over the load columns, csrc/kv_router_cost.h)."""
        hashes = request.hashes
        overlaps = candidates.by_position(self.index.longest_prefix(hashes))
        active = self.context.active
        shared = candidates.by_position(active.longest_prefix(hashes)) if active is not None and len(hashes) else {}
        costs = kv_router_costs(candidates.prefill_tokens, candidates.active_blocks, overlaps, request.num_prompt_tokens,
                                self.context.block_size, self.options.overlap_score_weight, shared)
        if self.index.lower_media and len(hashes):
            self._credit_lower_tiers(costs, candidates, request)
        return costs

    def _credit_lower_tiers(self, costs: list[float], candidates: Candidates, request: RoutingRequest) -> None:
        """Lower the prefill term by each replica's lower-tier blocks, each worth what it
        saves (module docstring), within what the prefill term still counts."""
        bs, o = self.context.block_size, self.options
        compute_s = bs / o.cost_model.prefill_tokens_per_s
        block_bytes = o.cost_model.bytes_per_token * bs
        bandwidth = {**{EVENT_MEDIUM[m]: g for m, g in DEFAULT_BANDWIDTH_GBPS.items()}, **(o.tier_bandwidth_gbps or {})}
        latency = {**{EVENT_MEDIUM[m]: u for m, u in DEFAULT_LATENCY_US.items()}, **(o.tier_latency_us or {})}
        tiered = candidates.by_position(self.index.tiered_prefix(request.hashes))
        for i, counts in tiered.items():
            credit = 0.0
            for medium, n in zip(self.index.lower_media, counts[1:], strict=True):
                if n:
                    load_s = block_bytes / (bandwidth.get(medium, 2.0) * 1e9) + latency.get(medium, 100.0) * 1e-6 / n
                    credit += n * max(0.0, 1.0 - load_s / compute_s)
            prefill = max((candidates.prefill_tokens[i] + request.num_prompt_tokens) / bs - counts[0], 0.0)
            costs[i] -= o.overlap_score_weight * min(credit, prefill)

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        costs = self.costs(candidates, request)
        if self.options.temperature > 0:
            return [[self._softmax_sample(costs)]]
        low = min(costs)
        if costs.count(low) == 1:
            return [[costs.index(low)]]
        return [[self.context.rng.choice([i for i, c in enumerate(costs) if c == low])]]

    def _softmax_sample(self, costs: list[float]) -> int:
        low, high = min(costs), max(costs)
        if low == high:
            return self.context.rng.randrange(len(costs))
        scale = 1.0 / ((high - low) * self.options.temperature)
        weights = [math.exp(-(cost - low) * scale) for cost in costs]
        return self.context.rng.choices(range(len(costs)), weights=weights)[0]
