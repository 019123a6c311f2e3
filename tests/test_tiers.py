"""Lower tiers (`cache.tiers`): configuration, the tier manager under both strategies,
write policies, the cost model, events, and the kit's tier rules (docs/tiers.md)."""

from __future__ import annotations

import os
import random

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

import prefixcache
import prefixcache.testing as kit
from prefixcache import build_cache
from prefixcache.backends.hash import HashCache
from prefixcache.config import CacheConfig, ConfigError, from_mapping
from prefixcache.config_checks import check_cache_config, parse_cache_config
from prefixcache.events import BlockRemoved, BlockStored
from prefixcache.eviction import EvictionPolicy
from prefixcache.tier_config import TierConfig

BACKENDS = ("hash", "radix")


class OldestFirst(EvictionPolicy):
    """A Python policy (no native order): `fifo`'s order, through Python."""

    def priority(self, candidate):
        return candidate.creation_time


class Failing(EvictionPolicy):
    """A Python policy that fails as `Failing.how` says (None: LRU, as floats)."""

    how = None
    calls: list[int] = []

    def priority(self, candidate):
        self.calls.append(candidate.last_access_time)
        if self.how == "raise":
            return 1 / 0
        if self.how == "str":
            return "soon"
        if self.how == "reenter":
            self.cache.tiers.native.reset()  # the running tier call refuses it
        return float(candidate.last_access_time)


def tiered(backend: str = "hash", block_size: int = 2, num_blocks: int = 4, tiers=({"medium": "CPU", "num_blocks": 4},),
           **more) -> prefixcache.PrefixCache:  # fmt: skip
    config = parse_cache_config(
        {"backend": backend, "block_size": block_size, "num_blocks": num_blocks, "tiers": list(tiers), **more}
    )
    return build_cache(config)


def run(cache, rid, tokens):
    adm = cache.admit(rid, tokens)
    assert adm is not None
    cache.commit(rid, len(tokens))
    cache.release(rid)
    return adm


# -------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("tier", "path", "message"),
    [
        ({"medium": "GPU", "num_blocks": 4}, "cache.tiers[0].medium", "allowed values: CPU, DISK"),
        ({"medium": "CPU"}, "cache.tiers[0]", "missing required key(s): num_blocks"),
        ({"medium": "CPU", "num_blocks": 0}, "cache.tiers[0].num_blocks", "must be an integer >= 1"),
        ({"medium": "CPU", "num_blocks": 4, "write": "back"}, "cache.tiers[0].write", "on_evict, write_through, selective"),
        ({"medium": "DISK", "num_blocks": 4}, "cache.tiers[0].path", "a DISK tier needs the path"),
        ({"medium": "CPU", "num_blocks": 4, "path": "/x"}, "cache.tiers[0].path", "only a DISK tier has a path"),
        ({"medium": "CPU", "num_blocks": 4, "eviction": "nope"}, "cache.tiers[0].eviction", "unknown eviction policy"),
        ({"medium": "CPU", "num_blocks": 4, "min_hits": 1, "write": "write_through"}, "cache.tiers[0].min_hits",
         "write: selective"),
        ({"medium": "CPU", "num_blocks": 4, "bandwidth_gbps": 0}, "cache.tiers[0].bandwidth_gbps", "> 0"),
        ({"medium": "CPU", "num_blocks": 4, "store_threshold": -1}, "cache.tiers[0].store_threshold", "integer >= 0"),
        ({"medium": "CPU", "num_blocks": 4, "store_threshold": True}, "cache.tiers[0].store_threshold", "must be an integer"),
        ({"medium": "CPU", "num_blocks": 4, "reuse_tracker_size": 8}, "cache.tiers[0].reuse_tracker_size",
         "store_threshold >= 2"),
        ({"medium": "CPU", "num_blocks": 4, "store_threshold": 2, "reuse_tracker_size": 0},
         "cache.tiers[0].reuse_tracker_size", "integer >= 1"),
        ({"medium": "CPU", "num_blocks": 2**29, "store_threshold": 2}, "cache.tiers[0].reuse_tracker_size",
         "the default: 4 x num_blocks"),
        ({"medium": "CPU", "num_blocks": 4, "wrte": "on_evict"}, "cache.tiers[0].wrte", "did you mean 'write'"),
    ],
)
def test_a_bad_tier_is_refused_naming_its_key(tier, path, message):
    with pytest.raises(ConfigError) as err:
        parse_cache_config({"block_size": 4, "num_blocks": 8, "tiers": [tier]})
    assert str(err.value).startswith(path + ":"), str(err.value)
    assert message in str(err.value)


