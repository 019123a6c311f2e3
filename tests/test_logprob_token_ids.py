"""Logprobs of named tokens (vLLM's `logprob_token_ids`: a scoring client asks for the
logprobs of its label tokens at each drawn position, whether or not they are among the most
likely): the engine's values against the whole distribution, and the server's fields,
checks and streaming as vLLM 0.33 serves them."""

from __future__ import annotations

import json
import re

import pytest

from prefixcache.engine.engine import Engine, GenerationRequest
from prefixcache.engine.loader import load_model
from prefixcache.engine.logprobs import MAX_LOGPROB_TOKEN_IDS
from prefixcache.engine.sampling import SamplingParams
from serve_cases import running, serve_config

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

PROMPT = list(b"Colour of the sky: ")
LABELS = (ord("b"), ord("g"), 7, ord("r"))  # 7: a control byte no model of text ranks high


@pytest.fixture(scope="module")
def engine():
    return Engine(serve_config("radix").serving, model=load_model("tiny"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_named_logprobs_are_the_distributions_at_each_drawn_position(engine, temperature):
    """Each drawn position returns the drawn token's logprob and rank and every named id's
    raw logprob, in the request's order: the same numbers the whole distribution holds."""
    sampling = SamplingParams(temperature=temperature, seed=3)
    vocab = engine.model.config.vocab_size
    whole, named = engine.generate([
        GenerationRequest(prompt=PROMPT, max_tokens=6, sampling=sampling, logprobs=vocab),
        GenerationRequest(prompt=PROMPT, max_tokens=6, sampling=sampling, logprob_token_ids=LABELS),
    ])  # fmt: skip
    assert whole.token_ids == named.token_ids and len(named.logprobs) == 6
    for full, got in zip(whole.logprobs, named.logprobs):
        assert (got.token_id, got.rank) == (full.token_id, full.rank)
        assert got.logprob == pytest.approx(full.logprob, abs=1e-6)
        everything = dict(full.top)
        assert [t for t, _ in got.top] == list(LABELS)
        assert [v for _, v in got.top] == pytest.approx([everything[t] for t in LABELS], abs=1e-6)
    engine.check_invariants()


@pytest.mark.parametrize("named, logprobs, message", [
    ((), None, "1 to 128 token ids"),
    (tuple(range(MAX_LOGPROB_TOKEN_IDS + 1)), None, "1 to 128 token ids"),
    ((1, 10**6), None, "1 to 128 token ids"),
    ((1, -1), None, "1 to 128 token ids"),
    ((1, True), None, "1 to 128 token ids"),
    ((1, 2), 3, "len\\(logprob_token_ids\\) = 2"),
])
def test_the_engine_refuses_bad_named_ids_before_anything_runs(engine, named, logprobs, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(GenerationRequest(prompt=PROMPT, logprob_token_ids=named, logprobs=logprobs))
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def replica():
    with running(load_model("tiny"), "hash") as r:
        yield r


def test_the_official_client_reads_the_drawn_token_then_every_named_one(replica):
    c = openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Sky?"}], max_tokens=4,
                                     temperature=0, logprobs=True, top_logprobs=1,
                                     extra_body={"logprob_token_ids": list(LABELS)})
    for entry in chat.choices[0].logprobs.content:
        tops = [t.token for t in entry.top_logprobs]
        # vLLM's order: the drawn token first, then each named one not already shown.
        want = [entry.token] + [chr(t) for t in LABELS if chr(t) != entry.token]
        assert tops == want and entry.top_logprobs[0].logprob == entry.logprob
    done = c.completions.create(model="tiny", prompt="Sky:", max_tokens=4, temperature=0, logprobs=0,
                                extra_body={"logprob_token_ids": list(LABELS)})
    lp = done.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert set(top) == {token, *map(chr, LABELS)} and top[token] == value


def test_a_streamed_answer_carries_the_same_named_logprobs(replica):
    url = replica.base_url + "/v1/completions"
    body = {"prompt": "Sky:", "max_tokens": 5, "temperature": 0, "logprobs": 2, "logprob_token_ids": list(LABELS)}
    whole = httpx.post(url, json=body, timeout=30).json()["choices"][0]["logprobs"]
    streamed = httpx.post(url, json={**body, "stream": True}, timeout=30).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    tops = [d for c in chunks if c["choices"][0]["logprobs"] for d in c["choices"][0]["logprobs"]["top_logprobs"]]
    assert tops == whole["top_logprobs"] and len(tops) == 5


@pytest.mark.parametrize("path, extra, message", [
    ("/v1/chat/completions", {"logprob_token_ids": []}, "must not be an empty list"),
    ("/v1/chat/completions", {"logprob_token_ids": [1]}, "`logprobs` must be set to true"),
    ("/v1/completions", {"logprob_token_ids": [1]}, "`logprobs` must be set"),
    ("/v1/completions", {"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0},
     "no output tokens are generated"),
    ("/v1/completions", {"logprob_token_ids": list(range(129)), "logprobs": 1}, "greater than max allowed: 128"),
    ("/v1/completions", {"logprob_token_ids": [1, 10**6], "logprobs": 1}, r"token_id\(s\) \[1000000\]"),
])
def test_bad_named_ids_get_vllms_400(replica, path, extra, message):
    body = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    r = httpx.post(replica.base_url + path, json={**body, "max_tokens": 2, **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids", r.json()
    assert re.search(message, r.json()["error"]["message"])
