"""Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs`, the way evaluation
harnesses score a text): each prompt token's raw logprob given the tokens before it, from
a prefill that reads nothing from the cache (`admit(read_cache=False)`), through the
engine and the server."""

from __future__ import annotations

import json

import pytest
import torch

from prefixcache.engine.engine import Engine, GenerationRequest
from prefixcache.engine.loader import load_model
from prefixcache.engine.scheduler import Scheduled, Sequence
from prefixcache.errors import ConfigError
from serve_cases import running, serve_config

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

PROMPT = list(b"The quick brown fox jumps over the lazy dog. " * 2)  # 90 byte tokens


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def reference(engine: Engine, prompt: list[int], position: int) -> torch.Tensor:
    """The raw logprobs of the token at `position` given the ones before it: the first
    draw of a request whose prompt stops there (its logits, kept)."""
    out = engine.generate([GenerationRequest(prompt=prompt[:position], max_tokens=1, keep_first_logits=True)])[0]
    return torch.log_softmax(out.first_logits.float(), dim=-1)


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_prompt_logprobs_are_the_models_and_read_nothing_from_the_cache(tiny, backend):
    engine = Engine(serve_config(backend, max_num_batched_tokens=32).serving, model=tiny)  # chunked: 90 = 32 + 32 + 26
    first = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=4)])[0]
    queries = engine.cache.stats().queries
    out = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=4, prompt_logprobs=3)])[0]
    assert out.metrics.cached_tokens == 0 and out.metrics.computed_prompt_tokens == len(PROMPT)  # cached, not read
    assert engine.cache.stats().queries == queries  # vLLM counts no query for it
    assert out.token_ids == first.token_ids  # the same output, computed from scratch
    assert len(out.prompt_logprobs) == len(PROMPT) and out.prompt_logprobs[0] is None
    assert [p.token_id for p in out.prompt_logprobs[1:]] == PROMPT[1:]
    for position in (1, 31, 32, 33, 64, 89):  # chunk ends and starts among them
        want = reference(engine, PROMPT, position)
        got = out.prompt_logprobs[position]
        assert got.logprob == pytest.approx(float(want[PROMPT[position]]), abs=1e-4)
        assert got.rank == int((want >= want[PROMPT[position]]).sum())
        top = torch.topk(want, 3)
        assert [t for t, _ in got.top] == top.indices.tolist()
    # What it computed is cached as any request's: the prompt hits afterwards.
    again = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=1)])[0]
    assert again.metrics.cached_tokens >= len(PROMPT) - 4
    engine.check_invariants()


def test_a_recompute_asks_only_for_the_positions_still_missing():
    seq = Sequence("r", list(range(10)), None, None, 4, frozenset(), None, None, num_prompt_logprobs=0,
                   prompt_logprobs=[None])
    seq.tokens = list(range(12))  # 2 output tokens: a preempted request's recompute covers them too
    assert Engine._prompt_rows(Scheduled(seq, 0, 6, prefill=True)) == range(0, 6)  # positions 1..6
    seq.prompt_logprobs += [None] * 6  # positions 0..6 done
    assert Engine._prompt_rows(Scheduled(seq, 0, 6, prefill=True)) == range(0)
    assert Engine._prompt_rows(Scheduled(seq, 0, 12, prefill=True)) == range(6, 9)  # positions 7..9, not the output's
    assert Engine._prompt_rows(Scheduled(seq, 9, 3, prefill=True)) == range(0)


def test_requests_the_engine_cannot_serve_are_refused_by_name(tiny):
    engine = Engine(serve_config("hash").serving, model=tiny)
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer"):
        engine.add_request(GenerationRequest(prompt=PROMPT, prompt_logprobs=-1))

    class Plain(type(engine.cache)):
        def admit(self, request_id, tokens, *, namespace=None, priority=0):  # no read_cache
            return super().admit(request_id, tokens, namespace=namespace, priority=priority)

    engine.cache.__class__ = Plain
    with pytest.raises(ConfigError, match="^prompt_logprobs: .*cannot admit a request without reading"):
        engine.add_request(GenerationRequest(prompt=PROMPT, prompt_logprobs=1))
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def replica(tiny):
    with running(tiny, "radix") as r:
        yield r


