"""Structured outputs (`prefixcache.engine.structured`, vLLM's `structured_outputs` and
OpenAI's `response_format`): whatever the model would draw, the output follows the
grammar; a spec that does not compile is refused by name; through the engine and the
server (the official client included)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance")

from prefixcache.engine.engine import Engine, GenerationRequest  # noqa: E402
from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.engine.sampling import SamplingParams  # noqa: E402
from prefixcache.engine.structured import Grammars, StructuredOutputs  # noqa: E402
from prefixcache.errors import ConfigError  # noqa: E402
from serve_cases import running, serve_config  # noqa: E402

PROMPT = list(b"The quick brown fox jumps over the lazy dog. ")
REGEXES = [r"[a-c]{4}", r"(yes|no|maybe)", r"[0-9]{2}-[0-9]{2}", r"x+y?z{1,3}", r"(ab|cd)(ef|gh)"]


@pytest.fixture(scope="module")
def engine():
    return Engine(serve_config("radix").serving, model=load_model("tiny"))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(REGEXES), st.integers(0, 2**31), st.sampled_from([0.0, 1.0, 2.0]))
def test_the_output_matches_the_regex_whatever_the_model_draws(engine, regex, seed, temperature):
    params = SamplingParams(temperature=temperature, seed=seed)
    out = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=24, sampling=params,
                                             structured_outputs=StructuredOutputs(regex=regex))])[0]
    # The grammar ends the output with the end-of-sequence token once it is complete.
    assert out.finish_reason == "stop" and out.token_ids[-1] == engine.tokenizer.eos_token_id
    assert re.fullmatch(regex, out.text), out.text


def test_choices_schemas_and_the_raw_logprobs_under_the_mask(engine):
    pick = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=8, logprobs=3,
                                              structured_outputs=StructuredOutputs(choice=("red", "green"))),
                            ])[0]  # fmt: skip
    assert pick.text in ("red", "green")
    first = pick.logprobs[0]
    # vLLM masks before it computes raw logprobs: only "r" and "g" can start the output.
    assert {t for t, v in first.top if v > float("-inf")} <= {ord("r"), ord("g")} and first.rank == 1
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "n": {"enum": [1, 2]}},
              "required": ["colour", "n"], "additionalProperties": False}
    spec = StructuredOutputs(json=schema, disable_any_whitespace=True)
    obj = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=40, structured_outputs=spec)])[0]
    value = json.loads(obj.text)
    assert value["colour"] in ("red", "green") and value["n"] in (1, 2) and set(value) == {"colour", "n"}
    lark = StructuredOutputs(grammar='start: "<" NAME ">"\nNAME: /[a-z]{2,3}/')
    tagged = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=10, structured_outputs=lark)])[0]
    assert re.fullmatch(r"<[a-z]{2,3}>", tagged.text)
    engine.check_invariants()


WEATHER = {"triggers": ["<f="], "structures": [
    {"begin": "<f=weather>", "end": "</f>", "schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                       "required": ["city"], "additionalProperties": False}}]}


def _allowed(grammar) -> set[int]:
    return set(grammar.allowed().nonzero().flatten().tolist())


def _feed(grammar, text: str) -> bool:
    return all(grammar.accept(b) for b in text.encode())


def test_a_structural_tag_allows_prose_and_holds_each_tag_body_to_its_schema(engine):
    """Any text, until it reaches a structure's begin; then only a body its schema allows,
    then the end, then text again. vLLM 0.33's guidance backend lets any JSON through
    here (it passes the schema already compiled, which llguidance reads as a schema of
    unknown keywords); the mask below is what its xgrammar backend enforces."""
    spec = StructuredOutputs(structural_tag=WEATHER, disable_any_whitespace=True)
    g = engine.compile_grammar(spec)
    assert _feed(g, "Let me check. <f=weather>")
    assert _allowed(g) == {ord("{")}
    assert _feed(g, '{"city":"')
    assert _allowed(g) == {ord("P"), ord("R")}  # the enum, not any string
    assert _feed(g, 'Rome"}</f> Sunny')
    assert engine.tokenizer.eos_token_id in _allowed(g)  # prose may end anywhere outside a tag
    wrong = engine.compile_grammar(spec)
    assert _feed(wrong, "<f=weather>{") and not _feed(wrong, '"town"')
    # The JSON text form (vLLM's `structured_outputs.structural_tag`) compiles to the same grammar.
    same = engine.compile_grammar(StructuredOutputs(structural_tag=json.dumps(WEATHER), disable_any_whitespace=True))
    assert _feed(same, "<f=weather>{\"city\":\"") and _allowed(same) == {ord("P"), ord("R")}
    out = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=12, structured_outputs=spec)])[0]
    assert out.finish_reason in ("stop", "length") and _feed(engine.compile_grammar(spec), out.text)
    engine.check_invariants()


def test_requests_with_the_same_spec_get_matchers_of_their_own(engine):
    """The second compile copies a fresh template: a request that advanced its matcher
    changes neither the template nor another request's."""
    spec = StructuredOutputs(regex="(ab|cd)e")
    first = engine.compile_grammar(spec)
    start = first.allowed().nonzero().flatten().tolist()
    assert start == [ord("a"), ord("c")]
    assert first.accept(ord("a")) and first.allowed().nonzero().flatten().tolist() == [ord("b")]
    second = engine.compile_grammar(spec)
    assert second.allowed().nonzero().flatten().tolist() == start
    assert second.accept(ord("c")) and not second.accept(ord("a"))  # "ca" is not in the language
    assert first.allowed().nonzero().flatten().tolist() == [ord("b")]


