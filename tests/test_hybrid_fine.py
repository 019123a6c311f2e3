"""`hash` with mamba states finer than the block (`options.state_granule`, backends/hybrid_fine.py).

The option is declared and checked; at block 528 a shared prefix hits to the granule
after its second sighting and a conversation's next turn hits where the last one ended
(vLLM: the block); the kit's hybrid rules hold with copy-on-write hits; the tiny hybrid
model (full attention + recurrent layers) computes the same tokens, logits and states
with and without the cache when it restores states at the granule.
"""

from __future__ import annotations

import random

import pytest

from prefixcache import build_cache
from prefixcache._C import BlockPool
from prefixcache.backends.hash import HashCache
from prefixcache.backends.hybrid_fine import FineStateHashCache
from prefixcache.config import CacheConfig
from prefixcache.engine.exactness import compare_trace, engines_for, random_trace
from prefixcache.engine.hybrid_model import HybridConfig, random_hybrid_weights
from prefixcache.engine.loader import LoadedModel
from prefixcache.engine.tokenizer import ByteTokenizer
from prefixcache.errors import ConfigError
from prefixcache.layout import NULL_BLOCK, LayerGroup
from prefixcache.testing_hybrid import check_hybrid_backend

FULL_MAMBA = (LayerGroup("full_attention"), LayerGroup("mamba"))


def cache_of(block_size=528, num_blocks=400, layout=FULL_MAMBA, **options):
    return build_cache(CacheConfig(block_size=block_size, num_blocks=num_blocks, layout=layout, options=options))


def run(cache, rid, prompt, output=()):
    """Admit, commit at the checkpoints and the prompt's end, decode `output` one token
    a step, release; the hit."""
    adm = cache.admit(rid, prompt)
    for c in adm.checkpoints:
        cache.commit(rid, c)
        assert cache.append(rid, []) is not None
    n = len(prompt)
    cache.commit(rid, n)
    for t in output:
        assert cache.append(rid, [t]) is not None
        n += 1
        cache.commit(rid, n)
    cache.release(rid)
    cache.check_invariants()
    return adm


def test_option_is_declared_and_checked():
    assert 16 in HashCache.option_choices["state_granule"]
    assert isinstance(cache_of(state_granule=16), FineStateHashCache)
    with pytest.raises(ConfigError, match="options.state_granule"):
        cache_of(state_granule=3)  # not among the choices
    with pytest.raises(ConfigError, match="options.state_granule"):
        cache_of(block_size=48, state_granule=32)  # does not divide the block
    with pytest.raises(ConfigError, match="options.state_granule"):
        cache_of(layout=(LayerGroup("full_attention"), LayerGroup("sliding_window", window=64)), state_granule=16)
    with pytest.raises(ConfigError, match="options.state_granule"):
        build_cache(CacheConfig(block_size=16, num_blocks=8, options={"state_granule": 4}))  # one group


def test_shared_prefix_hits_to_the_granule_at_block_528():
    rng = random.Random(0)
    shared = [rng.randrange(50_000) for _ in range(1500)]
    fine, vllm = cache_of(state_granule=16), cache_of()
    hits = {id(fine): [], id(vllm): []}
    for i in range(5):
        prompt = shared + [rng.randrange(50_000) for _ in range(700)]
        for cache in (fine, vllm):
            hits[id(cache)].append(run(cache, i, prompt).num_cached_tokens)
    assert hits[id(vllm)] == [0, 0, 1056, 1056, 1056]
    assert hits[id(fine)] == [0, 0, 1488, 1488, 1488]  # 1,500 floored to the granule


