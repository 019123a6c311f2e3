"""`radix` over hybrid layouts: SGLang 0.5.23's UnifiedRadixCache, scenario by scenario.

`SCENARIOS` are small seeded replays (full + SWA, full + Mamba, each with an ample pool
and under eviction pressure, full + SWA + Mamba under pressure, and each under SGLang's
chunked prefill); `EXPECTED` holds the
hit of every request as SGLang 0.5.23's own UnifiedRadixCache made it (the sglang-0.5.23
wheel's code, run on CPU), recorded by

    python benchmarks/hybrid_radix_parity.py --record

(which replays these same scenarios through SGLang's code). The rest: the hybrid
kit's rules, the conformance kit, what a hybrid layout configures, events per group,
and SGLang's named behaviours (a tombstone in a branch's last window, the branching
point a request checkpoints its state at).
"""

from __future__ import annotations

import io
import random
import unittest

import pytest

import prefixcache
from prefixcache import BlockPool, CacheConfig, build_cache
from prefixcache.backends.hybrid_radix import HybridRadixCache
from prefixcache.config_checks import check_cache_config
from prefixcache.backends.hybrid_radix_tree import Component
from prefixcache.backends.radix import RadixCache
from prefixcache.errors import ConfigError
from prefixcache.events import BlockRemoved, BlockStored
from prefixcache.layout import NULL_BLOCK, LayerGroup, Layout
from prefixcache.testing import RULE_CHECKS, conformance_test_case
from prefixcache.testing_hybrid import LAYOUTS, check_hybrid_backend

FULL = LayerGroup("full_attention")


def swa(window: int, ratio: float = 0.8) -> LayerGroup:
    return LayerGroup("sliding_window", window=window, pool_ratio=ratio)


def mamba(slots: int = 0) -> LayerGroup:
    return LayerGroup("mamba", slots=slots)


# -- the scenarios, and SGLang's hits on them --------------------------------------------
SCENARIOS = {
    # name: (kind, block size, full pages, SWA pages or Mamba slots (both: a pair), options)
    "swa-ample": ("swa", 4, 400, 320, {}),
    "swa-pressure": ("swa", 4, 70, 56, {}),
    "mamba-ample": ("mamba", 4, 400, 80, {"mamba_chunk": 8, "mamba_track_interval": 16}),
    "mamba-pressure": ("mamba", 4, 70, 16, {"mamba_chunk": 8, "mamba_track_interval": 16}),
    "swa-mamba-pressure": ("swa+mamba", 4, 80, (64, 16), {"mamba_chunk": 8, "mamba_track_interval": 16}),
    # SGLang's chunked prefill (--chunked-prefill-size 16): each chunk allocated, then inserted.
    "swa-chunked": ("swa", 4, 90, 72, {"chunked_prefill_size": 16}),
    "mamba-chunked": ("mamba", 4, 90, 16, {"mamba_chunk": 8, "mamba_track_interval": 16, "chunked_prefill_size": 16}),
    "swa-mamba-chunked": ("swa+mamba", 4, 400, (320, 80), {"mamba_chunk": 8, "mamba_track_interval": 16,
                                                           "chunked_prefill_size": 16}),
}
WINDOW = 13  # TOKENS a query reads (SGLang's sliding_window_size 12)
CONCURRENCY = 2


