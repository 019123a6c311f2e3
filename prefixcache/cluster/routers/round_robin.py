"""`round_robin`: each request to the next candidate in turn. The baseline a cache-aware
router is judged against: it spreads requests that share a prefix over every replica."""

from __future__ import annotations

from prefixcache.cluster.registry import register_router
from prefixcache.cluster.router import Candidates, Ranked, Router, RouterContext, RoutingRequest

__all__ = ["RoundRobinRouter"]


@register_router("round_robin")
class RoundRobinRouter(Router):
    """The candidates in turn, by position in the candidate list."""

    def __init__(self, context: RouterContext, options: None = None) -> None:
        super().__init__(context, options)
        self._turn = 0

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        turn = self._turn % len(candidates)
        self._turn += 1
        return [[turn]]
