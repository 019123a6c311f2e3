"""Logprobs of drawn tokens (`prefixcache.engine.logprobs`): against a naive model that
ranks the whole vocabulary in Python, and through the engine (raw logprobs: the same
whatever the temperature; one per token id; a prefix-cache hit changes none of them)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.engine import Engine, GenerationRequest
from prefixcache.engine.loader import load_model
from prefixcache.engine.logprobs import TokenLogprobs, token_logprobs
from prefixcache.engine.sampling import SamplingParams
from serve_cases import serve_config


def naive(row: list[float], token: int, k: int) -> TokenLogprobs:
    """The drawn token's raw logprob, its rank (tokens at least as likely, itself
    included) and the k most likely tokens, lower id first among equals."""
    m = max(row)
    norm = m + math.log(sum(math.exp(x - m) for x in row))
    lp = [x - norm for x in row]
    order = sorted(range(len(row)), key=lambda i: (-lp[i], i))
    return TokenLogprobs(token, lp[token], sum(1 for x in lp if x >= lp[token]), tuple((i, lp[i]) for i in order[:k]))


# Few distinct values, so ties are common: they decide ranks and the top's order.
rows = st.lists(st.sampled_from([-2.0, 0.0, 0.5, 1.0, 3.0]), min_size=1, max_size=12)


@given(st.lists(st.tuples(rows, st.integers(0, 12), st.data()), min_size=1, max_size=4))
@settings(max_examples=200, deadline=None)
def test_logprobs_agree_with_the_naive_model(cases):
    width = max(len(r) for r, _, _ in cases)
    table = [r + [-2.0] * (width - len(r)) for r, _, _ in cases]  # pad: every row the same vocabulary
    tokens = [data.draw(st.integers(0, width - 1)) for _, _, data in cases]
    ks = [min(k, width) for _, k, _ in cases]
    # Ask for the rows out of order: each answer follows its own row.
    rows_asked = list(reversed(range(len(cases))))
    got = token_logprobs(torch.tensor(table), rows_asked, [tokens[i] for i in rows_asked], [ks[i] for i in rows_asked])
    for g, i in zip(got, rows_asked):
        want = naive(table[i], tokens[i], ks[i])
        assert (g.token_id, g.rank, [t for t, _ in g.top]) == (want.token_id, want.rank, [t for t, _ in want.top])
        assert g.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [x for _, x in g.top] == pytest.approx([x for _, x in want.top], abs=1e-5)


def test_bad_arguments_are_named():
    logits = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="rows"):
        token_logprobs(logits, [0, 1], [0], [1, 1])
    with pytest.raises(ValueError, match=r"outside \[0, 5\]"):
        token_logprobs(logits, [0], [0], [6])
    assert token_logprobs(logits, [], [], []) == []


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


PROMPT = list(b"The quick brown fox jumps over the lazy dog. " * 2)


def test_the_engine_returns_raw_logprobs_one_per_token_and_a_hit_changes_none(tiny):
    engine = Engine(serve_config("radix").serving, model=tiny)
    greedy = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=12, logprobs=3, keep_first_logits=True)])[0]
    assert greedy.logprobs is not None and len(greedy.logprobs) == len(greedy.token_ids) == 12
    assert [lp.token_id for lp in greedy.logprobs] == greedy.token_ids
    first = torch.log_softmax(greedy.first_logits.float(), dim=-1)
    assert greedy.logprobs[0].logprob == pytest.approx(float(first[greedy.token_ids[0]]), abs=1e-5)
    for lp in greedy.logprobs:  # greedy: the drawn token is the most likely one
        assert lp.rank == 1 and len(lp.top) == 3 and lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
        assert [x for _, x in lp.top] == sorted((x for _, x in lp.top), reverse=True)
    # The same prompt again hits the cache (its prefill is not recomputed): the same logprobs.
    again = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=12, logprobs=3)])[0]
    assert again.metrics.cached_tokens > 0
    assert [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in again.logprobs] == \
        [(lp.token_id, lp.rank, [t for t, _ in lp.top]) for lp in greedy.logprobs]
    assert [lp.logprob for lp in again.logprobs] == pytest.approx([lp.logprob for lp in greedy.logprobs], abs=1e-4)
    # Raw logprobs: a hot, seeded draw reports the model's own distribution, not the
    # tempered one. Its first token is drawn from the same logits as the greedy one's.
    hot = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=6, logprobs=0, keep_first_logits=True,
                                             sampling=SamplingParams(temperature=1.5, seed=7))])[0]  # fmt: skip
    assert hot.logprobs[0].logprob == pytest.approx(float(first[hot.token_ids[0]]), abs=1e-4)
    assert all(lp.top == () for lp in hot.logprobs)
    # A request that does not ask gets none; a bad count is named, before it takes an id.
    assert engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=2)])[0].logprobs is None
    for bad in (-1, 10**6, True, 2.0):
        with pytest.raises(ValueError, match="^logprobs must be None or an integer"):
            engine.add_request(GenerationRequest(prompt=PROMPT, logprobs=bad))  # type: ignore[arg-type]
    assert not engine.has_unfinished()
    engine.check_invariants()


def test_each_step_reports_the_logprobs_of_the_tokens_it_drew(tiny):
    engine = Engine(serve_config("hash").serving, model=tiny)
    asks = engine.add_request(GenerationRequest(prompt=PROMPT, max_tokens=5, logprobs=1))
    plain = engine.add_request(GenerationRequest(prompt=PROMPT[:40], max_tokens=5))
    streamed: list[TokenLogprobs] = []
    final = None
    while engine.has_unfinished():
        out = engine.run_step()
        drawn = dict(out.tokens)
        for rid, lp in out.logprobs:
            assert rid == asks and lp.token_id == drawn[rid]
            streamed.append(lp)
        final = next((o for o in out.finished if o.request_id == asks), final)
        assert all(rid != plain for rid, _ in out.logprobs)
    assert final is not None and streamed == final.logprobs


def test_the_openai_shapes_follow_vllms_logprob_dict_order():
    from prefixcache.engine.tokenizer import ByteTokenizer
    from prefixcache.serve.responses import logprobs

    tok = ByteTokenizer(300)
    a, b, c, d = (ord(x) for x in "abcd")
    # Drawn below the top 2 (rank 4), then drawn as the second most likely; -inf is floored.
    low = TokenLogprobs(d, -3.0, 4, ((a, -0.5), (b, -1.0)))
    second = TokenLogprobs(b, -1.0, 2, ((a, -0.5), (b, -1.0)))
    masked = TokenLogprobs(c, float("-inf"), 300, ())
    chat = logprobs(tok, [low, second, masked], 2, chat=True)["content"]
    # vLLM's dict: the drawn token first, then the top by rank, none twice; a chat lists k of it.
    assert [[t["token"] for t in e["top_logprobs"]] for e in chat] == [["d", "a"], ["b", "a"], ["c"]]
    assert chat[2]["logprob"] == -9999.0 and chat[0]["bytes"] == [d]
    done = logprobs(tok, [low, second, masked], 2, chat=False, text_offset=5)
    # A completion lists k + 1 of it, keyed by token text.
    assert [list(t) for t in done["top_logprobs"]] == [["d", "a", "b"], ["b", "a"], ["c"]]
    assert done["tokens"] == ["d", "b", "c"] and done["text_offset"] == [5, 6, 7]
    assert done["token_logprobs"] == [-3.0, -1.0, -9999.0]
    assert logprobs(tok, [low], 0, chat=True)["content"][0]["top_logprobs"] == []


def vllm_count(chat: bool, flag: bool | None, k: int | None, vocab: int) -> int | str | None:
    """vLLM 0.33's rules for the count a request asks for, or the field it refuses."""
    if chat:
        if k is not None and (k < -1 or (k != 0 and not flag)):
            return "top_logprobs"
        if not flag or k is None:
            return None
    elif k is None:
        return None
    elif k < 0:
        return "logprobs"
    wanted = vocab if k == -1 else k
    return ("top_logprobs" if chat else "logprobs") if wanted > 20 else wanted


