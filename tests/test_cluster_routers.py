"""Each router's rule as a scenario: candidates with given loads and caches, one request,
the replica it must pick. Plus the interface (pick_replica, Candidates) and the registry."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from prefixcache import ConfigError
from prefixcache.cluster import KVIndex, PromptHasher, RouterContext, RoutingRequest, register_router, resolve_router
from prefixcache.cluster import registry as router_registry
from prefixcache.cluster.router import Candidates, ReplicaLoad, Router, pick_replica
from prefixcache.cluster.routers import (
    ApproxTreeRouter,
    EstimatedTTFTRouter,
    KVEventsRouter,
    PowerOfTwoRouter,
    PrefixAffinityRouter,
    RoundRobinRouter,
    WeightedScorersRouter,
)
from prefixcache.cluster.routers.approx_tree import ApproxTreeOptions
from prefixcache.cluster.routers.estimated_ttft import EstimatedTTFTOptions
from prefixcache.cluster.routers.kv_events import KVEventsOptions
from prefixcache.cluster.routers.prefix_affinity import PrefixAffinityOptions
from prefixcache.cluster.routers.weighted_scorers import WeightedScorersOptions
from prefixcache.service_model import ModelSpec, DeviceSpec, ServiceModel

BS = 16
HASHER = PromptHasher(BS)


def request(tokens, i=0):
    return RoutingRequest(i, list(tokens), hasher=HASHER)


def loads(*rows, replicas=None):
    """Candidates from (queued_tokens, num_requests, prefill_tokens, active_blocks) rows."""
    replicas = replicas or list(range(len(rows)))
    return Candidates.of(ReplicaLoad(r, q, 0, n, p, a) for r, (q, n, p, a) in zip(replicas, rows, strict=True))


def choose(router, candidates, req):
    """The replica id the router's answer stands for, and tell the router."""
    position = pick_replica(router.choose_replicas(candidates, req), candidates)
    router.on_request_routed(req, candidates.replicas[position])
    return candidates.replicas[position]


def context(index=None, capacity_tokens=1 << 20, seed=0, clock=lambda: 0.0, active=None, service=None):
    return RouterContext(BS, capacity_tokens, index, random.Random(seed), clock, active, service)


def columns(*rows, replicas=None):
    """Candidates from dicts of load fields (the others 0)."""
    replicas = replicas or list(range(len(rows)))
    return Candidates.of(ReplicaLoad(r, **row) for r, row in zip(replicas, rows, strict=True))


def indexed(n, holdings=()):
    """A KV index of n replicas, replica r holding the tokens' blocks, for (r, tokens) in holdings."""
    index = KVIndex()
    for r in range(n):
        index.add_replica(r)
    for r, tokens in holdings:
        cached(index, r, tokens)
    return index


# A step costs max(1 ms a token, 10 ms) and 4e-9 s a query-key pair; 64 tokens a step.
SERVICE = ServiceModel(model=ModelSpec(params=5e8, layers=1000, attention_dim=1, kv_dim=1, dtype_bytes=2),
                       device=DeviceSpec(tflops=1.0, bandwidth_tb_s=0.1), mfu=1.0, mbu=1.0, step_overhead_s=0.0,
                       max_num_batched_tokens=64)


def cached(index, replica, tokens):
    index.store(replica, HASHER(tokens).digests())


PROMPT = list(range(1000, 1160))  # 10 blocks
OTHER = list(range(5000, 5160))


# ------------------------------------------------------------------- interface


def test_pick_replica_takes_the_least_loaded_of_the_first_non_empty_group():
    c = loads((500, 1, 0, 0), (100, 1, 0, 0), (300, 1, 0, 0))
    assert pick_replica([[], [0, 2], [1]], c) == 2
    assert pick_replica([[0, 2, 1]], c) == 1
    assert pick_replica([[2, 0]], loads((5, 0, 0, 0), (9, 0, 0, 0), (5, 0, 0, 0))) == 2  # tie: group order
    with pytest.raises(ValueError, match="names none"):
        pick_replica([[], []], c)
    with pytest.raises(ValueError, match="not a position"):
        pick_replica([[3]], c)


def test_candidates_rows_and_columns_agree():
    c = loads((1, 2, 3, 4), (5, 6, 7, 8), replicas=["x", "y"])
    assert c[1] == ReplicaLoad("y", 5, 0, 6, 7, 8) and list(c)[0].replica == "x"
    assert c.row("y") == 1 and c.get_row("z") is None and c.tokens(1) == 5
    assert c.amounts("requests") == [2, 6] and c.amounts("tokens") == [1, 5]
    assert c.by_position({"y": 3, "z": 1}) == {1: 3}
    with pytest.raises(ValueError, match="repeat"):
        Candidates(["x", "x"])


def test_a_request_hashes_its_prompt_once_and_only_when_asked():
    req = RoutingRequest(0, PROMPT, hasher=HASHER)
    assert req._hashes is None
    assert len(req.hashes) == 10 and req.hashes is req.hashes
    with pytest.raises(ValueError, match="no hasher"):
        RoutingRequest(1, PROMPT).hashes


# ------------------------------------------------------------------ baselines


def test_round_robin_cycles_through_the_candidates():
    router = RoundRobinRouter(context())
    c = loads(*[(0, 0, 0, 0)] * 3)
    assert [choose(router, c, request(PROMPT)) for _ in range(5)] == [0, 1, 2, 0, 1]


