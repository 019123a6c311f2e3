"""The engine with lower tiers on the tiny random model: real data movement (a host
tensor pool, a disk file of checksummed blocks), outputs identical whichever tier served
a prefix, a restart onto the same disk file, and a bad or full disk as a miss or a
counted refusal, never wrong KV (docs/tiers.md)."""

from __future__ import annotations

import errno
import os

import pytest

from engine_cases import BACKENDS, assert_same_outputs
from prefixcache.config import CacheConfig, ConfigError, HashConfig
from prefixcache.engine import Engine, EngineConfig, GenerationRequest, ServingConfig, load_model
from prefixcache.tier_config import TierConfig
from prefixcache.tier_file import TierFile

BS = 4


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def prompts(vocab: int) -> list[list[int]]:
    """Two prompts sharing nothing, each long enough to fill the small device pool."""
    a = [(7 * i + 3) % vocab for i in range(6 * BS + 1)]
    b = [(11 * i + 5) % vocab for i in range(6 * BS + 1)]
    return [a, b]


def engine(tiny, backend: str, *tiers: TierConfig, caching: bool = True, num_blocks: int = 8) -> Engine:
    cache = CacheConfig(backend=backend, block_size=BS, num_blocks=num_blocks, tiers=tuple(tiers))
    return Engine(ServingConfig(cache, EngineConfig(model="tiny", prefix_caching=caching)), model=tiny)


def one(e: Engine, prompt: list[int]):
    out = e.generate([GenerationRequest(prompt=prompt, max_tokens=4, keep_first_logits=True)])[0]
    e.check_invariants()
    return out


def reference(tiny, backend):
    e = engine(tiny, backend, caching=False)
    a, b = prompts(tiny.weights.config.vocab_size)
    return [one(e, a), one(e, b), one(e, a)]


