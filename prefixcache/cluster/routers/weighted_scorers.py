"""`weighted_scorers`: llm-d's inference scheduler with its precise-prefix-cache profile:
a weighted sum of scorers over every candidate, the highest total wins.

As llm-d ships it (llm-d/llm-d `guides/precise-prefix-cache-aware/scheduler/
precise-prefix-cache-aware.values.yaml`, commit 019a3f3: `precise-prefix-cache-scorer`
weight 2.0, `kv-cache-utilization-scorer` 1.0, `queue-scorer` 1.0, `max-score-picker`),
each scorer as llm-d-router implements it (`pkg/epp/framework/plugins/scheduling/
scorer/`, commit 2342697), for a prompt of F = floor(P / B) full blocks:

    prefix_w = min(o_w / F, 1)      o_w: the leading blocks the KV index holds for w
                                    (llm-d-kv-cache's LongestPrefix scorer;
                                    `absoluteScoredPods`); 0 when F = 0
    kv_w     = 1 - usage_w          usage_w = KV blocks its running requests hold /
                                    its blocks (vLLM's `kv_cache_usage_perc`)
    queue_w  = (max q - q_w) / (max q - min q), 1 when all are equal
                                    q_w: requests waiting (vLLM's `num_requests_waiting`)
    score_w  = prefix_weight x prefix_w + kv_utilization_weight x kv_w + queue_weight x queue_w

With lower tiers (the index keeps CPU / STORAGE residency, `KVIndex(lower_media=...)`),
o_w is llm-d's weighted run: the longest leading run w holds on any medium, each block
weighing the most of its media's weights there (llm-d-kv-cache `DefaultKVCacheBackendConfig`:
gpu 1.0, cpu 0.8, a medium it does not list 1.0; `medium_weights`, by the vLLM event's
medium name).

The highest score wins, ties at random (the max-score picker shuffles before it picks).
The prefix comes from the event-fed index, so `needs_index`. Not modelled: llm-d's
speculative index entries (off unless `speculativeIndexing` is set) and its metrics'
scrape interval (the columns are read as they stand). A baseline port, in Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.cluster.registry import register_router
from prefixcache.cluster.router import Candidates, Ranked, Router, RouterContext, RoutingRequest
from prefixcache.config import ConfigError

__all__ = ["WeightedScorersRouter", "WeightedScorersOptions", "LLM_D_MEDIUM_WEIGHTS"]

LLM_D_MEDIUM_WEIGHTS = {"GPU": 1.0, "CPU": 0.8}
"""llm-d-kv-cache's `DefaultKVCacheBackendConfig` (gpu 1.0, cpu 0.8), by vLLM's medium names."""


@dataclass(frozen=True)
class WeightedScorersOptions:
    """prefix_weight, kv_utilization_weight, queue_weight: each scorer's weight (llm-d's
    shipped profile: 2, 1, 1)
    medium_weights: what a prefix block weighs on each medium (llm-d's backend configs:
    GPU 1.0, CPU 0.8; a medium not named weighs 1.0)"""

    prefix_weight: float = 2.0
    kv_utilization_weight: float = 1.0
    queue_weight: float = 1.0
    medium_weights: dict[str, float] = field(default_factory=lambda: dict(LLM_D_MEDIUM_WEIGHTS))

    def __post_init__(self) -> None:
        for name in ("prefix_weight", "kv_utilization_weight", "queue_weight"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ConfigError(name, f"must be a finite number >= 0, got {value!r}")
        for medium, value in self.medium_weights.items():
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(f"medium_weights.{medium}", f"must be a finite number >= 0, got {value!r}")


@register_router("weighted_scorers")
class WeightedScorersRouter(Router):
    """llm-d's precise prefix + KV utilization + queue scorers, max-score picker."""

    Options = WeightedScorersOptions
    needs_index = True

    def __init__(self, context: RouterContext, options: WeightedScorersOptions | None = None) -> None:
        super().__init__(context, options)
        self.index = context.index
        self._blocks = max(context.capacity_tokens // context.block_size, 1)

    def scores(self, candidates: Candidates, request: RoutingRequest) -> list[float]:
        """Each candidate's total score, in candidate order (the module docstring)."""
        opts = self.options
        full = request.num_prompt_tokens // self.context.block_size
        hashes = request.hashes
        if not len(hashes):
            overlaps = {}
        elif self.index.lower_media:
            overlaps = candidates.by_position(self.index.weighted_prefix(hashes, opts.medium_weights))
        else:
            overlaps = candidates.by_position(self.index.longest_prefix(hashes))
        queued = candidates.queued_requests
        low, high = min(queued), max(queued)
        out = []
        for i, (q, used) in enumerate(zip(queued, candidates.kv_blocks, strict=True)):
            prefix = min(overlaps.get(i, 0) / full, 1.0) if full else 0.0
            kv = 1.0 - min(used / self._blocks, 1.0)
            queue = 1.0 if high == low else (high - q) / (high - low)
            out.append(opts.prefix_weight * prefix + opts.kv_utilization_weight * kv + opts.queue_weight * queue)
        return out

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        scores = self.scores(candidates, request)
        high = max(scores)
        if scores.count(high) == 1:
            return [[scores.index(high)]]
        return [[self.context.rng.choice([i for i, s in enumerate(scores) if s == high])]]