def test_power_of_two_takes_the_lighter_of_two_random_replicas():
    router = PowerOfTwoRouter(context(seed=3))
    c = loads((9000, 1, 0, 0), (10, 1, 0, 0), (5000, 1, 0, 0), (7000, 1, 0, 0))
    picks = Counter(choose(router, c, request(PROMPT)) for _ in range(400))
    assert picks[0] == 0  # the heaviest never wins a pair
    assert picks[1] == pytest.approx(400 / 2, rel=0.2)  # in half the pairs: P(1 drawn) = 1/2
    assert choose(PowerOfTwoRouter(context()), loads((5, 0, 0, 0)), request(PROMPT)) == 0


# ------------------------------------------------------------------ kv_events


def test_kv_events_cost_is_dynamos_formula():
    index = KVIndex()
    for r in range(3):
        index.add_replica(r)
    cached(index, 1, PROMPT[:64])  # 4 of the prompt's 10 blocks on replica 1
    router = KVEventsRouter(context(index), KVEventsOptions(overlap_score_weight=2.0))
    c = loads((0, 0, 32, 5), (0, 0, 0, 7), (0, 0, 160, 0))
    # weight * ((prefill_tokens + P) / B - o) + active_blocks + floor(P / B): the new blocks
    # are counted against the active ones (none shared that the router knows of), not the cache
    assert router.costs(c, request(PROMPT)) == [2 * (32 + 160) / 16 + 5 + 10, 2 * ((0 + 160) / 16 - 4) + 7 + 10,
                                                2 * (160 + 160) / 16 + 0 + 10]
    ragged = PROMPT + list(range(9000, 9010))  # 170 tokens: 10 full blocks and a partial one
    assert router.costs(c, request(ragged)) == [2 * (32 + 170) / 16 + 5 + 10, 2 * ((0 + 170) / 16 - 4) + 7 + 10,
                                                2 * (160 + 170) / 16 + 0 + 10]


def test_kv_events_credits_a_cached_prefix_once_in_the_prefill_term():
    index = KVIndex()
    for r in range(2):
        index.add_replica(r)
    cached(index, 0, PROMPT)  # every block on replica 0: its prefill is 0 blocks, replica 1's 10
    router = KVEventsRouter(context(index))
    assert choose(router, loads((0, 1, 0, 9), (0, 0, 0, 0)), request(PROMPT)) == 0  # 0 + 9 + 10 < 10 + 0 + 10
    # 0 + 11 + 10 > 10 + 0 + 10: the cache saved replica 0's prefill, and its 11 active
    # blocks still count. Charging the new decode blocks against the cache (0 + 11 + 0)
    # would credit the 10 cached blocks twice and pick replica 0.
    assert router.costs(loads((0, 1, 0, 11), (0, 0, 0, 0)), request(PROMPT)) == [21.0, 20.0]
    assert choose(router, loads((0, 1, 0, 11), (0, 0, 0, 0)), request(PROMPT)) == 1


def test_kv_events_counts_only_the_prompt_blocks_not_already_active():
    index, active = KVIndex(), KVIndex()
    for r in range(2):
        index.add_replica(r)
        active.add_replica(r)
    cached(index, 0, PROMPT[:32])  # 2 blocks cached on replica 0
    active.store(0, HASHER(PROMPT[:96]).digests())  # a running request there shares 6 of the prompt's blocks
    active.store(1, HASHER(OTHER).digests())  # replica 1's active blocks share none
    router = KVEventsRouter(context(index, active=active))
    c = loads((0, 1, 0, 6), (0, 1, 0, 10))
    # (0 + 160) / 16 - o + active_blocks + (10 - a): replica 0 adds 4 new active blocks, replica 1 all 10
    assert router.costs(c, request(PROMPT)) == [10 - 2 + 6 + 4, 10 - 0 + 10 + 10]
    c = loads((0, 1, 0, 16), (0, 1, 0, 10))
    assert router.costs(c, request(PROMPT)) == [8 + 16 + 4, 30.0]
    assert choose(router, c, request(PROMPT)) == 0  # without a_w, 8 + 16 + 10 = 34 > 30: replica 1
    assert KVEventsRouter(context(index)).costs(c, request(PROMPT)) == [34.0, 30.0]
    assert choose(KVEventsRouter(context(index)), c, request(PROMPT)) == 1
    assert router.costs(c, request(PROMPT[:10])) == [(0 + 10) / 16 + 16, (0 + 10) / 16 + 10]  # no full block


def test_the_native_cost_takes_int64_columns_or_int_sequences_and_refuses_the_rest():
    from array import array

    from prefixcache._C import kv_router_costs, kv_router_lowest

    # weight * ((prefill + P) / B - o) + active + (floor(P / B) - a)
    costs = kv_router_costs(array("q", [0, 100]), [1, 2], {1: 2}, 40, 16, 1.0)
    assert costs == [(0 + 40) / 16 + 1 + 2, (100 + 40) / 16 - 2 + 2 + 2]
    costs = kv_router_costs(array("q", [0, 100]), [1, 2], {1: 2}, 40, 16, 1.0, {0: 2, 1: 5})
    assert costs == [(0 + 40) / 16 + 1 + 0, (100 + 40) / 16 - 2 + 2 + 0]  # new blocks never below 0
    assert kv_router_costs([0], [0], {0: 5}, 16, 16, 3.0) == [0 + 0 + 1]  # the prefill term clamped at 0, as Dynamo
    assert kv_router_costs([0], [0], {}, 16, 16, 1.0, None) == [2.0]
    assert kv_router_lowest((5, 0, 5), (0, 0, 0), {}, 16, 16, 1.0) == [1]
    assert kv_router_lowest((0, 0), (0, 0), {}, 32, 16, 1.0, {1: 2}) == [1]
    for bad, error, words in ((array("i", [1, 2]), TypeError, "int64 column"), ([1], ValueError, "one entry per"),
                              (array("d", [1.0, 2.0]), TypeError, "format 'd'")):
        with pytest.raises(error, match=words):
            kv_router_costs(bad, array("q", [1, 2]), {}, 40, 16, 1.0)
    with pytest.raises(IndexError, match="position 2"):
        kv_router_costs([0, 0], [0, 0], {2: 1}, 40, 16, 1.0)
    with pytest.raises(IndexError, match="active_overlaps: candidate position 3"):
        kv_router_costs([0, 0], [0, 0], {}, 40, 16, 1.0, {3: 1})
    with pytest.raises(TypeError, match="active_overlaps: expected a dict"):
        kv_router_costs([0, 0], [0, 0], {}, 40, 16, 1.0, [1, 2])