def workload(seed: int = 7, n: int = 36) -> list[tuple[list[int], list[int], str | None]]:
    """Prompts that share and branch off earlier prompts and answers (a system prompt,
    follow-ups, siblings), each with an answer; some in a second namespace."""
    rng = random.Random(seed)
    system = [rng.randrange(50) for _ in range(40)]
    seen: list[list[int]] = [system]
    out = []
    for _ in range(n):
        base = rng.choice(seen)
        prompt = base[: rng.randint(len(base) // 2, len(base))] + [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        answer = [rng.randrange(50) for _ in range(rng.choice([2, 5, 9, 20, 40]))]
        seen.append(prompt + answer)
        out.append((prompt, answer, rng.choice([None, None, None, "t"])))
    return out


def scenario_cache(name: str) -> HybridRadixCache:
    kind, bs, full, other, options = SCENARIOS[name]
    if kind == "swa":
        layout, blocks = (FULL, swa(WINDOW, other / full)), full + other
    elif kind == "mamba":
        layout, blocks = (FULL, mamba(other)), full + other
    else:
        layout, blocks = (FULL, swa(WINDOW, other[0] / full), mamba(other[1])), full + sum(other)
    cache = build_cache(CacheConfig(backend="radix", block_size=bs, num_blocks=blocks, layout=layout, options=options))
    assert cache._budgets[Component.FULL].capacity == full
    return cache  # type: ignore[return-value]


def replay(cache, reqs) -> list[int]:
    """One request at a time: admit, prefill (commits at the checkpoints), decode the
    answer but its last token, keep CONCURRENCY requests live (oldest released first)."""
    hits, live = [], []
    for i, (prompt, answer, ns) in enumerate(reqs):
        adm = cache.admit(i, prompt, namespace=ns)
        assert adm is not None, f"request {i} refused"
        hits.append(adm.num_cached_tokens)
        for c in adm.checkpoints:
            cache.commit(i, c)
        n = len(prompt)
        cache.commit(i, n)
        for token in answer[:-1]:
            assert cache.append(i, [token]) is not None
            n += 1
            cache.commit(i, n)
        live.append(i)
        if len(live) > CONCURRENCY:
            cache.release(live.pop(0))
        cache.check_invariants()
    for i in live:
        cache.release(i)
    cache.check_invariants()
    return hits


EXPECTED: dict[str, list[int]] = {}
EXPECTED.update({
    'mamba-ample': [0, 0, 0, 24, 32, 0, 0, 32, 32, 0, 24, 24, 24, 24, 32, 48, 48, 16, 32, 32, 32, 40, 48, 40, 24, 16, 24, 40, 24, 32, 16, 40, 24, 40, 48, 40],
    'mamba-pressure': [0, 0, 0, 24, 32, 0, 0, 32, 32, 0, 16, 16, 24, 24, 24, 32, 32, 0, 32, 32, 32, 0, 40, 40, 0, 0, 24, 24, 0, 24, 16, 32, 0, 32, 32, 32],
    'swa-ample': [0, 0, 0, 32, 32, 0, 0, 36, 32, 0, 28, 40, 28, 24, 36, 48, 48, 20, 40, 32, 44, 40, 52, 40, 28, 20, 28, 40, 32, 36, 20, 76, 28, 44, 56, 44],
    'swa-mamba-pressure': [0, 0, 0, 24, 32, 0, 0, 32, 32, 0, 16, 0, 24, 24, 24, 32, 32, 0, 32, 32, 32, 0, 40, 24, 0, 0, 24, 24, 0, 24, 0, 32, 0, 32, 24, 32],
    'swa-pressure': [0, 0, 0, 32, 32, 0, 0, 32, 32, 0, 28, 28, 28, 24, 32, 48, 48, 0, 32, 32, 32, 0, 48, 40, 28, 20, 28, 40, 0, 32, 20, 32, 28, 32, 28, 32],
    'mamba-chunked': [0, 0, 16, 24, 32, 0, 0, 16, 32, 0, 16, 0, 24, 24, 24, 48, 48, 0, 0, 32, 32, 0, 40, 40, 0, 16, 24, 24, 0, 0, 16, 16, 0, 0, 24, 32],
    'swa-chunked': [0, 0, 28, 32, 32, 28, 20, 36, 44, 20, 28, 0, 28, 24, 28, 48, 48, 20, 32, 32, 44, 0, 52, 40, 28, 0, 28, 40, 32, 32, 0, 32, 0, 32, 28, 32],
    'swa-mamba-chunked': [0, 0, 16, 32, 32, 16, 16, 32, 32, 16, 32, 24, 24, 24, 48, 64, 48, 16, 32, 32, 32, 40, 48, 40, 24, 32, 24, 40, 32, 32, 48, 40, 24, 40, 48, 40],
})


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_hits_are_sglangs(name):
    cache = scenario_cache(name)
    assert replay(cache, workload()) == EXPECTED[name]
    if "pressure" in name or name in ("mamba-chunked", "swa-chunked"):
        assert cache.stats().evictions > 0


# -- SGLang's named behaviours -----------------------------------------------------------
def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    a = [rng.randrange(100) for _ in range(90)]
    return [a, a[:70] + [101, 102, 103], a[:70] + [104, 105], a[:70] + [106]]


def _run(cache, prompts) -> list[tuple[int, tuple[int, ...]]]:
    out = []
    for i, prompt in enumerate(prompts):
        adm = cache.admit(i, prompt)
        out.append((adm.num_cached_tokens, tuple(adm.checkpoints)))
        for c in adm.checkpoints:
            cache.commit(i, c)
        cache.commit(i, len(prompt))
        cache.release(i)
        cache.check_invariants()
    return out


def test_a_tombstone_in_the_branchs_last_window_misses_it_until_a_branch_recovers_it():
    """SGLang issue 35515: a 90-token prompt keeps live SWA only in its last window; a
    sibling sharing 70 tokens finds full KV for 68 but tombstones in that hit's window:
    a miss. It checkpoints at the branching point (68), whose window takes its own pages
    back from the tombstones, and the next sibling hits 68 (numbers: SGLang 0.5.23)."""
    cache = build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=180, layout=(FULL, swa(13, 0.8))))
    assert _run(cache, _prompts()) == [(0, ()), (0, ()), (68, ()), (68, ())]