def test_tiers_need_a_collision_resistant_hash():
    with pytest.raises(ConfigError, match=r"^cache\.tiers: .*xxhash is not collision resistant"):
        parse_cache_config({"hash": {"algorithm": "xxhash"}, "tiers": [{"medium": "CPU", "num_blocks": 4}]})


def test_tiers_with_a_hybrid_layout_are_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"^cache\.layout: .*sliding_window.* cache\.tiers"):
        parse_cache_config({"tiers": [{"medium": "CPU", "num_blocks": 4}],
                            "layout": [{"kind": "full_attention"}, {"kind": "sliding_window", "window": 64}]})
    # A full-attention layout is the plain cache: tiers accept it.
    parse_cache_config({"tiers": [{"medium": "CPU", "num_blocks": 4}], "layout": [{"kind": "full_attention"}]})


def test_a_disk_path_must_be_a_private_regular_file_with_room(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = tmp_path / "kv.tier"
    link.symlink_to(target)
    disk = {"medium": "DISK", "num_blocks": 4}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: .*symbolic link"):
        parse_cache_config({"tiers": [{**disk, "path": str(link)}]})
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: .*not a directory"):
        parse_cache_config({"tiers": [{**disk, "path": str(target / "x")}]})
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path: .*not a regular file"):
        parse_cache_config({"tiers": [{**disk, "path": str(tmp_path / "dir")}]})
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match=r"writable by anyone without the sticky bit"):
        parse_cache_config({"tiers": [{**disk, "path": str(shared / "kv.tier")}]})
    ok = str(tmp_path / "ok.tier")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.path: tiers\[0\] uses the same file"):
        parse_cache_config({"tiers": [{**disk, "path": ok}, {**disk, "path": ok}]})
    huge = {**disk, "path": ok, "num_blocks": 1 << 29}
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.num_blocks: .* GB free"):
        parse_cache_config({"block_size": 16, "tiers": [huge], "cost_model": {"kv_bytes_per_token": 1 << 20}})
    parse_cache_config({"tiers": [{**disk, "path": ok}]})  # fine: a new file in a private directory


def test_without_tiers_a_config_and_its_stats_read_as_before():
    config = CacheConfig()
    assert config.tiers == () and "tiers" not in repr(build_cache(config).stats())
    assert build_cache(config).drain_transfers() == []


# ------------------------------------------------------------------ a tier's Python policy


def _churn(cache, seed: int, requests: int = 120) -> list[tuple]:
    """Random prompts over a small vocabulary (shared prefixes, device evictions, tier
    hits); per admission what it hit, where from, and what it loaded."""
    rng = random.Random(seed)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(2, 9))] for _ in range(6)]
    out = []
    for i in range(requests):
        tokens = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
        adm = run(cache, i, tokens)
        out.append((adm.num_cached_tokens, adm.tier_hits, len(adm.loads)))
        cache.drain_transfers()
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tier_ranks_with_a_python_policy_as_with_its_native_twin(backend):
    def build(eviction):
        tiers = ({"medium": "CPU", "num_blocks": 5, "eviction": eviction}, {"medium": "CPU", "num_blocks": 4})
        return tiered(backend, num_blocks=6, tiers=tiers)

    native, python = build("fifo"), build("tests.test_tiers:OldestFirst")
    assert _churn(native, 1) == _churn(python, 1)
    assert native.stats().tiers == python.stats().tiers and python.stats().tiers[0].evictions > 0
    assert native.tiers.native.order(0) == python.tiers.native.order(0)
    python.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("how", "cause"), [("raise", ZeroDivisionError), ("str", TypeError),
                                            ("reenter", RuntimeError)])  # fmt: skip
