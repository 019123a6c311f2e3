"""Priority scheduling (vLLM's `--scheduling-policy priority`): requests wait in order of
(priority, arrival), a full pool preempts the running request last in that order, and
every request still finishes with the output it has alone; under "fcfs" a priority other
than 0 is refused, as vLLM refuses it."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pytest
from engine_cases import assert_same_outputs, engine_for, serving

from prefixcache.engine import GenerationRequest, load_model
from prefixcache.errors import ConfigError

httpx = pytest.importorskip("httpx")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def run(engine, requests) -> list[str]:
    """Add `requests` at once, step to the end; the request ids in the order they finished."""
    ids = [engine.add_request(r) for r in requests]
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step()]
    assert sorted(order) == sorted(ids)
    return order


def test_waiting_requests_go_by_priority_then_arrival(tiny):
    engine = engine_for(tiny, serving("tiny", max_num_seqs=1, scheduling_policy="priority"))
    reqs = [GenerationRequest(prompt=[10 + i] * 8, max_tokens=2, priority=p, request_id=f"r{i}")
            for i, p in enumerate([3, 1, 2, 1, -4])]  # fmt: skip
    assert run(engine, reqs) == ["r4", "r1", "r3", "r2", "r0"]
    fcfs = engine_for(tiny, serving("tiny", max_num_seqs=1))
    assert run(fcfs, [GenerationRequest(prompt=[10 + i] * 8, max_tokens=2, request_id=f"r{i}") for i in range(3)]) == [
        "r0", "r1", "r2"]


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
def test_a_full_pool_preempts_the_worst_priority_not_the_newest(tiny, policy, victim):
    """`low` runs first; `high` (a better priority) arrives after. When their decodes fill
    the pool, priority preempts `low`, where first come, first served preempts the newest."""
    engine = engine_for(tiny, serving("tiny", num_blocks=8, scheduling_policy=policy))
    low = GenerationRequest(prompt=list(range(40)), max_tokens=30, request_id="low",
                            priority=5 if policy == "priority" else 0)  # fmt: skip
    high = GenerationRequest(prompt=list(range(100, 140)), max_tokens=30, request_id="high")
    engine.add_request(low)
    done = engine.step()  # `low` admitted and prefilled alone
    engine.add_request(high)
    while engine.has_unfinished():
        done += engine.step()
    by_id = {o.request_id: o for o in done}
    assert by_id[victim].metrics.preemptions > 0
    assert by_id[({"low", "high"} - {victim}).pop()].metrics.preemptions == 0
    engine.check_invariants()


@pytest.mark.parametrize("backend, seed", [("hash", 7), ("hash", 11), ("hash", 23), ("radix", 7), ("radix", 5)])
def test_under_pressure_every_request_finishes_with_its_own_output(tiny, backend, seed):
    rng = random.Random(seed)
    base = [(i * 37) % 250 for i in range(48)]
    reqs = [GenerationRequest(prompt=base[: 20 + 4 * i] + [i, i + 1], max_tokens=24, priority=rng.randint(-2, 2), keep_first_logits=True,
                              request_id=f"q{i}") for i in range(8)]  # fmt: skip
    big = engine_for(tiny, serving("tiny", backend=backend, num_blocks=512, scheduling_policy="priority"))
    small = engine_for(tiny, serving("tiny", backend=backend, num_blocks=8, scheduling_policy="priority"))
    assert_same_outputs(small.generate(reqs), big.generate(reqs))
    assert small.stats().preemptions > 0
    small.check_invariants()


def test_priority_is_refused_without_priority_scheduling(tiny):
    engine = engine_for(tiny, serving("tiny"))
    with pytest.raises(ConfigError, match="Priority scheduling is not enabled") as err:
        engine.add_request(GenerationRequest(prompt=[1, 2, 3], priority=1))
    assert err.value.path == "priority" and not engine.has_unfinished()
    with pytest.raises(ConfigError, match="allowed values: fcfs, priority"):
        serving("tiny", scheduling_policy="lifo")


def test_the_server_takes_priority_only_with_priority_scheduling(tiny):
    pytest.importorskip("fastapi")
    from serve_cases import running

    body = {"prompt": "x", "max_tokens": 2, "priority": 3}
    with running(tiny, "hash") as fcfs:
        r = httpx.post(fcfs.base_url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert "Priority scheduling is not enabled" in r.json()["error"]["message"]
    with running(tiny, "hash", scheduling_policy="priority") as ranked:
        assert httpx.post(ranked.base_url + "/v1/completions", json=body, timeout=30).status_code == 200


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(-3, 3), st.integers(0, 4), st.integers(8, 40)), min_size=2, max_size=7),
       st.integers(8, 12))
def test_requests_arriving_mid_run_all_finish_as_they_would_alone(tiny, arrivals, num_blocks):
    """Requests of random priorities arrive at random steps into a tight pool: each ends
    with the tokens it draws with the pool to itself, and nothing stays pinned."""
    reqs = [GenerationRequest(prompt=[(7 * i + j) % 250 for j in range(n)], max_tokens=20, priority=p,
                              request_id=f"a{i}") for i, (p, _, n) in enumerate(arrivals)]  # fmt: skip
    roomy = engine_for(tiny, serving("tiny", scheduling_policy="priority"))
    alone = {r.request_id: roomy.generate([r])[0].token_ids for r in reqs}
    engine = engine_for(tiny, serving("tiny", num_blocks=num_blocks, scheduling_policy="priority"))
    pending = sorted(zip((a for _, a, _ in arrivals), range(len(reqs))))
    done, step = [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            engine.add_request(reqs[pending.pop(0)[1]])
        if engine.has_unfinished():
            done += engine.step()
        step += 1
    assert {o.request_id: o.token_ids for o in done} == alone
    engine.check_invariants()
    engine.cache.evict(num_blocks)  # every request released: evicting the cache frees the whole pool
    assert engine.cache.pool.num_free == num_blocks