def test_a_state_hit_needs_a_state_and_the_branching_point_checkpoints_one():
    """Mamba states every 8 tokens (mamba_chunk 8): the first prompt's prefill tracks its
    state at 88; a sibling sharing 70 tokens has full KV for 68 but no state there: a miss,
    and its prefill checkpoints at the branching point 64 (`Admission.checkpoints`), so
    the next sibling hits 64 (numbers: SGLang 0.5.23)."""
    cache = build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=130, layout=(FULL, mamba(30)),
                                    options={"mamba_chunk": 8, "mamba_track_interval": 16}))  # fmt: skip
    # The third tracks its state at its end (72): no checkpoint needed there.
    assert _run(cache, _prompts()) == [(0, (88,)), (0, (64,)), (64, ()), (64, ())]


def test_a_state_hit_is_copied_on_write():
    """The hit's state block is the tree's (the engine reads it once); the request runs on
    a slot of its own, and tracks into its own ping-pong slots."""
    cache = build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=130, layout=(FULL, mamba(30)),
                                    options={"mamba_chunk": 8, "mamba_track_interval": 16}))  # fmt: skip
    prompts = _prompts()
    _run(cache, prompts[:2])
    adm = cache.admit("c", prompts[2])
    states = adm.group_tables[1]
    node_state = cache.tree.match(prompts[2][:64], None).node.mamba
    assert states[64 // 4 - 1] == node_state and states[72 // 4 - 1] not in (NULL_BLOCK, node_state)
    req = cache._requests.get("c")
    assert req.running not in (node_state, None) and states[72 // 4 - 1] in req.ping_pong
    cache.release("c")
    cache.check_invariants()


def test_state_pressure_tombstones_an_inner_state_and_keeps_its_full_kv():
    """A 10-slot state pool: two branches off a 40-token prefix leave its state on an
    inner node; unrelated requests then need the slots, the least recently used states
    go (leaves whole, the inner one as a tombstone: its FULL pages stay), and the
    prefix, still fully cached, is a miss without its state (hits: SGLang 0.5.23)."""
    cache = build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=140, layout=(FULL, mamba(10)),
                                    options={"mamba_chunk": 8, "mamba_track_interval": 16}))  # fmt: skip
    base = list(range(200, 240))
    prompts = [base + [1], base + [2] * 17, base + [3] * 17] + [[1000 + 10 * i + k for k in range(17)] for i in range(3, 9)]
    assert [hit for hit, _ in _run(cache, prompts)] == [0, 40, 40, 0, 0, 0, 0, 0, 0]
    inner = cache.tree.match(base, None)
    assert inner.full_hit == 40 and inner.num_tokens == 0
    node = cache.tree.root.children[(None, tuple(base[:4]))]
    assert len(node.key) == 40 and node.children and node.full is not None and node.mamba is None
    assert _run(cache, [base + [9, 9]])[0][0] == 0


def test_a_match_changes_nothing_and_settling_it_splits_where_the_walk_ended():
    """A match ending inside a node (here past the hit: the node holds no state there)
    changes nothing; settled, that node is split at the walk's end and the hit is the
    same, so a match again ends at a node's end with the same hit and pages."""
    cache = build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=140, layout=(FULL, swa(8), mamba(10)),
                                    options={"mamba_chunk": 8, "mamba_track_interval": 16}))  # fmt: skip
    base = list(range(200, 240))
    _run(cache, [base + [1]])
    query = base[:24] + [7] * 8
    nodes = cache.tree.num_nodes
    out = cache.tree.match(query, None)
    assert out.inside is not None and out.inside[1] == 24 and cache.tree.num_nodes == nodes
    assert cache.tree.match(query, None).inside == out.inside  # nothing moved
    settled = cache.tree.settle(out)
    assert cache.tree.num_nodes == nodes + 1 and settled.inside is None
    again = cache.tree.match(query, None)
    assert again.inside is None and again.full_hit == out.full_hit == 24
    assert (again.num_tokens, again.node) == (settled.num_tokens, settled.node) and again.num_tokens == out.num_tokens
    assert again.pages(Component.FULL, 4) == settled.pages(Component.FULL, 4) == out.pages(Component.FULL, 4)
    cache.check_invariants()


