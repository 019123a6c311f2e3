"""vLLM's `bad_words` (`prefixcache.engine.sampling`): each word's token sequences (bare,
and after a space where that tokenizes as another word of the same length), and each
step the last token of every sequence whose rest the output ends with is banned; against
a naive model, through the engine and the server."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.engine import Engine, GenerationRequest
from prefixcache.engine.loader import load_model
from prefixcache.engine.sampling import SamplingParams, bad_word_tokens, processed_logits
from prefixcache.engine.tokenizer import ByteTokenizer
from prefixcache.errors import ConfigError
from serve_cases import serve_config

VOCAB = 6
ids = st.integers(0, VOCAB - 1)


def naive_banned(words: list[list[int]], output: list[int]) -> set[int]:
    """The tokens that would complete a word now: its last one, where the output ends
    with all the others."""
    return {w[-1] for w in words if len(w) <= len(output) + 1 and (len(w) == 1 or output[-(len(w) - 1):] == w[:-1])}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(ids, min_size=1, max_size=4), min_size=1, max_size=4), st.lists(ids, max_size=8))
def test_the_banned_tokens_are_the_ones_that_would_complete_a_word(words, output):
    out = processed_logits(torch.zeros(1, VOCAB), [SamplingParams()], [[0]], [output], [()], [words])
    assert {t for t in range(VOCAB) if out[0, t] == float("-inf")} == naive_banned(words, output)
    assert processed_logits(torch.zeros(1, VOCAB), [SamplingParams()], [[0]], [output], [()], [()]).eq(0).all()


def test_words_are_tokenized_as_vllm_tokenizes_them():
    tok = ByteTokenizer(300)

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    # Byte tokens: " ab" is one token longer than "ab", so only the bare word is banned.
    assert bad_word_tokens(["  ab"], enc) == ((97, 98),)
    # A tokenizer whose " x" is one other token: both forms (vLLM adds the spaced one).
    vocab = {"x": [5], " x": [9], "yz": [6, 7], " yz": [8, 7]}
    assert bad_word_tokens(["x", "yz"], vocab.__getitem__) == ((5,), (9,), (6, 7), (8, 7))
    for bad in ("", "   ", None):
        with pytest.raises(ConfigError, match="^bad_words: each bad word must be a non-blank str"):
            bad_word_tokens([bad], enc)  # type: ignore[list-item]


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_the_engine_never_ends_the_output_with_a_bad_word(backend):
    engine = Engine(serve_config(backend).serving, model=load_model("tiny"))
    prompt = list(b"The quick brown fox jumps over the lazy dog. ")
    free = engine.generate([GenerationRequest(prompt=prompt, max_tokens=40, ignore_eos=True)])[0].text
    words = (free[3:6], free[10:12], free[20])  # what greedy draws, three words of it
    assert all(w in free for w in words)
    banned = engine.generate([GenerationRequest(prompt=prompt, max_tokens=40, ignore_eos=True, bad_words=words)])[0]
    assert len(banned.token_ids) == 40 and not any(w in banned.text for w in words), banned.text
    engine.check_invariants()


def test_the_server_serves_bad_words_and_names_what_it_refuses():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from serve_cases import running

    with running(load_model("tiny"), "hash") as r:
        url = r.base_url + "/v1/completions"
        body = {"prompt": "The quick brown fox", "max_tokens": 20, "ignore_eos": True}
        free = httpx.post(url, json=body, timeout=30).json()["choices"][0]["text"]
        word = free[2:4]
        got = httpx.post(url, json={**body, "bad_words": [word]}, timeout=30).json()["choices"][0]["text"]
        assert word in free and word not in got
        for bad in ([""], [" "], ["x"] * 65, ["x" * 1025]):
            refused = httpx.post(url, json={**body, "bad_words": bad}, timeout=30)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words"
