"""Ending a request whose output loops (vLLM's `repetition_detection`): the test against a
plain model of it, vLLM's checks, the engine's finish reason and text, and the server's
fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.engine import Engine, GenerationRequest
from prefixcache.engine.loader import load_model
from prefixcache.engine.repetition import RepetitionDetection, ends_in_repetition
from prefixcache.engine.sampling import SamplingParams
from serve_cases import running, serve_config

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


def looping(output: list[int], lo: int, hi: int, count: int) -> bool:
    """The model: some size in [lo, hi] whose last `count` chunks are one chunk repeated."""
    return any(len(output) >= s * count and output[-s * count:] == output[-s:] * count for s in range(lo, hi + 1))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=24), st.integers(0, 4), st.integers(0, 4), st.integers(2, 4))
def test_a_loop_is_found_exactly_where_the_model_finds_one(output, lo, extra, count):
    spec = RepetitionDetection(max_pattern_size=max(lo, 1) + extra, min_pattern_size=lo, min_count=count)
    # vLLM stops at the first size too long to repeat `count` times: a longer one cannot either.
    assert ends_in_repetition(output, spec) == looping(output, max(lo, 1), spec.max_pattern_size, count)


def test_detection_off_and_vllms_checks():
    assert not ends_in_repetition([7] * 50, RepetitionDetection())  # max_pattern_size 0: off
    with pytest.raises(ValueError, match="min_pattern_size <= max_pattern_size"):
        RepetitionDetection(max_pattern_size=2, min_pattern_size=3, min_count=2)
    with pytest.raises(ValueError, match="min_count must be >= 2"):
        RepetitionDetection(max_pattern_size=2, min_count=1)
    with pytest.raises(ValueError, match="must be an integer"):
        RepetitionDetection(max_pattern_size=True, min_count=2)


@pytest.fixture(scope="module")
def engine():
    return Engine(serve_config("hash").serving, model=load_model("tiny"))


def test_a_looping_request_ends_with_reason_repetition_and_its_whole_text(engine):
    only_a = SamplingParams(temperature=0.0, allowed_token_ids=(ord("a"),))
    spec = RepetitionDetection(max_pattern_size=1, min_count=4)
    looped, later, free = engine.generate([
        GenerationRequest(prompt=list(b"loop: "), max_tokens=20, sampling=only_a, repetition_detection=spec),
        GenerationRequest(prompt=list(b"loop: "), max_tokens=20, sampling=only_a, repetition_detection=spec,
                          min_tokens=6),
        GenerationRequest(prompt=list(b"loop: "), max_tokens=5, sampling=only_a),
    ])  # fmt: skip
    assert (looped.finish_reason, looped.text, len(looped.token_ids)) == ("repetition", "aaaa", 4)
    assert (later.finish_reason, len(later.token_ids)) == ("repetition", 6)  # not before min_tokens
    assert (free.finish_reason, free.text) == ("length", "aaaaa")
    engine.check_invariants()


@pytest.fixture(scope="module")
def replica():
    with running(load_model("tiny"), "radix") as r:
        yield r


def test_the_server_reports_vllms_finish_and_stop_reasons(replica):
    url = replica.base_url + "/v1/completions"
    body = {"prompt": "loop: ", "max_tokens": 20, "temperature": 0, "allowed_token_ids": [ord("b")],
            "repetition_detection": {"max_pattern_size": 2, "min_count": 3}}
    choice = httpx.post(url, json=body, timeout=30).json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"], choice["text"]) == ("repetition", "repetition_detected",
                                                                               "bbb")  # fmt: skip
    bad = httpx.post(url, json={**body, "repetition_detection": {"max_pattern_size": 2, "min_count": 1}}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "repetition_detection"
    assert "min_count must be >= 2" in bad.json()["error"]["message"]
    metrics = httpx.get(replica.base_url + "/metrics", timeout=30).text
    assert any(line.startswith("vllm:request_success_total") and 'finished_reason="repetition"' in line
               and not line.endswith(" 0.0") for line in metrics.splitlines())