# -- SGLang's chunked prefill ---------------------------------------------------------------
def _chunked(num_blocks: int, layout=(FULL, swa(13)), **options) -> HybridRadixCache:
    return build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=num_blocks, layout=layout,
                                   options={"chunked_prefill_size": 16, **options}))  # type: ignore[return-value]


def test_each_chunk_is_allocated_at_the_commit_that_ends_the_one_before_and_inserted_there():
    """A 50-token prompt in chunks of 16: checkpoints at 16, 32, 48; the tables cover the
    first chunk; the commit at 16 inserts it (a sibling hits it at once, as SGLang's
    stash_chunked_request publishes it) and allocates [16, 32)."""
    cache = _chunked(200)
    prompt = list(range(100, 150))
    adm = cache.admit("a", prompt)
    assert (adm.num_cached_tokens, adm.checkpoints, len(adm.block_table)) == (0, (16, 32, 48), 4)
    assert cache.match(prompt[:20]).num_tokens == 0
    cache.commit("a", 16)
    assert len(cache.block_table("a")) == 8 and all(len(t) == 8 for t in cache.block_tables("a"))
    assert cache.match(prompt[:20]).num_tokens == 16
    cache.check_invariants()
    for c in (32, 48, 50):
        cache.commit("a", c)
        cache.check_invariants()
    assert len(cache.block_table("a")) == 13
    cache.release("a")
    assert cache.admit("b", prompt[:49] + [7]).num_cached_tokens == 48
    cache.release("b")
    cache.check_invariants()
    assert cache.pool.num_pinned == sum(len(n.full) + len(n.swa or ()) for n in cache.tree.nodes() if n.full)


def test_a_mamba_prefill_tracks_a_state_in_each_chunk():
    """States every 8 tokens (mamba_chunk 8): each chunk tracks its last aligned state,
    so a chunk end is both a checkpoint and a state the tree keeps."""
    cache = _chunked(200, (FULL, mamba(40)), mamba_chunk=8, mamba_track_interval=16)
    prompt = list(range(100, 150))
    adm = cache.admit("a", prompt)
    assert adm.checkpoints == (16, 32, 48)
    for c in (*adm.checkpoints, 50):
        cache.commit("a", c)
    assert cache.match(prompt[:40]).num_tokens == 32  # the state stashed at the chunk end
    cache.release("a")
    cache.check_invariants()


def test_a_chunk_without_room_waits_and_append_retries_it():
    cache = _chunked(2 * 15, (FULL, swa(13, 1.0)))  # 15 FULL pages, 15 SWA pages
    other = cache.admit("other", list(range(200, 240)))  # 10 pages
    assert other is not None and other.checkpoints == (16, 32)
    for c in (16, 32, 40):
        cache.commit("other", c)
    adm = cache.admit("a", list(range(100, 120)))  # 5 pages: 4, then 1
    assert adm is not None and adm.checkpoints == (16,)
    assert cache.append("other", [1]) is not None  # the decode takes the last free FULL page
    cache.commit("other", 41)
    cache.commit("a", 16)  # the next chunk finds no page: the request waits
    assert cache.append("a", []) is None
    with pytest.raises(RuntimeError, match=r"append\(r, \[\]\)"):
        cache.commit("a", 20)
    cache.check_invariants()
    cache.release("other")
    assert cache.append("a", []) == []
    assert len(cache.block_table("a")) == 5
    cache.commit("a", 20)
    cache.release("a")
    cache.check_invariants()


def test_a_commit_past_the_checkpoints_runs_each_chunk_in_order():
    a, b = _chunked(200), _chunked(200)
    prompt = list(range(100, 150))
    for cache, commits in ((a, (16, 32, 48, 50)), (b, (50,))):
        cache.admit("r", prompt)
        for c in commits:
            cache.commit("r", c)
        cache.check_invariants()
    assert a.block_table("r") == b.block_table("r") and a.tree.num_nodes == b.tree.num_nodes
    assert a.drain_events() == b.drain_events()