def ab_a(e: Engine, vocab: int):
    """a, then b (which pushes a's blocks out of the device), then a again: a's prefix
    comes back from the lower tier."""
    a, b = prompts(vocab)
    return [one(e, a), one(e, b), one(e, a)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_loaded_from_host_gives_the_same_output(tiny, backend):
    e = engine(tiny, backend, TierConfig("CPU", 16))
    assert e.cache.tiers.native.lineage is (backend == "radix")  # no events, no disk: radix names its pages
    got = ab_a(e, tiny.weights.config.vocab_size)
    assert_same_outputs(got, reference(tiny, backend), logits_rtol=1e-5)
    host = e.cache.stats().tiers[0]
    assert got[2].metrics.cached_tokens == 6 * BS and host.loads >= 5 and host.errors == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_prefix_loaded_from_disk_gives_the_same_output_and_survives_a_restart(tiny, backend, tmp_path):
    disk = TierConfig("DISK", 32, path=str(tmp_path / "kv.tier"))
    e = engine(tiny, backend, TierConfig("CPU", 2), disk)
    got = ab_a(e, tiny.weights.config.vocab_size)
    want = reference(tiny, backend)
    assert_same_outputs(got, want, logits_rtol=1e-5)
    stats = e.cache.stats().tiers
    assert got[2].metrics.cached_tokens == 6 * BS and stats[1].loads > 0 and stats[1].stores > 0
    e.close()
    # The disk alone below the device: a prompt that fills the whole pool pushes a's blocks
    # into the file; a new engine on it serves a's prefix from it at once.
    e = engine(tiny, backend, disk)
    a, b = prompts(tiny.weights.config.vocab_size)
    one(e, a)
    one(e, [t + 1 for t in b] + [1] * 3)  # with its output, all 8 blocks: every cached block goes down
    e.close()
    again = engine(tiny, backend, disk)
    assert again.kv_tiers.restored >= 6
    out = one(again, a)
    assert out.metrics.cached_tokens == 6 * BS and again.cache.stats().tiers[0].loads == 6
    assert_same_outputs([out], [want[0]], logits_rtol=1e-5)
    again.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graceful_close_writes_what_the_device_and_host_hold_so_a_restart_hits_whole(tiny, backend, tmp_path):
    # on_evict: a's blocks never left the device and b's sit on the host, so the file holds
    # neither until close() persists them; a restart then serves both prefixes whole.
    path = str(tmp_path / "kv.tier")
    e = engine(tiny, backend, TierConfig("CPU", 8), TierConfig("DISK", 32, path=path), num_blocks=8)
    a, b = prompts(tiny.weights.config.vocab_size)
    want = [one(e, b), one(e, a)]
    assert e.cache.stats().tiers[1].stores == 0 and e.cache.stats().tiers[0].used_blocks >= 6
    e.close()
    again = engine(tiny, backend, TierConfig("CPU", 8), TierConfig("DISK", 32, path=path), num_blocks=8)
    assert again.kv_tiers.restored >= 12
    got = [one(again, b), one(again, a)]
    assert [o.metrics.cached_tokens for o in got] == [6 * BS, 6 * BS]
    assert_same_outputs(got, want, logits_rtol=1e-5)
    again.close()
    again.close()  # a second close writes nothing and does not fail


def test_a_file_of_another_block_size_or_model_is_refused_by_name(tiny, tmp_path):
    path = str(tmp_path / "kv.tier")
    engine(tiny, "hash", TierConfig("DISK", 8, path=path)).close()
    cache = CacheConfig(block_size=8, num_blocks=10, tiers=(TierConfig("DISK", 8, path=path),))
    with pytest.raises(ConfigError, match=r"cache\.tiers\[0\]\.path: .*written with block_size 4; this cache has 8"):
        Engine(ServingConfig(cache, EngineConfig(model="tiny")), model=tiny)
    cache = CacheConfig(block_size=BS, num_blocks=10, hash=HashConfig("sha256"), tiers=(TierConfig("DISK", 8, path=path),))
    with pytest.raises(ConfigError, match=r"written with algorithm 'sha256_cbor'"):
        Engine(ServingConfig(cache, EngineConfig(model="tiny")), model=tiny)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_or_truncated_disk_block_is_a_counted_miss(tiny, tmp_path, damage):
    path = tmp_path / "kv.tier"
    disk = TierConfig("DISK", 32, path=str(path))
    e = engine(tiny, "hash", TierConfig("CPU", 2), disk)
    a, b = prompts(tiny.weights.config.vocab_size)
    want = reference(tiny, "hash")
    one(e, a)
    one(e, b)
    e._run_transfers()
    f = e.kv_tiers.files[1]
    slots = e.cache.tiers.native.used_slots(1)
    assert slots
    if damage == "flip":  # one byte of every record's KV
        for slot in slots:
            at = f._offset(slot) + f.record_size // 2
            byte = os.pread(f.fd, 1, at)
            os.pwrite(f.fd, bytes([byte[0] ^ 0xFF]), at)
    else:
        os.truncate(path, f._offset(min(slots)) + 100)
    out = one(e, a)  # nothing wrong is loaded: the prefix is computed again where it broke
    assert_same_outputs([out], [want[2]], logits_rtol=1e-5)
    assert e.cache.stats().tiers[1].errors >= 1
    e.close()


def test_a_full_disk_is_a_counted_refusal_never_a_crash(tiny, tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TierFile, "write", full)
    e = engine(tiny, "hash", TierConfig("CPU", 2), TierConfig("DISK", 32, path=str(tmp_path / "kv.tier")))
    got = ab_a(e, tiny.weights.config.vocab_size)
    assert_same_outputs(got, reference(tiny, "hash"), logits_rtol=1e-5)
    disk = e.cache.stats().tiers[1]
    assert disk.refused > 0 and disk.used_blocks == 0 and disk.loads == 0
    e.close()


def test_a_tiny_disk_for_the_model_is_refused_before_anything_is_written(tiny, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 20, 1 << 20, 4096))
    with pytest.raises(ConfigError, match=r"cache\.tiers\[0\]\.num_blocks: .* GB free"):
        engine(tiny, "hash", TierConfig("DISK", 64, path=str(tmp_path / "kv.tier")))
    assert not (tmp_path / "kv.tier").exists()


def test_a_replica_stopped_and_started_on_its_disk_tier_serves_the_prefix_at_once(tiny, tmp_path):
    from serve_cases import in_engine

    from prefixcache.serve.config import parse_serve_config
    from prefixcache.serve.server import Replica

    config = parse_serve_config({
        "cache": {"block_size": BS, "num_blocks": 16, "tiers": [{"medium": "DISK", "num_blocks": 32,
                                                                  "path": str(tmp_path / "kv.tier")}]},
        "engine": {"model": "tiny", "num_threads": 1},
    })  # fmt: skip
    a = prompts(tiny.weights.config.vocab_size)[0]
    cached = []
    for _ in range(2):
        replica = Replica(config, model=tiny)
        replica.start()
        try:
            out = in_engine(replica, lambda e: e.generate([GenerationRequest(prompt=a, max_tokens=2)])[0])
            cached.append(out.metrics.cached_tokens)
        finally:
            replica.stop()  # a's blocks never left the device: stop() persists them
    assert cached == [0, 6 * BS]
