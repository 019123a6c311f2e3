"""The cluster A/B simulation: the scheduler and the service model by hand (chunked
prefill, prefill competing with decode, a request arriving mid-segment, slots, cache
room, hits), the reported latencies and goodput, the load columns and the router's
hooks, the reference lines, every router over real replicas of both strategies, and its
outputs."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import prefixcache
from prefixcache.cluster.config import ClusterConfig, parse_cluster_config
from prefixcache.cluster.results import SLO
from prefixcache.cluster.router import Router
from prefixcache.service_model import ServiceModel
from prefixcache.cluster.simulate import SHARED, run_cluster, simulate, simulate_shared
from prefixcache.workloads import Request, TokenRuns, Workload

ROUTERS = ("round_robin", "power_of_two", "approx_tree", "prefix_affinity", "kv_events", "weighted_scorers",
           "estimated_ttft")

# A device where a step costs max(1 ms per token, 10 ms): 5e8 parameters at 1 TFLOP/s
# (2 x 5e8 / 1e12 = 1 ms a token) whose 1 GB of weights take 10 ms at 0.1 TB/s; one
# layer of width 1, so attention and KV reads cost ~1e-11 s (hence approx below).
BY_HAND = {
    "model": {"params": 5e8, "layers": 1, "attention_dim": 1, "kv_dim": 1, "dtype_bytes": 2},
    "device": {"memory_gib": 80, "tflops": 1.0, "bandwidth_tb_s": 0.1},
    "mfu": 1.0, "mbu": 1.0, "step_overhead_s": 0.0, "max_num_batched_tokens": 64, "max_num_seqs": 8,
}


def config(workload: dict | None = None, **changes) -> ClusterConfig:
    data = {
        "workload": workload or {"generator": "shared_prefix",
                                 "params": {"num_groups": 6, "prompts_per_group": 8, "system_prompt_len": 256,
                                            "question_len": 32, "output_len": 16, "request_rate": 40.0}},
        "cache": {"backend": "hash", "block_size": 16},
        "capacity_tokens": 4096,
        "replicas": [3],
        "service": {"max_num_seqs": 4, "max_num_batched_tokens": 512},
        "routers": {name: {} for name in ROUTERS},
    }
    data.update(changes)
    return parse_cluster_config(data)


def by_hand(*requests: tuple[float, int, int, int]) -> Workload:
    """Requests (arrival s, prompt run start, prompt tokens, output tokens)."""
    return Workload("by_hand", tuple(
        Request(t, TokenRuns([(start, start + n)]), TokenRuns([(10**6 + k * 100, 10**6 + k * 100 + out)]), tag=str(k))
        for k, (t, start, n, out) in enumerate(requests)))


def hand_config(**service) -> ClusterConfig:
    return config(service={**BY_HAND, **service}, routers={"round_robin": {}}, replicas=[1])


def run_by_hand(workload: Workload, cfg: ClusterConfig | None = None):
    cfg = cfg or hand_config()
    return simulate(workload, cfg, "rr", cfg.routers["round_robin"], 1)


def test_a_prompt_is_prefilled_in_chunks_of_the_token_budget_then_decoded_a_token_a_step():
    run = run_by_hand(by_hand((0.0, 0, 100, 5)))
    # chunks of 64 and 36 tokens (64 ms, 36 ms), the first token at 0.1 s; 4 decode steps of 10 ms
    assert run.ttft_s == pytest.approx((0.100,))
    assert run.finish_s == pytest.approx((0.140,))
    assert run.tpot_s == pytest.approx((0.010,))
    assert run.queue_s == (0.0,)
    assert run.busy_s == pytest.approx((0.140,)) and run.prefilled == (100,)


def test_a_prefill_competes_with_decode_and_an_arrival_is_scheduled_at_the_next_step():
    # A (20 tokens, 10 out) decodes from 0.02 s in 10 ms steps; B (100 tokens) arrives at
    # 0.055 s, mid-step: A's run of steps is cut at 0.06, where B is admitted next to A's
    # decode (63 tokens: 64 ms), then its last 37 (38 ms with A's token), its first token
    # at 0.162; A's steps meanwhile take 64 and 38 ms.
    run = run_by_hand(by_hand((0.0, 0, 20, 10), (0.055, 500, 100, 3)))
    a_first, b_first = 0.02, 0.06 + 0.064 + 0.038
    assert run.ttft_s == pytest.approx((a_first, b_first - 0.055))
    assert run.queue_s == pytest.approx((0.0, 0.005))  # B waited for the step in progress
    # after B's first token both decode: B's 2 more tokens by 0.182, A's last at 0.192
    assert run.finish_s == pytest.approx((b_first + 0.03, b_first + 0.02))
    assert run.tpot_s == pytest.approx(((b_first + 0.03 - a_first) / 9, 0.01))


def test_goodput_is_the_share_of_requests_within_the_ttft_and_itl_objectives():
    cfg = hand_config()
    workload = by_hand((0.0, 0, 20, 10), (0.055, 500, 100, 3))  # TTFT 0.02 and 0.107; TPOT 0.0191 and 0.01
    for slo, good in (({"ttft_s": 0.2, "itl_s": 0.02}, 1.0), ({"ttft_s": 0.1, "itl_s": 0.02}, 0.5),
                      ({"ttft_s": 0.2, "itl_s": 0.015}, 0.5), ({"ttft_s": 0.01, "itl_s": 0.001}, 0.0)):
        at = dataclasses.replace(cfg, slo=SLO(**slo))
        run = simulate(workload, at, "rr", at.routers["round_robin"], 1)
        assert run.goodput == good, slo
        assert run.summary()["goodput"] == good


def test_a_hit_skips_its_tokens_and_slots_and_cache_room_make_requests_wait():
    # C repeats A's prompt after A finished: its first block (16 tokens) is a hit, 4 are computed
    run = run_by_hand(by_hand((0.0, 0, 20, 2), (1.0, 0, 20, 2)))
    assert run.hits.hit_tokens == (0, 16)
    assert run.ttft_s == pytest.approx((0.02, 0.01))  # 4 tokens: the 10 ms floor
    # one slot: B waits for A to finish (0.02 + 0.01), then its own prefill
    run = run_by_hand(by_hand((0.0, 0, 20, 2), (0.0, 500, 20, 2)), hand_config(max_num_seqs=1))
    assert run.queue_s == pytest.approx((0.0, 0.03)) and run.ttft_s == pytest.approx((0.02, 0.05))
    # room for one prompt at a time (2 blocks of 16): the same wait, for the cache
    cfg = hand_config().with_point(capacity_tokens=32)
    run = simulate(by_hand((0.0, 0, 20, 2), (0.0, 500, 20, 2)), cfg, "rr", cfg.routers["round_robin"], 1)
    assert run.queue_s == pytest.approx((0.0, 0.03))


def test_a_hit_loaded_from_a_host_tier_waits_for_its_load(monkeypatch):
    # The device holds 2 blocks: B evicts A's, which goes down to the host tier. C repeats
    # A's prompt: its first block (16 tokens) comes back from the host, 64 bytes of this
    # model's KV (4 bytes a token) at 64 bytes/s: one second before its 4 tokens compute.
    tier = {"medium": "CPU", "num_blocks": 4, "bandwidth_gbps": 64e-9, "latency_us": 0}
    cache = {"backend": "hash", "block_size": 16, "tiers": [tier],
             "cost_model": {"kv_bytes_per_token": 4, "prefill_tokens_per_s": 1.0}}  # loading pays, to the cache
    cfg = config(service=BY_HAND, routers={"round_robin": {}}, replicas=[1], cache=cache, capacity_tokens=32)
    run = simulate(by_hand((0.0, 0, 20, 2), (0.5, 500, 20, 2), (1.0, 0, 20, 2)), cfg, "rr", cfg.routers["round_robin"], 1)
    assert run.hits.hit_tokens == (0, 0, 16)
    assert run.ttft_s == pytest.approx((0.02, 0.02, 1.01))
    # a tier as fast as the host link: the load is 1 ns, the hit as from the device
    fast = config(service=BY_HAND, routers={"round_robin": {}}, replicas=[1], capacity_tokens=32,
                  cache={**cache, "tiers": [{"medium": "CPU", "num_blocks": 4, "latency_us": 0}]})
    run = simulate(by_hand((0.0, 0, 20, 2), (0.5, 500, 20, 2), (1.0, 0, 20, 2)), fast, "rr", fast.routers["round_robin"], 1)
    assert run.hits.hit_tokens == (0, 0, 16) and run.ttft_s == pytest.approx((0.02, 0.02, 0.01))
    # the shared cache holds every replica's pool and tier: three engines, three times the blocks
    import prefixcache.cluster.simulate as sim

    built = []
    monkeypatch.setattr(sim, "build_cache", lambda c: built.append(c) or prefixcache.build_cache(c))
    simulate_shared(by_hand((0.0, 0, 20, 2)), cfg.with_replicas((3,)), 3)
    assert [(c.num_blocks, c.tiers[0].num_blocks) for c in built] == [(6, 12)]


def test_cache_when_scheduled_lets_a_request_admitted_in_the_same_step_hit_what_the_step_computes():
    # A and B share a 32-token prefix and arrive together while C's prefill runs, so the
    # next step admits both (budget 64: 40 + 23 tokens, next to C's first decode). By default
    # each computes the prefix; as vLLM (cache_when_scheduled), A's scheduled blocks are
    # cached when the step is planned, so B, admitted after A in that step, hits them.
    workload = by_hand((0.0, 500, 20, 5), (0.005, 0, 40, 2), (0.005, 0, 40, 2))
    plain = run_by_hand(workload)
    assert plain.hits.hit_tokens == (0, 0, 0) and plain.prefilled == (100,)
    vllm = dataclasses.replace(hand_config(), cache_when_scheduled=True)
    run = run_by_hand(workload, vllm)
    assert run.hits.hit_tokens == (0, 0, 32) and run.prefilled == (68,)  # B computes its last 8


def test_a_request_larger_than_a_replica_is_rejected_and_the_rest_run():
    cfg = config(capacity_tokens=64, replicas=[2], routers={"round_robin": {}}, commit_outputs=False)
    run = simulate(by_hand((0.0, 0, 40, 4), (0.0, 100, 80, 4), (0.1, 0, 40, 4)), cfg, "rr",
                   cfg.routers["round_robin"], 2)
    assert run.rejected == (1,) and run.replica_of == (0, -1, 0)
    assert math.isnan(run.ttft_s[1]) and run.goodput == pytest.approx(2 / 3)


class Recorder(Router):
    """Sends everything to the first candidate; keeps the load columns it was shown and
    the hooks it heard, with the simulated time."""

    seen: list[tuple] = []
    heard: list[tuple] = []

    def choose_replicas(self, candidates, request):
        assert self.context.active.blocks(0) == candidates.active_blocks[0]
        assert self.context.service is not None and self.context.service.max_num_batched_tokens == 64
        Recorder.seen.append((candidates.prefill_tokens[0], candidates.active_blocks[0], candidates.queued_requests[0],
                              candidates.num_requests[0], candidates.kv_blocks[0]))
        return [[0]]

    def on_first_token(self, request, replica):
        Recorder.heard.append(("first", request.request_id, round(self.context.clock(), 6)))

    def on_request_completed(self, request, replica):
        Recorder.heard.append(("done", request.request_id, round(self.context.clock(), 6)))


class IndexRecorder(Recorder):
    needs_index = True


@pytest.mark.parametrize("router", ["Recorder", "IndexRecorder"])
def test_the_load_columns_and_the_hooks_follow_each_request(router):
    cfg = config(service={**BY_HAND, "max_num_seqs": 1}, routers={"recorder": {"router": f"{__name__}:{router}"}},
                 replicas=[1], commit_outputs=False)
    Recorder.seen, Recorder.heard = [], []
    # A [0, 40) runs alone (first token 0.04, done 0.05); B [0, 36) waits for the slot;
    # C [0, 50) arrives once A is done, with B running.
    run = simulate(by_hand((0.0, 0, 40, 2), (0.01, 0, 36, 2), (0.055, 0, 50, 2)), cfg, "r",
                   cfg.routers["recorder"], 1)
    # B is admitted at 0.05 with a 2-block hit. With an index its estimate stays what the
    # index showed when it was routed (nothing: A's blocks were not computed yet), as
    # Dynamo's; without one it is the admission's miss, 4 tokens.
    b_prefill = 36 if router == "IndexRecorder" else 4
    assert Recorder.seen == [
        (0, 0, 0, 0, 0),
        # A prefilling (40 uncached), 2 active blocks (B's too), A running (3 blocks held)
        (40, 2, 0, 1, 3),
        # A done; B running, holding 3 blocks
        (b_prefill, 2, 0, 1, 3),
    ]
    assert run.hits.hit_tokens == (0, 32, 32)
    assert [h[:2] for h in Recorder.heard] == [("first", 0), ("done", 0), ("first", 1), ("done", 1), ("first", 2),
                                               ("done", 2)]
    assert [h[2] for h in Recorder.heard][:2] == [0.04, 0.05]


def test_at_one_replica_every_router_is_the_shared_cache():
    cfg = config(replicas=[1])
    shared = simulate_shared(cfg.workload.build(), cfg, 1)
    for label, spec in cfg.routers.items():
        run = simulate(cfg.workload.build(), cfg, label, spec, 1)
        assert run.hits == shared.hits and run.ttft_s == pytest.approx(shared.ttft_s), label


def test_the_shared_cache_runs_n_engines_over_one_cache():
    cfg = hand_config()
    # two fresh prompts at once: two engines prefill them side by side
    shared = simulate_shared(by_hand((0.0, 0, 20, 2), (0.0, 500, 20, 2)), cfg, 2)
    assert shared.ttft_s == pytest.approx((0.02, 0.02)) and sorted(shared.replica_of) == [0, 1]
    # the second engine finds the first one's blocks: one cache
    shared = simulate_shared(by_hand((0.0, 0, 20, 30), (0.5, 0, 20, 2), (0.5, 0, 20, 2)), cfg, 2)
    assert shared.hits.hit_tokens == (0, 16, 16)


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_every_router_runs_over_real_replicas_and_cache_aware_ones_beat_round_robin(backend):
    kv4 = {"router": "kv_events", "options": {"overlap_score_weight": 4.0}}
    cfg = config(cache={"backend": backend, "block_size": 16}, routers={**{r: {} for r in ROUTERS}, "kv4": kv4})
    result = run_cluster(cfg)
    n = len(cfg.workload.build())
    shared = result.run(SHARED, 3)
    for label in (*ROUTERS, "kv4"):
        run = result.run(label, 3)
        assert len(run.hits) == n and not run.rejected and sum(run.requests_per_replica) == n
        assert run.hit_ratio <= shared.hit_ratio + 0.02, label  # a waiting next turn may see a little more
        assert 0 <= run.goodput <= 1 and run.ttft_p50_s <= run.ttft_p90_s <= run.ttft_p99_s
        # events are recorded where the router reads the index, and only there
        assert (run.events > 0) == (label in ("kv_events", "kv4", "weighted_scorers", "estimated_ttft")), label
    rr = result.run("round_robin", 3).hit_ratio
    for label in ("approx_tree", "prefix_affinity", "kv4", "weighted_scorers", "estimated_ttft"):
        assert result.run(label, 3).hit_ratio >= shared.hit_ratio - 0.01 > rr + 0.15, label
    assert result.run("kv_events", 3).hit_ratio > rr + 0.1  # Dynamo's weight 1 trades hits for load


def test_the_precise_router_keeps_a_burst_of_one_prefix_together_while_its_events_are_in_flight():
    # 1,024-token system prompts arriving faster than a paced replica prefills one (an 8B model on
    # an H100 x 0.05: 0.8 s): reading the index alone, the router sees the burst miss everywhere and
    # a queue of misses on the replica computing it, and scatters it
    cfg = config(workload={"generator": "shared_prefix",
                           "params": {"num_groups": 4, "prompts_per_group": 8, "system_prompt_len": 1024,
                                      "question_len": 64, "output_len": 16, "request_rate": 7.0}},
                 capacity_tokens=6144, replicas=[2],
                 service={"speedup_ratio": 0.05, "max_num_seqs": 16, "max_num_batched_tokens": 2048},
                 routers={"estimated_ttft": {}, "index": {"router": "estimated_ttft", "options": {"in_flight": False}}})
    result = run_cluster(cfg)
    in_flight, index = result.run("estimated_ttft", 2), result.run("index", 2)
    ceiling = (32 - 4) * 1024 / (32 * 1088)  # every group's first prompt misses
    assert in_flight.hit_ratio >= ceiling - 0.04 > index.hit_ratio + 0.06
    assert in_flight.ttft_p50_s < index.ttft_p50_s


def test_a_replay_is_deterministic():
    cfg = config(routers={"power_of_two": {}, "estimated_ttft": {}})
    one, two = run_cluster(cfg), run_cluster(cfg)
    for a, b in zip(one.runs, two.runs, strict=True):
        assert a.hits == b.hits and a.ttft_s == b.ttft_s and a.replica_of == b.replica_of


def test_outputs_committed_or_not():
    multi_turn = {"generator": "multi_turn", "params": {"num_conversations": 6, "turns": 3, "answer_len": 48,
                                                        "request_rate": 2.0}}  # turns of a conversation ~3 s apart: each done before the next
    with_outputs = run_cluster(config(multi_turn, commit_outputs=True, routers={"kv_events": {}}))
    without = run_cluster(config(multi_turn, commit_outputs=False, routers={"kv_events": {}}))
    # a next turn's prompt holds the previous answer: hit only when outputs were committed
    assert with_outputs.run(SHARED, 3).hit_ratio > without.run(SHARED, 3).hit_ratio


def test_a_user_router_runs_from_its_module_path():
    cfg = config(routers={"longest": {"router": "longest_prefix_router:LongestPrefixRouter",
                                      "options": {"max_extra_tokens": 4096}}})
    result = run_cluster(cfg)
    assert result.run("longest", 3).hit_ratio > result.run("round_robin", 3).hit_ratio
    assert result.reference == "round_robin" and result.labels == ("round_robin", "longest", SHARED)


def test_results_as_rows_json_and_csv(tmp_path):
    cfg = config(replicas=[1, 2], routers={"kv_events": {}, "estimated_ttft": {}})
    result = run_cluster(cfg)
    assert result.labels == ("round_robin", "kv_events", "estimated_ttft", SHARED)
    assert [(r["replicas"], r["series"]) for r in result.rows()][:4] == [
        (1, "round_robin"), (1, "kv_events"), (1, "estimated_ttft"), (1, SHARED)]
    result.write_json(tmp_path / "cluster.json")
    data = json.loads((tmp_path / "cluster.json").read_text())
    row = data["runs"][0]
    # the fixed names tests outside the repository read
    for key in ("hit_ratio", "goodput", "ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "queue_p99_s"):
        assert isinstance(row[key], float), key
    run = result.run("round_robin", 1)
    assert row["ttft_mean_s"] == pytest.approx(sum(run.ttft_s) / len(run.ttft_s))
    assert row["ttft_p90_s"] == pytest.approx(float(__import__("numpy").percentile(run.ttft_s, 90)))
    assert row["hit_ratio_per_replica"] == [round(run.hit_ratio, 4)] and row["requests_per_replica"] == [48]
    assert data["config"]["service"]["device"]["bandwidth_tb_s"] == 3.35
    result.write_csv(tmp_path / "cluster.csv")
    lines = (tmp_path / "cluster.csv").read_text().splitlines()
    assert len(lines) == 1 + 2 * 4 and lines[0].startswith("series,kind,router,replicas,hit_ratio")


@pytest.mark.parametrize(
    "changes, path, words",
    [
        ({"replicas": []}, "replicas", "at least one"),
        ({"replicas": [2, 2]}, "replicas", "twice"),
        ({"capacity_tokens": 8}, "capacity_tokens", "at least one block"),
        ({"service": {"max_num_seqs": 0}}, "service.max_num_seqs", ">= 1"),
        ({"service": {"fixed_s": 1}}, "service.fixed_s", "allowed keys: model, device"),
        ({"service": {"device": "h300"}}, "service.device", "known: h100, h200"),
        ({"service": {"device": {"memory_gib": 16}}, "capacity_tokens": None}, "service.device.memory_gib",
         "no room for KV"),
        ({"service": {"mfu": 1.5}}, "service.mfu", "(0, 1]"),
        ({"slo": {"ttft_s": 0}}, "slo.ttft_s", "> 0"),
        ({"arrival_speedup": 0}, "arrival_speedup", "> 0"),
        ({"routers": {"x": {"router": "nope"}}}, "routers.x.router", "unknown router"),
        ({"routers": {"kv": {"router": "kv_events", "options": {"overlap_score_weight": -1}}}},
         "routers.kv.options.overlap_score_weight", ">= 0"),
        ({"routers": {"e": {"router": "estimated_ttft", "options": {"load_weight": -1}}}},
         "routers.e.options.load_weight", ">= 0"),
        ({"cache": {"backend": "hash", "block_size": 16, "num_blocks": 8}}, "cache.num_blocks", "capacity_tokens"),
        ({"routers": {"kv": {"router": "kv_event"}}}, "routers.kv.router", "unknown router 'kv_event'; known:"),
        ({"routers": {"kv_events": {"options": {"weight": 1}}}}, "routers.kv_events.options.weight",
         "allowed keys: overlap_score_weight, temperature"),
        ({"replicas": [0]}, "replicas[0]", ">= 1"),
        ({"workload": {"mooncake": {"path": None, "outputs": False}}}, "workload.mooncake.outputs", "output length"),
        ({"routers": {"bad label": {"router": "kv_events"}}}, "routers.bad label", "router label"),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(changes, path, words):
    from prefixcache.config import ConfigError

    with pytest.raises(ConfigError) as err:
        config(**changes)
    assert err.value.path == path and words in str(err.value)


def test_without_a_capacity_a_replica_holds_what_its_device_leaves_for_kv():
    cfg = config(capacity_tokens=None, cache={"backend": "hash", "block_size": 512})
    tokens = ServiceModel(max_num_seqs=4, max_num_batched_tokens=512).capacity_tokens()
    assert cfg.capacity_tokens == tokens and cfg.cache.num_blocks == tokens // 512
    h200 = config(capacity_tokens=None, service={"device": "h200"})
    assert h200.capacity_tokens == ServiceModel(device="h200").capacity_tokens() > 2 * tokens - 10_000


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_replicas_with_a_host_tier_route_on_per_tier_residency(backend):
    """Each replica's cache keeps a CPU tier below a device too small for the groups: the
    index the event-fed routers read holds per-tier residency, every request runs, and the
    host tier serves hits the device alone would have lost."""
    tiers = [{"medium": "CPU", "num_blocks": 512}]
    cache = {"backend": backend, "block_size": 16, "tiers": tiers}
    routers = {"kv_events": {}, "estimated_ttft": {}, "round_robin": {}}
    flat = run_cluster(config(cache={"backend": backend, "block_size": 16}, routers=routers, capacity_tokens=1024))
    tiered = run_cluster(config(cache=cache, routers=routers, capacity_tokens=1024))
    n = len(config().workload.build())
    for label in routers:
        run = tiered.run(label, 3)
        assert len(run.hits) == n and not run.rejected and sum(run.requests_per_replica) == n, label
    assert sum(tiered.run(r, 3).hit_ratio for r in routers) > sum(flat.run(r, 3).hit_ratio for r in routers)
