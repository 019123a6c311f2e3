"""A user's router, as one class: the replica with the longest cached prefix of the
prompt (from the cluster's KV index), unless it is more than `max_extra_tokens` more
loaded than the least loaded replica; then the least loaded.

Select it in a cluster YAML by path (this folder on PYTHONPATH):

    routers:
      longest: {router: "longest_prefix_router:LongestPrefixRouter", options: {max_extra_tokens: 8192}}
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.cluster import Candidates, Ranked, Router, RoutingRequest


@dataclass(frozen=True)
class LongestPrefixOptions:
    max_extra_tokens: int = 16384  # TOKENS of load a cache hit may cost at most

    def __post_init__(self) -> None:
        if self.max_extra_tokens < 0:
            raise ValueError(f"max_extra_tokens must be >= 0, got {self.max_extra_tokens}")


class LongestPrefixRouter(Router):
    Options = LongestPrefixOptions
    needs_index = True

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        loads = [candidates.tokens(i) for i in range(len(candidates))]
        allowed = min(loads) + self.options.max_extra_tokens
        cached = candidates.by_position(self.context.index.longest_prefix(request.hashes))
        eligible = [i for i, blocks in cached.items() if loads[i] <= allowed]
        if eligible:
            best = max(cached[i] for i in eligible)
            return [[i for i in eligible if cached[i] == best]]
        return [list(range(len(candidates)))]  # the caller takes the least loaded
