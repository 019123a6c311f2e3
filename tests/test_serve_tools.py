"""Forced tool calls (a chat's `tools` with `tool_choice` "required" or a named function,
as vLLM 0.33 serves them by constrained decoding): the checks and schema, the parsed
`tool_calls`, and the server whole and streamed, driven by the official client."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.serve.errors import APIError  # noqa: E402
from prefixcache.serve.openai_types import ChatCompletionRequest  # noqa: E402
from prefixcache.serve.tools import ToolChoice, tool_calls, tool_choice  # noqa: E402
from serve_cases import running  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "additionalProperties": False, "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Weather?"}]}
# The tiny random model would spend its tokens on the free whitespace JSON allows (vLLM's
# default for tools too) and on the extra properties vLLM's "required" schema allows in a
# call: a bias against whitespace bytes, and for closing an object or array wherever the
# schema allows it, lets it reach the end of a call.
NO_SPACE = {"logit_bias": {**{str(b): -100 for b in b" \t\n\r"}, str(ord("}")): 50, str(ord("]")): 50}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def choice_of(**body) -> ToolChoice | None:
    return tool_choice(ChatCompletionRequest(**CHAT, **body))


@pytest.mark.parametrize("body, param, message", [
    ({"tools": []}, "tools", "must not be an empty array"),
    ({"tool_choice": "required"}, "tool_choice", "`tools` must be set"),
    ({"tools": [WEATHER]}, "tool_choice", '"auto" tool choice requires'),  # auto is the default with tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "Tool 'nope' has not been passed"),
    ({"tools": [TIME, {"type": "function", "function": {"name": "t2", "parameters": {
        "$defs": {"zone": {"enum": ["X"]}}}}}], "tool_choice": "required"}, "tools", "multiple schemas"),
])
def test_vllms_checks(body, param, message):
    with pytest.raises(APIError, match=message) as err:
        choice_of(**body)
    assert err.value.param == param


def test_what_each_choice_forces():
    assert choice_of() is None and choice_of(tools=[WEATHER], tool_choice="none") is None
    named = choice_of(tools=[WEATHER, TIME], tool_choice=NAMED)
    assert named.name == "get_weather" and named.schema == WEATHER["function"]["parameters"]
    required = choice_of(tools=[WEATHER, TIME], tool_choice="required").schema
    # vLLM's: an array of {name, parameters}, the tools' $defs lifted to the top.
    assert required["type"] == "array" and required["minItems"] == 1 and required["$defs"] == {
        "zone": {"enum": ["UTC", "CET"]}}
    names = [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert "$defs" in TIME["function"]["parameters"]  # the request's own schema is left as it was


def test_outputs_become_tool_calls():
    named = ToolChoice("get_weather", {})
    (call,) = tool_calls(named, '{"city": "Rome"}')
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    required = ToolChoice(None, {})
    text = '[{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "get_weather", "parameters": {}}]'
    assert [c["function"] for c in tool_calls(required, text)] == [
        {"name": "get_time", "arguments": '{"zone": "CET"}'}, {"name": "get_weather", "arguments": "{}"}]
    assert len(tool_calls(ToolChoice(None, {}, parallel=False), text)) == 1  # parallel_tool_calls false
    assert tool_calls(required, '[{"name": "get_time", "param') is None  # cut by max_tokens: left as content


@pytest.fixture(scope="module")
def replica():
    with running(load_model("tiny"), "hash") as r:
        yield r


@pytest.fixture(scope="module")
def client(replica):
    return openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_named_function_is_called_with_arguments_its_schema_allows(client):
    chat = client.chat.completions.create(model="tiny", **CHAT, tools=[WEATHER, TIME], tool_choice=NAMED,
                                          max_tokens=40, temperature=0, extra_body=NO_SPACE)
    choice = chat.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and choice.message.content == "" and choice.finish_reason == "stop"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})


def test_required_calls_parse_into_tool_calls_and_finish_with_tool_calls(client):
    chat = client.chat.completions.create(model="tiny", **CHAT, tools=[WEATHER, TIME], tool_choice="required",
                                          max_tokens=200, temperature=0, extra_body=NO_SPACE)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls and choice.message.content == ""
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert (call.function.name, args) in [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"}),
                                              ("get_time", {"zone": "UTC"}), ("get_time", {"zone": "CET"})]
    # Cut by max_tokens, the partial array is the content, as text (vLLM's parse would fail).
    cut = client.chat.completions.create(model="tiny", **CHAT, tools=[WEATHER, TIME], tool_choice="required",
                                         max_tokens=5, temperature=0, extra_body=NO_SPACE).choices[0]
    assert cut.finish_reason == "length" and cut.message.content.startswith("[") and not cut.message.tool_calls


def test_a_streamed_tool_call_adds_up_to_the_one_sent_whole(client, replica):
    for tool_choice_ in (NAMED, "required"):
        body = {**CHAT, "tools": [WEATHER, TIME], "tool_choice": tool_choice_, "max_tokens": 200, "temperature": 0}
        whole = client.chat.completions.create(model="tiny", **body, extra_body=NO_SPACE).choices[0]
        assert whole.message.tool_calls  # (the streams below are compared with a whole call)
        stream = client.chat.completions.create(model="tiny", **body, stream=True, extra_body=NO_SPACE)
        calls: dict[int, dict] = {}
        content, finish = "", None
        for chunk in stream:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                call["arguments"] += d.function.arguments or ""
        assert finish == whole.finish_reason
        if whole.message.tool_calls:
            want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
            assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == want
            assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())
        else:
            assert content == whole.message.content and not calls


def test_tools_and_another_constraint_at_once_are_refused(replica):
    r = httpx.post(replica.base_url + "/v1/chat/completions", timeout=30, json={
        **CHAT, "tools": [WEATHER], "tool_choice": "required", "structured_outputs": {"regex": "a"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
    r = httpx.post(replica.base_url + "/v1/chat/completions", timeout=30,
                   json={**CHAT, "tools": [bad], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.json()  # not the schema we built
    assert "bogus" in r.json()["error"]["message"]
    none = httpx.post(replica.base_url + "/v1/chat/completions", timeout=30,
                      json={**CHAT, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 2})
    assert none.status_code == 200 and none.json()["choices"][0]["message"]["tool_calls"] == []


def test_an_agents_earlier_tool_turns_reach_the_template():
    from prefixcache.engine.tokenizer import ByteTokenizer
    from prefixcache.serve.preprocess import _chat_messages, _template_variables

    turns = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"}]  # fmt: skip
    body = ChatCompletionRequest(messages=turns, tools=[WEATHER], tool_choice="none")
    template = ("{% for t in tools %}<{{ t.function.name }}>{% endfor %}{% for m in messages %}"
                "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments }}{% elif m.role == 'tool' %}"
                "[{{ m.tool_call_id }}:{{ m.content }}]{% else %}{{ m.content }}{% endif %}{% endfor %}")
    text = bytes(ByteTokenizer(320, chat_template=template).apply_chat_template(
        _chat_messages(body), variables=_template_variables(body)))
    assert text == b'<get_weather>Weather?{"city": "Rome"}[c1:sunny]'
