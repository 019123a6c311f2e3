"""`prefixcache serve` over HTTP, driven by the official `openai` client and raw httpx.

A real uvicorn server on 127.0.0.1 (a port the OS picks) serves the tiny generated model.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import re

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("zmq")

from prefixcache.engine.loader import load_model  # noqa: E402
from serve_cases import idle, in_engine, running, wait_until  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # 135 byte tokens on the tiny model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def replicas(tiny):
    """One replica per arm, all on the same weights: hash, radix, no cache."""
    with running(tiny, "hash") as h, running(tiny, "radix") as r, running(tiny, "hash", prefix_caching=False) as n:
        yield {"hash": h, "radix": r, "none": n}


def client(replica) -> openai.OpenAI:
    return openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


def sse_events(response: httpx.Response) -> list:
    """The data lines of a server-sent-event response, JSON-decoded ([DONE] kept as is)."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_and_health(replicas):
    r = replicas["hash"]
    models = client(r).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    body = httpx.get(r.base_url + "/v1/models").json()
    assert body["data"][0]["max_model_len"] == min(4096, 256 * 4)
    assert httpx.get(r.base_url + "/health").status_code == 200


@pytest.mark.parametrize("arm", ["hash", "radix"])
def test_a_shared_prefix_is_served_from_the_cache_and_the_text_does_not_change(replicas, arm):
    cached, plain = client(replicas[arm]), client(replicas["none"])
    first = cached.completions.create(model="tiny", prompt=PROMPT + "one", max_tokens=6)
    second = cached.completions.create(model="tiny", prompt=PROMPT + "two", max_tokens=6)
    baseline = plain.completions.create(model="tiny", prompt=PROMPT + "two", max_tokens=6)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(PROMPT) // 4 * 4
    assert baseline.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].text == baseline.choices[0].text  # greedy: caching never changes output
    assert first.usage.prompt_tokens == len((PROMPT + "one").encode()) and second.usage.completion_tokens == 6
    assert second.object == "text_completion" and second.id.startswith("cmpl-")