def test_echo_with_logprobs_scores_a_text_as_evaluation_harnesses_ask(replica):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 0, from
    the official client."""
    c = openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    text = bytes(PROMPT).decode()
    scored = c.completions.create(model="tiny", prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = scored.choices[0]
    assert choice.text == text  # the prompt alone: nothing drawn is shown
    lp = choice.logprobs
    assert lp.tokens == list(text) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == list(range(len(text)))
    assert all(len(top) <= 2 and lp.tokens[i] in top for i, top in enumerate(lp.top_logprobs) if top is not None)
    assert scored.usage.prompt_tokens == len(PROMPT) and scored.usage.completion_tokens == 1  # vLLM's: one drawn
    # The same numbers as the prompt_logprobs field, and as a prefix cache hit would never give.
    body = httpx.post(replica.base_url + "/v1/completions", timeout=30,
                      json={"prompt": text, "max_tokens": 2, "prompt_logprobs": 1}).json()
    fields = body["choices"][0]["prompt_logprobs"]
    assert fields[0] is None and len(fields) == len(PROMPT)
    assert [e[str(t)]["logprob"] for e, t in zip(fields[1:], PROMPT[1:])] == pytest.approx(lp.token_logprobs[1:])
    assert all(list(e)[0] == str(t) and e[str(t)]["decoded_token"] == chr(t) for e, t in zip(fields[1:], PROMPT[1:]))
    # Echo with an output: the prompt then what was drawn, logprobs of both.
    both = httpx.post(replica.base_url + "/v1/completions", timeout=30,
                      json={"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 0, "ignore_eos": True}).json()
    out = httpx.post(replica.base_url + "/v1/completions", timeout=30,
                     json={"prompt": text, "max_tokens": 3, "ignore_eos": True}).json()["choices"][0]["text"]
    assert both["choices"][0]["text"] == text + out
    logprobs = both["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 3 and logprobs["token_logprobs"][0] is None
    # vLLM's choice carries the prompt logprobs the echo asked for, as the field would.
    assert both["choices"][0]["prompt_logprobs"][1] == {str(PROMPT[1]): fields[1][str(PROMPT[1])]}


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_a_streamed_echo_is_the_whole_response_in_chunks(replica, max_tokens):
    """vLLM streams echo: a choice's first chunk starts with its prompt (and the prompt's
    logprobs); the chunks add up to the response sent whole, n choices each echoed."""
    url = replica.base_url + "/v1/completions"
    text = bytes(PROMPT).decode()
    body = {"prompt": text, "max_tokens": max_tokens, "echo": True, "logprobs": 2, "ignore_eos": True, "n": 2,
            "temperature": 1.0, "seed": 7}
    whole = httpx.post(url, json=body, timeout=30).json()
    events = [e for e in sse_events(httpx.post(url, json={**body, "stream": True}, timeout=30)) if e != "[DONE]"]
    for i in range(2):
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == i]
        assert chunks[0]["text"].startswith(text)
        want = whole["choices"][i]
        assert "".join(c["text"] for c in chunks) == want["text"]
        got = {key: [x for c in chunks if c["logprobs"] for x in c["logprobs"][key]] for key in want["logprobs"]}
        assert got["tokens"] == want["logprobs"]["tokens"] and got["text_offset"] == want["logprobs"]["text_offset"]
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert got["token_logprobs"][1:] == pytest.approx(want["logprobs"]["token_logprobs"][1:])
        assert len(got["tokens"]) == len(PROMPT) + max_tokens


def sse_events(response) -> list:
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])
            for line in response.text.splitlines() if line.startswith("data: ")]


def test_a_chat_returns_its_prompts_logprobs_beside_its_choices(replica):
    body = httpx.post(replica.base_url + "/v1/chat/completions", timeout=30,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                            "prompt_logprobs": 0}).json()
    fields = body["prompt_logprobs"]
    assert fields[0] is None and len(fields) == body["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in fields[1:])  # the prompt token's own, and no top ones
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


@pytest.mark.parametrize("body, param, message", [
    ({"prompt_logprobs": 21}, "prompt_logprobs", "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "Requested prompt logprobs of 320"),
    ({"prompt_logprobs": -2}, "prompt_logprobs", "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."),
    ({"echo": True, "logprobs": 21}, "logprobs", "Requested sample logprobs of 21"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
])
def test_what_vllm_refuses_is_refused_with_its_message(replica, body, param, message):
    r = httpx.post(replica.base_url + "/v1/completions", json={"prompt": "hello", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert r.json()["error"]["message"].startswith(message)


def test_a_chat_echo_repeats_the_assistants_last_message_as_vllm_does(replica):
    url = replica.base_url + "/v1/chat/completions"
    ask = [{"role": "user", "content": "hi"}]
    started = [*ask, {"role": "assistant", "content": "Sure, "}]
    body = {"max_tokens": 3, "ignore_eos": True, "echo": True}
    plain = httpx.post(url, json={**body, "messages": started, "echo": False}, timeout=30).json()
    echoed = httpx.post(url, json={**body, "messages": started}, timeout=30).json()
    assert echoed["choices"][0]["message"]["content"] == "Sure, " + plain["choices"][0]["message"]["content"]
    # With logprobs, a chat's shape: the drawn tokens' (a completion's echo would add the prompt's).
    scored = httpx.post(url, json={**body, "messages": started, "logprobs": True}, timeout=30).json()["choices"][0]
    assert len(scored["logprobs"]["content"]) == 3
    # The last message is the user's: nothing to repeat.
    alone = httpx.post(url, json={**body, "messages": ask}, timeout=30).json()
    assert alone["choices"][0]["message"]["content"] == httpx.post(
        url, json={**body, "messages": ask, "echo": False}, timeout=30).json()["choices"][0]["message"]["content"]
    # Streamed: a chunk of its own after the role chunk, then the output.
    lines = httpx.post(url, json={**body, "messages": started, "stream": True}, timeout=30).text.splitlines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert chunks[1]["choices"][0]["delta"] == {"content": "Sure, "}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        echoed["choices"][0]["message"]["content"]