def test_a_failing_tier_policy_ranks_its_block_first_and_fails_the_next_admission(backend, how, cause, monkeypatch):
    cache = tiered(backend, tiers=({"medium": "CPU", "num_blocks": 4, "eviction": "tests.test_tiers:Failing"},))
    policy = type(cache.tiers.policies[0])  # the class as the registry imported it
    monkeypatch.setattr(policy, "cache", cache, raising=False)
    monkeypatch.setattr(policy, "calls", [])
    run(cache, "a", [1, 2, 3, 4, 5, 6, 7])
    monkeypatch.setattr(policy, "how", how)
    run(cache, "b", [11, 12, 13, 14, 15, 16, 17])  # a's blocks go down: ranked, and failing
    assert policy.calls, "the policy was asked"
    assert cache.tiers.native.order(0)  # ranked first, held all the same
    with pytest.raises(RuntimeError, match=r"tiers\[0\]\.eviction: policy 'Failing' failed to rank a block") as err:
        cache.admit("c", [1, 2, 3, 4, 5, 6, 7])
    assert isinstance(err.value.__cause__, cause)
    monkeypatch.setattr(policy, "how", None)
    cache.check_invariants()  # nothing half done: the failed admission changed nothing
    assert run(cache, "c", [1, 2, 3, 4, 5, 6, 7]).num_cached_tokens == 6  # served from the tier
    cache.check_invariants()


