"""The cluster A/B simulation: the service model by hand, queueing, rejection, the reference
lines, every router over real replicas of both strategies, and its outputs."""

from __future__ import annotations

import dataclasses

import pytest

from prefixcache.cluster.config import ClusterConfig, RouterSpec, parse_cluster_config
from prefixcache.cluster.registry import resolve_router_spec
from prefixcache.cluster.router import Router
from prefixcache.cluster.service_model import ServiceModel
from prefixcache.cluster.simulate import SHARED, run_cluster, simulate, simulate_shared
from prefixcache.workloads import Request, TokenRuns, Workload

ROUTERS = ("round_robin", "power_of_two", "approx_tree", "prefix_affinity", "kv_events")


def config(workload: dict | None = None, **changes) -> ClusterConfig:
    data = {
        "workload": workload or {"generator": "shared_prefix",
                                 "params": {"num_groups": 6, "prompts_per_group": 8, "system_prompt_len": 256,
                                            "question_len": 32, "output_len": 16, "request_rate": 40.0}},
        "cache": {"backend": "hash", "block_size": 16},
        "capacity_tokens": 4096,
        "replicas": [3],
        "service": {"fixed_s": 0.001, "prefill_token_s": 1e-4, "output_token_s": 1e-3, "max_concurrent": 4},
        "routers": {name: {} for name in ROUTERS},
    }
    data.update(changes)
    return parse_cluster_config(data)


def by_hand(*requests: tuple[float, int, int]) -> Workload:
    """Requests (arrival s, prompt run start, prompt tokens) with 10 output tokens each."""
    return Workload("by_hand", tuple(
        Request(t, TokenRuns([(start, start + n)]), TokenRuns([(10**6 + k * 100, 10**6 + k * 100 + 10)]), tag=str(k))
        for k, (t, start, n) in enumerate(requests)))


def test_ttft_queueing_and_busy_time_follow_the_service_model():
    cfg = config(service={"fixed_s": 0.5, "prefill_token_s": 0.01, "output_token_s": 0.1, "max_concurrent": 1},
                 routers={"round_robin": {}}, replicas=[1])
    # A (32 tokens) at 0; B (the same prompt) at 0.1 waits for A's slot; C (fresh) at 10, idle replica
    run = simulate(by_hand((0.0, 0, 32), (0.1, 0, 32), (10.0, 500, 48)), cfg, "rr", cfg.routers["round_robin"], 1)
    a_service = 0.5 + 32 * 0.01 + 10 * 0.1  # 1.82 s
    b_hit = 16  # both blocks cached, the hit capped at len - 1 = 31 tokens: one block
    assert run.hits.hit_tokens == (0, b_hit, 0)
    assert run.ttft_s == pytest.approx((0.5 + 0.32, a_service - 0.1 + 0.5 + 16 * 0.01, 0.5 + 0.48))
    assert run.busy_s == pytest.approx((a_service + (0.5 + 0.16 + 1.0) + (0.5 + 0.48 + 1.0),))
    assert run.replica_of == (0, 0, 0) and run.rejected == ()


def test_prefill_is_one_at_a_time_and_decode_overlaps():
    cfg = config(service={"fixed_s": 0.0, "prefill_token_s": 0.01, "output_token_s": 0.1, "max_concurrent": 2},
                 routers={"round_robin": {}}, replicas=[1])
    # A and B (different prompts) at 0, two slots: B's prefill waits for A's; C waits for a slot
    run = simulate(by_hand((0.0, 0, 32), (0.0, 500, 64), (0.0, 900, 16)), cfg, "rr", cfg.routers["round_robin"], 1)
    a_first, b_first = 0.32, 0.32 + 0.64
    c_start = a_first + 1.0  # A's slot frees when A has decoded its 10 tokens
    assert run.ttft_s == pytest.approx((a_first, b_first, c_start + 0.16))
    shared = simulate_shared(by_hand((0.0, 0, 32), (0.0, 500, 64)), cfg, 2)  # 2 replicas' worth: 2 prefill engines
    assert shared.ttft_s == pytest.approx((0.32, 0.64))