def test_tokens_appended_inside_a_chunked_prefill_take_the_chunks_not_yet_allocated():
    cache = _chunked(200)
    prompt = list(range(100, 150))
    cache.admit("r", prompt)
    cache.commit("r", 16)
    assert len(cache.append("r", [1, 2])) == 13 - 8
    cache.commit("r", 52)
    cache.release("r")
    cache.check_invariants()


# -- the per-path state cap (beyond SGLang) ------------------------------------------------
def _states_on_path(cache: HybridRadixCache, tokens: list[int]) -> list[int]:
    """Positions (TOKENS) of the states on the tree path `tokens` follows."""
    out = cache.tree.match(tokens, None)
    depth, positions = 0, []
    for node, covered in out.path:
        depth += covered
        if node.mamba is not None and covered == len(node.key):
            positions.append(depth)
    return positions


def test_state_cap_keeps_a_released_paths_deepest_states_by_replay_saved():
    """Chunks of 8 leave a state every 8 tokens of a 41-token prompt (and the tracked one
    at 40); `state_cap: 2` keeps the deepest and the one whose replay is longest."""
    def run(cap: int) -> HybridRadixCache:
        cache = _chunked(400, (FULL, mamba(40)), mamba_chunk=4, mamba_track_interval=16, chunked_prefill_size=8,
                         state_cap=cap)  # fmt: skip
        prompt = list(range(100, 141))
        adm = cache.admit("a", prompt)
        for c in (*adm.checkpoints, len(prompt)):
            cache.commit("a", c)
        cache.release("a")
        cache.check_invariants()
        return cache

    prompt = list(range(100, 141))
    assert _states_on_path(run(0), prompt) == [8, 16, 24, 32, 40]
    capped = run(2)
    assert _states_on_path(capped, prompt) == [32, 40]  # 8, 16, 24 each save 8; 32 saves 32 once they go
    assert capped.match(prompt).num_tokens == 40
    assert capped.stats().evictions == 3


def test_state_cap_leaves_a_state_another_request_locks():
    cache = _chunked(400, (FULL, mamba(40)), mamba_chunk=4, mamba_track_interval=16, chunked_prefill_size=8,
                     state_cap=1)  # fmt: skip
    prompt = list(range(100, 141))
    adm = cache.admit("a", prompt)
    for c in (*adm.checkpoints, len(prompt)):
        cache.commit("a", c)
    b = cache.admit("b", prompt[:17] + [7, 8])  # hits the state at 16 and locks it
    assert b.num_cached_tokens == 16
    cache.release("a")
    assert _states_on_path(cache, prompt) == [16, 40]
    cache.release("b")
    cache.check_invariants()


# -- configuration -----------------------------------------------------------------------
def test_a_full_attention_layout_is_the_plain_radix_backend():
    for layout in ((), (FULL,), (FULL, FULL)):
        cache = build_cache(CacheConfig(backend="radix", num_blocks=64, layout=layout))
        assert type(cache) is RadixCache
    assert type(build_cache(CacheConfig(backend="radix", num_blocks=64, layout=(FULL, swa(32))))) is HybridRadixCache