@given(st.booleans(), st.none() | st.booleans(), st.none() | st.integers(-3, 25))
@settings(max_examples=300, deadline=None)
def test_the_server_asks_for_what_vllm_would(chat, flag, k):
    pytest.importorskip("fastapi")
    from prefixcache.serve.errors import APIError
    from prefixcache.serve.openai_types import ChatCompletionRequest, CompletionRequest
    from prefixcache.serve.preprocess import _logprobs

    if chat:
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=flag, top_logprobs=k)
    else:
        body = CompletionRequest(prompt="x", logprobs=k)
    want = vllm_count(chat, flag, k, vocab=320)
    if isinstance(want, str):
        with pytest.raises(APIError) as err:
            _logprobs(body, 320)
        assert err.value.param == want
    else:
        assert _logprobs(body, 320) == want


def test_penalties_shape_the_draw_and_leave_the_logprobs_raw(tiny):
    engine = Engine(serve_config("hash").serving, model=tiny)
    plain = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=16, ignore_eos=True, logprobs=1)])[0]
    strict = SamplingParams(temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.5)
    penalized = engine.generate([GenerationRequest(prompt=PROMPT, max_tokens=16, ignore_eos=True, logprobs=1,
                                                   sampling=strict)])[0]  # fmt: skip
    assert penalized.token_ids != plain.token_ids  # greedy over penalized logits draws otherwise
    # The first token is drawn from the same raw logits in both runs: raw logprobs agree,
    # whichever token each drew, and a penalized greedy token need not rank first.
    first = {t: lp for t, lp in plain.logprobs[0].top}
    assert penalized.logprobs[0].logprob <= plain.logprobs[0].logprob + 1e-4  # (a cache hit: float noise)
    if penalized.token_ids[0] in first:
        assert penalized.logprobs[0].logprob == pytest.approx(first[penalized.token_ids[0]], abs=1e-5)
    assert any(lp.rank > 1 for lp in penalized.logprobs)
    engine.check_invariants()