def test_a_request_larger_than_a_replica_is_rejected_and_the_rest_run():
    cfg = config(capacity_tokens=64, replicas=[2], routers={"round_robin": {}})
    run = simulate(by_hand((0.0, 0, 40), (0.0, 100, 80), (0.1, 0, 40)), cfg, "rr", cfg.routers["round_robin"], 2)
    assert run.rejected == (1,) and run.replica_of == (0, -1, 0) and len(run.ttft_s) == 2


class LoadRecorder(Router):
    """Sends everything to the first candidate and keeps the load columns it was shown."""

    seen: list[tuple[int, int]] = []

    def choose_replicas(self, candidates, request):
        # the active sequences the cluster hands routers are what the column counts
        assert self.context.active.blocks(0) == candidates.active_blocks[0]
        LoadRecorder.seen.append((candidates.prefill_tokens[0], candidates.active_blocks[0],
                                  self.context.active.longest_prefix(request.hashes).get(0, 0)))
        return [[0]]


def test_the_load_columns_are_dynamos_active_sequences():
    cfg = config(service={"fixed_s": 0.0, "prefill_token_s": 0.01, "output_token_s": 0.1, "max_concurrent": 1},
                 routers={"recorder": {"router": f"{__name__}:LoadRecorder"}}, replicas=[1])
    LoadRecorder.seen = []
    # A [0, 40) runs 0-1.4 (first token 0.4); B [0, 36) and C [0, 50) wait for its slot; B
    # runs from 1.4 with a 2-block hit (first token 1.44); D, unrelated, arrives at 1.41.
    run = simulate(by_hand((0.0, 0, 40), (0.1, 0, 36), (0.2, 0, 50), (1.41, 1000, 16)), cfg, "r",
                   cfg.routers["recorder"], 1)
    assert run.hits.hit_tokens == (0, 32, 32, 0)
    assert LoadRecorder.seen == [
        (0, 0, 0),
        (40, 2, 2),  # A's prompt, all uncached, until its first token; its 2 full blocks (no outputs), both B's
        (40 + 36, 2, 2),  # B's 2 blocks are A's: counted once; C's first 2 are active already
        # A done; B's estimate stays what it was at routing (the cache was empty then), not
        # the 4 tokens it prefills; C adds its third block; D shares none
        (36 + 50, 3, 0),
    ]


def test_at_one_replica_every_router_is_the_shared_cache():
    cfg = config(replicas=[1])
    shared = simulate_shared(cfg.workload.build(), cfg, 1)
    for label, spec in cfg.routers.items():
        run = simulate(cfg.workload.build(), cfg, label, spec, 1)
        assert run.hits == shared.hits and run.ttft_s == pytest.approx(shared.ttft_s), label


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_every_router_runs_over_real_replicas_and_cache_aware_ones_beat_round_robin(backend):
    kv4 = {"router": "kv_events", "options": {"overlap_score_weight": 4.0}}
    cfg = config(cache={"backend": backend, "block_size": 16}, routers={**{r: {} for r in ROUTERS}, "kv4": kv4})
    result = run_cluster(cfg)
    n = len(cfg.workload.build())
    shared = result.run(SHARED, 3)
    for label in (*ROUTERS, "kv4"):
        run = result.run(label, 3)
        assert sum(run.requests_per_replica) == n and len(run.ttft_s) == n
        assert run.hit_ratio <= shared.hit_ratio + 0.02  # the ceiling, up to timing
    rr = result.run("round_robin", 3).hit_ratio
    for label in ("approx_tree", "prefix_affinity", "kv4"):
        assert result.run(label, 3).hit_ratio > rr + 0.05, label
    # At Dynamo's weight 1 a cached block saves what an active block costs, so a replica
    # holding the 16-block system prompt loses it to one with 18 fewer active blocks.
    assert result.run("kv_events", 3).hit_ratio > rr
    assert result.run("kv_events", 3).events > 0 and result.run("round_robin", 3).events == 0


