"""`engine.pace`: an engine whose steps last what a service model gives their work.

The model still computes (outputs equal the unpaced engine's), each step takes at least
its modelled time (a lower bound, so a loaded machine cannot make these fail: it only
counts overruns), a cache hit shortens the modelled prefill, the pace takes the engine's
own scheduler limits and refuses keys it would not follow, and a cluster's router
estimates with the replicas' pace unless told otherwise."""

from __future__ import annotations

import time

import pytest

from prefixcache.config import ConfigError
from prefixcache.engine import Engine
from prefixcache.engine.config import parse_serving_config
from prefixcache.engine.loader import load_model
from prefixcache.serve.cluster_config import parse_cluster_serve_config
from prefixcache.service_model import ServiceModel

SPEEDUP = 0.2  # an 8B model on one H100, five times slower: a decode step about 33 ms
PROMPT = [i % 300 + 1 for i in range(640)]  # long enough for its prefill to be compute-bound


def config(pace: object = None, **engine: object):
    section = {"model": "tiny", "num_threads": 1, "max_num_seqs": 4, "max_num_batched_tokens": 1024, "max_tokens": 3,
               **engine}
    if pace is not None:
        section["pace"] = pace
    return parse_serving_config({"cache": {"backend": "hash", "block_size": 16, "num_blocks": 64}, "engine": section})


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def run(engine: Engine, prompt: list[int]) -> tuple[list[float], list]:
    """Each step's wall SECONDS, and the outputs, of `prompt` alone through `engine`."""
    engine.add_request(prompt)
    walls, outputs = [], []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs += engine.step()
        walls.append(time.perf_counter() - t0)
    return walls, outputs


def test_a_paced_step_lasts_at_least_its_modelled_time_and_outputs_are_unchanged(tiny):
    paced, plain = Engine(config({"speedup_ratio": SPEEDUP}), model=tiny), Engine(config(), model=tiny)
    model = paced.config.engine.pace
    assert model == ServiceModel(speedup_ratio=SPEEDUP, max_num_seqs=4, max_num_batched_tokens=1024)
    walls, paced_out = run(paced, PROMPT)
    assert [o.token_ids for o in paced_out] == [o.token_ids for o in run(plain, PROMPT)[1]]
    # the prompt in one 640-token chunk, then two single-token decodes
    modelled = [model.chunks_s([(0, 640)]), model.chunks_s([(640, 1)]), model.chunks_s([(641, 1)])]
    assert len(walls) == 3
    for wall, want in zip(walls, modelled):
        assert wall >= want
    m = paced_out[0].metrics
    assert m.first_token_s - m.arrival_s >= modelled[0]
    stats = paced.stats()
    assert stats.steps == 3 and stats.overrun_steps + (stats.paced_s > 0) >= 1  # slept, or counted each overrun
    assert plain.stats().paced_s == 0.0 and plain.stats().overrun_steps == 0


def test_a_hit_shortens_the_modelled_prefill(tiny):
    engine = Engine(config({"speedup_ratio": SPEEDUP}), model=tiny)
    model = engine.config.engine.pace
    run(engine, PROMPT)
    walls, outputs = run(engine, PROMPT)
    hit = outputs[0].metrics
    assert engine.stats().prefill_tokens_saved == 624  # 39 of the prompt's 40 blocks
    assert walls[0] >= model.chunks_s([(624, 16)])
    assert model.chunks_s([(624, 16)]) < model.chunks_s([(0, 640)])
    assert hit.first_token_s - hit.arrival_s >= model.chunks_s([(624, 16)])


def test_the_pace_takes_the_engines_limits_and_refuses_what_it_would_not_follow():
    assert config({}).engine.pace == ServiceModel(max_num_seqs=4, max_num_batched_tokens=1024)
    assert config({"max_num_seqs": 4}).engine.pace.max_num_seqs == 4  # the same value is no conflict
    assert config({"device": "h200", "mfu": 0.4}).engine.pace.hardware.bandwidth_tb_s == 4.8
    for pace, path, words in (
        ({"max_num_seqs": 8}, "engine.pace.max_num_seqs", "is engine.max_num_seqs (4)"),
        ({"max_num_batched_tokens": 512}, "engine.pace.max_num_batched_tokens", "is engine.max_num_batched_tokens"),
        ({"gpu_memory_utilization": 0.5}, "engine.pace.gpu_memory_utilization", "cache.num_blocks"),
        ({"reserved_gib": 1}, "engine.pace.reserved_gib", "cache.num_blocks"),
        ({"speedup_ratio": 0}, "engine.pace.speedup_ratio", "> 0"),
        ({"device": "b200"}, "engine.pace.device", "known: h100, h200"),
        ({"speed": 2}, "engine.pace.speed", "allowed keys"),
    ):
        with pytest.raises(ConfigError) as err:
            config(pace)
        assert err.value.path == path and words in str(err.value), str(err.value)


def cluster(router: str, **section: object):
    return parse_cluster_serve_config({
        "cache": {"backend": "hash", "block_size": 16, "num_blocks": 64},
        "engine": {"model": "tiny", "max_num_seqs": 4, "max_num_batched_tokens": 256, "pace": {"speedup_ratio": 0.1}},
        "cluster": {"router": router, **section},
    })


def test_a_clusters_router_estimates_with_the_replicas_pace():
    pace = ServiceModel(speedup_ratio=0.1, max_num_seqs=4, max_num_batched_tokens=256)
    assert cluster("estimated_ttft").cluster.service == pace
    assert cluster("kv_events").cluster.service == pace
    given = cluster("estimated_ttft", service={"device": "h200"}).cluster.service
    assert given == ServiceModel(device="h200")  # a service the file gives stays
    assert cluster("ray_power_of_two").cluster.service is None  # Ray's routers read none