# ------------------------------------------------------------------ semantics, both strategies


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_evicted_prefix_is_demoted_then_loaded_back(backend):
    cache = tiered(backend)
    first = [1, 2, 3, 4, 5, 6, 7]
    run(cache, "a", first)
    assert cache.drain_transfers() == []  # on_evict: nothing moves until the device evicts
    run(cache, "b", [11, 12, 13, 14, 15, 16, 17])  # takes every device block: a's three go down
    stores = cache.drain_transfers()
    assert sorted(t[:3:2] for t in stores) == [(-1, 0)] * 3
    m = cache.match(first)
    assert m.num_tokens == 6 and m.tiers == (0, 0, 0)
    adm = cache.admit("c", first)
    assert adm.num_cached_tokens == 6 and adm.tier_hits == (0, 6) and adm.declined_tokens == 0
    assert [dst for _, _, dst in adm.loads] == list(adm.block_table[:3])
    moved = cache.drain_transfers()
    loads = [t for t in moved if t[2] == -1]
    assert [(t[0], t[1], t[3]) for t in loads] == list(adm.loads)
    tier = cache.stats().tiers[0]
    assert (tier.medium, tier.loads, tier.hit_tokens, tier.loaded_tokens) == ("CPU", 3, 6, 6)
    assert tier.bytes_written == tier.stores * 2 * 131072
    cache.release("c")
    cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_threshold_admits_a_block_at_its_second_use_even_after_it_was_lost(backend):
    cache = tiered(backend, tiers=({"medium": "CPU", "num_blocks": 4, "store_threshold": 2},))
    first, other = [1, 2, 3, 4, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17]
    run(cache, "a", first)
    run(cache, "b", other)  # a's three blocks leave the device after one use: dropped, not stored
    assert cache.drain_transfers() == [] and cache.match(first).num_tokens == 0
    run(cache, "c", first)  # a miss that computes them again: their second use
    run(cache, "d", [21, 22, 23, 24, 25, 26, 27])  # c's blocks are demoted now, b's (one use) are not
    assert sorted(t[:3:2] for t in cache.drain_transfers()) == [(-1, 0)] * 3
    m = cache.match(first)
    assert m.num_tokens == 6 and m.tiers == (0, 0, 0)
    assert cache.match(other).num_tokens == 0
    assert (cache.stats().tiers[0].stores, cache.stats().tiers[0].filtered) == (3, 6)  # a's, then b's, kept out
    cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reuse_tracker_forgets_the_least_recently_used_hashes(backend):
    tier = {"medium": "CPU", "num_blocks": 4, "store_threshold": 2, "reuse_tracker_size": 3}
    cache = tiered(backend, tiers=(tier,))
    run(cache, "a", [1, 2, 3, 4, 5, 6, 7])
    run(cache, "b", [11, 12, 13, 14, 15, 16, 17])  # three more hashes: a's are forgotten
    run(cache, "c", [1, 2, 3, 4, 5, 6, 7])  # so this use counts as their first
    run(cache, "d", [21, 22, 23, 24, 25, 26, 27])
    assert cache.drain_transfers() == [] and cache.stats().tiers[0].stores == 0
    assert cache.stats().tiers[0].filtered == 9
    cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slow_tier_is_declined_by_the_cost_model_and_says_so(backend):
    slow = {"medium": "CPU", "num_blocks": 4, "bandwidth_gbps": 1e-6}  # a block takes ~hours to load
    cache = tiered(backend, tiers=(slow,))
    first = [1, 2, 3, 4, 5, 6, 7]
    run(cache, "a", first)
    run(cache, "b", [11, 12, 13, 14, 15, 16, 17])
    assert cache.match(first).num_tokens == 6
    adm = cache.admit("c", first)
    assert (adm.num_cached_tokens, adm.declined_tokens, adm.loads) == (0, 6, ())
    assert cache.stats().tiers[0].hit_tokens == 6 and cache.stats().tiers[0].loaded_tokens == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_through_copies_at_commit_and_selective_after_hits(backend):
    cache = tiered(backend, tiers=({"medium": "CPU", "num_blocks": 8, "write": "write_through"},))
    cache.admit("a", [1, 2, 3, 4, 5])
    assert cache.drain_transfers() == []  # nothing is copied before the compute that writes it
    cache.commit("a", 5)
    assert [t[:3:2] for t in cache.drain_transfers()] == [(-1, 0), (-1, 0)]
    cache.release("a")
    cache = tiered(backend, tiers=({"medium": "CPU", "num_blocks": 8, "write": "selective", "min_hits": 2},))
    run(cache, "a", [1, 2, 3, 4, 5])
    run(cache, "b", [1, 2, 3, 4, 5])
    assert cache.drain_transfers() == []  # one hit so far
    run(cache, "c", [1, 2, 3, 4, 5])
    assert len(cache.drain_transfers()) == 2 and cache.stats().tiers[0].stores == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_tier_events_name_the_medium_and_carry_real_tokens(backend):
    cache = tiered(backend, enable_events=True)
    run(cache, "a", [1, 2, 3, 4, 5])
    run(cache, "b", [11, 12, 13, 14, 15, 16, 17])
    events = cache.drain_events()
    cpu = [e for e in events if getattr(e, "medium", None) == "CPU"]
    stored = [e for e in cpu if isinstance(e, BlockStored)]
    assert sorted(e.token_ids for e in stored) == [(1, 2), (3, 4)]
    assert all(e.locality == "LOCAL" and e.block_size == 2 for e in stored)
    # Each demotion: a BlockRemoved on the device before the BlockStored on CPU, in one batch.
    for e in stored:
        gpu_removed = next(i for i, x in enumerate(events) if isinstance(x, BlockRemoved) and x.medium == "GPU"
                           and x.block_hashes == e.block_hashes)  # fmt: skip
        assert gpu_removed < events.index(e)