def test_kv_events_follows_the_cache_when_loads_are_even_and_the_load_when_not():
    index = KVIndex()
    for r in range(4):
        index.add_replica(r)
    cached(index, 2, PROMPT)
    cached(index, 3, PROMPT[:32])
    even = loads(*[(0, 1, 100, 20)] * 4)
    assert choose(KVEventsRouter(context(index)), even, request(PROMPT)) == 2
    busy = loads((0, 1, 100, 20), (0, 1, 100, 20), (0, 9, 3000, 400), (0, 1, 100, 20))
    assert choose(KVEventsRouter(context(index)), busy, request(PROMPT)) == 3  # 2 blocks cached, light
    blind = KVEventsRouter(context(index), KVEventsOptions(overlap_score_weight=0.0))
    assert choose(blind, loads((0, 0, 0, 30), (0, 0, 0, 8), (0, 0, 0, 8), (0, 0, 0, 9)), request(OTHER)) in (1, 2)


def test_kv_events_breaks_ties_at_random_whatever_each_replica_holds():
    index = KVIndex()
    for r in range(3):
        index.add_replica(r)
    cached(index, 0, OTHER)
    cached(index, 2, OTHER[:48])
    c = loads(*[(0, 0, 0, 0)] * 3)
    # no overlap anywhere, equal loads: Dynamo picks among the tied uniformly, not by cache size
    picks = Counter(choose(KVEventsRouter(context(index, seed=s)), c, request(PROMPT)) for s in range(60))
    assert set(picks) == {0, 1, 2}
    index.clear(0)
    index.clear(2)
    picks = Counter(choose(KVEventsRouter(context(index, seed=s)), c, request(PROMPT)) for s in range(60))
    assert set(picks) == {0, 1, 2}  # all equal: at random


def test_kv_events_temperature_samples_by_softmax_of_costs():
    index = KVIndex()
    for r in range(2):
        index.add_replica(r)
    router = KVEventsRouter(context(index, seed=1), KVEventsOptions(temperature=1.0))
    c = loads((0, 0, 0, 0), (0, 0, 0, 10))
    picks = Counter(choose(router, c, request(PROMPT)) for _ in range(2000))
    # costs rescaled to [0, 1]: p(0) / p(1) = e
    assert picks[0] / picks[1] == pytest.approx(2.718, rel=0.15)
    with pytest.raises(ValueError, match="reads the KV index"):
        KVEventsRouter(context(None))


# ------------------------------------------------------------- estimated_ttft


def ttft_twin(prefill_tokens, running, cached_tokens, prompt, service=SERVICE, load_weight=1.0, decode_weight=0.1,
              decode_cap_s=float("inf")):
    """The estimated-TTFT cost, readable (csrc/ttft_cost.h)."""
    n = prompt - cached_tokens
    x = prefill_tokens + n
    steps = x / max(service.max_num_batched_tokens - running, 1)
    pairs = n * cached_tokens + n * (n + 1) / 2
    compute = service.token_s * (x + running * steps) + service.pair_s * pairs
    ttft = steps * service.step_overhead_s + max(compute, steps * service.weights_s)
    own = service.token_s * n + service.pair_s * pairs
    return ttft + load_weight * own + decode_weight * running * min(own, decode_cap_s)