def test_token_id_prompts_and_a_stream_that_ends_with_done(replicas):
    r = replicas["radix"]
    ids = list(range(40, 90))
    plain = client(r).completions.create(model="tiny", prompt=ids, max_tokens=5)
    response = httpx.post(r.base_url + "/v1/completions", json={
        "model": "tiny", "prompt": ids, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    *chunks, usage, _ = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # 50 ids, whole blocks of 4, last computed
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain.choices[0].text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert len(chunks) == 5  # one chunk per step, as vLLM streams


def test_chat_with_and_without_streaming(replicas):
    c = client(replicas["hash"])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert 1 <= whole.usage.completion_tokens <= 4 and whole.id.startswith("chatcmpl-")
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=4, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same chat, asked twice
    parts = c.chat.completions.create(model="tiny", max_tokens=4, messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hello there"}]}])
    assert parts.choices[0].message.content == whole.choices[0].message.content


def test_max_tokens_past_the_rest_of_the_context_is_cut_as_vllm_does(replicas):
    r = replicas["hash"]  # max_model_len 1024 (the pool)
    out = client(r).completions.create(model="tiny", prompt=[7] * 1020, max_tokens=50)
    assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"


def _a_stop_string_in(text: str) -> tuple[str, int]:
    """Three characters from the middle of `text` (several tokens on the byte-level tiny
    model) and where they first occur."""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    return stop, text.index(stop)


@pytest.mark.parametrize("arm", ["hash", "radix"])
def test_a_stop_string_ends_the_output_before_it_as_vllm_does(replicas, arm):
    r, plain = replicas[arm], client(replicas["none"])
    free = plain.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop, at = _a_stop_string_in(text)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "stop": ["never seen", stop]}
    out = httpx.post(r.base_url + "/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text[:at], "stop", stop)
    assert 0 < out["usage"]["completion_tokens"] < 40  # the tokens drawn up to the one that completed it
    kept = httpx.post(r.base_url + "/v1/completions", json={**body, "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == text[: at + len(stop)]
    # Streamed: the held-back characters never leak; the deltas add up to the same text.
    for include in (False, True):
        response = httpx.post(r.base_url + "/v1/completions", json={
            **body, "include_stop_str_in_output": include, "stream": True})
        chunks = [e for e in sse_events(response) if e != "[DONE]"]
        streamed = "".join(c["choices"][0]["text"] for c in chunks)
        assert streamed == text[: at + (len(stop) if include else 0)]
        assert (chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]) == ("stop", stop)
    # A chat stops alike (the openai client's own `stop`).
    messages = [{"role": "user", "content": PROMPT}]
    free_chat = plain.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                              extra_body={"ignore_eos": True})
    chat_stop, chat_at = _a_stop_string_in(free_chat.choices[0].message.content)
    chat = client(r).chat.completions.create(model="tiny", messages=messages, max_tokens=40, stop=chat_stop,
                                             extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == free_chat.choices[0].message.content[:chat_at]
    assert chat.choices[0].finish_reason == "stop"
    idle(r)
    in_engine(r, lambda e: e.check_invariants())


@pytest.mark.parametrize("arm", ["hash", "radix"])
def test_logprobs_in_chat_and_completions_streamed_or_not_as_vllm_writes_them(replicas, arm):
    c = client(replicas[arm])
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # greedy: the drawn token leads, and is the most likely (it and the top 2: at most 3 keys)
        assert next(iter(top)) == token and top[token] == value == max(top.values()) and 1 <= len(top) <= 3
    # A stream carries each step's tokens' logprobs, offsets from the text sent before them.
    chunks = [ch for ch in c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, logprobs=2, stream=True)
              if ch.choices]
    streamed = [(ch.choices[0].logprobs.tokens, ch.choices[0].logprobs.text_offset) for ch in chunks]
    assert sum((t for t, _ in streamed), []) == lp.tokens and sum((o for _, o in streamed), []) == lp.text_offset
    assert sum((ch.choices[0].logprobs.token_logprobs for ch in chunks), []) == pytest.approx(lp.token_logprobs, abs=1e-4)
    # Chat: a flag and a count; the content entries are the completion tokens' own.
    messages = [{"role": "user", "content": "hello there"}]
    chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    stream = c.chat.completions.create(model="tiny", messages=messages, max_tokens=6, logprobs=True, top_logprobs=3,
                                       stream=True)
    streamed_content = [e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed_content] == [e.token for e in content]
    # top_logprobs 0 (vLLM's default): the drawn tokens alone; not asked for: null, as vLLM writes it.
    bare = c.chat.completions.create(model="tiny", messages=messages, max_tokens=3, logprobs=True)
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content] == [[], [], []][: bare.usage.completion_tokens]
    assert c.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices[0].logprobs is None
    raw = httpx.post(replicas[arm].base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert raw["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("arm", ["hash", "radix"])
def test_n_choices_are_vllms_child_requests_and_share_the_prompts_prefill(replicas, arm):
    c = client(replicas[arm])
    prompt = PROMPT + "n choices " + arm
    kw = {"model": "tiny", "max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}
    three = c.completions.create(prompt=prompt, n=3, seed=11, **kw)
    assert [ch.index for ch in three.choices] == [0, 1, 2]
    # Choice i is the request alone with seed + i (vLLM's ParentRequest), whatever ran beside it.
    alone = [c.completions.create(prompt=prompt, seed=11 + i, **kw).choices[0].text for i in range(3)]
    assert [ch.text for ch in three.choices] == alone
    assert three.usage.prompt_tokens == len(prompt.encode()) and three.usage.completion_tokens == 18
    # The choices arrive together and their prompt is computed once: the others wait for
    # the first one's prefill and hit it (the usage reports the last to finish).
    before = in_engine(replicas[arm], lambda e: e.stats().prefill_tokens_computed)
    fresh = c.completions.create(prompt="a brand new prompt for the n test, " * 3 + arm, n=4, seed=5, **kw)
    assert fresh.usage.prompt_tokens_details.cached_tokens > 0
    computed = in_engine(replicas[arm], lambda e: e.stats().prefill_tokens_computed) - before
    assert computed < fresh.usage.prompt_tokens + 3 * 4  # once, plus each choice's last, unaligned block
    # Greedy choices are identical; a stream interleaves the choices by index.
    messages = [{"role": "user", "content": "hello there " + arm}]
    whole = c.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2)
    assert len({ch.message.content for ch in whole.choices}) == 1 and whole.usage.completion_tokens == 10
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert [ch.choices[0].delta.role for ch in chunks[:2]] == ["assistant", "assistant"]
    assert [ch.choices[0].index for ch in chunks[:2]] == [0, 1]
    for i in (0, 1):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert "".join(x.delta.content or "" for x in mine) == whole.choices[i].message.content
        assert [x.finish_reason for x in mine if x.finish_reason] == [whole.choices[i].finish_reason]
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    idle(replicas[arm])
    in_engine(replicas[arm], lambda e: e.check_invariants())


def test_a_batch_of_prompts_is_one_request_per_prompt_its_choices_prompt_by_prompt(replicas):
    r = replicas["radix"]
    c = client(r)
    a, b = PROMPT + "batch one", "a different prompt, for the batch test"
    alone = [c.completions.create(model="tiny", prompt=p, max_tokens=5) for p in (a, b)]
    both = c.completions.create(model="tiny", prompt=[a, b], max_tokens=5, n=2)
    # vLLM's order: prompt by prompt, n choices each; greedy, so each equals its prompt alone.
    assert [ch.index for ch in both.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == len(a.encode()) + len(b.encode()) and both.usage.completion_tokens == 20
    # Both prompts were asked before: each hits what its first request cached; the usage sums them.
    assert both.usage.prompt_tokens_details.cached_tokens == sum(
        (len(p.encode()) - 1) // 4 * 4 for p in (a, b))
    ids = c.completions.create(model="tiny", prompt=[list(b"xyz" * 5), list(b"abc" * 5)], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 30
    chunks = [ch for ch in c.completions.create(model="tiny", prompt=[a, b], max_tokens=5, stream=True) if ch.choices]
    for i in (0, 1):
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) == alone[i].choices[0].text
    idle(r)
    in_engine(r, lambda e: e.check_invariants())


def test_continuous_usage_stats_puts_each_choices_usage_so_far_in_every_chunk(replicas):
    r = replicas["hash"]
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = sse_events(httpx.post(r.base_url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "count"}], "max_tokens": 4, "n": 2, "stream": True,
        "stream_options": options, "ignore_eos": True}))
    *chunks, final, done = chat
    assert done == "[DONE]" and final["usage"]["completion_tokens"] == 8
    prompt = final["usage"]["prompt_tokens"]
    for i in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == i]
        # vLLM's: the role chunk at 0, then each chunk its choice's tokens so far (one a step)
        assert [c["usage"]["completion_tokens"] for c in mine] == [0, 1, 2, 3, 4]
        assert all(c["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt + c["usage"]["completion_tokens"],
                                  "completion_tokens": c["usage"]["completion_tokens"]} for c in mine)
    # With include_usage false it is off, as in vLLM; a completion stream carries it alike.
    off = sse_events(httpx.post(r.base_url + "/v1/completions", json={
        "prompt": "count", "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": False, "continuous_usage_stats": True}}))
    assert all("usage" not in c for c in off[:-1])
    on = sse_events(httpx.post(r.base_url + "/v1/completions", json={
        "prompt": "count", "max_tokens": 3, "stream": True, "stream_options": options, "ignore_eos": True}))
    assert [c["usage"]["completion_tokens"] for c in on[:-2]] == [1, 2, 3]


BAD = [
    # (what, path, body (dict) or raw bytes, status, param)
    ("invalid JSON", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("a JSON array", "/v1/completions", [1, 2], 400, None),
    ("no prompt", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens -3", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}, 400,
     "max_tokens"),
    ("max_completion_tokens 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("max_tokens past the context", "/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("a prompt longer than the context", "/v1/completions", {"prompt": [1] * 1100}, 400, "input_tokens"),
    ("a prompt as long as the context", "/v1/completions", {"prompt": [1] * 1024}, 400, "input_tokens"),
    ("max_tokens a string", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt a number", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("token ids as bools", "/v1/completions", {"prompt": [True, False]}, 400, "prompt"),
    ("a negative token id", "/v1/completions", {"prompt": [3, -1]}, 400, "prompt"),
    ("a token id past the vocabulary", "/v1/completions", {"prompt": [3, 320]}, 400, "prompt"),
    ("temperature a string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("stream a list", "/v1/completions", {"prompt": "x", "stream": [1]}, 400, "stream"),
    ("an empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("an empty token list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("an empty prompt in a batch", "/v1/completions", {"prompt": ["a", ""]}, 400, "prompt[1]"),
    ("an empty token list in a batch", "/v1/completions", {"prompt": [[5], []]}, 400, "prompt[1]"),
    ("prompts x n past 1024 choices", "/v1/completions", {"prompt": ["a"] * 9, "n": 128}, 400, "prompt"),
    ("a batch past 1024 prompts", "/v1/completions", {"prompt": [[1]] * 1025}, 400, "prompt"),
    ("n = 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    # vLLM's fields that change what is generated, not done here: refused, never ignored
    ("min_p past 1", "/v1/completions", {"prompt": "x", "temperature": 1, "min_p": 1.5}, 400, "min_p"),
    # penalties as vLLM's SamplingParams checks them
    ("a presence penalty past 2", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("a frequency penalty below -2", "/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("a repetition penalty of 0", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_tokens below 0", "/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ("min_tokens past max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 4}, 400,
     "min_tokens"),
    ("a logit bias key not a token id", "/v1/completions", {"prompt": "x", "logit_bias": {"a": 10}}, 400,
     "logit_bias"),
    ("a logit bias past the vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"320": 10}}, 400,
     "logit_bias"),
    ("no allowed token", "/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("an allowed token past the vocabulary", "/v1/completions", {"prompt": "x", "allowed_token_ids": [5, 400]}, 400,
     "allowed_token_ids"),
    ("a blank bad word", "/v1/completions", {"prompt": "x", "bad_words": ["no", " "]}, 400, "bad_words"),
    ("only stop tokens allowed before min_tokens", "/v1/completions",
     {"prompt": "x", "min_tokens": 2, "max_tokens": 4, "allowed_token_ids": [65], "stop_token_ids": [65]}, 400,
     "allowed_token_ids"),
    ("a response format of no known type", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}, 400,
     "response_format.type"),
    ("a regex that does not compile", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "(x"}}, 400,
     "structured_outputs.regex"),
    ("tools with auto tool choice (no tool-call parser)", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice"),
    ("beam search", "/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("n past 128", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 129}, 400, "n"),
    ("n a string", "/v1/completions", {"prompt": "x", "n": "two"}, 400, "n"),
    # logprobs as vLLM checks them, then its max_logprobs (20); -1 is the whole vocabulary (320)
    ("negative logprobs", "/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("logprobs past max_logprobs", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ("top_logprobs -2", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -2}, 400, "top_logprobs"),
    ("top_logprobs -1: the vocabulary", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("logprobs a string", "/v1/completions", {"prompt": "x", "logprobs": "some"}, 400, "logprobs"),
    ("an empty stop string", "/v1/completions", {"prompt": "x", "stop": ["\n", ""]}, 400, "stop"),
    ("too many stop strings", "/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(65)]}, 400, "stop"),
    ("a stop string too long", "/v1/completions", {"prompt": "x", "stop": "y" * 1025}, 400, "stop"),
    ("stop a number", "/v1/completions", {"prompt": "x", "stop": 7}, 400, "stop"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("no messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("a message without a role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("an image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]"),
    ("a seed past int64", "/v1/completions", {"prompt": "x", "seed": 2**63}, 400, "seed"),
    # vLLM 0.33's SamplingParams: temperature in [0, 2] and finite
    ("temperature above 2", "/v1/completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature"),
    ("temperature infinite", "/v1/completions", b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    ("temperature NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    # lone UTF-16 surrogates: valid JSON escapes, no Unicode text (a 500 before)
    ("a surrogate in a text prompt", "/v1/completions", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("a surrogate in a prompt list", "/v1/completions", b'{"prompt": ["\\ud800"]}', 400, "prompt[0]"),
    ("a surrogate in model", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 400, "model"),
    ("a surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages[0].content"),
    ("a surrogate in a key", "/v1/completions", b'{"prompt": "x", "\\ud800": 1}', 400, "\\ud800"),
    ("JSON nested too deeply", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
]


@pytest.mark.parametrize("what, path, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_body_never_a_500(replicas, what, path, body, status, param):
    url = replicas["hash"].base_url + path
    response = (httpx.post(url, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes)
                else httpx.post(url, json=body))
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert error["param"] == param and error["message"]
    assert error["type"] in ("Bad Request", "BadRequestError", "NotFoundError")


def test_unknown_routes_and_methods_answer_in_the_same_shape(replicas):
    base = replicas["hash"].base_url
    missing, wrong = httpx.get(base + "/v1/nothing"), httpx.get(base + "/v1/completions")
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "Not Found")
    assert (wrong.status_code, wrong.json()["error"]["type"]) == (405, "Method Not Allowed")
    assert wrong.headers["allow"] == "POST"  # RFC 9110: a 405 says what the route serves


def test_the_openapi_schema_is_served_as_vllm_does_and_true_to_the_server(replicas):
    base = replicas["hash"].base_url
    schema = httpx.get(base + "/openapi.json").json()
    assert httpx.get(base + "/docs").status_code == 200 and httpx.get(base + "/redoc").status_code == 200
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        post = schema["paths"][path]["post"]
        body = post["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"} and model in schema["components"]["schemas"]
        assert {"400", "404", "408", "413", "500", "503"} <= set(post["responses"])
    assert "CompletionRequest" in schema["components"]["schemas"]
    assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "422" not in json.dumps(schema)  # this server answers a body that fails validation with 400
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(schema)))
    assert refs <= set(schema["components"]["schemas"])  # every reference resolves
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)  # code generators need unique ids
    assert {"get", "post"} <= set(schema["paths"]["/flush_cache"]) and "get" in schema["paths"]["/metrics"]
    tokenize = schema["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert [r["$ref"].rsplit("/", 1)[1] for r in tokenize["anyOf"]] == ["TokenizeCompletionRequest",
                                                                        "TokenizeChatRequest"]


def test_penalties_change_what_greedy_draws(replicas):
    c = client(replicas["radix"])
    kw = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    plain = c.completions.create(**kw).choices[0].text
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"extra_body": {"ignore_eos": True,
                                                                                         "repetition_penalty": 1.5}}):
        assert c.completions.create(**{**kw, **penalty}).choices[0].text != plain, penalty


def test_min_tokens_and_min_p_are_served(replicas):
    c = client(replicas["hash"])
    first = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).choices[0].text
    stop_id = ord(first)  # the tiny model's tokens are bytes
    body = {"stop_token_ids": [stop_id], "ignore_eos": True}
    early = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, extra_body=body)
    assert early.usage.completion_tokens == 1
    held = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, extra_body={**body, "min_tokens": 6})
    assert held.usage.completion_tokens >= 6 and first not in held.choices[0].text[:6]
    # min_p 1: only the most likely token survives, so a hot draw is the greedy one.
    hot = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.5, seed=3,
                               extra_body={"min_p": 1.0, "ignore_eos": True})
    greedy = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True})
    assert hot.choices[0].text == greedy.choices[0].text


def test_logit_bias_and_allowed_token_ids_steer_what_is_drawn(replicas):
    c = client(replicas["hash"])
    forced = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logit_bias={str(ord("q")): 100},
                                  extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "q" * 6  # +100 (OpenAI's most) outweighs every other logit
    only = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=1,
                                extra_body={"ignore_eos": True, "allowed_token_ids": [ord("a"), ord("b")]})
    assert set(only.choices[0].text) <= {"a", "b"} and len(only.choices[0].text) == 8


def test_special_tokens_are_left_out_of_the_text_unless_the_request_keeps_them(replicas):
    """vLLM's `skip_special_tokens` (default true), streamed and not; the token ids and
    usage are the same either way."""
    url = replicas["radix"].base_url
    end = 258  # <|im_end|>: +100 wins every draw, and with ignore_eos it does not stop
    body = {"prompt": PROMPT, "max_tokens": 4, "logit_bias": {str(end): 100}, "ignore_eos": True}
    for keep, text in ((None, ""), (True, ""), (False, "<|im_end|>" * 4)):
        asked = body if keep is None else {**body, "skip_special_tokens": keep}
        plain = httpx.post(url + "/v1/completions", json=asked, timeout=30).json()
        assert plain["choices"][0]["text"] == text and plain["usage"]["completion_tokens"] == 4
        chunks = sse_events(httpx.post(url + "/v1/completions", json={**asked, "stream": True}, timeout=30))
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1] if c["choices"]) == text
    # vLLM's fast detokenizer ignores spaces_between_special_tokens; so does this server.
    spaced = httpx.post(url + "/v1/completions", json={**body, "skip_special_tokens": False,
                                                        "spaces_between_special_tokens": False}, timeout=30)
    assert spaced.json()["choices"][0]["text"] == "<|im_end|>" * 4


def test_the_neutral_values_of_fields_not_served_are_accepted(replicas):
    """A client that sends vLLM's defaults explicitly (penalties 0, repetition 1, text
    format, no tools) is served as if it had not sent them."""
    url = replicas["hash"].base_url
    plain = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}).json()["choices"][0]["text"]
    body = {"prompt": "x", "max_tokens": 3, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
            "min_p": 0, "min_tokens": 0, "logit_bias": {}, "use_beam_search": False, "response_format": {"type": "text"}}
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain


