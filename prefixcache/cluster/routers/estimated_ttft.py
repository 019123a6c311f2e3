"""`estimated_ttft`: the precise router. Each request goes to the replica where its first
token is estimated to come soonest, charged for the delay its prefill adds for others
there: the KV index (fed by the replicas' own events) says what each replica holds, the
load columns what each is busy with, and the replicas' service model what that costs.

For a prompt of P TOKENS and a candidate w holding o_w of its leading blocks (block size
B), the hit is h_w = min(o_w B, floor((P - 1) / B) B) and n_w = P - h_w tokens are left
to prefill, from position h_w. The replica has `prefill_tokens_w` prompt tokens of other
requests ahead of it (the requests routed there whose first token is not out: Dynamo's
prefill load), and b_w = `num_requests_w` - `queued_requests_w` requests running, each
taking one token of every step. With the service model's rates (`ServiceModel.token_s`,
`pair_s`, `weights_s`, `step_overhead_s`, `max_num_batched_tokens`), X = prefill_tokens_w
+ n_w, steps = X / (budget - b_w):

    ttft_w = steps x overhead + max(token_s (X + b_w steps) + pair_s (n_w h_w + n_w (n_w + 1) / 2),
                                    steps x weights_s)
    own_w  = token_s n_w + pair_s (n_w h_w + n_w (n_w + 1) / 2)
    cost_w = ttft_w + load_weight x own_w + decode_weight x b_w x own_w

the lowest cost wins (ties at random). `ttft_w` is `ServiceModel.prefill_s` of the
replica's prefill queue and this prompt; `own_w` is its own prefill, which delays
everyone queued behind it by as much (`load_weight`: a miss weighs more than the delay it
suffers itself) and lengthens the steps of each request decoding there by as much in all
(`decode_weight`: a long miss weighs most where many decode, whose inter-token latency it
would break). All are SECONDS, so the cost compares a cache hit with a queue in the units
a user feels, where Dynamo's cost trades blocks of cache against blocks of load one for
one. load_weight 0 and decode_weight 0: the greedy lowest-estimated-TTFT choice.

The defaults (1.0, 0.1) are measured, not derived: on the Mooncake conversation trace
(docs/cluster.md) the decode charge buys goodput at the knee (fewer requests over the
inter-token objective) for a few percent of TTFT p99 (the long prompts it moves wait a
little longer); `decode_weight: 0` keeps the p99.

Computed natively over the load columns (csrc/ttft_cost.h), like `kv_events`. Where the
cluster passes no service model (`RouterContext.service` None), the defaults
(`ServiceModel()`: an 8B model on one H100) set the rates: only their ratios matter to
the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache._C import estimated_ttft_costs, estimated_ttft_lowest
from prefixcache.cluster.registry import register_router
from prefixcache.cluster.router import Candidates, Ranked, Router, RouterContext, RoutingRequest
from prefixcache.service_model import ServiceModel
from prefixcache.config import ConfigError

__all__ = ["EstimatedTTFTRouter", "EstimatedTTFTOptions"]


@dataclass(frozen=True)
class EstimatedTTFTOptions:
    """load_weight: the charge for the delay a request's prefill adds for those queued behind it
    decode_weight: the charge for the delay it adds for each request decoding there
    (both 0: the greedy lowest-estimated-TTFT choice)"""

    load_weight: float = 1.0
    decode_weight: float = 0.1

    def __post_init__(self) -> None:
        for name in ("load_weight", "decode_weight"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ConfigError(name, f"must be a finite number >= 0, got {value!r}")


@register_router("estimated_ttft")
class EstimatedTTFTRouter(Router):
    """The lowest estimated TTFT plus the charge for the work it adds (module docstring)."""

    Options = EstimatedTTFTOptions
    needs_index = True

    def __init__(self, context: RouterContext, options: EstimatedTTFTOptions | None = None) -> None:
        super().__init__(context, options)
        self.index = context.index
        service = context.service if context.service is not None else ServiceModel()
        self._model = (service.token_s, service.pair_s, service.weights_s, service.step_overhead_s,
                       service.max_num_batched_tokens, self.options.load_weight, self.options.decode_weight)

    def costs(self, candidates: Candidates, request: RoutingRequest) -> list[float]:
        """Each candidate's cost in SECONDS, in candidate order (the module docstring)."""
        hashes = request.hashes
        overlaps = candidates.by_position(self.index.longest_prefix(hashes)) if len(hashes) else None
        return estimated_ttft_costs(candidates.prefill_tokens, candidates.num_requests, candidates.queued_requests,
                                    overlaps, request.num_prompt_tokens, self.context.block_size, *self._model)

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        hashes = request.hashes
        overlaps = candidates.by_position(self.index.longest_prefix(hashes)) if len(hashes) else None
        lowest = estimated_ttft_lowest(candidates.prefill_tokens, candidates.num_requests, candidates.queued_requests,
                                       overlaps, request.num_prompt_tokens, self.context.block_size, *self._model)
        return [[lowest[0] if len(lowest) == 1 else self.context.rng.choice(lowest)]]
