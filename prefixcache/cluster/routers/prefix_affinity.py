"""`prefix_affinity`: Ray Serve LLM's `PrefixCacheAffinityRouter` (PrefixAwarePow2ReplicaRouter).

1. Imbalance check: if the highest minus the lowest candidate load exceeds
   `imbalanced_threshold` (Ray compares queue lengths: `load_unit: requests`), route as
   power of two choices.
2. Balanced: match the prompt against the predicted caches (the prompts routed to each
   replica, `RoutedPrefixes`). At a match rate (matched / prompt TOKENS) of at least
   `match_rate_threshold` (10%), the replicas with the longest match; below it, the
   replicas with the least predicted cache ("smallest tenants"), to spread the cache.
   The caller picks the least loaded of the group, as Ray picks the shortest queue.
3. The prompt is inserted into the chosen replica's prediction (Ray's
   `on_request_routed`). With `do_eviction`, every `eviction_interval_s` each replica
   above `eviction_threshold_tokens` is trimmed (LRU) to `eviction_target_tokens`.

Ray's tree is over characters (defaults 400,000 / 360,000 characters, 10 s, eviction
off); ours is over blocks of tokens, with the same defaults at about 4 characters a
token (100,000 / 90,000 TOKENS). Matching is page-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.cluster.registry import register_router
from prefixcache.cluster.routed_prefixes import RoutedPrefixes
from prefixcache.cluster.router import Candidates, LoadUnit, Ranked, ReplicaId, Router, RouterContext, RoutingRequest
from prefixcache.cluster.routers.power_of_two import two_random
from prefixcache.config import ConfigError

__all__ = ["PrefixAffinityRouter", "PrefixAffinityOptions"]


@dataclass(frozen=True)
class PrefixAffinityOptions:
    """imbalanced_threshold: load spread above which routing is power of two choices
    match_rate_threshold: matched / prompt TOKENS (0-1) needed to follow the match
    do_eviction, eviction_threshold_tokens, eviction_target_tokens, eviction_interval_s:
        trim predictions above the threshold to the target (TOKENS) every interval (SECONDS)
    load_unit: how loads are counted for the imbalance check"""

    imbalanced_threshold: int = 10
    match_rate_threshold: float = 0.1
    do_eviction: bool = False
    eviction_threshold_tokens: int = 100_000
    eviction_target_tokens: int = 90_000
    eviction_interval_s: float = 10.0
    load_unit: LoadUnit = "requests"

    def __post_init__(self) -> None:
        if self.imbalanced_threshold < 0:
            raise ConfigError("imbalanced_threshold", f"must be >= 0, got {self.imbalanced_threshold!r}")
        if not 0.0 <= self.match_rate_threshold <= 1.0:
            raise ConfigError("match_rate_threshold", f"must be in [0, 1], got {self.match_rate_threshold!r}")
        if self.eviction_target_tokens < 0 or self.eviction_threshold_tokens < self.eviction_target_tokens:
            raise ConfigError(
                "eviction_target_tokens",
                f"must be in [0, eviction_threshold_tokens={self.eviction_threshold_tokens}], "
                f"got {self.eviction_target_tokens!r}",
            )
        if self.eviction_interval_s < 0:
            raise ConfigError("eviction_interval_s", f"must be >= 0 SECONDS, got {self.eviction_interval_s!r}")


@register_router("prefix_affinity")
class PrefixAffinityRouter(Router):
    """Ray Serve LLM's prefix-cache affinity over power of two choices."""

    Options = PrefixAffinityOptions

    def __init__(self, context: RouterContext, options: PrefixAffinityOptions | None = None) -> None:
        super().__init__(context, options)
        self.tree = RoutedPrefixes(context.block_size)
        self._last_trim = context.clock()

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        opts = self.options
        loads = candidates.amounts(opts.load_unit)
        if max(loads) - min(loads) > opts.imbalanced_threshold:
            return [two_random(self, candidates)]
        matched = candidates.by_position(self.tree.longest_prefix(request.hashes))
        best = max(matched.values(), default=0)
        if best and best * self.context.block_size >= opts.match_rate_threshold * request.num_prompt_tokens:
            return [[i for i, blocks in matched.items() if blocks == best]]
        sizes = self.tree.tokens_of(candidates.replicas)
        smallest = min(sizes)
        return [[i for i, size in enumerate(sizes) if size == smallest]]

    def on_request_routed(self, request: RoutingRequest, replica: ReplicaId) -> None:
        self.tree.insert(replica, request.hashes)
        opts = self.options
        now = self.context.clock()
        if opts.do_eviction and now - self._last_trim >= opts.eviction_interval_s:
            self._last_trim = now
            for r in self.tree.replicas:
                if self.tree.tokens(r) > opts.eviction_threshold_tokens:
                    self.tree.evict_to(r, opts.eviction_target_tokens)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        self.tree.remove_replica(replica)