def test_an_empty_logit_bias_leaves_the_engines_default_sampling():
    """`{}` asks for nothing: the engine's default (and its per-request seed) applies, as
    without the field; a bias makes the request's own sampling."""
    from prefixcache.engine.sampling import SamplingParams
    from prefixcache.serve.openai_types import CompletionRequest
    from prefixcache.serve.preprocess import _sampling

    default = SamplingParams(temperature=1.0, seed=5)
    assert _sampling(CompletionRequest(prompt="x", logit_bias={}), default) is None
    assert _sampling(CompletionRequest(prompt="x", logit_bias={"7": 1.0}), default).logit_bias == ((7, 1.0),)


def test_lax_type_conversions_are_accepted_as_fastapi_and_vllm_accept_them(replicas):
    """pydantic's lax mode, as FastAPI (and so vLLM) validates: a numeric string or a
    whole float for an int, a bool for an int (true is 1), "true"/"yes"/1 for a bool; a
    fractional float for an int is not."""
    url = replicas["hash"].base_url + "/v1/completions"
    for body, tokens in (({"max_tokens": "3"}, 3), ({"max_tokens": 2.0}, 2), ({"max_tokens": True}, 1),
                         ({"max_tokens": 2, "temperature": "0"}, 2)):
        r = httpx.post(url, json={"prompt": "x", "ignore_eos": True, **body})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == tokens, (body, r.text)
    for flag in ("true", "yes", 1):
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 1, "stream": flag})
        assert r.headers["content-type"].startswith("text/event-stream"), flag
    r = httpx.post(url, json={"prompt": "x", "max_tokens": 2.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_the_official_client_sees_the_errors_as_its_own_exceptions(replicas):
    c = client(replicas["hash"])
    with pytest.raises(openai.NotFoundError) as err:
        c.completions.create(model="nope", prompt="x", max_tokens=2)
    assert err.value.body["param"] == "model" or err.value.status_code == 404
    with pytest.raises(openai.BadRequestError, match="max_tokens must be at least 1"):
        c.completions.create(model="tiny", prompt="x", max_tokens=0)


def pumping() -> list:
    """The server's tasks still reading a choice's engine stream (`app._merged`)."""
    return [t for t in gc.get_objects() if type(t) is asyncio.Task and not t.done()
            and getattr(t.get_coro(), "__name__", "") == "pump"]


def test_clients_that_go_away_release_their_blocks(replicas):
    """Streams closed after their first chunk and plain requests whose client times out
    are aborted: afterwards nothing is running and no block is pinned."""
    for arm in ("hash", "radix"):
        r = replicas[arm]
        idle(r)
        body = {"model": "tiny", "prompt": PROMPT + arm, "max_tokens": 900, "ignore_eos": True}
        with httpx.Client(base_url=r.base_url, timeout=30) as http:
            for n in (1, 3, 1):  # n = 3: every choice is aborted, not only the first
                with http.stream("POST", "/v1/completions", json={**body, "stream": True, "n": n}) as stream:
                    next(stream.iter_lines())  # the first chunk: the request is running
            for n in (1, 2):
                with pytest.raises(httpx.ReadTimeout):
                    http.post("/v1/completions", json={**body, "n": n}, timeout=0.3)
        idle(r)
        wait_until(lambda: not pumping(), "every choice's stream reader to stop")  # none left waiting forever
        in_engine(r, lambda e: e.check_invariants())  # every pinned block is the tree's or a live request's
        held = (lambda e: e.cache.tree.protected_size) if arm == "radix" else (lambda e: e.cache.pool.num_pinned)
        assert in_engine(r, held) == 0  # radix: no node locked by a request; hash: no block pinned
        after = client(r).completions.create(model="tiny", prompt=PROMPT + arm, max_tokens=2)
        assert after.usage.prompt_tokens_details.cached_tokens > 0  # what the aborted requests computed stays cached


def test_concurrent_requests_are_batched_into_shared_steps(replicas):
    r = replicas["radix"]
    idle(r)
    before = in_engine(r, lambda e: e.stats().steps)
    with httpx.Client(base_url=r.base_url, timeout=30) as http, contextlib.ExitStack() as open_streams:
        bodies = [open_streams.enter_context(http.stream("POST", "/v1/completions", json={
            "prompt": [5 + i] * 12, "max_tokens": 8, "ignore_eos": True, "stream": True})) for i in range(4)]
        texts = [b.read() for b in bodies]  # all four were submitted before any is read to its end
    assert all(t.endswith(b"data: [DONE]\n\n") for t in texts)
    steps = in_engine(r, lambda e: e.stats().steps) - before
    assert steps < 4 * 8  # 32 tokens sampled in fewer steps: requests shared them


def test_the_serve_command_names_a_config_mistake(tmp_path, capsys):
    from prefixcache.cli import main

    bad = tmp_path / "serve.yaml"
    bad.write_text("cache: {backend: hash}\nengine: {model: tiny}\nkv_events: {enabled: true, endpoint: 'udp://x'}\n")
    assert main(["serve", str(bad)]) == 2
    assert "kv_events.endpoint: must be a ZeroMQ endpoint" in capsys.readouterr().err
    assert main(["validate", "configs/serve.yaml"]) == 0  # the shipped default
    assert "kv_events" in capsys.readouterr().out
