"""vLLM's `/tokenize` and `/detokenize`: what a client (a router that scores prefixes, a
benchmark that counts tokens) asks a replica instead of loading its tokenizer, answered as
the generation routes would tokenize the same prompt."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from prefixcache.engine.loader import load_model  # noqa: E402
from serve_cases import running  # noqa: E402

CHAT = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def replica():
    with running(load_model("tiny"), "hash") as r:
        yield r


def test_a_prompt_and_a_chat_tokenize_as_the_generation_routes_see_them(replica):
    url = replica.base_url
    tok = load_model("tiny").tokenizer
    limit = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
    text = httpx.post(url + "/tokenize", json={"prompt": "héllo <|im_end|>"}, timeout=30).json()
    assert text == {"count": len(tok.encode("héllo <|im_end|>")), "max_model_len": limit,
                    "tokens": tok.encode("héllo <|im_end|>"), "token_strs": None}
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT, "return_token_strs": True}, timeout=30).json()
    generated = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                                "return_token_ids": True}, timeout=30).json()
    assert chat["tokens"] == generated["prompt_token_ids"] and chat["count"] == generated["usage"]["prompt_tokens"]
    # Token strings as the exported tokenizer.json names them (GPT-2's byte alphabet: 'Ġ' is a space).
    assert chat["token_strs"][:3] == ["<|im_start|>", "s", "y"] and "Ġ" in chat["token_strs"]
    open_ended = httpx.post(url + "/tokenize", timeout=30, json={
        "messages": [*CHAT, {"role": "assistant", "content": "Hel"}], "add_generation_prompt": False,
        "continue_final_message": True}).json()  # fmt: skip
    assert bytes(open_ended["tokens"][-4:]) == b"\nHel"


def test_detokenize_is_the_text_of_the_ids_and_bad_input_is_a_400(replica):
    url = replica.base_url
    ids = httpx.post(url + "/tokenize", json={"prompt": "round trip ✓"}, timeout=30).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=30).json() == {"prompt": "round trip ✓"}
    for path, body, param in (("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens"),
                              ("/tokenize", {"prompt": 5}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                              ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message")):
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body, r.json())


def test_ping_and_version_answer_as_vllms(replica):
    from importlib.metadata import version

    assert httpx.get(replica.base_url + "/ping", timeout=30).status_code == 200
    assert httpx.post(replica.base_url + "/ping", timeout=30).status_code == 200
    assert httpx.get(replica.base_url + "/version", timeout=30).json() == {"version": version("prefixcache")}
