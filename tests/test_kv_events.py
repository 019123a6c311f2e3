"""KV events as both backends record them: vLLM 0.33's fields, and a bounded log."""

from __future__ import annotations

import logging

import pytest

import prefixcache
from prefixcache.config import CacheConfig
from prefixcache.events import (
    FULL_ATTENTION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
    NullEventLog,
    event_log,
)
from prefixcache.isolation import Isolation, LoRA


def make(backend: str, num_blocks: int = 8, **kw):
    return prefixcache.build_cache(CacheConfig(backend=backend, block_size=4, num_blocks=num_blocks, **kw))


def run(cache, rid, tokens, namespace=None):
    cache.admit(rid, tokens, namespace=namespace)
    cache.commit(rid, len(tokens))
    cache.release(rid)


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_every_event_names_group_0_and_the_full_attention_kind(backend):
    cache = make(backend)
    run(cache, "a", list(range(9)), namespace=Isolation("tenant", LoRA("adapter", "/w/adapter", id=7)))
    assert cache.evict(8) == 2
    assert cache.reset()
    events = cache.drain_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in stored) == 2 == sum(len(e.block_hashes) for e in removed)
    for e in stored:
        assert (e.group_idx, e.kv_cache_spec_kind, e.medium) == (0, FULL_ATTENTION, "GPU")
        assert (e.lora_id, e.lora_name) == (7, "adapter")
    assert [e.extra_keys[0] for e in stored][0] == ("adapter", "tenant")  # vLLM's untagged event form
    assert all(e.group_idx == 0 for e in removed)
    assert events[-1] == AllBlocksCleared()


def test_a_lora_id_is_a_label_not_an_isolation_key():
    """vLLM hashes the adapter's name and path, not its int id: two ids of one adapter share blocks."""
    cache = make("hash")
    tokens = list(range(9))
    run(cache, "a", tokens, namespace=Isolation(None, LoRA("ad", "/p", id=1)))
    assert cache.match(tokens, namespace=Isolation(None, LoRA("ad", "/p", id=2))).num_tokens == 8
    assert LoRA("ad", "/p", 1) == LoRA("ad", "/p", 2)
    assert Isolation(None, ("ad", "/p", 3)).lora.id == 3
    for bad in (0, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match="lora.id must be an int >= 1 or None"):
            LoRA("ad", "/p", bad)


def test_a_full_log_drops_the_oldest_and_counts_what_it_dropped(caplog):
    log = EventLog(capacity=3)
    with caplog.at_level(logging.WARNING, logger="prefixcache.events"):
        for i in range(5):
            log.record(BlockRemoved((bytes([i]),)))
    assert log.dropped == 2 and len(log) == 3
    assert [e.block_hashes[0] for e in log.drain()] == [b"\x02", b"\x03", b"\x04"]
    assert len(caplog.records) == 1 and "dropping the oldest" in caplog.text  # said once, not per event
    assert log.drain() == [] and log.dropped == 2
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        EventLog(capacity=0)


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_a_cache_nobody_drains_stays_bounded_and_says_so(backend, monkeypatch):
    monkeypatch.setattr("prefixcache.events.EVENT_LOG_CAPACITY", 4)
    cache = make(backend, num_blocks=64)
    for i in range(6):
        run(cache, f"r{i}", [100 * i + t for t in range(9)])
    stats = cache.stats()
    assert len(cache.drain_events()) == 4
    assert stats.events_dropped == (12 if backend == "radix" else 6) - 4  # radix: one event per page
    assert make(backend, enable_events=False).stats().events_dropped == 0


def test_a_disabled_log_is_the_null_log_and_never_builds_events():
    built = []

    def build(*hashes):
        built.append(hashes)
        return [BlockRemoved((h,)) for h in hashes]

    off, on = event_log(False), event_log(True, capacity=4)
    assert type(off) is NullEventLog and type(on) is EventLog and on.capacity == 4
    off.record(AllBlocksCleared())
    off.record_from(build, b"a", b"b")
    assert (built, off.drain(), len(off), off.dropped, off.enabled) == ([], [], 0, 0, False)
    on.record_from(build, b"a", b"b")
    assert built == [(b"a", b"b")] and on.drain() == [BlockRemoved((b"a",)), BlockRemoved((b"b",))]
    assert on.enabled
