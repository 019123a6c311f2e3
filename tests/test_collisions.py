"""Forced hash collisions: no request ever receives a block whose KV differs from its own.

A test-only block hash replaces `xxhash` in `prefixcache.hashing.ALGORITHMS` (the
table every chain is hashed through) and maps every block to one of a few digests,
so nearly every look-up meets impostors: blocks with other tokens, the same tokens
after another prefix, or the same prefix in another namespace or adapter. Random
workloads then run through both backends under `prefixcache.stress`, whose causal KV
shadow checks every hit, match, copy and commit exactly, under each eviction policy.
The `hash` backend must refute each impostor (and count it), full blocks and the
sources of partial hits alike (a `partial_hit` hook finds them by hash too); the
`radix` backend compares tokens and never consults the hash for a hit. Control runs
with verification switched off prove the shadow notices wrong hits.
"""

from __future__ import annotations

import pickle
import zlib

import pytest

import prefixcache
from prefixcache import hashing
from prefixcache._C import BlockContents
from prefixcache.backends.hash import HashCache
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.stress import stress
from prefixcache.testing import KVShadow, RuleViolation

POLICIES = ["lru", "lfu", "fifo", "gslru"]
PARTIAL_BLOCK = "partial_block:PartialBlockHash"  # examples/ is on sys.path (conftest)


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


def make(backend: str, block_size: int, num_blocks: int, eviction: str = "lru", **options):
    config = CacheConfig(
        backend=backend,
        block_size=block_size,
        num_blocks=num_blocks,
        hash=HashConfig("xxhash"),
        eviction=eviction,
        options=options,
    )
    return prefixcache.build_cache(config)


def run(cache, rid, tokens, namespace=None):
    adm = cache.admit(rid, tokens, namespace=namespace)
    cache.commit(rid, len(tokens))
    cache.release(rid)
    return adm


@pytest.mark.parametrize("eviction", POLICIES)
def test_every_key_collides_and_each_request_still_gets_only_its_own_blocks(collide, eviction):
    collide(1)  # every block of every chain has the same hash
    cache = make("hash", 4, 32, eviction)
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


# Verification meets every eviction policy; radix never consults the hash for a hit, so
# one policy shows it unaffected; partial_block needs 2+ tokens a block for partial hits.
@pytest.mark.parametrize(
    ("backend", "block_size", "eviction"),
    [
        *((b, bs, policy) for b, bs in (("hash", 1), ("hash", 4), (PARTIAL_BLOCK, 4)) for policy in POLICIES),
        ("radix", 1, "lru"),
        ("radix", 4, "lru"),
    ],
)
@pytest.mark.parametrize("num_values", [1, 3])
def test_random_workloads_under_a_weak_hash_never_serve_a_wrong_block(
    collide, backend, block_size, num_values, eviction
):
    collide(num_values)
    cache = make(backend, block_size, 64, eviction)
    report = stress(cache, operations=6000, seed=num_values * 10 + block_size, check_every=200)
    assert report.hit_tokens > 0 and report.refused > 0 and report.evicted_blocks > 0, report
    if backend == "radix":
        assert report.verify_failures == 0
    else:
        assert report.verify_failures > 0, "the weak hash should have produced refuted hits"
    assert (report.copies > 0) == (backend == PARTIAL_BLOCK), report  # proved partial hits happen


