"""vLLM's request fields about what a response carries: `request_id` (and the
X-Request-Id header) as the response id, `return_token_ids`, `return_tokens_as_token_ids`;
and the vLLM fields this server does not serve, refused by name rather than ignored."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from prefixcache.engine.loader import load_model  # noqa: E402
from serve_cases import running  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def replica():
    with running(load_model("tiny"), "radix") as r:
        yield r


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("chat", [False, True])
def test_the_response_id_is_the_header_s_else_the_body_s(replica, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prefix = "chatcmpl" if chat else "cmpl"
    body = {**(CHAT if chat else {"prompt": "hello"}), "max_tokens": 2}
    url = replica.base_url + path
    assert httpx.post(url, json={**body, "request_id": "mine"}, timeout=30).json()["id"] == f"{prefix}-mine"
    both = httpx.post(url, json={**body, "request_id": "mine"}, headers={"X-Request-Id": "hdr"}, timeout=30)
    assert both.json()["id"] == f"{prefix}-hdr"  # vLLM reads the header first
    assert {e["id"] for e in events(httpx.post(url, json={**body, "stream": True, "request_id": "s"}, timeout=30))} \
        == {f"{prefix}-s"}
    assert httpx.post(url, json=body, timeout=30).json()["id"].startswith(f"{prefix}-")


def test_two_requests_that_share_an_id_are_both_served(replica):
    """The id names the response; the engine's own ids stay unique."""
    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=replica.base_url, timeout=30) as client:
            body = {"prompt": "The quick brown fox", "max_tokens": 8, "ignore_eos": True, "request_id": "same"}
            return await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(3)))

    for r in asyncio.run(both()):
        assert r.status_code == 200 and r.json()["id"] == "cmpl-same" and r.json()["usage"]["completion_tokens"] == 8


def test_return_token_ids_whole_and_streamed(replica):
    url = replica.base_url + "/v1/completions"
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "n": 2,
            "temperature": 1.0, "seed": 3}
    whole = httpx.post(url, json=body, timeout=30).json()
    prompt = list(b"The quick brown fox")
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 6
    chunks = events(httpx.post(url, json={**body, "stream": True}, timeout=30))
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == whole["choices"][i]["token_ids"]
    # Without the flag no ids are added.
    plain = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=30).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_a_chat_returns_its_prompt_ids_beside_its_choices(replica):
    url = replica.base_url + "/v1/chat/completions"
    body = {**CHAT, "max_tokens": 4, "return_token_ids": True, "ignore_eos": True}
    whole = httpx.post(url, json=body, timeout=30).json()
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    assert len(whole["choices"][0]["token_ids"]) == 4
    chunks = events(httpx.post(url, json={**body, "stream": True}, timeout=30))
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]  # the role chunk
    assert [t for c in chunks[1:] if c["choices"] for t in c["choices"][0]["token_ids"]] == \
        whole["choices"][0]["token_ids"]


@pytest.mark.parametrize("chat", [False, True])
def test_return_tokens_as_token_ids_names_each_token_by_its_id(replica, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**(CHAT if chat else {"prompt": "hello"}), "max_tokens": 3, "return_tokens_as_token_ids": True,
            "return_token_ids": True, **({"logprobs": True, "top_logprobs": 1} if chat else {"logprobs": 1})}
    got = httpx.post(replica.base_url + path, json=body, timeout=30).json()["choices"][0]
    want = [f"token_id:{t}" for t in got["token_ids"]]
    if chat:
        assert [e["token"] for e in got["logprobs"]["content"]] == want
    else:
        assert got["logprobs"]["tokens"] == want and all(k.startswith("token_id:") for d in
                                                           got["logprobs"]["top_logprobs"] for k in d)


