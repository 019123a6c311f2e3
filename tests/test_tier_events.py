"""Tier residency on the wire: a KV index rebuilt from a tiered cache's events agrees with
the cache on every medium, the kv_events router credits a lower-tier block by what
loading it costs, and the precise router takes a lower-tier run as a hit plus its load
(docs/tiers.md, docs/cluster.md). The 10^6-operation soak is benchmarks/soak_tier_events.py."""

from __future__ import annotations

import random

import pytest

from prefixcache.cluster.kv_index import KVIndex
from prefixcache.cluster.prompt_hashes import PromptHasher
from prefixcache.cluster.router import Candidates, RouterContext, RoutingRequest
from prefixcache.cluster.routers.kv_events import KVEventsOptions, KVEventsRouter
from prefixcache.cluster.tier_soak import soak_tier_events
from prefixcache.config import CacheConfig, ConfigError
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


def _held(tokens: int, *media_per_replica: tuple[str, ...]) -> tuple[KVIndex, RoutingRequest]:
    """An index over CPU and STORAGE residency, replica r holding the whole prompt of
    `tokens` TOKENS (block 4) on each medium in media_per_replica[r] (GPU: the device)."""
    index = KVIndex(lower_media=("CPU", "STORAGE"))
    request = RoutingRequest("r", list(range(tokens)), hasher=PromptHasher(4))
    hashes = request.hashes.digests()
    for r, media in enumerate(media_per_replica):
        index.add_replica(r)
        for medium in media:
            if medium == "GPU":
                index.store(r, hashes)
            else:
                index.apply(r, [_stored(h, medium) for h in hashes])
    return index, request


def test_the_router_credits_a_lower_tier_block_by_its_load_cost():
    index, request = _held(17, ("GPU",), ("CPU",), ("STORAGE",), ())
    assert index.tiered_prefix(request.hashes) == {0: (4, 0, 0), 1: (0, 4, 0), 2: (0, 0, 4)}
    candidates = Candidates(range(4))
    fast = _router(index, cost_model=CostModel(1024, 1000.0))
    costs = fast.costs(candidates, request)
    assert costs[0] < costs[1] < costs[2] < costs[3]  # device, host, disk, nothing
    slow = _router(index, cost_model=CostModel(1 << 30, 1e9),
                   tier_bandwidth_gbps={"CPU": 1.0, "STORAGE": 1.0})  # fmt: skip
    costs = slow.costs(candidates, request)
    assert costs[1] == costs[2] == costs[3] > costs[0]  # loading is slower than computing: no credit


def test_the_precise_router_takes_a_lower_tier_run_as_a_hit_plus_its_load():
    from prefixcache.cluster.routers.estimated_ttft import EstimatedTTFTOptions, EstimatedTTFTRouter
    from prefixcache.service_model import ServiceModel

    # the whole prompt on replica 0's device, 1's host tier, 2's disk; 3 holds nothing
    index, request = _held(4097, ("GPU",), ("CPU",), ("STORAGE",), ())
    service = ServiceModel()

    def router(**options):
        context = RouterContext(block_size=4, capacity_tokens=1 << 20, index=index, service=service)
        return EstimatedTTFTRouter(context, EstimatedTTFTOptions(**options))

    candidates = Candidates(range(4))
    costs = router(tier_bandwidth_gbps={"STORAGE": 10.0}).costs(candidates, request)
    assert costs[0] < costs[1] < costs[2] < costs[3]  # device, host, disk, nothing
    # the host's cost is the device's plus its load (twice: the delay for those behind it too)
    load = service.load_s(4096, 25.0, 10e-6)
    assert costs[1] == pytest.approx(costs[0] + 2 * load)
    assert router().choose_replicas(candidates, request) == [[0]]
    # the default disk (2 GB/s) loads these 512 MiB slower than the prefill computes them:
    # replica 2 costs what a miss costs
    slow = router().costs(candidates, request)
    assert slow[2] == slow[3] and slow[1] == costs[1]
    with pytest.raises(ConfigError, match=r"tier_bandwidth_gbps\.GPU: allowed values: CPU, STORAGE"):
        EstimatedTTFTOptions(tier_bandwidth_gbps={"GPU": 1.0})


def test_stick_s_holds_to_a_run_on_a_lower_tier_as_to_one_on_the_device():
    from prefixcache.cluster.routers.estimated_ttft import EstimatedTTFTOptions, EstimatedTTFTRouter
    from prefixcache.service_model import ServiceModel

    # the whole prompt in replica 1's host tier, behind a long prefill queue; 0 and 2 hold nothing
    index, request = _held(4097, (), ("CPU",), ())
    candidates = Candidates(range(3))
    candidates.prefill_tokens[1] = 200_000

    def router(stick_s, stick_ttft_s=None):
        context = RouterContext(block_size=4, capacity_tokens=1 << 20, index=index, service=ServiceModel(),
                                rng=random.Random(0))
        return EstimatedTTFTRouter(context, EstimatedTTFTOptions(stick_s=stick_s, stick_ttft_s=stick_ttft_s))

    costs = router(0.0).costs(candidates, request)
    assert costs[0] == costs[2] < costs[1]  # the queue costs more than the miss
    assert router(0.0).choose_replicas(candidates, request) in ([[0]], [[2]])
    assert router(costs[1] - costs[0] + 0.01).choose_replicas(candidates, request) == [[1]]
    assert router(costs[1] - costs[0] - 0.01).choose_replicas(candidates, request) in ([[0]], [[2]])
    # stick_ttft_s reads replica 1's TTFT with the load from its host tier: the queue's 200,000
    # tokens and its own last one (attending to the 4,096 loaded), in steps, then the load
    # (0.02 s of 6.5 s: the bound is drawn closer than that)
    s = ServiceModel()
    steps = 200_001 / s.max_num_batched_tokens
    ttft = (steps * s.overhead_s + max(s.token_s * 200_001 + s.pair_s * 4097, steps * s.weights_s)
            + s.load_s(4096, 25.0, 10e-6))
    assert router(100.0, ttft * 1.0001).choose_replicas(candidates, request) == [[1]]
    assert router(100.0, ttft * 0.9999).choose_replicas(candidates, request) in ([[0]], [[2]])


def test_llm_d_scorers_weigh_a_lower_tier_block_as_llm_d_does():
    from prefixcache.cluster.routers.weighted_scorers import WeightedScorersRouter

    # GPU 1.0 a block, CPU 0.8, STORAGE (not in llm-d's defaults) 1.0, both: the most of them
    index, request = _held(17, ("GPU",), ("CPU",), ("STORAGE",), ("CPU", "STORAGE"), ())
    index.apply(4, [_stored(h, "CPU") for h in request.hashes.digests()[:2]])  # a run of two
    assert index.weighted_prefix(request.hashes, {"GPU": 1.0, "CPU": 0.8}) == pytest.approx(
        {0: 4.0, 1: 3.2, 2: 4.0, 3: 4.0, 4: 1.6})
    router = WeightedScorersRouter(RouterContext(block_size=4, capacity_tokens=1 << 20, index=index))
    scores = router.scores(Candidates(range(5)), request)
    assert scores[0] == scores[2] == scores[3] > scores[1] > scores[4]
    assert scores[0] - scores[1] == pytest.approx(2 * (1.0 - 0.8))  # prefix weight 2, 4 of 4 blocks


def _stored(h, medium):
    from prefixcache.events import BlockStored

    return BlockStored((h,), None, (1, 2, 3, 4), 4, medium=medium, locality="LOCAL")
