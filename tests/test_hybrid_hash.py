"""`hash` over hybrid layouts: vLLM 0.33's hybrid manager, scenario by scenario.

The numbers here are vLLM 0.33's own (benchmarks/hybrid_parity.py replays these
layouts through its `KVCacheManager` and compares request by request); each test is
one scenario with the expected hit.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import prefixcache
from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.events import BlockRemoved, BlockStored
from prefixcache.backends.hybrid_groups import SlidingWindowGroup
from prefixcache.backends.hybrid_hash import HybridHashCache
from prefixcache.layout import NULL_BLOCK, LayerGroup
from prefixcache.testing_hybrid import LAYOUTS

FULL = LayerGroup("full_attention")
MAMBA = LayerGroup("mamba")


def swa(window: int) -> LayerGroup:
    return LayerGroup("sliding_window", window=window)


def make(*groups: LayerGroup, block_size: int = 16, num_blocks: int = 4096, **options):
    return prefixcache.build_cache(
        CacheConfig(block_size=block_size, num_blocks=num_blocks, layout=groups, options=options)
    )


def run(cache, rid, tokens):
    """Admit, commit at each checkpoint, then the prompt; return the admission."""
    adm = cache.admit(rid, tokens)
    assert adm is not None
    for c in adm.checkpoints:
        cache.commit(rid, c)
        assert cache.append(rid, []) == []
    cache.commit(rid, len(tokens))
    return adm


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def test_full_attention_only_layout_is_the_plain_hash_backend():
    from prefixcache.backends.hash import HashCache

    cache = make(FULL, FULL)
    assert type(cache) is HashCache


def test_mamba_at_block_528_hits_the_state_its_first_chunk_ended_on():
    # The case: a 1,500-token shared prefix + 700 unique tokens. vLLM splits the
    # first prefill at 1,056 (the last block boundary before the prompt's last token
    # that the split finds first: (2200 - 1) // 528 * 528 = 2112 is the replay point,
    # and a second request's junction is 1,056).
    rng = random.Random(0)
    shared = tokens(rng, 1500)
    cache = make(FULL, MAMBA, block_size=528)
    first = run(cache, 0, shared + tokens(rng, 700))
    assert first.num_cached_tokens == 0 and first.checkpoints == (2112,)
    second = run(cache, 1, shared + tokens(rng, 700))
    # Full attention hits 1,056 (two whole blocks); no state there yet: a miss, and a junction.
    assert second.num_cached_tokens == 0 and second.checkpoints == (1056, 2112)
    third = run(cache, 2, shared + tokens(rng, 700))
    assert third.num_cached_tokens == 1056
    cache.check_invariants()


def test_mamba_table_holds_one_block_per_chunk():
    rng = random.Random(1)
    cache = make(FULL, MAMBA, block_size=16)
    adm = cache.admit("a", tokens(rng, 100))
    full, mamba = adm.group_tables
    assert len(full) == 6 and NULL_BLOCK not in full  # through the first checkpoint: 96 tokens
    assert adm.checkpoints == (96,)
    assert list(mamba).count(NULL_BLOCK) == 5 and len(mamba) == 6
    cache.commit("a", 96)
    full, mamba = cache.block_tables("a")
    assert len(full) == 7 and len(mamba) == 7 and sum(b != NULL_BLOCK for b in mamba) == 2


def test_sliding_window_hit_needs_the_window_blocks_before_the_cut():
    rng = random.Random(2)
    cache = make(FULL, swa(64), block_size=16)  # a hit needs ceil(63 / 16) = 4 blocks
    prompt = tokens(rng, 200)
    run(cache, 0, prompt)
    cache.release(0)
    # The same prompt: sparse retention kept the 4 blocks before the replay point (199 -> block 12).
    again = run(cache, 1, prompt)
    assert again.num_cached_tokens == 192
    swa_table = again.group_tables[1]
    assert swa_table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in swa_table[8:12]
    cache.release(1)
    # A prompt sharing 150 tokens: full attention hits 144, the window tail there was
    # never kept: the cached run from block 0 is too short, so 0, and 144 is a junction.
    sibling = prompt[:150] + tokens(rng, 50)
    assert run(cache, 2, sibling).num_cached_tokens == 0
    cache.release(2)
    assert run(cache, 3, prompt[:150] + tokens(rng, 50)).num_cached_tokens == 144
    cache.check_invariants()


def test_dense_retention_hits_a_shared_prefix_on_its_second_sighting():
    rng = random.Random(3)
    shared = tokens(rng, 150)
    sparse, dense = make(FULL, swa(64)), make(FULL, swa(64), retention="dense")
    for cache in (sparse, dense):
        run(cache, 0, shared + tokens(rng, 50))
    assert run(sparse, 1, shared + tokens(rng, 50)).num_cached_tokens == 0
    assert run(dense, 1, shared + tokens(rng, 50)).num_cached_tokens == 144


def test_state_interval_keeps_states_for_the_second_sighting():
    rng = random.Random(4)
    shared = tokens(rng, 1500)
    cache = make(FULL, MAMBA, block_size=16, retention="dense", state_interval=256)
    first = run(cache, 0, shared + tokens(rng, 700))
    assert first.checkpoints[:3] == (256, 512, 768)
    assert run(cache, 1, shared + tokens(rng, 700)).num_cached_tokens == 1280


def test_events_are_per_group():
    rng = random.Random(5)
    cache = make(FULL, swa(32), MAMBA, block_size=16)
    prompt = tokens(rng, 100)
    run(cache, "a", prompt)
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored}
    assert kinds == {(0, "full_attention", None), (1, "sliding_window", 32), (2, "mamba", None)}
    full = [e for e in stored if e.group_idx == 0]
    assert sum(len(e.block_hashes) for e in full) == 6
    # The window group keeps the 2 blocks before the replay point (99 -> block 6): blocks 4, 5.
    window = [e for e in stored if e.group_idx == 1]
    assert sum(len(e.block_hashes) for e in window) == 2
    cache.release("a")
    cache.evict(1000)
    removed = [e for e in cache.drain_events() if isinstance(e, BlockRemoved)]
    assert {e.group_idx for e in removed} == {0, 1, 2}


def test_refused_admission_changes_nothing():
    rng = random.Random(6)
    cache = make(FULL, MAMBA, block_size=16, num_blocks=10)
    assert cache.admit("big", tokens(rng, 200)) is None
    assert cache.pool.num_free == 10 and cache.stats().rejected == 1
    cache.check_invariants()


def test_a_commit_past_the_checkpoints_passes_each():
    rng = random.Random(7)
    cache = make(FULL, MAMBA, block_size=16)
    prompt = tokens(rng, 100)
    adm = cache.admit(0, prompt)
    assert adm.checkpoints == (96,)
    cache.commit(0, 100)  # a replay that ignores checkpoints
    cache.release(0)
    assert run(cache, 1, prompt).num_cached_tokens == 96


@pytest.mark.parametrize(
    ("groups", "options", "key"),
    [
        ((swa(64),), {}, "layout"),
        ((FULL, MAMBA), {"state_interval": 10}, "options.state_interval"),
    ],
)
def test_bad_hybrid_configs_name_the_key(groups, options, key):
    with pytest.raises(ConfigError) as err:
        make(*groups, **options)
    assert err.value.path.endswith(key)


def test_hybrid_options_need_a_hybrid_layout():
    with pytest.raises(ConfigError, match="options.retention"):
        make(FULL, retention="dense")


def test_radix_and_plugins_refuse_a_hybrid_layout_they_do_not_support():
    from prefixcache.backends.hash import HashCache

    class Mine(HashCache):
        pass

    with pytest.raises(ConfigError, match="layout"):
        Mine(prefixcache.BlockPool(64), CacheConfig(num_blocks=64, layout=(FULL, MAMBA)))


def test_radix_refuses_a_hybrid_layout_it_does_not_build_naming_the_key():
    # radix keeps one SWA component (SGLang's one sliding_window_size): two windows are refused.
    with pytest.raises(ConfigError, match="layout"):
        prefixcache.build_cache(CacheConfig(backend="radix", num_blocks=64, layout=(FULL, swa(32), swa(64))))


@given(st.lists(st.sampled_from([NULL_BLOCK, NULL_BLOCK, 0, 1, 2, 7]), max_size=12), st.booleans())
def test_live_blocks_are_the_rows_entries_but_null_blocks_in_order(row, as_tuple):
    from prefixcache.backends.hybrid_groups import live_blocks

    given_row = tuple(row) if as_tuple else row
    assert list(live_blocks(given_row)) == [b for b in row if b != NULL_BLOCK]
    assert given_row == (tuple(row) if as_tuple else row)  # read, never changed


def chunked(chunk: int) -> LayerGroup:
    return LayerGroup("chunked_local_attention", chunk=chunk)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.one_of(st.integers(2, 40).map(swa), st.sampled_from([8, 12, 20]).map(chunked), st.just(MAMBA)),
             min_size=1, max_size=2),
    st.booleans(),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_the_native_hit_is_the_python_reconciliation(extra, second_full, block_size, dense, seed):
    """On pools filled by random traffic with shared prefixes (evicting, some requests
    left running), the native finder's hit, junction and per-group rows equal
    `_reconcile`'s, the Python definition, for prompts and limits of every length."""
    rng = random.Random(seed)
    options = {"retention": "dense"} if dense else {}
    groups = (FULL, *extra, FULL) if second_full else (FULL, *extra)
    cache = make(*groups, block_size=block_size, num_blocks=rng.randrange(24, 90), **options)
    assert cache.hit_finder is not None
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    live = []
    for i in range(30):
        prompt = rng.choice(stems)[: rng.randrange(1, 41)] + [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        adm = cache.admit(i, prompt)
        if adm is not None:
            for c in adm.checkpoints:
                cache.commit(i, c)
                if cache.append(i, []) is None:  # no room for the next chunk: give up on it
                    break
            else:
                cache.commit(i, len(prompt))
            live.append(i)
        if live and (len(live) > 3 or rng.random() < 0.6):
            cache.release(live.pop(rng.randrange(len(live))))
        query = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 20))]
        digests = cache._prompt_digests(query, None)
        for limit in (len(query) - 1, len(query), rng.randrange(0, len(query) + 1)):
            length, junction, rows = cache.hit_finder.find(cache.pool, digests, limit)
            want = cache._reconcile(digests, limit)
            assert (length, junction, rows) == (want.length, want.junction, want.blocks)
    for rid in live:
        cache.release(rid)
    cache.check_invariants()