@pytest.mark.filterwarnings("ignore::prefixcache.config.SecurityWarning")  # trusting it on purpose
def test_without_verification_the_shadow_catches_the_wrong_hits(collide):
    """Control: the hash backend trusting its weak hash (verify_hits: never, what the
    sha256 path does) hands out another prompt's blocks, and the shadow says so; under
    random load the chain it trusts can even name one block twice."""
    collide(position_hash)
    cache = make("hash", 4, 32, verify_hits="never")
    shadow = KVShadow(4, 32)
    a, b = list(range(0, 13)), list(range(100, 113))
    adm = cache.admit("a", a)
    shadow.allocated(adm.block_table)
    shadow.write(adm.block_table, None, a, 0, len(a))
    cache.commit("a", len(a))
    cache.release("a")
    adm = cache.admit("b", b)
    assert adm.num_cached_tokens == 12  # trusted: a's blocks
    with pytest.raises(RuleViolation, match=r"^rule 6 .* block #0 = \d+ holds namespace None, tokens \.\.\.\(0, 1, 2, 3\)"):
        shadow.check(adm.block_table, None, b, adm.num_cached_tokens, "admit of b")
    cache.release("b")
    with pytest.raises((RuleViolation, ValueError)):
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
    assert type(cache._verifier) is BlockContents  # sha256 with verification on request
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
    cache._verifier.record(-1, [first], [7, 7, 7, 7], 0, b"")  # as if first held other tokens
    with pytest.raises(prefixcache.InvariantError, match=f"cached block {first} \\(#0\\) does not hold exactly"):
        cache.check_invariants()


# ------------------------------------------------------------------- partial hits


class NextKeyPartial(HashCache):
    """A plausible partial-hit hook that trusts its hash: the next block's key is cached,
    so (were the hash collision-free) its holder's head is the prompt's next tokens.
    It needs that block to be full in the tokens it is given (`match` is called here
    with whole blocks)."""

    partial_hits = True

    def partial_hit(self, tokens, namespace, digests, num_hit_blocks, limit):
        key = digests[num_hit_blocks * self.digest_size : (num_hit_blocks + 1) * self.digest_size]
        block = self.pool.lookup(key) if key else None
        return None if block is None else (block, min(limit, self.block_size - 1))


def make_partial(cls, verify_hits="auto"):
    """A 4-token-block xxhash cache of class `cls` (a hook subclass or the example)."""
    if isinstance(cls, str):
        return make(cls, 4, 32, verify_hits=verify_hits)
    config = CacheConfig(block_size=4, num_blocks=32, hash=HashConfig("xxhash"), options={"verify_hits": verify_hits})
    return cls(prefixcache.BlockPool(32), config)


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "xxhash"])
def test_without_collisions_the_hook_offers_a_proved_partial_hit(algorithm):
    """Control: a prompt that is A's first 8 tokens may hit 7 (the last token is always
    computed); the hook offers A's block 1, which holds them, proved under xxhash."""
    config = CacheConfig(block_size=4, num_blocks=32, hash=HashConfig(algorithm))
    cache = NextKeyPartial(prefixcache.BlockPool(32), config)
    a = run(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9]).block_table
    adm = cache.admit("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert (adm.num_cached_tokens, adm.copies) == (7, ((a[1], adm.block_table[1], 3),))
    assert cache.stats().verify_failures == 0
    cache.check_invariants()


@pytest.mark.parametrize("via", ["admit", "match"])
def test_a_partial_source_from_another_prefix_is_refuted(collide, via):
    """The audit's case through the example plugin: C's hit ends after block 0 and the
    plugin offers A's block 1 ([5, 6, 7, 8] after [1, 2, 3, 4]), whose head matches C's
    next tokens but whose KV was computed after another prefix."""
    collide(1)
    cache = make_partial(PARTIAL_BLOCK)
    a = run(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9]).block_table
    d = run(cache, "d", [50, 51, 52, 53, 0, 0, 0, 0, 9]).block_table
    failures = cache.stats().verify_failures
    c = [50, 51, 52, 53, 5, 6, 7, 99, 9]
    assert cache._children[cache.pool.key(a[1])].keys() >= {a[1], d[1]}  # offered by hash
    if via == "match":
        assert cache.match(c[:-1]) == prefixcache.Match(4, (d[0],))
    else:
        assert cache.admit("c", c) == prefixcache.Admission((d[0], *cache.block_table("c")[1:]), 4, ())
        assert cache.stats().verify_failures == failures + 1
    # A genuine sibling (d's block 1, after the same prefix) still serves its head.
    e = [50, 51, 52, 53, 0, 0, 7, 7, 9]
    if via == "match":
        assert cache.match(e[:-1]) == prefixcache.Match(6, (d[0], d[1]))
    else:
        adm = cache.admit("e", e)
        assert (adm.num_cached_tokens, adm.copies) == (6, ((d[1], adm.block_table[1], 2),))
    cache.check_invariants()