@pytest.mark.parametrize(
    ("layout", "extra", "key"),
    [
        ((FULL, swa(32)), {"eviction": "lfu"}, "eviction"),
        ((FULL, swa(32), swa(64)), {}, "layout"),
        ((FULL, swa(32, 0.5), swa(32, 0.6)), {}, "layout"),
        ((FULL, swa(32)), {"options": {"mamba_chunk": 8}}, "options"),
        ((FULL, mamba()), {"options": {"mamba_chunk": 24}}, "options.mamba_chunk"),
        ((FULL, mamba()), {"options": {"mamba_track_interval": 0}}, "options.mamba_track_interval"),
        ((FULL, mamba(64)), {}, "layout"),
        ((), {"options": {"mamba_chunk": 8}}, "options"),
        ((FULL, swa(32)), {"options": {"chunked_prefill_size": 24}}, "options.chunked_prefill_size"),
        ((FULL, mamba()), {"options": {"chunked_prefill_size": -16}}, "options.chunked_prefill_size"),
        ((FULL, mamba()), {"options": {"chunked_prefill_size": 32}}, "options.chunked_prefill_size"),
        ((), {"options": {"chunked_prefill_size": 64}}, "options.chunked_prefill_size"),
        ((FULL, mamba()), {"options": {"state_cap": -1}}, "options.state_cap"),
        ((FULL, swa(32)), {"options": {"state_cap": 1}}, "options"),
        ((), {"options": {"state_cap": 1}}, "options.state_cap"),
        ((FULL, swa(32)), {"options": {"no_tail_cliff": "yes"}}, "options.no_tail_cliff"),
        ((), {"options": {"no_tail_cliff": True}}, "options.no_tail_cliff"),
    ],
)
def test_bad_hybrid_configs_name_the_key(layout, extra, key):
    config = CacheConfig(backend="radix", block_size=16, num_blocks=64, layout=layout, **extra)
    with pytest.raises(ConfigError) as err:
        check_cache_config(config)  # at load (and `prefixcache validate`), before any cache is built
    assert err.value.path == key or str(err.value).startswith(key), str(err.value)
    with pytest.raises(ConfigError) as err:
        RadixCache(BlockPool(64), config)
    assert err.value.path == key or str(err.value).startswith(key), str(err.value)


def test_a_radix_plugin_refuses_a_hybrid_layout_at_load():
    class Mine(RadixCache):
        pass

    with pytest.raises(ConfigError, match="^layout: backend .*Mine does not cache hybrid layouts"):
        Mine.check_layout(CacheConfig(num_blocks=64, layout=(FULL, swa(32))), Mine.parse_options({}))


def test_the_mamba_options_bind_only_with_a_mamba_group():
    """Without one, block 528 (not a multiple of the default mamba_chunk 64) builds."""
    cache = build_cache(CacheConfig(backend="radix", block_size=528, num_blocks=64, layout=(FULL, swa(1024))))
    assert type(cache) is HybridRadixCache
    with pytest.raises(ConfigError, match="^options.mamba_chunk"):
        build_cache(CacheConfig(backend="radix", block_size=528, num_blocks=64, layout=(FULL, mamba())))


def test_the_pools_split_the_one_pool():
    """num_blocks less the state slots (SGLang's mamba_full_memory_ratio 0.9 by default),
    split FULL / SWA by pool_ratio (SGLang's swa_full_tokens_ratio)."""
    def budgets(layout):
        c = build_cache(CacheConfig(backend="radix", block_size=16, num_blocks=190, layout=layout))
        return {k.name: b.capacity for k, b in c._budgets.items()}

    assert budgets((FULL, swa(64))) == {"SWA": 84, "FULL": 106}
    assert budgets((FULL, mamba())) == {"MAMBA": 90, "FULL": 100}
    assert budgets((FULL, swa(64, 0.5), mamba(40))) == {"MAMBA": 40, "SWA": 50, "FULL": 100}


def test_a_state_takes_the_blocks_its_bytes_fill():
    """With sizes given, a state costs its bytes: at block 16 a 2 MiB state (528 tokens of a
    4 KiB-a-token layer) takes 33 blocks, so the default state pool is 0.9 / 1.9 of the pool
    in bytes; at block 528 it is one block, as without sizes."""
    kv, state = LayerGroup("full_attention", bytes_per_token=4096), LayerGroup("mamba", state_bytes=528 * 4096)
    assert Layout((kv, state)).state_blocks(16) == 33
    assert Layout((kv, state)).state_blocks(528) == 1
    assert Layout((FULL, state)).state_blocks(16) == Layout((kv, mamba())).state_blocks(16) == 1

    def budgets(block_size, num_blocks, layout, **options):
        c = build_cache(CacheConfig(backend="radix", block_size=block_size, num_blocks=num_blocks, layout=layout,
                                    options={"mamba_chunk": 16, **options}))  # fmt: skip
        return {k.name: b.capacity for k, b in c._budgets.items()}

    assert budgets(16, 3300, (kv, state)) == {"MAMBA": 47, "FULL": 3300 - 47 * 33}
    assert budgets(16, 3300, (kv, LayerGroup("mamba", state_bytes=528 * 4096, slots=10))) == {
        "MAMBA": 10, "FULL": 3300 - 330}
    with pytest.raises(ConfigError, match=r"^layout: the mamba group's 100 state slots, 33 blocks each"):
        budgets(16, 3300, (kv, LayerGroup("mamba", state_bytes=528 * 4096, slots=100)))
    # The held-back blocks are never handed out: a full pool still checks.
    cache = build_cache(CacheConfig(backend="radix", block_size=16, num_blocks=400, layout=(kv, state),
                                    options={"mamba_chunk": 16}))  # fmt: skip
    for i in range(40):
        adm = cache.admit(i, [i] * 7 + list(range(200)))
        if adm is None:
            break
        cache.commit(i, 207)
        cache.check_invariants()
    assert cache.pool.num_free >= 400 - cache._budgets[Component.FULL].capacity - cache._budgets[Component.MAMBA].capacity


