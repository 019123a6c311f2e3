"""The engine on a hybrid model: cached and uncached runs agree exactly.

A handful of randomized traces here (benchmarks/hybrid_soak.py runs 1,000): the tiny
hybrid model (full, sliding-window, chunked-local and recurrent layers) on the `hash`
strategy with the layout the model declares, a pool small enough to evict; greedy
tokens identical, first-token logits within 1e-4, the recurrent state bit for bit.
"""

from __future__ import annotations

import random

import pytest

from prefixcache.config import CacheConfig
from prefixcache.engine.exactness import compare_trace, engines_for, random_trace, tiny_hybrid
from prefixcache.errors import ConfigError
from prefixcache.layout import LayerGroup


@pytest.fixture(scope="module")
def model():
    return tiny_hybrid(seed=0)


def test_engine_takes_the_models_layout(model):
    cached, _ = engines_for(model, CacheConfig(block_size=16, num_blocks=64))
    assert cached.config.cache.layout == model.layout
    assert [g.kind for g in model.layout] == ["full_attention", "sliding_window", "chunked_local_attention", "mamba"]


def test_engine_refuses_a_layout_the_model_does_not_have(model):
    with pytest.raises(ConfigError, match="cache.layout"):
        engines_for(model, CacheConfig(block_size=16, num_blocks=64, layout=(LayerGroup("full_attention"), LayerGroup("mamba"))))


def test_cached_and_uncached_runs_agree_while_the_pool_evicts(model):
    cached, uncached = engines_for(model, CacheConfig(block_size=16, num_blocks=40))
    hits = evictions = 0
    for seed in (3, 6, 8):
        r = compare_trace(cached, uncached, random_trace(random.Random(seed), model.weights.config.vocab_size, max_prompt=120))
        assert r.difference is None, r.difference
        hits += r.hit_tokens
        evictions += r.evictions
    assert hits > 0 and evictions > 0