@pytest.mark.parametrize("field, value", [
    ("priority", 1), ("watermarking", True), ("prompt_embeds", "AAAA"),
    ("thinking_token_budget", 10),
    ("kv_transfer_params", {"do_remote_decode": True}), ("ec_transfer_params", {}),
    ("mm_processor_kwargs", {"a": 1}),
])
def test_fields_that_change_the_answer_are_refused_unless_neutral(replica, field, value):
    url = replica.base_url + "/v1/chat/completions"
    refused = httpx.post(url, json={**CHAT, "max_tokens": 2, field: value}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    neutral = {"priority": 0, "watermarking": False, "thinking_token_budget": -1}.get(field)
    assert httpx.post(url, json={**CHAT, "max_tokens": 2, field: neutral}, timeout=30).status_code == 200


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_its_inputs(replica):
    from prefixcache.engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer(320, chat_template="{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}")
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    thinking = tok.apply_chat_template([{"role": "user", "content": "hi"}], variables={"enable_thinking": True})
    assert (bytes(plain), bytes(thinking)) == (b"hi", b"<think>hi")
    url = replica.base_url + "/v1/chat/completions"
    ok = httpx.post(url, json={**CHAT, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}, timeout=30)
    assert ok.status_code == 200
    clash = httpx.post(url, json={**CHAT, "max_tokens": 2, "chat_template_kwargs": {"messages": []}}, timeout=30)
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"


CONTINUED = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a "}]


def test_continue_final_message_ends_the_prompt_inside_the_last_message():
    """transformers' rule (vLLM's): cut after the last message's content, its end-of-turn
    gone; its trailing spaces kept where the template kept them."""
    from prefixcache.engine.chat_template import ChatTemplateError, render_chat
    from prefixcache.engine.tokenizer import SMOLLM2_CHAT_TEMPLATE

    text = render_chat(SMOLLM2_CHAT_TEMPLATE, CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\nOnce upon a ")
    trimmed = "{% for m in messages %}[{{ m['content'] | trim }}]{% endfor %}"
    assert render_chat(trimmed, CONTINUED, add_generation_prompt=False, continue_final_message=True) == \
        "[Tell me a story.][Once upon a"
    with pytest.raises(ChatTemplateError, match="final message does not appear"):
        render_chat("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", CONTINUED,
                    add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="Cannot set both"):
        render_chat(SMOLLM2_CHAT_TEMPLATE, CONTINUED, continue_final_message=True)


def test_a_chat_continues_its_last_message_or_answers_in_its_role(replica):
    url = replica.base_url + "/v1/chat/completions"
    tok = load_model("tiny").tokenizer
    body = {"messages": CONTINUED, "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True,
            "return_token_ids": True, "echo": True}
    got = httpx.post(url, json=body, timeout=30).json()
    want = tok.apply_chat_template(CONTINUED, add_generation_prompt=False, continue_final_message=True)
    assert got["prompt_token_ids"] == want and bytes(want[-12:]) == b"Once upon a "
    message = got["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("Once upon a ")  # echo: the same role
    # Without the generation prompt the response takes the last message's role (vLLM's).
    as_user = httpx.post(url, json={**CHAT, "max_tokens": 2, "add_generation_prompt": False, "stream": True}, timeout=30)
    assert events(as_user)[0]["choices"][0]["delta"]["role"] == "user"
    both = httpx.post(url, json={**CHAT, "max_tokens": 2, "continue_final_message": True}, timeout=30)
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_truncate_prompt_tokens_keeps_the_last_tokens_unless_told_otherwise(replica):
    url = replica.base_url + "/v1/completions"
    tok = load_model("tiny").tokenizer
    ids = tok.encode("abcdefghij")
    body = {"prompt": "abcdefghij", "max_tokens": 2, "return_token_ids": True}
    left = httpx.post(url, json={**body, "truncate_prompt_tokens": 4}, timeout=30).json()
    assert left["choices"][0]["prompt_token_ids"] == ids[-4:] and left["usage"]["prompt_tokens"] == 4
    right = httpx.post(url, json={**body, "truncate_prompt_tokens": 4, "truncation_side": "right"}, timeout=30).json()
    assert right["choices"][0]["prompt_token_ids"] == ids[:4]
    echoed = httpx.post(url, json={"prompt": "abcdefghij", "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 3},
                        timeout=30).json()
    assert echoed["choices"][0]["text"].startswith("hij")  # the text the model was given
    chat = httpx.post(replica.base_url + "/v1/chat/completions",
                      json={**CHAT, "max_tokens": 2, "return_token_ids": True, "truncate_prompt_tokens": 5}, timeout=30)
    assert chat.json()["prompt_token_ids"] == tok.apply_chat_template(CHAT["messages"])[-5:]


def test_truncate_prompt_tokens_minus_one_fits_the_context_and_bad_sizes_get_vllms_400(replica):
    url = replica.base_url + "/v1/completions"
    info = httpx.get(replica.base_url + "/v1/models", timeout=30).json()["data"][0]
    limit = info["max_model_len"]
    long = [65] * limit  # fills the context: refused as it is
    assert httpx.post(url, json={"prompt": long, "max_tokens": 4}, timeout=30).status_code == 400
    fit = httpx.post(url, json={"prompt": long, "max_tokens": 4, "truncate_prompt_tokens": -1}, timeout=30).json()
    assert fit["usage"]["prompt_tokens"] == limit - 4
    for keep, message in ((limit, "cannot be greater than max_model_len - max_tokens"), (0, "cannot be empty")):
        r = httpx.post(url, json={"prompt": "abc", "max_tokens": 4, "truncate_prompt_tokens": keep}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
        assert message in r.json()["error"]["message"]
    bad = httpx.post(url, json={"prompt": "abc", "truncate_prompt_tokens": -2}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_documents_reach_a_rag_template_and_leave_others_as_they_were(replica):
    from prefixcache.engine.tokenizer import ByteTokenizer
    from prefixcache.serve.openai_types import ChatCompletionRequest
    from prefixcache.serve.preprocess import _template_variables

    rag = ByteTokenizer(320, chat_template="{% for d in documents %}[{{ d['text'] }}]{% endfor %}"
                                           "{{ messages[0]['content'] }}")
    body = ChatCompletionRequest(**CHAT, documents=[{"title": "t", "text": "sky is blue"}],
                                 chat_template_kwargs={"documents": "replaced"})
    assert bytes(rag.apply_chat_template(CHAT["messages"], variables=_template_variables(body))) == b"[sky is blue]hi"
    url = replica.base_url + "/v1/chat/completions"
    plain = httpx.post(url, json={**CHAT, "max_tokens": 2, "return_token_ids": True}, timeout=30).json()
    with_docs = httpx.post(url, json={**CHAT, "max_tokens": 2, "return_token_ids": True,
                                      "documents": [{"text": "d"}]}, timeout=30).json()
    assert with_docs["prompt_token_ids"] == plain["prompt_token_ids"]  # ChatML reads no documents


def test_a_requests_own_chat_template_needs_the_servers_trust(replica):
    url = replica.base_url + "/v1/chat/completions"
    for extra in ({"chat_template": "{{ messages[0]['content'] }}"},
                  {"chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}"}}):
        r = httpx.post(url, json={**CHAT, "max_tokens": 2, **extra}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template is not set" in r.json()["error"]["message"]
    with running(load_model("tiny"), "hash", server={"trust_request_chat_template": True}) as trusting:
        url = trusting.base_url + "/v1/chat/completions"
        own = {**CHAT, "max_tokens": 2, "return_token_ids": True, "chat_template": "{{ messages[0]['content'] }}!"}
        assert bytes(httpx.post(url, json=own, timeout=30).json()["prompt_token_ids"]) == b"hi!"
        # The same sandbox and bounds as the model's own template.
        for template in ("{% if %}", "{% for i in range(10**9) %}{{ i }}{% endfor %}"):
            r = httpx.post(url, json={**own, "chat_template": template}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.json()
        plain = httpx.post(url, json={**CHAT, "max_tokens": 2}, timeout=30)
        assert plain.status_code == 200  # the model's template still serves the others