# -- events --------------------------------------------------------------------------------
def test_events_are_per_group_with_the_hash_backends_block_hashes():
    layout = (FULL, swa(9), mamba(20))
    cache = build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=120, layout=layout,
                                    options={"mamba_chunk": 8, "mamba_track_interval": 16}))  # fmt: skip
    prompt = list(range(1, 42))
    adm = cache.admit("a", prompt, namespace="t")
    for c in adm.checkpoints:
        cache.commit("a", c)
    cache.commit("a", len(prompt))
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    by_group = {g: [e for e in stored if e.group_idx == g] for g in range(3)}
    assert [e.kv_cache_spec_kind for e in stored if e.group_idx == 1] == ["sliding_window"] * len(by_group[1])
    assert all(e.kv_cache_spec_sliding_window == 9 for e in by_group[1])
    # The full group's pages: the chained block hashes the hash backend announces.
    hashed = build_cache(CacheConfig(backend="hash", block_size=4, num_blocks=64))
    hashed.admit("a", prompt, namespace="t")
    hashed.commit("a", len(prompt))
    want = [h for e in hashed.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    got = [h for e in by_group[0] for h in e.block_hashes]
    assert got == want[: len(got)] and len(got) == 40 // 4
    # One state, at 40 tokens: the block it ends on.
    assert [e.block_hashes for e in by_group[2]] == [(want[40 // 4 - 1],)]
    cache.release("a")
    cache.evict(120)
    removed = [e for e in cache.drain_events() if isinstance(e, BlockRemoved)]
    assert {e.group_idx for e in removed} == {0, 1, 2}


# -- the kits ------------------------------------------------------------------------------
def _make(block_size: int, num_blocks: int, layout, chunked: int = 0, no_tail_cliff: bool = False) -> HybridRadixCache:
    options = {"mamba_chunk": block_size, "mamba_track_interval": 2 * block_size} if any(
        g.kind == "mamba" for g in layout) else {}  # fmt: skip
    return build_cache(CacheConfig(backend="radix", block_size=block_size, num_blocks=num_blocks, layout=layout,
                                   options={**options, "chunked_prefill_size": chunked,
                                            "no_tail_cliff": no_tail_cliff}))  # type: ignore[return-value]


def test_the_hybrid_kit_passes():
    check_hybrid_backend(_make, num_blocks=96)
    check_hybrid_backend("radix", seeds=range(2))  # SGLang's defaults: a state every 64 tokens
    check_hybrid_backend(lambda bs, n, layout: _make(bs, n, layout, chunked=2 * bs), num_blocks=96)  # chunked prefill
    check_hybrid_backend(lambda bs, n, layout: _make(bs, n, layout, no_tail_cliff=True), num_blocks=48)  # pools evict


def _conformance_factory(layout_of):
    """The kit's num_blocks as the FULL pool; the SWA and state pools beside it."""

    def make(bs: int, n: int, **config) -> HybridRadixCache:
        layout = layout_of(n)
        blocks = n + sum(n if g.kind == "sliding_window" else g.slots for g in layout[1:])
        return _make_conf(bs, blocks, layout, config)

    return make


def _make_conf(bs, blocks, layout, config):
    options = {"mamba_chunk": bs, "mamba_track_interval": 2 * bs} if any(g.kind == "mamba" for g in layout) else {}
    return build_cache(CacheConfig(backend="radix", block_size=bs, num_blocks=blocks, layout=layout, options=options,
                                   **config))  # fmt: skip


CONFORMANCE_LAYOUTS = {
    "full+swa": lambda n: (FULL, swa(6, 1.0)),
    "full+mamba": lambda n: (FULL, mamba(4 * n)),
    "full+chunked": lambda n: (FULL, LayerGroup("chunked_local_attention", chunk=8)),
}


@pytest.mark.parametrize("layout", sorted(CONFORMANCE_LAYOUTS))
def test_the_conformance_kit_passes(layout):
    """Every rule check and the state machine, but one: SGLang inserts a request's KV at
    its checkpoints (after the prefill, at its end), not at every decode commit, so the
    check that a decode step's commit is hittable right away does not apply. (Chunked
    prefill allocates a table chunk by chunk, outside this kit's rules: the hybrid kit
    above drives it.)"""
    make = _conformance_factory(CONFORMANCE_LAYOUTS[layout])
    for bs in (1, 4):
        for check in RULE_CHECKS:
            if check.__name__ != "rule_commit_and_append_is_both_calls":
                check(make, bs)
    case = conformance_test_case(make, block_size=4, max_examples=8)
    result = unittest.TextTestRunner(stream=io.StringIO()).run(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    assert result.wasSuccessful(), (result.failures or result.errors)[0][1]


# -- the engine ------------------------------------------------------------------------------
@pytest.mark.parametrize(("chunked", "cap", "cliff"), [(0, 0, False), (32, 0, False), (32, 1, False), (0, 0, True)])
def test_the_engine_on_radix_runs_cached_as_uncached(chunked, cap, cliff):
    """The tiny hybrid model (full, sliding-window, chunked-local, recurrent) on `radix`
    with a pool that evicts, its prefill one extend or SGLang's chunks of 32 tokens, with
    or without a state cap or `no_tail_cliff`: tokens, first logits and recurrent states
    as uncached, and no block pinned after each trace (benchmarks/hybrid_soak.py
    --backend radix: more)."""
    from prefixcache.engine.exactness import compare_trace, engines_for, random_trace, tiny_hybrid

    model = tiny_hybrid(seed=0)
    config = CacheConfig(backend="radix", block_size=16, num_blocks=60,
                         options={"mamba_chunk": 16, "mamba_track_interval": 32, "chunked_prefill_size": chunked,
                                  "state_cap": cap, "no_tail_cliff": cliff})  # fmt: skip
    cached, uncached = engines_for(model, config)
    assert type(cached.cache) is HybridRadixCache
    hits = evictions = 0
    for seed in (3, 4, 5):
        r = compare_trace(cached, uncached, random_trace(random.Random(seed), model.weights.config.vocab_size, max_prompt=120))
        assert r.difference is None, r.difference
        hits += r.hit_tokens
        evictions += r.evictions
    assert hits > 0 and evictions > 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "+".join(g.kind for g in layout))
def test_ids_beyond_int32_and_int64_are_stored_or_refused_by_name(layout):
    """The kit's check on every hybrid layout (`hash` stores them, as CBOR bignums;
    `radix` refuses them, storing int32 ids): never another error."""
    from prefixcache.testing import big_ids_are_stored_or_refused

    big_ids_are_stored_or_refused(
        lambda bs, n: prefixcache.build_cache(CacheConfig(backend="radix", block_size=bs, num_blocks=n, layout=layout)), 4
    )


def test_at_its_own_block_a_long_shared_prefix_hits_to_the_state_grid():
    """The state that makes vLLM raise its block to 528 tokens has a pool of its own here (it
    takes the 33 blocks its bytes fill), so the block stays 16: a 1,500-token shared prefix
    hits 1,472 (floored to SGLang's state grid, 64) from its third sighting, where block
    528 hits 1,056 (the second learns the branching point, as SGLang's one extend does)."""
    rng = random.Random(3)
    shared = [rng.randrange(50_000) for _ in range(1500)]
    prompts = [shared + [rng.randrange(50_000) for _ in range(700)] for _ in range(6)]
    kv, state = LayerGroup("full_attention", bytes_per_token=4096), LayerGroup("mamba", state_bytes=528 * 4096)

    def hits(block_size: int, **options) -> list[int]:
        cache = build_cache(CacheConfig(backend="radix", block_size=block_size, num_blocks=60_000 // block_size * 16,
                                        layout=(kv, state), options=options))  # fmt: skip
        out = []
        for i, prompt in enumerate(prompts):
            adm = cache.admit(i, prompt)
            for c in adm.checkpoints:
                cache.commit(i, c)
            cache.commit(i, len(prompt))
            cache.release(i)
            out.append(adm.num_cached_tokens)
        cache.check_invariants()
        return out

    assert hits(16) == [0, 0] + [1472] * 4
    assert hits(528, mamba_chunk=48) == [0, 0] + [1056] * 4