def test_a_replay_is_deterministic():
    cfg = config()
    w = cfg.workload.build()
    first = [simulate(w, cfg, label, spec, 3) for label, spec in cfg.routers.items()]
    again = [simulate(w, cfg, label, spec, 3) for label, spec in cfg.routers.items()]
    for a, b in zip(first, again, strict=True):
        assert (a.hits, a.replica_of, a.ttft_s) == (b.hits, b.replica_of, b.ttft_s)


def test_outputs_committed_or_not():
    cfg = config(workload={"generator": "multi_turn", "params": {"num_conversations": 4, "turns": 3,
                                                                 "system_prompt_len": 32, "question_len": 16,
                                                                 "answer_len": 32, "request_rate": 0.5}},
                 replicas=[1], routers={"round_robin": {}})
    w = cfg.workload.build()
    spec = cfg.routers["round_robin"]
    with_outputs = simulate(w, cfg, "rr", spec, 1)
    without = simulate(w, dataclasses.replace(cfg, commit_outputs=False), "rr", spec, 1)
    assert with_outputs.hit_ratio > without.hit_ratio  # a next turn hits the previous answer


def test_a_user_router_runs_from_its_module_path():
    cfg = config(routers={"longest": {"router": "longest_prefix_router:LongestPrefixRouter",
                                      "options": {"max_extra_tokens": 4096}}})
    result = run_cluster(cfg)
    assert result.run("longest", 3).hit_ratio > result.run("round_robin", 3).hit_ratio
    assert result.reference == "round_robin" and result.labels == ("round_robin", "longest", SHARED)


def test_results_as_rows_json_and_csv(tmp_path):
    cfg = config(replicas=[2, 3], routers={"kv_events": {}})
    result = run_cluster(cfg)
    rows = result.rows()
    assert [(r["replicas"], r["series"]) for r in rows] == [
        (2, "round_robin"), (2, "kv_events"), (2, SHARED), (3, "round_robin"), (3, "kv_events"), (3, SHARED)]
    result.write_json(tmp_path / "c.json")
    result.write_csv(tmp_path / "c.csv")
    text = (tmp_path / "c.csv").read_text().splitlines()
    assert text[0].startswith("series,kind,router,replicas,hit_ratio") and len(text) == 7
    assert '"overlap_score_weight": 1.0' in (tmp_path / "c.json").read_text()


@pytest.mark.parametrize(
    ("changes", "path", "words"),
    [
        ({"routers": {"kv": {"router": "kv_event"}}}, "routers.kv.router", "unknown router 'kv_event'; known:"),
        ({"routers": {"kv_events": {"options": {"weight": 1}}}}, "routers.kv_events.options.weight",
         "allowed keys: overlap_score_weight, temperature"),
        ({"routers": {"approx_tree": {"options": {"load_unit": "blocks"}}}}, "routers.approx_tree.options.load_unit",
         "allowed values: requests, tokens"),
        ({"cache": {"backend": "hash", "num_blocks": 9}}, "cache.num_blocks", "capacity_tokens"),
        ({"replicas": [2, 2]}, "replicas", "twice"),
        ({"replicas": [0]}, "replicas[0]", ">= 1"),
        ({"service": {"max_concurrent": 0}}, "service.max_concurrent", ">= 1"),
        ({"service": {"fixed": 1}}, "service.fixed", "allowed keys: fixed_s"),
        ({"arrival_speedup": 0}, "arrival_speedup", "> 0"),
        ({"workload": {"mooncake": {"path": None, "outputs": False}}}, "workload.mooncake.outputs", "output length"),
        ({"routers": {"bad label": {"router": "kv_events"}}}, "routers.bad label", "router label"),
    ],
)
def test_config_errors_name_the_key_and_what_is_allowed(changes, path, words):
    with pytest.raises(Exception, match=words) as err:
        config(**changes)
    assert err.value.path == path


def test_service_model_refuses_negative_costs():
    with pytest.raises(ValueError, match="prefill_token_s"):
        ServiceModel(prefill_token_s=-1.0)
    spec = RouterSpec("kv_events", {"temperature": 0.5})
    assert resolve_router_spec(spec.router, spec.options).parsed.temperature == 0.5
