"""Tier residency on the wire: a KV index rebuilt from a tiered cache's events agrees with
the cache on every medium, and the kv_events router credits a lower-tier block by what
loading it costs (docs/tiers.md). The 10^6-operation soak is benchmarks/soak_tier_events.py."""

from __future__ import annotations

import pytest

from prefixcache.cluster.kv_index import KVIndex
from prefixcache.cluster.prompt_hashes import PromptHasher
from prefixcache.cluster.router import Candidates, RouterContext, RoutingRequest
from prefixcache.cluster.routers.kv_events import KVEventsOptions, KVEventsRouter
from prefixcache.cluster.tier_soak import soak_tier_events
from prefixcache.config import CacheConfig
from prefixcache.tier_config import CostModel, TierConfig


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_an_index_rebuilds_per_tier_residency_from_the_events(backend):
    config = CacheConfig(backend=backend, block_size=4, num_blocks=24,
                         tiers=(TierConfig("CPU", 12), TierConfig("CPU", 16, eviction="chain")))  # fmt: skip
    result = soak_tier_events(config, 3000, seed=1)
    assert result.tier_hits > 50 and result.stored_lower > 500  # every tier was exercised
    assert result.checks == 3001


def test_write_through_and_selective_residency_also_agree():
    config = CacheConfig(block_size=4, num_blocks=24, tiers=(TierConfig("CPU", 12, write="write_through"),
                                                             TierConfig("CPU", 16, write="selective")))  # fmt: skip
    assert soak_tier_events(config, 1500, seed=2).checks == 1501


def _router(index: KVIndex, **options) -> KVEventsRouter:
    return KVEventsRouter(RouterContext(block_size=4, capacity_tokens=1 << 20, index=index), KVEventsOptions(**options))


def test_the_router_credits_a_lower_tier_block_by_its_load_cost():
    index = KVIndex(lower_media=("CPU", "STORAGE"))
    for r in range(4):
        index.add_replica(r)
    request = RoutingRequest("r", list(range(17)), hasher=PromptHasher(4))
    hashes = request.hashes.digests()
    index.store(0, hashes)  # the device: free
    index.apply(1, [_stored(h, "CPU") for h in hashes])
    index.apply(2, [_stored(h, "STORAGE") for h in hashes])
    assert index.tiered_prefix(request.hashes) == {0: (4, 0, 0), 1: (0, 4, 0), 2: (0, 0, 4)}
    candidates = Candidates(range(4))
    fast = _router(index, cost_model=CostModel(1024, 1000.0))
    costs = fast.costs(candidates, request)
    assert costs[0] < costs[1] < costs[2] < costs[3]  # device, host, disk, nothing
    slow = _router(index, cost_model=CostModel(1 << 30, 1e9),
                   tier_bandwidth_gbps={"CPU": 1.0, "STORAGE": 1.0})  # fmt: skip
    costs = slow.costs(candidates, request)
    assert costs[1] == costs[2] == costs[3] > costs[0]  # loading is slower than computing: no credit


def _stored(h, medium):
    from prefixcache.events import BlockStored

    return BlockStored((h,), None, (1, 2, 3, 4), 4, medium=medium, locality="LOCAL")