def choice_twin(costs, overlaps, prompt, stick_s, ttfts=None, stick_ttft_s=float("inf")):
    """The estimated-TTFT choice, readable (csrc/ttft_cost.h): the lowest cost, or the holders
    of the longest usable cached run at their lowest where that is within stick_s of it,
    those of them whose estimated TTFT is at most stick_ttft_s."""
    hit = [min(overlaps.get(i, 0), (prompt - 1) // BS) for i in range(len(costs))]
    if stick_s > 0 and max(hit) > 0:
        held = min(c for c, h in zip(costs, hit) if h == max(hit))
        if held <= min(costs) + stick_s:
            kept = [i for i, (c, h) in enumerate(zip(costs, hit))
                    if h == max(hit) and c == held and (ttfts is None or ttfts[i] <= stick_ttft_s)]
            if kept:
                return kept
    return [i for i, c in enumerate(costs) if c == min(costs)]


def test_estimated_ttft_is_the_prefill_queue_plus_its_own_uncached_tokens_in_seconds():
    index = indexed(3, [(1, PROMPT[:64])])  # 4 of the prompt's 10 blocks on replica 1
    router = EstimatedTTFTRouter(context(index, service=SERVICE))
    c = columns({"prefill_tokens": 0}, {"prefill_tokens": 0}, {"prefill_tokens": 500})
    pairs = lambda n, h: n * h + n * (n + 1) / 2  # noqa: E731
    assert router.costs(c, request(PROMPT)) == pytest.approx([
        2 * (0.160 + 4e-9 * pairs(160, 0)),  # its TTFT, and as much again for those behind it
        2 * (0.096 + 4e-9 * pairs(96, 64)),
        (0.660 + 4e-9 * pairs(160, 0)) + (0.160 + 4e-9 * pairs(160, 0)),
    ])
    assert choose(router, c, request(PROMPT)) == 1
    # the holder's queue: 100 tokens ahead make it 0.292 s (+ attention) against 0.320 s: still the
    # holder; greedy (load_weight 0), 0.196 s against 0.160 s: the idle replica
    c = columns({"prefill_tokens": 0}, {"prefill_tokens": 100})
    assert choose(router, c, request(PROMPT)) == 1
    greedy = EstimatedTTFTRouter(context(index, service=SERVICE), EstimatedTTFTOptions(load_weight=0.0))
    assert choose(greedy, c, request(PROMPT)) == 0


def test_estimated_ttft_counts_the_decodes_that_share_each_step_and_the_last_prompt_token():
    index = indexed(2, [(0, PROMPT), (1, PROMPT)])  # the whole prompt on both
    router = EstimatedTTFTRouter(context(index, service=SERVICE))
    # 32 running requests take half of each step's 64 tokens: the prompt's prefill takes twice the steps
    c = columns({"num_requests": 32}, {"num_requests": 40, "queued_requests": 8})
    # 10 blocks cached, but the last token is always computed: a hit of 9 blocks, 16 tokens left
    assert router.costs(c, request(PROMPT)) == pytest.approx([ttft_twin(0, 32, 144, 160), ttft_twin(0, 32, 144, 160)])
    # half a step's worth of tokens (the 32 decodes' tokens ride along), then its own prefill
    # again for those queued behind it and a tenth of it for each of the 32 decoding
    own = 1e-3 * 16 + 4e-9 * (16 * 144 + 136)
    assert ttft_twin(0, 32, 144, 160) == pytest.approx(1e-3 * (16 + 32 * 0.5) + 4e-9 * (16 * 144 + 136) + 4.2 * own)


def test_a_long_miss_goes_where_fewer_requests_decode():
    index = indexed(2)
    # replica 0: 8 requests decoding, nothing to prefill; replica 1: one decoding, 300 prompt tokens queued
    c = columns({"num_requests": 8}, {"num_requests": 1, "prefill_tokens": 300})
    long, short = request(list(range(3000, 3640))), request(PROMPT)
    router = EstimatedTTFTRouter(context(index, service=SERVICE))
    # 640 tokens: first token in 0.73 s on replica 0 (56 prompt tokens a step), 0.96 s on replica 1; but
    # its 0.64 s of prefill lengthens 8 requests' steps on replica 0: 0.1 x 8 x 0.64 s > 0.23 s + 0.1 x 0.64 s
    assert choose(router, c, long) == 1
    assert choose(EstimatedTTFTRouter(context(index, service=SERVICE), EstimatedTTFTOptions(decode_weight=0.0)),
                  c, long) == 0  # greedy: replica 0's TTFT is the shorter
    assert router.costs(c, short) == pytest.approx([ttft_twin(0, 8, 0, 160), ttft_twin(300, 1, 0, 160)])


def test_decode_cap_s_bounds_what_a_long_miss_is_charged_for_the_decodes():
    index = indexed(2)
    c = columns({"num_requests": 8}, {"num_requests": 1, "prefill_tokens": 300})
    long = request(list(range(3000, 3640)))
    capped = EstimatedTTFTRouter(context(index, service=SERVICE), EstimatedTTFTOptions(decode_cap_s=0.1))
    # the decode charge counts 0.1 s of its 0.64 s prefill: 0.08 s on replica 0, whose TTFT is 0.23 s shorter
    assert capped.costs(c, long) == pytest.approx([ttft_twin(0, 8, 0, 640, decode_cap_s=0.1),
                                                   ttft_twin(300, 1, 0, 640, decode_cap_s=0.1)])
    assert choose(capped, c, long) == 0
    uncapped = EstimatedTTFTRouter(context(index, service=SERVICE), EstimatedTTFTOptions(decode_cap_s=None))
    assert choose(uncapped, c, long) == 1  # the default: all of it (test_a_long_miss_goes_where_fewer_requests_decode)


def test_stick_s_keeps_the_holder_of_the_longest_run_while_it_costs_at_most_that_much_more():
    index = indexed(3, [(1, PROMPT[:64]), (2, PROMPT[:32])])  # 4 blocks on replica 1, 2 on replica 2
    c = columns({}, {"prefill_tokens": 500}, {})
    costs = EstimatedTTFTRouter(context(index, service=SERVICE)).costs(c, request(PROMPT))
    assert costs[2] < costs[0] < costs[1]  # the holder's queue makes it the dearest
    gap = costs[1] - costs[2]
    for stick, expected in ((0.0, 2), (gap * 0.99, 2), (gap * 1.01, 1)):
        router = EstimatedTTFTRouter(context(index, service=SERVICE), EstimatedTTFTOptions(stick_s=stick))
        assert choose(router, c, request(PROMPT)) == expected, stick
        assert router.costs(c, request(PROMPT)) == costs  # the option moves the choice, not the costs
    # a prompt no replica holds: the lowest cost, whatever stick_s
    router = EstimatedTTFTRouter(context(index, service=SERVICE), EstimatedTTFTOptions(stick_s=100.0))
    assert choose(router, columns({"prefill_tokens": 100}, {}, {}), request(OTHER)) in (1, 2)
    # a run the prompt cannot use (past its last whole block before the last token) is no longer
    short = request(PROMPT[:33])  # 2 usable blocks: replicas 1 and 2 hold as much of it
    assert choose(router, columns({}, {"prefill_tokens": 500}, {}), short) == 2
    for bad, field in ((-1.0, "stick_s"), ("1", "stick_s"), (None, "stick_s"), (-0.5, "decode_cap_s"),
                       (float("inf"), "decode_cap_s"), (True, "decode_cap_s"), (-1.0, "stick_ttft_s"),
                       (float("nan"), "stick_ttft_s"), ("2", "stick_ttft_s")):
        with pytest.raises(ConfigError, match=field):
            EstimatedTTFTOptions(**{field: bad})


def test_stick_ttft_s_keeps_a_request_with_the_holder_only_while_its_ttft_there_is_within_it():
    index = indexed(3, [(1, PROMPT[:64]), (2, PROMPT[:32])])  # 4 blocks on replica 1, 2 on replica 2
    c = columns({}, {"prefill_tokens": 500}, {})
    plain = EstimatedTTFTRouter(context(index, service=SERVICE))
    costs = plain.costs(c, request(PROMPT))
    held_ttft = ttft_twin(500, 0, 64, 160, load_weight=0.0, decode_weight=0.0)  # replica 1's TTFT, charges aside
    assert costs[2] < costs[1] and held_ttft < costs[1]
    for bound, expected in ((None, 1), (held_ttft * 1.01, 1), (held_ttft * 0.99, 2), (0.0, 2)):
        router = EstimatedTTFTRouter(context(index, service=SERVICE),
                                     EstimatedTTFTOptions(stick_s=100.0, stick_ttft_s=bound))
        assert choose(router, c, request(PROMPT)) == expected, bound
        assert router.costs(c, request(PROMPT)) == costs  # it moves the choice, not the costs
    # without stick_s nothing sticks, whatever the bound
    router = EstimatedTTFTRouter(context(index, service=SERVICE), EstimatedTTFTOptions(stick_ttft_s=10.0))
    assert choose(router, c, request(PROMPT)) == 2


def test_in_flight_counts_what_a_replica_is_prefilling_before_its_events_arrive():
    index, active = indexed(2), indexed(2, [(1, PROMPT[:96])])  # replica 1 prefills 6 of the prompt's 10 blocks
    c = columns({}, {"prefill_tokens": 96, "num_requests": 1})
    # the index alone: a miss everywhere, and replica 1 has a queue
    alone = EstimatedTTFTOptions(in_flight=False)
    assert choose(EstimatedTTFTRouter(context(index, active=active, service=SERVICE), alone), c, request(PROMPT)) == 0
    router = EstimatedTTFTRouter(context(index, active=active, service=SERVICE))  # in_flight: the default
    assert router.costs(c, request(PROMPT)) == pytest.approx(
        [ttft_twin(0, 0, 0, 160), ttft_twin(96, 1, 96, 160)])
    assert choose(router, c, request(PROMPT)) == 1
    # where the index shows more than is in flight, the index counts
    cached(index, 0, PROMPT)
    assert router.costs(c, request(PROMPT))[0] == pytest.approx(ttft_twin(0, 0, 144, 160))
    # without active sequences the option changes nothing
    without = EstimatedTTFTRouter(context(index, service=SERVICE))
    assert without.costs(c, request(PROMPT)) == EstimatedTTFTRouter(context(index, service=SERVICE), alone).costs(
        c, request(PROMPT))
    with pytest.raises(ConfigError, match="in_flight"):
        EstimatedTTFTOptions(in_flight="yes")


def test_in_flight_takes_what_it_credited_off_the_prefill_queue_until_the_first_token():
    index, active = indexed(2), indexed(2, [(1, PROMPT)])  # replica 1 prefills the prompt: 160 tokens queued
    router = EstimatedTTFTRouter(context(index, active=active, service=SERVICE), EstimatedTTFTOptions(in_flight=True))
    c = columns({}, {"prefill_tokens": 160, "num_requests": 1})
    second = request(PROMPT, i=2)
    assert choose(router, c, second) == 1  # a hit of 9 blocks there, though no event says so yet
    # the cluster counts the second request whole on replica 1 (the index showed nothing); the router
    # credits what the cluster would not have counted had the index shown the prefix (all 10 blocks)
    c.prefill_tokens[1] += 160
    cached(active, 1, PROMPT)
    assert router.costs(c, request(PROMPT, i=3))[1] == pytest.approx(ttft_twin(160, 1, 144, 160))
    router.on_first_token(second, 1)  # the credit ends at the first token; the cluster's count drops later here
    assert router.costs(c, request(PROMPT, i=3))[1] == pytest.approx(ttft_twin(320, 1, 144, 160))
    c.prefill_tokens[1] -= 160
    # a request chosen for but routed elsewhere, or never routed, is credited nothing
    router.choose_replicas(c, request(PROMPT, i=4))
    router.on_request_routed(request(PROMPT, i=4), 0)
    router.on_request_completed(request(PROMPT, i=4), 0)
    assert router.costs(c, request(PROMPT, i=5))[1] == pytest.approx(ttft_twin(160, 1, 144, 160))
    third = request(PROMPT, i=6)
    assert choose(router, c, third) == 1
    router.on_replica_removed(1)
    router.on_first_token(third, 1)  # late news of a removed replica: nothing left to drop
    assert router.costs(c, request(PROMPT, i=7))[1] == pytest.approx(ttft_twin(160, 1, 144, 160))


def test_in_flight_a_request_routed_again_loses_its_old_credit():
    index, active = indexed(2), indexed(2, [(1, PROMPT)])
    router = EstimatedTTFTRouter(context(index, active=active, service=SERVICE))
    c = columns({}, {"prefill_tokens": 160, "num_requests": 1})
    retried = request(PROMPT, i=2)
    assert choose(router, c, retried) == 1  # credited 160 tokens on replica 1
    c.prefill_tokens[1] += 160
    assert router.costs(c, request(PROMPT, i=3))[1] == pytest.approx(ttft_twin(160, 1, 144, 160))
    router.choose_replicas(c, retried)  # its call failed; the retry goes to replica 0, with nothing to credit
    router.on_request_routed(retried, 0)
    assert router.costs(c, request(PROMPT, i=3))[1] == pytest.approx(ttft_twin(320, 1, 144, 160))
    # costs() is a query: it records no choice, so routing after it credits nothing
    router.costs(c, request(PROMPT, i=4))
    router.on_request_routed(request(PROMPT, i=4), 1)
    assert router.costs(c, request(PROMPT, i=3))[1] == pytest.approx(ttft_twin(320, 1, 144, 160))


def test_the_native_ttft_cost_is_its_twin():
    from array import array

    from prefixcache._C import estimated_ttft_choice, estimated_ttft_costs, estimated_ttft_lowest

    rng = random.Random(7)
    service = ServiceModel()  # an 8B model on an H100: attention, overhead and the weights' floor all count
    for _ in range(300):
        n = rng.randint(1, 9)
        prompt = rng.randint(1, 3000)
        prefill = [rng.randint(0, 50_000) for _ in range(n)]
        queued = [rng.randint(0, 5) for _ in range(n)]
        requests = [q + rng.randint(0, 2000) for q in queued]
        overlaps = {i: rng.randint(0, 300) for i in range(n) if rng.random() < 0.6}
        weight, decode = rng.choice([0.0, 0.5, 1.0, 3.0]), rng.choice([0.0, 0.1, 1.0])
        cap, stick = rng.choice([float("inf"), 0.0, 0.05, 0.5]), rng.choice([0.0, 0.01, 0.1, 1.0])
        within = rng.choice([float("inf"), 0.0, 0.1, 1.0, 10.0])
        args = (array("q", prefill), requests, array("q", queued), overlaps, prompt, BS, service.token_s,
                service.pair_s, service.weights_s, service.step_overhead_s, service.max_num_batched_tokens, weight,
                decode, cap)
        costs = estimated_ttft_costs(*args)
        most = (prompt - 1) // BS * BS
        cached = [min(overlaps.get(i, 0) * BS, most) for i in range(n)]
        assert costs == pytest.approx([
            ttft_twin(prefill[i], requests[i] - queued[i], cached[i], prompt, service, weight, decode, cap)
            for i in range(n)], rel=1e-12)
        same, ttfts = estimated_ttft_costs(*args, with_ttft=True)
        assert same == costs and ttfts == pytest.approx([
            ttft_twin(prefill[i], requests[i] - queued[i], cached[i], prompt, service, 0.0, 0.0) for i in range(n)],
            rel=1e-12)
        assert estimated_ttft_lowest(*args, stick) == choice_twin(costs, overlaps, prompt, stick)
        assert estimated_ttft_choice(costs, overlaps, prompt, BS, stick) == choice_twin(costs, overlaps, prompt, stick)
        twin = choice_twin(costs, overlaps, prompt, stick, ttfts, within)
        assert estimated_ttft_lowest(*args, stick, within) == twin
        assert estimated_ttft_choice(costs, overlaps, prompt, BS, stick, ttfts, within) == twin
        assert estimated_ttft_lowest(*args) == [i for i, c in enumerate(costs) if c == min(costs)]
    with pytest.raises(ValueError, match="one entry per candidate"):
        estimated_ttft_costs([0], [0, 0], [0], {}, 10, BS, 1.0, 0.0, 0.0, 0.0, 64, 1.0)
    with pytest.raises(ValueError, match="prompt_tokens must be >= 1"):
        estimated_ttft_costs([0], [0], [0], {}, 0, BS, 1.0, 0.0, 0.0, 0.0, 64, 1.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        estimated_ttft_costs([0], [0], [0], {}, 10, BS, -1.0, 0.0, 0.0, 0.0, 64, 1.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        estimated_ttft_costs([0], [0], [0], {}, 10, BS, 1.0, 0.0, 0.0, 0.0, 64, 1.0, float("nan"))
    with pytest.raises(ValueError, match="budget must be >= 1"):
        estimated_ttft_costs([0], [0], [0], {}, 10, BS, 1.0, 0.0, 0.0, 0.0, 0, 1.0)
    with pytest.raises(IndexError, match="position 1"):
        estimated_ttft_costs([0], [0], [0], {1: 2}, 10, BS, 1.0, 0.0, 0.0, 0.0, 64, 1.0)
    with pytest.raises(ValueError, match="decode_cap_s must be >= 0"):
        estimated_ttft_costs([0], [0], [0], {}, 10, BS, 1.0, 0.0, 0.0, 0.0, 64, 1.0, 0.1, -1.0)
    with pytest.raises(ValueError, match="stick_s must be >= 0"):
        estimated_ttft_choice([0.0], {}, 10, BS, float("nan"))
    with pytest.raises(IndexError, match="position 2"):
        estimated_ttft_choice([0.0, 1.0], {2: 1}, 10, BS, 1.0)
    with pytest.raises(ValueError, match="stick_ttft_s must be >= 0"):
        estimated_ttft_choice([0.0], {}, 10, BS, 1.0, [0.0], -1.0)
    with pytest.raises(ValueError, match="needs one ttft per candidate"):
        estimated_ttft_choice([0.0, 1.0], {}, 10, BS, 1.0, [0.0], 1.0)


def test_estimated_ttft_breaks_ties_at_random_and_needs_the_index():
    c = columns({}, {}, {})
    picks = Counter(choose(EstimatedTTFTRouter(context(indexed(3), seed=s)), c, request(PROMPT)) for s in range(60))
    assert set(picks) == {0, 1, 2}
    with pytest.raises(ValueError, match="reads the KV index"):
        EstimatedTTFTRouter(context(None))
    # without a service model the defaults (an 8B model on one H100) set the rates
    assert EstimatedTTFTRouter(context(indexed(1))).costs(columns({}), request(PROMPT)) == pytest.approx(
        [ttft_twin(0, 0, 0, 160, ServiceModel())])


# ----------------------------------------------------------- weighted_scorers


def test_weighted_scorers_are_llm_ds_prefix_kv_utilization_and_queue_scorers():
    index = indexed(3, [(0, PROMPT[:64]), (2, PROMPT)])  # replica 0: 4 of 10 blocks; replica 2: all
    router = WeightedScorersRouter(context(index, capacity_tokens=100 * BS))
    c = columns({"queued_requests": 0, "kv_blocks": 50}, {"queued_requests": 2, "kv_blocks": 0},
                {"queued_requests": 4, "kv_blocks": 100})
    # 2 x matched / 10 blocks + 1 x (1 - usage) + 1 x (max q - q) / (max q - min q)
    assert router.scores(c, request(PROMPT)) == pytest.approx([2 * 0.4 + 0.5 + 1.0, 0 + 1.0 + 0.5, 2 * 1 + 0 + 0])
    # 2.3 against 1.5 and 2.0: the whole prefix on a full, queued replica loses to 4 blocks on an idle one
    assert choose(router, c, request(PROMPT)) == 0
    heavy = WeightedScorersRouter(context(index, capacity_tokens=100 * BS), WeightedScorersOptions(prefix_weight=4.0))
    assert choose(heavy, c, request(PROMPT)) == 2  # 4.0 against 3.1 and 1.5
    # equal queues score 1 each; a prompt without a full block scores no prefix
    even = columns({"queued_requests": 3}, {"queued_requests": 3}, {"queued_requests": 3})
    assert router.scores(even, request(PROMPT[:10])) == [2.0, 2.0, 2.0]
    picks = Counter(choose(WeightedScorersRouter(context(index, seed=s)), even, request(PROMPT[:10]))
                    for s in range(60))
    assert set(picks) == {0, 1, 2}  # ties at random, as the max-score picker shuffles
    with pytest.raises(ConfigError, match="queue_weight: must be a finite number >= 0"):
        WeightedScorersRouter.parse_options({"queue_weight": -1})


# ---------------------------------------------------------------- approx_tree


def test_approx_tree_follows_its_prediction_above_the_cache_threshold():
    router = ApproxTreeRouter(context(), ApproxTreeOptions(cache_threshold=0.5))
    c = loads(*[(0, 1, 0, 0)] * 3)
    first = choose(router, c, request(PROMPT))
    assert choose(router, c, request(PROMPT[:96] + OTHER[:64])) == first  # 6 of 10 blocks predicted there
    # 3 of 10 blocks: below the threshold, the smallest predicted cache (an empty one) wins
    assert choose(router, c, request(PROMPT[:48] + OTHER[64:])) != first


def test_approx_tree_balances_when_both_imbalance_thresholds_trip():
    opts = ApproxTreeOptions(cache_threshold=0.1, balance_abs_threshold=4, balance_rel_threshold=2.0)
    router = ApproxTreeRouter(context(), opts)
    router.on_request_routed(request(PROMPT), 0)
    assert choose(router, loads((0, 5, 0, 0), (0, 2, 0, 0)), request(PROMPT)) == 0  # 5 - 2 <= 4: follow the cache
    assert choose(router, loads((0, 10, 0, 0), (0, 5, 0, 0)), request(PROMPT)) == 0  # 10 <= 2 x 5: still balanced
    assert choose(router, loads((0, 11, 0, 0), (0, 5, 0, 0)), request(PROMPT)) == 1  # both tripped: least loaded
    by_tokens = ApproxTreeRouter(context(), ApproxTreeOptions(balance_abs_threshold=100, load_unit="tokens"))
    by_tokens.on_request_routed(request(PROMPT), 0)
    assert choose(by_tokens, loads((5000, 1, 0, 0), (10, 9, 0, 0)), request(PROMPT)) == 1


def test_approx_tree_trims_predictions_to_max_tree_size_every_interval():
    now = [0.0]
    opts = ApproxTreeOptions(max_tree_size=4 * BS, eviction_interval_s=10.0)
    router = ApproxTreeRouter(context(clock=lambda: now[0]), opts)
    router.on_request_routed(request(PROMPT), 0)
    assert router.tree.tokens(0) == 10 * BS  # not yet: the interval has not passed
    now[0] = 10.0
    router.on_request_routed(request(OTHER[:32]), 1)
    assert router.tree.tokens(0) == 4 * BS and router.tree.tokens(1) == 2 * BS
    # the survivors are the chain's head: leaves go first
    assert router.tree.longest_prefix(HASHER(PROMPT)) == {0: 4}


# ------------------------------------------------------------ prefix_affinity


def test_prefix_affinity_follows_a_match_of_ten_percent_or_more():
    router = PrefixAffinityRouter(context())
    c = loads(*[(0, 1, 0, 0)] * 4)
    router.on_request_routed(request(PROMPT), 2)
    assert choose(router, c, request(PROMPT[:16] + OTHER[:144])) == 2  # 1 of 10 blocks: exactly 10%
    router.on_request_routed(request(OTHER), 2)
    router.on_request_routed(request(OTHER[:32]), 3)
    # below 10%: the smallest predicted caches (0 and 1, empty), the less loaded of them
    fresh = list(range(9000, 9160))
    assert choose(router, loads((50, 1, 0, 0), (10, 1, 0, 0), (0, 1, 0, 0), (0, 1, 0, 0)), request(fresh)) == 1


def test_prefix_affinity_falls_back_to_power_of_two_when_imbalanced():
    router = PrefixAffinityRouter(context(seed=5), PrefixAffinityOptions(imbalanced_threshold=3))
    router.on_request_routed(request(PROMPT), 0)
    c = loads((900, 9, 0, 0), (0, 1, 0, 0), (0, 1, 0, 0))
    picks = Counter(choose(router, c, request(PROMPT)) for _ in range(50))
    assert picks[0] == 0 and picks[1] > 0 and picks[2] > 0  # never the cached but overloaded replica


def test_prefix_affinity_evicts_only_when_asked():
    now = [0.0]
    opts = PrefixAffinityOptions(do_eviction=True, eviction_threshold_tokens=6 * BS, eviction_target_tokens=3 * BS,
                                 eviction_interval_s=1.0)
    router = PrefixAffinityRouter(context(clock=lambda: now[0]), opts)
    now[0] = 1.0
    router.on_request_routed(request(PROMPT), 0)
    router.on_request_routed(request(OTHER[:80]), 1)
    assert router.tree.tokens(0) == 3 * BS and router.tree.tokens(1) == 5 * BS  # 1 is under the threshold
    keep = PrefixAffinityRouter(context(clock=lambda: now[0]))
    keep.on_request_routed(request(PROMPT), 0)
    assert keep.tree.tokens(0) == 10 * BS


def test_a_removed_replica_leaves_the_predictions():
    router = ApproxTreeRouter(context())
    router.on_request_routed(request(PROMPT), "gone")
    router.on_replica_removed("gone")
    assert router.tree.longest_prefix(HASHER(PROMPT)) == {} and router.tree.tokens("gone") == 0


# ------------------------------------------------------------------- registry


def test_routers_are_found_by_name_entry_point_and_path(monkeypatch):
    assert resolve_router("kv_events") is KVEventsRouter
    assert set(router_registry.available_routers()) >= {"round_robin", "power_of_two", "approx_tree",
                                                        "prefix_affinity", "kv_events", "weighted_scorers",
                                                        "estimated_ttft"}
    from longest_prefix_router import LongestPrefixRouter

    assert resolve_router("longest_prefix_router:LongestPrefixRouter") is LongestPrefixRouter
    monkeypatch.setattr(router_registry, "_entry_point_names",
                        lambda group: {"plugged": "longest_prefix_router:LongestPrefixRouter"})
    assert resolve_router("plugged") is LongestPrefixRouter
    with pytest.raises(ConfigError, match="unknown router 'kv_event'; known: .*kv_events"):
        resolve_router("kv_event")
    with pytest.raises(ConfigError, match="not a Router subclass"):
        resolve_router("collections:OrderedDict")


def test_register_router_takes_router_classes_only():
    @register_router("test_least_loaded")
    class LeastLoaded(Router):
        def choose_replicas(self, candidates, request):
            return [list(range(len(candidates)))]

    assert resolve_router("test_least_loaded") is LeastLoaded and LeastLoaded.name == "test_least_loaded"
    assert choose(LeastLoaded(context()), loads((9, 0, 0, 0), (3, 0, 0, 0)), request(PROMPT)) == 1
    with pytest.raises(TypeError, match="Router subclass"):
        register_router("nope")(dict)


def test_options_are_checked_against_the_router_class():
    @dataclass(frozen=True)
    class Opts:
        k: int = 1

    assert KVEventsRouter.parse_options({"temperature": 0.5}).temperature == 0.5
    with pytest.raises(ConfigError, match=r"options.temprature: unknown key; allowed keys: .*temperature"):
        KVEventsRouter.parse_options({"temprature": 0.5})
    with pytest.raises(ConfigError, match="load_unit: 'blocks' is not allowed; allowed values: requests, tokens"):
        ApproxTreeRouter.parse_options({"load_unit": "blocks"})
    with pytest.raises(ConfigError, match="cache_threshold: must be in"):
        ApproxTreeRouter.parse_options({"cache_threshold": 1.5})
    with pytest.raises(ConfigError, match="takes no options"):
        RoundRobinRouter.parse_options({"k": 1})