@pytest.mark.parametrize("spec, field, message", [
    (StructuredOutputs(regex="(a"), "structured_outputs.regex", "invalid regex"),
    (StructuredOutputs(json="{not json"), "structured_outputs.json", "Expecting property name"),
    (StructuredOutputs(json="[1]"), "structured_outputs.json", "must be a JSON schema"),
    (StructuredOutputs(grammar="start: @@@"), "structured_outputs.grammar", "lexer error"),
    (StructuredOutputs(choice=()), "structured_outputs.choice", "must be a non-empty list of strings"),
    (StructuredOutputs(structural_tag="{not json"), "structured_outputs.structural_tag", "Expecting property name"),
    (StructuredOutputs(structural_tag=[1]), "structured_outputs.structural_tag", "must be an object"),
    (StructuredOutputs(structural_tag={**WEATHER, "triggers": ["<g="]}),
     "structured_outputs.structural_tag.structures[0].begin", "Trigger <f=weather> not found in triggers"),
    (StructuredOutputs(structural_tag={**WEATHER, "triggers": []}), "structured_outputs.structural_tag.triggers",
     "non-empty list"),
    (StructuredOutputs(structural_tag={**WEATHER, "structures": []}), "structured_outputs.structural_tag.structures",
     "No structural tags found"),
    (StructuredOutputs(structural_tag={"triggers": ["<"], "structures": [{"begin": "<a>", "end": ">"}]}),
     "structured_outputs.structural_tag.structures[0].schema", "must be a JSON schema"),
    (StructuredOutputs(structural_tag={"type": "structural_tag", "format": {"type": "triggered_tags"}}),
     "structured_outputs.structural_tag.format", "xgrammar"),
    (StructuredOutputs(regex="a", choice=("b",)), "structured_outputs", "exactly one of"),
    (StructuredOutputs(), "structured_outputs", "exactly one of"),
])
def test_a_spec_that_does_not_compile_is_refused_by_name(engine, spec, field, message):
    with pytest.raises(ConfigError, match=message) as err:
        engine.add_request(GenerationRequest(prompt=PROMPT, structured_outputs=spec))
    assert err.value.path == field
    assert not engine.has_unfinished()