class _PythonAdmission(HybridHashCache):
    """The Python definition of a new request's room check, pins and allocation: a class
    that replaces `_needed` is not admitted natively."""

    def _needed(self, request, num_tokens, hit_blocks, hit):
        return super()._needed(request, num_tokens, hit_blocks, hit)


def _pool_state(cache) -> tuple:
    pool = cache.pool
    return pool.num_free, [(pool.ref_count(b), pool.key(b)) for b in range(pool.num_blocks)]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.one_of(st.integers(2, 40).map(swa), st.sampled_from([8, 12, 20]).map(chunked), st.just(MAMBA)),
             min_size=1, max_size=2),
    st.sampled_from([1, 2, 4]),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_the_native_admission_is_the_python_definition(extra, block_size, dense, seed):
    """Random traffic (shared prefixes, refusals, chunked prefills, decodes, evictions)
    through a cache admitting natively and one running `_needed`, `add_hit` and
    `_allocate`: the same admissions, the same block tables, the same pool (every
    block's references and key, the free count) and the same events, after every step."""
    rng = random.Random(seed)
    config = CacheConfig(block_size=block_size, num_blocks=rng.randrange(16, 80), layout=(FULL, *extra),
                         enable_events=True, options={"retention": "dense"} if dense else {})  # fmt: skip
    native = prefixcache.build_cache(config)
    python = _PythonAdmission(prefixcache.BlockPool(config.num_blocks), config)
    assert native.admitter is not None and python.admitter is None
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    live = []
    for i in range(30):
        prompt = rng.choice(stems)[: rng.randrange(1, 41)] + [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
        got = [cache.admit(i, prompt) for cache in (native, python)]
        assert got[0] == got[1]
        assert got[0] is None or [native.block_tables(i)] == [python.block_tables(i)]
        if got[0] is not None:
            live.append(i)
            for cache in (native, python):
                for c in got[0].checkpoints:
                    cache.commit(i, c)
                    if cache.append(i, []) is None:
                        break
                else:
                    cache.commit(i, len(prompt))
                    cache.append(i, [rng.randrange(5) for _ in range(block_size)])
        if live and (len(live) > 3 or rng.random() < 0.5):
            rid = live.pop(rng.randrange(len(live)))
            for cache in (native, python):
                cache.release(rid)
        assert _pool_state(native) == _pool_state(python)
        assert native.drain_events() == python.drain_events()
    for rid in live:
        for cache in (native, python):
            cache.release(rid)
    native.check_invariants()
    python.check_invariants()


class _EveryStep(HybridHashCache):
    """Every decode step through the groups' calls: a class that replaces
    `_remove_skipped` skips none (`quiet_until` is this class's rule, not its own)."""

    def _remove_skipped(self, request, num_computed):
        super()._remove_skipped(request, num_computed)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.one_of(st.integers(2, 40).map(swa), st.sampled_from([8, 12, 20]).map(chunked), st.just(MAMBA)),
             min_size=1, max_size=2),
    st.sampled_from([1, 2, 4, 16]),
    st.booleans(),
    st.booleans(),
    st.integers(0, 2**32 - 1),
)
def test_a_quiet_decode_step_is_every_groups_step(extra, block_size, dense, no_tail_cliff, seed):
    """Requests decoding token by token (1-3 tokens a step, each committed), admitted,
    refused and released at random in a small pool: a cache that skips the steps where
    no group frees or allocates (`quiet_until`) and one that runs every group's calls
    agree on every step's answer, the tables, the pool and the events."""
    rng = random.Random(seed)
    options = {"retention": "dense"} if dense else {}
    if no_tail_cliff:
        options["no_tail_cliff"] = True
    config = CacheConfig(block_size=block_size, num_blocks=rng.randrange(24, 90), layout=(FULL, *extra),
                         enable_events=True, options=options)  # fmt: skip
    quiet = prefixcache.build_cache(config)
    every = _EveryStep(prefixcache.BlockPool(config.num_blocks), config)
    assert quiet._quiet_steps and not every._quiet_steps
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    live: dict[int, int] = {}  # request -> tokens committed
    for step in range(120):
        if not live or (len(live) < 4 and rng.random() < 0.15):
            prompt = rng.choice(stems)[: rng.randrange(1, 41)] + [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            got = [cache.admit(step, prompt) for cache in (quiet, every)]
            assert got[0] == got[1]
            if got[0] is not None:
                stuck = False
                for c in got[0].checkpoints:
                    chunk = [cache.commit(step, c) or cache.append(step, []) for cache in (quiet, every)]
                    assert chunk[0] == chunk[1]
                    if chunk[0] is None:  # no room for the next chunk: give the request up
                        stuck = True
                        break
                for cache in (quiet, every):
                    cache.release(step) if stuck else cache.commit(step, len(prompt))
                if not stuck:
                    live[step] = len(prompt)
        elif rng.random() < 0.1:
            rid = rng.choice(sorted(live))
            del live[rid]
            for cache in (quiet, every):
                cache.release(rid)
        else:
            rid = rng.choice(sorted(live))
            new = [rng.randrange(5) for _ in range(rng.choice((1, 1, 1, 2, 3)))]
            got = [cache.append(rid, new) for cache in (quiet, every)]
            assert got[0] == got[1]
            if got[0] is not None:
                live[rid] += len(new)
                for cache in (quiet, every):
                    cache.commit(rid, live[rid])
        assert [quiet.block_tables(r) for r in sorted(live)] == [every.block_tables(r) for r in sorted(live)]
        assert _pool_state(quiet) == _pool_state(every)
        assert quiet.drain_events() == every.drain_events()
    for rid in live:
        for cache in (quiet, every):
            cache.release(rid)
    assert _pool_state(quiet) == _pool_state(every)
    quiet.check_invariants()
    every.check_invariants()


@pytest.mark.parametrize("extra", [swa(64), MAMBA, chunked(32)], ids=["swa", "mamba", "chunked"])
def test_a_decode_step_calls_the_groups_only_where_one_frees_or_allocates(extra):
    """Decoding 64 tokens at block 16: the groups are called at the steps that cross a
    block or where one frees (the window's edge, the state's block), not at the others."""
    cache = make(FULL, extra, block_size=16)
    calls = []
    for m in cache.managers:  # counted on the instances: their kinds stay built-in
        m.remove_skipped = lambda *args, _f=m.remove_skipped: calls.append(1) or _f(*args)
    run(cache, "r", tokens(random.Random(3), 100))
    done = 100
    for t in range(64):
        assert cache.append("r", [t]) is not None
        done += 1
        cache.commit("r", done)
    steps = len(calls) // len(cache.managers)
    # 4 blocks crossed, each at most 4 steps (the crossing, the step after it, a window's
    # or a chunk's edge): 13, 10 and 9 of the 64 here, where every step called them before.
    assert 4 <= steps <= 16, steps
    cache.release("r")
    cache.check_invariants()


def test_a_subclass_that_replaces_the_managers_or_the_look_up_order_answers_in_python():
    cache = make(FULL, swa(32), block_size=4)
    finder = cache.hit_finder
    assert finder is not None and cache.hit_finder is finder  # built once
    cache._spec_groups = cache._spec_groups[:1]
    assert cache.hit_finder is not finder  # rebuilt for the new order
    cache.managers = (cache.managers[0], _PythonWindow(cache.managers[1].group, 1, cache.pool, 4))
    assert cache.hit_finder is None


class _PythonWindow(SlidingWindowGroup):
    """A window manager of a plugin's own: the native finder does not know its find_hit."""


def test_the_native_finder_refuses_bad_arguments_by_name():
    from prefixcache._C import BlockPool, HybridHitFinder

    suffix = (1).to_bytes(4, "big")
    with pytest.raises(ValueError, match="kind must be 0-3, got 7"):
        HybridHitFinder([(0, 0, 0, b""), (7, 0, 0, suffix)], [[0], [1]], True, 16, 32)
    with pytest.raises(TypeError, match=r"each group is \(kind, window_blocks, chunk, suffix\)"):
        HybridHitFinder([[0, 0, 0, b""]], [[0]], True, 16, 32)
    with pytest.raises(TypeError, match="suffix must be bytes"):
        HybridHitFinder([(0, 0, 0, "")], [[0]], True, 16, 32)
    with pytest.raises(ValueError, match="spec group names group 2 of 2"):
        HybridHitFinder([(0, 0, 0, b""), (1, 2, 0, suffix)], [[0], [2]], True, 16, 32)
    with pytest.raises(ValueError, match="a chunked group needs chunk >= 1"):
        HybridHitFinder([(0, 0, 0, b""), (2, 0, 0, suffix)], [[0], [1]], True, 16, 32)
    finder = HybridHitFinder([(0, 0, 0, b""), (1, 2, 0, suffix)], [[0], [1]], True, 16, 32)
    pool = BlockPool(8)
    with pytest.raises(ValueError, match="33 digest bytes are not whole digests of 32"):
        finder.find(pool, b"x" * 33, 64)
    with pytest.raises(TypeError, match="digests must be bytes or bytearray"):
        finder.find(pool, "x" * 32, 64)
    assert finder.find(pool, bytearray(64), -5) == (0, 0, [[], []])  # nothing cached, no length
    assert finder.find(pool, b"", 2**70) == (0, 0, [[], []])


def test_a_finds_rows_read_as_lists_and_go_back_to_the_admitter_unconverted():
    """The finder's rows stay native (`HitRows`): a read is a list, and the admitter
    takes them as they are, or as lists, to the same admission."""
    rng = random.Random(5)
    prompt = tokens(rng, 100)
    caches = [make(FULL, swa(32), MAMBA), make(FULL, swa(32), MAMBA)]
    for cache in caches:
        run(cache, "a", prompt)
        cache.release("a")
    query = prompt + tokens(rng, 30)  # the state the prompt's prefill ended on: 96 tokens
    digests = caches[0]._prompt_digests(query, None)
    length, junction, rows = caches[0].hit_finder.find(caches[0].pool, digests, len(query) - 1)
    want = caches[0]._reconcile(digests, len(query) - 1)
    assert (length, junction) == (want.length, want.junction) == (96, 0)
    assert type(rows).__name__ == "HitRows" and len(rows) == 3
    assert rows == want.blocks and rows.tolist() == want.blocks and list(rows) == want.blocks
    assert rows[-1] == rows[2] == want.blocks[2] and rows[2][-1] != NULL_BLOCK
    assert rows != [[1], [2], [3]] and rows != "abc" and repr(rows).startswith("HitRows([[")
    with pytest.raises(IndexError, match="HitRows index out of range"):
        rows[3]
    with pytest.raises(TypeError):
        hash(rows)
    ends = caches[0]._chunk_ends(length, len(query), junction)
    got = [
        cache.admitter.admit(cache.pool, found, length, len(query), ends[0], cache.pool.num_free)
        for cache, found in zip(caches, (rows, rows.tolist()))
    ]
    assert got[0] == got[1] and got[0] is not None
    assert [caches[0].pool.ref_count(b) for b in range(caches[0].pool.num_blocks)] == [
        caches[1].pool.ref_count(b) for b in range(caches[1].pool.num_blocks)
    ]


def test_the_native_admitter_refuses_bad_arguments_by_name():
    from prefixcache._C import BlockPool, HybridAdmitter

    with pytest.raises(ValueError, match="kind must be 0-3, got 9"):
        HybridAdmitter([(0, 0, 0), (9, 0, 0)], 16)
    with pytest.raises(TypeError, match=r"each group is \(kind, window, chunk\)"):
        HybridAdmitter([(0, 0, 0, b"")], 16)
    with pytest.raises(ValueError, match="a sliding window window >= 1"):
        HybridAdmitter([(0, 0, 0), (1, 0, 0)], 16)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        HybridAdmitter([(0, 0, 0)], 0)
    admitter = HybridAdmitter([(0, 0, 0), (1, 64, 0)], 16)
    pool = BlockPool(8)
    with pytest.raises(ValueError, match="1 rows for 2 groups"):
        admitter.admit(pool, [[]], 0, 32, 32, 8)
    with pytest.raises(ValueError, match="block id -2 is neither -1 nor a block"):
        admitter.admit(pool, [[-2], [-1]], 16, 32, 32, 8)
    with pytest.raises(ValueError, match="0 <= first_end <= num_tokens"):
        admitter.admit(pool, [[], []], 0, 32, 48, 8)
    with pytest.raises(IndexError, match="block id 99 is out of range"):  # the pool checks its ids
        admitter.admit(pool, [[99], [99]], 16, 32, 32, 8)
    assert admitter.admit(pool, [[], []], 0, 32, 32, 3) is None  # 2 blocks a group: no room in 3
    assert pool.num_free == 8  # a refusal changes nothing
    tables, cached, last_state, took = admitter.admit(pool, [[], []], 0, 32, 32, 8)
    assert [len(t) for t in tables] == [2, 2] and cached == [None, None] and last_state == [None, None] and took
    assert pool.num_free == 4


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "+".join(g.kind for g in layout))
def test_ids_beyond_int32_and_int64_are_stored_or_refused_by_name(layout):
    """The kit's check on every hybrid layout (`hash` stores them, as CBOR bignums;
    `radix` refuses them, storing int32 ids): never another error."""
    from prefixcache.testing import big_ids_are_stored_or_refused

    big_ids_are_stored_or_refused(
        lambda bs, n: prefixcache.build_cache(CacheConfig(backend="hash", block_size=bs, num_blocks=n, layout=layout)), 4
    )