# ----------------------------------------------------------------------------- the kit


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "tiers",
    [
        (TierConfig("CPU", 3),),
        (TierConfig("CPU", 2, eviction="chain"), TierConfig("CPU", 3, write="on_evict", eviction="lfu")),
        (TierConfig("CPU", 4, write="write_through"),),
        (TierConfig("CPU", 2, write="selective", min_hits=1), TierConfig("CPU", 3)),
        (TierConfig("CPU", 2), TierConfig("CPU", 3, store_threshold=2, reuse_tracker_size=6)),
        (TierConfig("CPU", 3, eviction="tests.test_tiers:OldestFirst"), TierConfig("CPU", 3)),
    ],
    ids=["cpu", "cpu+cpu-chain", "write-through", "selective+cpu", "cpu+reused-cpu", "python-policy+cpu"],
)
def test_both_strategies_pass_the_kit_with_tiers(backend, tiers):
    # The plain host tier at the kit's block sizes; the other layouts at one (the suite's time).
    sizes = (1, 4) if len(tiers) == 1 and tiers[0].write == "on_evict" else (2,)
    kit.check_backend(backend, tiers=tiers, enable_events=True, max_examples=25, block_sizes=sizes)


@pytest.mark.parametrize(
    "tiers",
    [
        (TierConfig("CPU", 3),),
        (TierConfig("CPU", 2, eviction="chain"), TierConfig("CPU", 3, write="on_evict", eviction="lfu")),
        (TierConfig("CPU", 2, write="selective", min_hits=1), TierConfig("CPU", 3, write="write_through")),
    ],
    ids=["cpu", "cpu+cpu-chain", "selective+write-through"],
)
def test_radix_with_lineage_passes_the_kit(tiers):
    # Without events or a disk, radix names its pages and follows them through the tiers.
    config = CacheConfig(backend="radix", block_size=2, num_blocks=8, tiers=tiers, enable_events=False)
    assert build_cache(config).tiers.native.lineage
    kit.check_backend("radix", tiers=tiers, enable_events=False, max_examples=25, block_sizes=(1, 2))


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=2, max_size=12), min_size=1, max_size=30),
    eviction=st.sampled_from(["lru", "lfu", "chain"]),
)
def test_radix_finds_by_lineage_what_it_finds_by_hash(prompts, eviction):
    # A host tier large enough never to evict holds no block whose parent it lost, so
    # lineage (names, followed from the tree) and hashes must find exactly the same:
    # every admission's hit, per tier, its loads, and the tiers' counters.
    def replay(events):
        cache = tiered("radix", num_blocks=4, tiers=({"medium": "CPU", "num_blocks": 64, "eviction": eviction},),
                       enable_events=events)  # fmt: skip
        assert cache.tiers.native.lineage is not events
        seen = []
        for i, tokens in enumerate(prompts):
            adm = cache.admit(i, tokens)
            seen.append(None if adm is None else (adm.num_cached_tokens, adm.tier_hits, adm.loads))
            if adm is not None:
                cache.commit(i, len(tokens))
                cache.release(i)
                cache.drain_transfers()
            cache.check_invariants()
        return seen, cache.stats().tiers

    assert replay(False) == replay(True)


class _MisloadingHash(HashCache):
    """Loads the lower-tier blocks of a hit into the request's blocks in reverse order."""

    def drain_transfers(self):
        out = super().drain_transfers()
        loads = [t for t in out if t[2] == -1]
        dsts = [t[3] for t in loads][::-1]
        fixed = iter(dsts)
        return [(t[0], t[1], t[2], next(fixed)) if t[2] == -1 else t for t in out]


def test_the_kit_catches_a_lower_tier_hit_that_is_not_the_demoted_kv():
    with pytest.raises(kit.RuleViolation, match="rule 6"):
        kit.rule_lower_tiers_serve_demoted_kv(
            lambda bs, n: _MisloadingHash(prefixcache.BlockPool(n), CacheConfig(block_size=bs, num_blocks=n,
                                          tiers=(TierConfig("CPU", 6),))), 2)  # fmt: skip


def test_check_cache_config_checks_tiers_once_more_for_build_cache(tmp_path):
    config = from_mapping(CacheConfig, {"tiers": [{"medium": "CPU", "num_blocks": 2, "eviction": "nope"}]})
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.eviction"):
        check_cache_config(config)


