"""`power_of_two`: two candidates drawn at random, the less loaded wins (Ray Serve's
default `PowerOfTwoChoicesRequestRouter`). Load is TOKENS queued + running; which of the
two is lighter is `pick_replica`'s rule, applied by the caller to the group returned."""

from __future__ import annotations

from prefixcache.cluster.registry import register_router
from prefixcache.cluster.router import Candidates, Ranked, Router, RoutingRequest

__all__ = ["PowerOfTwoRouter", "two_random"]


def two_random(router: Router, candidates: Candidates) -> list[int]:
    """Two distinct candidate positions in random order (one if there is one), from the
    router's seeded rng: the first draw ranks first, so ties go to either with equal odds."""
    n = len(candidates)
    if n == 1:
        return [0]
    rng = router.context.rng
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    return [i, j + (j >= i)]


@register_router("power_of_two")
class PowerOfTwoRouter(Router):
    """The less loaded (TOKENS) of two random candidates."""

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        return [two_random(self, candidates)]