@pytest.mark.parametrize("via", ["admit", "match"])
def test_the_built_in_partial_path_proves_what_a_hook_offers(collide, via):
    """Through a hook that trusts its hash (every key is one here): with no full hit the
    source must start a chain in the request's namespace with the request's head; after
    full hits it must follow them, and a hit block itself is no source."""
    collide(1)
    cache = make_partial(NextKeyPartial)
    a = run(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9]).block_table
    cases = [  # (tokens, namespace, hit tokens, source or None, refuted)
        ([1, 2, 0, 0, 5, 6, 7, 8, 9], None, 0, None, True),  # a[0]'s head is not the prompt's
        ([1, 2, 3, 4, 5, 6, 7, 8, 9], "tenant", 0, None, True),  # same tokens, other namespace
        ([1, 2, 3, 0, 5, 6, 7, 8, 9], None, 3, a[0], True),  # block 0 refuted, its head proved
        ([1, 2, 3, 4, 9, 9, 9, 9, 9], None, 4, None, True),  # the hook offers hit block a[0]
    ]
    for i, (tokens, namespace, hit, source, refuted) in enumerate(cases):
        if via == "match":
            blocks = (*a[: hit // 4], *([source] if source is not None else []))
            assert cache.match(tokens[:-1], namespace=namespace) == prefixcache.Match(hit, blocks), tokens
            continue
        failures = cache.stats().verify_failures
        adm = cache.admit(i, tokens, namespace=namespace)
        copies = ((source, adm.block_table[hit // 4], hit % 4),) if source is not None else ()
        assert (adm.num_cached_tokens, adm.copies) == (hit, copies), tokens
        assert cache.stats().verify_failures == failures + refuted
        cache.check_invariants()
        cache.release(i)
    cache.check_invariants()


class FirstBlockPartial(HashCache):
    """A hook with a bug: it offers the prompt's first cached block, a hit itself."""

    partial_hits = True

    def partial_hit(self, tokens, namespace, digests, num_hit_blocks, limit):
        return (self.pool.lookup(digests[: self.digest_size]), 1) if num_hit_blocks else None


def test_under_a_trusted_hash_a_hit_block_offered_as_source_is_an_error():
    """Nothing is verified under SHA-256, so a hit block offered as the next position's
    source can only be the hook's mistake: ValueError, and nothing changes."""
    cache = FirstBlockPartial(prefixcache.BlockPool(32), CacheConfig(block_size=4, num_blocks=32))
    a = run(cache, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9]).block_table
    with pytest.raises(ValueError, match=f"block {a[0]}, is one of the hit blocks"):
        cache.admit("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert cache.stats().verify_failures == 0
    cache.check_invariants()


@pytest.mark.filterwarnings("ignore::prefixcache.config.SecurityWarning")  # trusting it on purpose
def test_without_verification_a_trusted_partial_source_is_wrong_kv(collide):
    """Control: trusting the weak hash, the hook's copy source is another prompt's block,
    and the stress shadow says so."""
    collide(1)
    cache = make_partial(NextKeyPartial, verify_hits="never")
    shadow = KVShadow(4, 32)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    adm = cache.admit("a", a)
    shadow.allocated(adm.block_table)
    shadow.write(adm.block_table, None, a, 0, len(a))
    cache.commit("a", len(a))
    cache.release("a")
    b = [50, 51, 52, 53]  # its one full block is the last: only a partial hit may serve it
    adm = cache.admit("b", b)
    assert adm.num_cached_tokens == 3 and adm.copies[0][0] == 0
    with pytest.raises(RuleViolation, match=r"^rule 6 .* partial-hit source 0 holds namespace None, tokens \.\.\.\(1, 2, 3, 4\)"):
        shadow.check_head(adm.copies[0][0], None, b, adm.num_cached_tokens, "admit of b")