def test_a_tier_file_records_what_wrote_it_and_refuses_another(tmp_path):
    from prefixcache.tier_file import FileIdentity, TierFile

    path = tmp_path / "kv.tier"
    mine = FileIdentity("model-a layers=2", 4, 64, "sha256_cbor", 8)
    f = TierFile.open(path, mine, 32)
    f.write(3, b"k" * 32, None, (1, 2, 3, 4), 2, bytes(range(64)))
    assert f.read(3).kv == bytes(range(64)) and f.read(3).parent is None and f.read(2) is None
    f.close()
    for name, other in (("model", "model-b layers=2"), ("block_size", 8), ("algorithm", "sha256")):
        changed = FileIdentity(**{**vars(mine), name: other})
        with pytest.raises(ConfigError, match=rf"written with {name} .*refused"):
            TierFile.open(path, changed, 32)
    (tmp_path / "junk").write_bytes(b"not a tier file" * 400)
    with pytest.raises(ConfigError, match="is not a prefixcache tier file"):
        TierFile.open(tmp_path / "junk", mine, 32)


def test_an_ab_with_tiers_compares_at_equal_total_capacity_and_sweeps_device_by_host(tmp_path):
    from prefixcache.ab import run_ab, sweep_split
    from prefixcache.ab_config import parse_ab_config

    config = parse_ab_config({
        "workload": {"generator": "multi_turn", "params": {"num_conversations": 6, "turns": 3, "seed": 1}},
        "capacity_tokens": 2048,
        "arms": {"flat": {"backend": "hash", "block_size": 16},
                 "host": {"backend": "hash", "block_size": 16, "tiers": [{"medium": "CPU", "num_blocks": 64}]}},
    })  # fmt: skip
    assert (config.arms["flat"].num_blocks, config.arms["host"].num_blocks) == (128, 64)
    result = run_ab(config)
    rows = {r["series"]: r for r in result.summary_rows()}
    assert rows["host"]["tier0_medium"] == "CPU" and rows["host"]["tier0_loads"] > 0
    assert rows["flat"]["tier0_loads"] == 0 and rows["host"]["prefill_s_saved"] > 0
    again = type(result).from_dict(result.to_dict())
    assert again.arm("host").tiers == result.arm("host").tiers
    swept = sweep_split(config, [512, 1024], [256, 1024])
    series = {p.series for p in swept.points}
    assert {"flat", "host host=256", "host host=1,024"} <= series
    assert sorted(swept.capacities) == [768, 1280, 1536, 2048]
    assert all(p.device_tokens + p.host_tokens == p.capacity_tokens for p in swept.points if p.host_tokens)
    with pytest.raises(ConfigError, match=r"arms\.host\.tiers: the tiers hold 64 blocks"):
        parse_ab_config({**config_mapping(), "capacity_tokens": 1024})


def config_mapping():
    return {
        "workload": {"generator": "multi_turn", "params": {"num_conversations": 6, "turns": 3, "seed": 1}},
        "capacity_tokens": 2048,
        "arms": {"host": {"backend": "hash", "block_size": 16, "tiers": [{"medium": "CPU", "num_blocks": 64}]}},
    }


def test_persist_copies_what_is_held_above_a_disk_tier_once():
    from prefixcache._C import TierManager

    host, disk = (4, "on_evict", 0, "lru", False, {}, False, 0, 0), (8, "on_evict", 0, "lru", False, {}, True, 0, 0)
    m = TierManager(4, 2, 32, [host, disk], True, True)
    keys = [bytes([i]) * 32 for i in range(6)]
    m.device_cached([0, 1, 2, 3], b"".join(keys[:4]), None, list(range(8)), 0, 0, 0)
    m.device_evicted([0, 1])  # keys 0, 1 go to the host tier
    m.device_cached([0, 1], b"".join(keys[4:]), keys[3], list(range(4)), 0, 0, 0)
    m.drain_transfers()
    assert m.persist(1) == 6 and m.num_used(1) == 6 and m.num_used(0) == 2 and m.num_device_cached == 4
    moved = m.drain_transfers()
    assert sorted(zip(moved[::4], moved[2::4])) == [(-1, 1)] * 4 + [(0, 1)] * 2
    assert m.persist(1) == 0  # nothing new above it
    m.check_invariants(None)
    with pytest.raises(ValueError, match="only a disk tier persists"):
        m.persist(0)