def test_without_llguidance_a_grammar_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails as if it were not installed
    fresh = Engine(serve_config("hash").serving, model=load_model("tiny"))
    with pytest.raises(ConfigError, match=r"^structured_outputs: .*pip install 'prefixcache\[structured\]'"):
        fresh.add_request(GenerationRequest(prompt=PROMPT, structured_outputs=StructuredOutputs(regex="a")))
    assert fresh.generate([GenerationRequest(prompt=PROMPT, max_tokens=2)])[0].finish_reason == "length"


httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def replica():
    with running(load_model("tiny"), "hash") as r:
        yield r


def test_the_official_client_gets_json_that_follows_its_schema(replica):
    c = openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Well?"}], max_tokens=30,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"structured_outputs": None})
    # Free whitespace (vLLM's default) lets a random model wander: read past it.
    text = chat.choices[0].message.content
    if chat.choices[0].finish_reason == "stop":
        assert json.loads(text)["answer"] in ("yes", "no")
    else:
        assert text.lstrip().startswith("{")
    done = c.completions.create(model="tiny", prompt="Colour:", max_tokens=30,
                                extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert json.loads(done.choices[0].text)["answer"] in ("yes", "no") and done.choices[0].finish_reason == "stop"


def test_the_official_client_asks_for_a_structural_tag_in_both_forms(replica, engine):
    c = openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=8,
                                     response_format={"type": "structural_tag", **WEATHER})
    done = c.completions.create(model="tiny", prompt="Weather:", max_tokens=8,
                                extra_body={"structured_outputs": {"structural_tag": json.dumps(WEATHER)}})
    for choice, text in ((chat.choices[0], chat.choices[0].message.content), (done.choices[0], done.choices[0].text)):
        assert choice.finish_reason in ("stop", "length")
        assert _feed(engine.compile_grammar(StructuredOutputs(structural_tag=WEATHER)), text), text


def test_a_streamed_choice_adds_up_to_the_one_sent_whole(replica):
    url = replica.base_url + "/v1/completions"
    body = {"prompt": "Pick:", "max_tokens": 10, "structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}
    whole = httpx.post(url, json=body, timeout=30).json()["choices"][0]["text"]
    streamed = httpx.post(url, json={**body, "stream": True}, timeout=30).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert whole in ("alpha", "beta", "gamma") and "".join(c["choices"][0]["text"] for c in chunks) == whole


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag.triggers"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}}, "response_format.format"),
    ({"response_format": {"type": "structural_tag", "triggers": ["<f="]}}, "response_format"),
    ({"response_format": {**WEATHER, "type": "structural_tag", "triggers": ["<g="]}},
     "structured_outputs.structural_tag.structures[0].begin"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_specs_get_a_400_naming_the_field(replica, extra, param):
    r = httpx.post(replica.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 3, **extra}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
    if extra == {"structured_outputs": {}}:  # none set: said so, not vLLM's message for several
        assert "exactly one of" in r.json()["error"]["message"]


def test_a_grammar_compiles_beside_the_engine_thread_so_no_step_waits_for_it(replica, monkeypatch):
    """While one request's grammar is still compiling, another request is served whole."""
    compiling, release = threading.Event(), threading.Event()
    compile_ = Grammars.compile

    def slow(self, spec):
        compiling.set()
        assert release.wait(30), "the test never released the compile"
        return compile_(self, spec)

    monkeypatch.setattr(Grammars, "compile", slow)
    url = replica.base_url + "/v1/completions"

    async def both() -> tuple[dict, dict]:
        async with httpx.AsyncClient(timeout=60) as client:
            held = asyncio.ensure_future(client.post(url, json={"prompt": "x", "max_tokens": 5,
                                                                "structured_outputs": {"choice": ["yes", "no"]}}))
            while not compiling.is_set():
                await asyncio.sleep(0.01)
            plain = (await client.post(url, json={"prompt": "hello", "max_tokens": 4})).json()
            assert not held.done()  # still compiling, and the plain request was served meanwhile
            release.set()
            return plain, (await held).json()

    plain, constrained = asyncio.run(both())
    assert plain["usage"]["completion_tokens"] == 4 and constrained["choices"][0]["text"] in ("yes", "no")