def test_partial_hit_copies_the_head_of_a_cached_block():
    rng = random.Random(1)
    shared = [rng.randrange(50_000) for _ in range(1500)]
    cache = cache_of(state_granule=16)
    for i in range(2):
        run(cache, i, shared + [rng.randrange(50_000) for _ in range(700)])
    adm = cache.admit("x", shared + [7] * 100)
    assert adm.num_cached_tokens == 1488
    ((src, dst, n),) = adm.copies
    assert n == 1488 - 2 * 528 and dst == adm.block_table[2] and cache.pool.ref_count(src) >= 1
    assert adm.group_tables[1][1488 // 16 - 1] != NULL_BLOCK  # the state it starts from
    assert cache.match(shared + [7] * 100).num_tokens == 1488
    cache.check_invariants()
    cache.commit("x", len(shared) + 100)
    cache.release("x")
    assert cache.pool.num_pinned == 0


def test_next_turn_hits_where_the_last_one_ended():
    """A conversation shorter than one 528-token block: vLLM never hits; with the
    option the next turn hits the last turn's prompt and answer, to the granule."""
    rng = random.Random(2)
    fine, vllm = cache_of(state_granule=16), cache_of()
    history = [rng.randrange(50_000) for _ in range(330)]
    got = {id(fine): [], id(vllm): []}
    for turn in range(3):
        answer = [rng.randrange(50_000) for _ in range(30)]
        for cache in (fine, vllm):
            got[id(cache)].append(run(cache, f"t{turn}", history, answer).num_cached_tokens)
        computed = len(history) + len(answer) - 1
        history = history + answer + [rng.randrange(50_000) for _ in range(20)]
        if turn < 2:
            assert computed // 16 * 16 > 0
    assert got[id(vllm)] == [0, 0, 0]
    assert got[id(fine)][0] == 0 and all(h > 0 and h % 16 == 0 for h in got[id(fine)][1:])
    assert got[id(fine)][1] == (330 + 30 - 1) // 16 * 16


@pytest.mark.parametrize("options", [{"state_granule": 2}, {"state_granule": 4, "retention": "dense"},
                                     {"state_granule": 2, "state_interval": 6, "retention": "dense"}])  # fmt: skip
def test_kit_hybrid_rules_hold(options):
    def make(block_size, num_blocks, layout):
        return HashCache(BlockPool(num_blocks), CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                            layout=layout, options=options))  # fmt: skip

    check_hybrid_backend(make, layouts=[FULL_MAMBA, (*FULL_MAMBA, LayerGroup("full_attention"))], seeds=range(4))


def test_engine_restores_states_at_the_granule_exactly():
    """Full attention + recurrent layers, block 16, states every 4 tokens: hits inside
    blocks (each with its copy) and states restored at the granule give the uncached
    run's tokens, logits and states."""
    config = HybridConfig(layers=("full_attention", "mamba", "full_attention"))
    loaded = LoadedModel("tiny-hybrid", random_hybrid_weights(config, 0), ByteTokenizer(config.vocab_size, None),
                         config.layout)  # fmt: skip
    cached, uncached = engines_for(loaded, CacheConfig(block_size=16, num_blocks=48, options={"state_granule": 4}))
    assert cached.model.state_tokens == 4
    copies = []
    copy_blocks = cached.model.copy_blocks
    cached.model.copy_blocks = lambda c: (copies.extend(c), copy_blocks(c))
    hits = 0
    for seed in (1, 5):
        r = compare_trace(cached, uncached, random_trace(random.Random(seed), config.vocab_size, max_prompt=80))
        assert r.difference is None, r.difference
        hits += r.hit_tokens
    assert hits > 0 and copies and all(0 < n < 16 for _, _, n in copies)


def test_replay_victims_drop_the_least_replay_first_never_the_deepest():
    from prefixcache.state_cap import replay_victims

    states = [(64, 1), (128, 2), (144, 3), (400, 4), (416, 5)]
    assert replay_victims(states, 5) == []
    assert replay_victims(states, 4) == [3]  # 144 saves 16 over 128 (416's 16 is the deepest's: kept)
    assert replay_victims(states, 2) == [3, 1, 2]
    assert replay_victims(states, 1) == [3, 1, 2, 4]


@pytest.mark.parametrize("granule", [0, 16])
def test_state_cap_keeps_at_most_cap_states_per_path(granule):
    rng = random.Random(3)
    options = {"retention": "dense", "state_interval": 64, "state_cap": 2}
    if granule:
        options["state_granule"] = granule
    cache = cache_of(block_size=64, num_blocks=200, **options)
    prompt = [rng.randrange(50_000) for _ in range(700)]
    answer = [rng.randrange(50_000) for _ in range(40)]
    run(cache, "a", prompt, answer)
    mark = b"\xfe\x00\x00\x00\x01" if granule else b"\x00\x00\x00\x01"  # a state's key ends so (group 1)
    states = [b for b in range(cache.pool.num_blocks) if (k := cache.pool.key(b)) is not None and k[32:] == mark]
    assert len(states) == 2
    assert cache.stats().evictions >= 9  # the path held a state every 64 tokens
    # What stays is the deepest (where a next turn continues) and one far from it.
    assert run(cache, "b", prompt + answer + [1] * 20).num_cached_tokens == (739 // 16 * 16 if granule else 704)
    assert 0 < run(cache, "c", prompt).num_cached_tokens < 640
