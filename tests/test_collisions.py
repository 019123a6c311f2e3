"""Forced hash collisions: no request ever receives a block whose KV differs from its own.

A test-only block hash replaces `xxhash` in `prefixcache.hashing.ALGORITHMS` (the
table every chain is hashed through) and maps every block to one of a few digests,
so nearly every look-up meets impostors: blocks with other tokens, the same tokens
after another prefix, or the same prefix in another namespace or adapter. Random
workloads then run through both backends under `prefixcache.stress`, whose causal KV
shadow checks every hit, match and commit exactly. The `hash` backend must refute each
impostor (and count it); the `radix` backend compares tokens and never consults the
hash for a hit. A control run with verification switched off proves the shadow
notices wrong hits.
"""

from __future__ import annotations

import pickle
import zlib

import pytest

import prefixcache
from prefixcache import hashing
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.stress import PrefixShadow, stress


def weak_hash(num_values: int):
    """A 16-byte 'digest' with only `num_values` values (deterministic)."""

    def digest(obj) -> bytes:
        return bytes([zlib.crc32(pickle.dumps(obj, protocol=5)) % num_values]) * 16

    return digest


def position_hash(obj) -> bytes:
    """Ignores tokens and extra keys: block i of every chain gets the same digest."""
    parent = obj[0] if isinstance(obj, tuple) else b""
    return zlib.crc32(parent).to_bytes(4, "little") * 4


@pytest.fixture
def collide(monkeypatch):
    """Make `xxhash` a weak hash for this test only: `weak_hash(n)` for an int, else
    the function given."""

    def install(how) -> None:
        monkeypatch.setitem(hashing.ALGORITHMS, "xxhash", weak_hash(how) if isinstance(how, int) else how)
        hashing.seed_digest.cache_clear()

    yield install
    hashing.seed_digest.cache_clear()


def make(backend: str, block_size: int, num_blocks: int, **options):
    config = CacheConfig(
        backend=backend, block_size=block_size, num_blocks=num_blocks, hash=HashConfig("xxhash"), options=options
    )
    return prefixcache.build_cache(config)


def run(cache, rid, tokens, namespace=None):
    adm = cache.admit(rid, tokens, namespace=namespace)
    cache.commit(rid, len(tokens))
    cache.release(rid)
    return adm


def test_every_key_collides_and_each_request_still_gets_only_its_own_blocks(collide):
    collide(1)  # every block of every chain has the same hash
    cache = make("hash", 4, 32)
    a, b = list(range(0, 13)), list(range(100, 113))
    assert run(cache, "a", a).num_cached_tokens == 0
    # b's first key is a's first key: a's block is found, refuted, and not used.
    assert run(cache, "b", b).num_cached_tokens == 0
    assert cache.stats().verify_failures == 1
    # Both copies stay indexed under the one key; each prompt finds its own among them.
    key = cache.pool.key(cache.match(a).block_ids[0])
    assert len(cache.pool.blocks_for(key)) == 6
    assert cache.admit("a2", a).num_cached_tokens == 12
    assert cache.admit("b2", b).num_cached_tokens == 12
    assert cache.admit("c", a, namespace="tenant").num_cached_tokens == 0  # same tokens, other tenant
    assert cache.stats().verify_failures == 2
    cache.check_invariants()


@pytest.mark.parametrize("backend", ["hash", "radix"])
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("num_values", [1, 3])
def test_random_workloads_under_a_weak_hash_never_serve_a_wrong_block(collide, backend, block_size, num_values):
    collide(num_values)
    cache = make(backend, block_size, 64)
    report = stress(cache, operations=6000, seed=num_values * 10 + block_size, check_every=200)
    assert report.hit_tokens > 0 and report.refused > 0, report
    if backend == "hash":
        assert report.verify_failures > 0, "the weak hash should have produced refuted hits"
    else:
        assert report.verify_failures == 0


def test_without_verification_the_shadow_catches_the_wrong_hits(collide):
    """Control: the hash backend trusting its weak hash (verify_hits: never, what the
    sha256 path does) hands out another prompt's blocks, and the shadow says so; under
    random load the chain it trusts can even name one block twice."""
    collide(position_hash)
    cache = make("hash", 4, 32, verify_hits="never")
    shadow = PrefixShadow(4, 32)
    a, b = list(range(0, 13)), list(range(100, 113))
    adm = cache.admit("a", a)
    shadow.allocated(adm.block_table)
    shadow.write(adm.block_table, None, a, 0, len(a))
    cache.commit("a", len(a))
    cache.release("a")
    adm = cache.admit("b", b)
    assert adm.num_cached_tokens == 12  # trusted: a's blocks
    with pytest.raises(AssertionError, match=r"block #0 = \d+ holds namespace None, tokens \.\.\.\(0, 1, 2, 3\)"):
        shadow.check(adm.block_table, None, b, adm.num_cached_tokens, "admit of b")
    cache.release("b")
    with pytest.raises((AssertionError, ValueError)):
        stress(make("hash", 4, 64, verify_hits="never"), operations=6000, seed=34, check_every=200)


def test_sha256_trusts_its_hash_and_builds_no_verifier(monkeypatch):
    import prefixcache.backends.hash as backend

    def refuse(*_):
        raise AssertionError("a cryptographic hash must not pay for verification")

    monkeypatch.setattr(backend, "BlockContents", refuse)
    for algorithm in ("sha256_cbor", "sha256"):
        cache = prefixcache.build_cache(CacheConfig(block_size=4, num_blocks=16, hash=HashConfig(algorithm)))
        assert run(cache, "a", list(range(9))).num_cached_tokens == 0
        assert run(cache, "b", list(range(9))).num_cached_tokens == 8
        cache.check_invariants()


def test_verify_hits_option():
    cache = prefixcache.build_cache(CacheConfig(block_size=4, num_blocks=16, options={"verify_hits": "always"}))
    assert cache._contents is not None  # sha256 with verification on request
    assert run(cache, "a", list(range(9))).num_cached_tokens == 0
    assert run(cache, "b", list(range(9))).num_cached_tokens == 8
    cache.check_invariants()
    with pytest.raises(prefixcache.ConfigError, match="options.verify_hits: 'sometimes' is not allowed"):
        make("hash", 4, 16, verify_hits="sometimes")


def test_check_invariants_notices_a_cached_block_whose_record_lies():
    cache = make("hash", 4, 16)
    cache.admit("r", list(range(9)))
    cache.commit("r", 9)
    cache.check_invariants()
    first = cache.block_table("r")[0]
    cache._contents.record(-1, [first], [7, 7, 7, 7], 0, b"")  # as if first held other tokens
    with pytest.raises(prefixcache.InvariantError, match=f"cached block {first} \\(#0\\) does not hold exactly"):
        cache.check_invariants()
