"""`approx_tree`: SGLang's cache-aware router (sgl-router `cache_aware` policy).

It predicts each replica's cache from the requests it routed there (`RoutedPrefixes`:
the prompts' block hashes, LRU-trimmed to `max_tree_size`), with no event stream:

1. Load check. The system is imbalanced when BOTH (max - min) > balance_abs_threshold
   AND max > balance_rel_threshold x min, loads counted in `load_unit` (SGLang counts
   in-flight requests). Imbalanced: the least loaded replica.
2. Balanced: the longest predicted match. If matched / prompt TOKENS > cache_threshold,
   the replica with that match (the least loaded of several); else the replica whose
   predicted cache is smallest (SGLang's `get_smallest_tenant`: most room), least
   loaded on a tie.
3. Either way the prompt is inserted into the chosen replica's prediction, and every
   `eviction_interval_s` of clock time each prediction is trimmed to max_tree_size.

Defaults are those of `python -m sglang_router.launch_router` (RouterArgs): 0.3, 64,
1.5, 120 s; SGLang's max_tree_size counts tree entries (2**26 by default); ours is
TOKENS and defaults to one replica's cache capacity, which is what the prediction
stands for. Matching is page-aligned, as SGLang's token tree is: a prompt's partial
last block is never predicted cached.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.cluster.registry import register_router
from prefixcache.cluster.routed_prefixes import RoutedPrefixes
from prefixcache.cluster.router import Candidates, LoadUnit, Ranked, ReplicaId, Router, RouterContext, RoutingRequest
from prefixcache.config import ConfigError

__all__ = ["ApproxTreeRouter", "ApproxTreeOptions"]


@dataclass(frozen=True)
class ApproxTreeOptions:
    """cache_threshold: match ratio (0-1) above which the best-matching replica wins
    balance_abs_threshold / balance_rel_threshold: the imbalance test (both must hold)
    eviction_interval_s: SECONDS of clock between trims (0: after every request)
    max_tree_size: TOKENS each prediction is trimmed to (null: one replica's capacity)
    load_unit: how loads are counted for the imbalance test and the least-loaded pick"""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int | None = None
    load_unit: LoadUnit = "requests"

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ConfigError("cache_threshold", f"must be in [0, 1], got {self.cache_threshold!r}")
        if self.balance_abs_threshold < 0:
            raise ConfigError("balance_abs_threshold", f"must be >= 0, got {self.balance_abs_threshold!r}")
        if self.balance_rel_threshold < 1.0:
            raise ConfigError("balance_rel_threshold", f"must be >= 1.0, got {self.balance_rel_threshold!r}")
        if self.eviction_interval_s < 0:
            raise ConfigError("eviction_interval_s", f"must be >= 0 SECONDS, got {self.eviction_interval_s!r}")
        if self.max_tree_size is not None and self.max_tree_size < 1:
            raise ConfigError("max_tree_size", f"must be >= 1 TOKENS or null, got {self.max_tree_size!r}")


@register_router("approx_tree")
class ApproxTreeRouter(Router):
    """SGLang's cache-aware routing over a predicted cache per replica."""

    Options = ApproxTreeOptions

    def __init__(self, context: RouterContext, options: ApproxTreeOptions | None = None) -> None:
        super().__init__(context, options)
        self.tree = RoutedPrefixes(context.block_size)
        self._max_tokens = self.options.max_tree_size or context.capacity_tokens
        self._last_trim = context.clock()

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        opts = self.options
        loads = candidates.amounts(opts.load_unit)
        low, high = min(loads), max(loads)
        if high - low > opts.balance_abs_threshold and high > low * opts.balance_rel_threshold:
            return [[loads.index(low)]]
        matched = candidates.by_position(self.tree.longest_prefix(request.hashes))
        best = max(matched.values(), default=0)
        if best and best * self.context.block_size > opts.cache_threshold * request.num_prompt_tokens:
            group = [i for i, blocks in matched.items() if blocks == best]
        else:
            sizes = self.tree.tokens_of(candidates.replicas)
            smallest = min(sizes)
            group = [i for i, size in enumerate(sizes) if size == smallest]
        return [[min(group, key=loads.__getitem__)]]

    def on_request_routed(self, request: RoutingRequest, replica: ReplicaId) -> None:
        self.tree.insert(replica, request.hashes)
        now = self.context.clock()
        if now - self._last_trim >= self.options.eviction_interval_s:
            self._last_trim = now
            for r in self.tree.replicas:
                self.tree.evict_to(r, self._max_tokens)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        self.tree.remove_replica(replica)
