"""The engine's serving hooks: an abort path, a per-step event drain, events off without a consumer."""

from __future__ import annotations

import pytest

from prefixcache.ab_config import parse_ab_config
from prefixcache.config import CacheConfig, ConfigError
from prefixcache.engine import Engine, EngineConfig, GenerationRequest, ServingConfig, load_model
from prefixcache.engine.config import parse_serving_config
from prefixcache.events import BlockStored


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def engine(tiny, sink=None, backend="hash", **kw) -> Engine:
    config = ServingConfig(CacheConfig(backend=backend, block_size=4, num_blocks=64),
                           EngineConfig(model="tiny", num_threads=1, **kw))
    return Engine(config, model=tiny, event_sink=sink)


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_events_go_to_the_sink_once_per_step_and_nowhere_without_one(tiny, backend):
    batches = []
    e = engine(tiny, batches.append, backend)
    e.add_request(GenerationRequest(prompt=list(range(10)), max_tokens=3))
    steps = 0
    while e.has_unfinished():
        e.run_step()
        steps += 1
        assert e.cache.drain_events() == []  # the step drained the log into the sink
    assert 0 < len(batches) <= steps and all(batches)
    assert any(isinstance(ev, BlockStored) for batch in batches for ev in batch)
    quiet = engine(tiny, None, backend)
    assert quiet.cache.config.enable_events is False
    quiet.generate([GenerationRequest(prompt=list(range(10)), max_tokens=3)])
    assert quiet.cache.drain_events() == [] and quiet.cache.stats().events_dropped == 0


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_abort_releases_a_request_wherever_it_is(tiny, backend):
    batches = []
    e = engine(tiny, batches.append, backend, max_num_seqs=1, max_num_batched_tokens=8)
    running = e.add_request(GenerationRequest(prompt=list(range(30)), max_tokens=50))
    queued = e.add_request(GenerationRequest(prompt=list(range(40, 60)), max_tokens=5))
    out = e.run_step()  # a first 8-token chunk of `running`'s prompt; `queued` waits (one seq at a time)
    assert out.tokens == () and [s.request_id for s in e.scheduler.waiting] == [queued]
    assert e.abort(queued) and not e.abort(queued) and not e.abort("nobody")
    e.run_step()
    assert e.abort(running) and not e.has_unfinished()
    e.check_invariants()
    assert e.cache.stats().requests == 1
    if backend == "hash":
        assert e.cache.pool.num_pinned == 0
    else:
        assert e.cache.tree.protected_size == 0
    assert any(isinstance(ev, BlockStored) for batch in batches for ev in batch)  # what it computed stays cached


def test_step_output_names_each_sampled_token(tiny):
    e = engine(tiny)
    a = e.add_request(GenerationRequest(prompt=[1, 2, 3], max_tokens=2))
    b = e.add_request(GenerationRequest(prompt=[4, 5, 6, 7], max_tokens=1))
    first = e.run_step()
    assert [rid for rid, _ in first.tokens] == [a, b] and [o.request_id for o in first.finished] == [b]
    second = e.run_step()
    assert [rid for rid, _ in second.tokens] == [a] and second.finished[0].token_ids == [first.tokens[0][1],
                                                                                        second.tokens[0][1]]


def test_ignore_eos_drops_only_the_end_of_sequence_token(tiny):
    e = engine(tiny, stop_token_ids=(5,))
    e.add_request(GenerationRequest(prompt=[1, 2], ignore_eos=True, stop_token_ids=(9,)))
    e.add_request(GenerationRequest(prompt=[1, 2]))
    ignoring, plain = e.scheduler.waiting
    eos = e.tokenizer.eos_token_id
    assert ignoring.stop_token_ids == {5, 9} and plain.stop_token_ids == {5, eos}


def test_an_engine_file_records_no_events_and_says_so_if_asked_to():
    config = parse_serving_config({"cache": {"backend": "hash"}, "engine": {"model": "tiny"}})
    assert config.cache.enable_events is False
    assert parse_serving_config({"cache": {}, "engine": {"model": "tiny"}}, events=True).cache.enable_events is True
    with pytest.raises(ConfigError, match="cache.enable_events: is true, but an engine records KV events only"):
        parse_serving_config({"cache": {"enable_events": True}, "engine": {"model": "tiny"}})


def test_ab_arms_record_events_only_when_they_say_so():
    ab = parse_ab_config({
        "workload": {"generator": "no_sharing", "params": {"num_requests": 2}},
        "capacity_tokens": 4096,
        "arms": {"quiet": {"backend": "hash"}, "counted": {"backend": "radix", "enable_events": True}},
    })
    assert ab.arms["quiet"].enable_events is False and ab.arms["counted"].enable_events is True


@pytest.mark.parametrize("section, message", [
    ({"endpoint": "udp://127.0.0.1:1"}, "kv_events.endpoint: must be a ZeroMQ endpoint"),
    ({"replay_endpoint": "tcp://*:5557"}, "kv_events.replay_endpoint: must differ from endpoint"),
    ({"buffer_steps": 0}, "kv_events.buffer_steps: must be an integer >= 1"),
    ({"enabeld": True}, "kv_events.enabeld: unknown key; allowed keys: enabled, endpoint"),
])
def test_a_serve_file_names_what_is_wrong_with_kv_events(section, message):
    from prefixcache.serve.config import parse_serve_config

    with pytest.raises(ConfigError, match=message):
        parse_serve_config({"cache": {}, "engine": {"model": "tiny"}, "kv_events": section}, "serve.yaml")
    served = parse_serve_config({"cache": {}, "engine": {"model": "tiny"}, "kv_events": {"enabled": True}})
    assert served.serving.cache.enable_events is True and served.kv_events.endpoint == "tcp://*:5557"