def test_token_ids_are_kept_as_wide_as_the_strategy_keeps_them():
    from prefixcache._C import TierManager

    tier = [(4, "on_evict", 0, "lru", False, {}, False, 0, 0)]
    narrow = TierManager(4, 2, 8, tier, True, False, True, 4)
    root = narrow.new_name()
    with pytest.raises(ValueError, match="tokens"):  # an id radix's tree cannot hold
        narrow.device_cached_named([0], root, [1, 2**31], 0, 0, 0)
    assert narrow.device_key(0) is None  # refused before anything changed
    narrow.device_cached_named([0], root, [1, -(2**31)], 0, 0, 0)
    narrow.device_evicted([0])
    assert narrow.follow(root, [1, -(2**31)])[0] == [(0, 0)]
    assert list(narrow.slot_tokens(0, 0)) == [1, -(2**31)]  # read back as ints, sign kept
    with pytest.raises(ValueError, match="token_bytes must be 4 or 8, got 2"):
        TierManager(4, 2, 8, tier, True, False, False, 2)
    wide = TierManager(4, 2, 32, tier, True, False)
    assert wide.token_bytes == 8 and narrow.token_bytes == 4
    assert build_cache(CacheConfig(backend="radix", block_size=2, num_blocks=8, tiers=(TierConfig("CPU", 4),),
                                   enable_events=False)).tiers.native.token_bytes == 4  # fmt: skip


@pytest.mark.parametrize("width,code", [(4, "i"), (8, "q")])
def test_a_buffer_of_the_managers_width_is_read_in_place_and_any_other_converted(width, code):
    """The tier manager reads an array of its own id width (or a contiguous view of one) in
    place, and converts anything else: the same pages either way, and a buffer it holds
    cannot be resized under it by a Python policy running inside the call."""
    from array import array

    from prefixcache._C import TierManager

    ids = [5, -7, 2**31 - 1, 0, 3, 9]

    def manager(policy="lru"):
        m = TierManager(8, 2, 8, [(8, "on_evict", 0, policy, False, {}, False, 0, 0)], True, False, True, width)
        return m, m.new_name()

    forms = [ids, array(code, ids), memoryview(array(code, [0, 0] + ids))[2:], array("q" if code == "i" else "i", ids),
             memoryview(array(code, [x for i in ids for x in (i, 0)]))[::2]]  # fmt: skip
    seen = []
    for tokens in forms:
        m, root = manager()
        m.device_cached_named([0, 1, 2], root, tokens, 0, 0, 0)
        m.device_evicted([0, 1, 2])
        seen.append(([list(m.slot_tokens(0, s)) for s in m.used_slots(0)], m.follow(root, ids)[0]))
    assert all(s == seen[0] for s in seen) and len(seen[0][1]) == 3
    held, outcomes = array(code, ids), []

    class Resizer:
        leaves_only = False

        def __call__(self, candidate):  # a rank that tries to grow the caller's buffer
            try:
                held.extend(range(1000))
                outcomes.append("resized")
            except BufferError:
                outcomes.append("refused")
            return (0, 0)

    # write_through: the tier stores, and ranks, inside device_cached_named, while it reads `held`.
    m = TierManager(8, 2, 8, [(8, "write_through", 0, Resizer(), False, {}, False, 0, 0)], True, False, True, width)
    m.device_cached_named([0, 1, 2], m.new_name(), held, 0, 0, 0)
    assert outcomes == ["refused"] * 3 and list(held) == ids
