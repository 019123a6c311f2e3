"""Stop strings over a growing output text (`prefixcache.engine.detokenizer`), against a naive
model that decodes the whole output again after every token, and through the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine.detokenizer import IncrementalDecoder, StopStrings
from prefixcache.engine.engine import GenerationRequest
from prefixcache.engine.tokenizer import ByteTokenizer
from prefixcache.serve.responses import IncrementalText

TOK = ByteTokenizer(300)


def naive_stop(tokens: list[int], stops: list[str], include: bool) -> tuple[int, str, str] | None:
    """(tokens drawn, the stop string, the text kept) where the first of `stops` in the
    request's order is found in the characters the latest token completed (vLLM's rule),
    decoding everything again at each token."""
    before = ""
    for k in range(1, len(tokens) + 1):
        text = TOK.decode(tokens[:k])
        if text.endswith("\ufffd"):  # a character not yet whole: the incremental decoder waits for it
            continue
        for stop in stops:
            i = text.find(stop, max(0, len(before) - len(stop) + 1))
            if i != -1:
                return k, stop, text[: i + len(stop) if include else i]
        before = text
    return None


texts = st.text(alphabet="ab\nxé", max_size=40)


@settings(max_examples=300, deadline=None)
@given(texts, st.lists(st.text(alphabet="ab\nxé", min_size=1, max_size=4), min_size=1, max_size=3), st.booleans())
def test_stop_strings_agree_with_the_naive_model(text, stops, include):
    tokens = list(text.encode())
    checker = StopStrings(TOK, stops, include)
    got = None
    for k, t in enumerate(tokens, 1):
        if checker.add(t) is not None:
            got = (k, checker.stop, checker.text)
            break
    assert got == naive_stop(tokens, stops, include)


def test_the_first_stop_string_in_the_requests_order_wins_over_an_earlier_one():
    """vLLM's check: "world" and "d" both end at the last token; the list decides."""
    for stops, expect in ((["world", "d"], "world"), (["d", "world"], "d")):
        checker = StopStrings(TOK, stops, False)
        found = [checker.add(t) for t in b"hello world"]
        assert found[-1] == expect and not any(found[:-1])
        assert checker.text == ("hello " if expect == "world" else "hello worl")


def test_bad_stop_strings_are_named():
    for bad in ([], [""], ["a", 3]):
        with pytest.raises(ValueError, match="^stop: each stop string must be a non-empty str"):
            StopStrings(TOK, bad, False)


@settings(max_examples=200, deadline=None)
@given(texts, st.integers(0, 6), st.lists(st.integers(1, 5), min_size=1, max_size=12))
def test_a_stream_holding_back_characters_sends_a_prefix_of_the_final_text(text, hold, steps):
    """IncrementalText never sends what it holds back; the deltas add up to the final text."""
    from prefixcache.engine.engine import RequestOutput

    tokens = list(text.encode())
    stream = IncrementalText(TOK, hold)
    decoder = IncrementalDecoder(TOK)
    sent, i = "", 0
    for n in steps:
        sent += stream.add(tokens[i : i + n])
        decoder.add(tokens[i : i + n])
        i += n
        assert decoder.text.startswith(sent) and len(sent) == max(0, len(decoder.text) - hold)
    final = TOK.decode(tokens[:i])
    out = RequestOutput("r", [], tokens[:i], final, "length", None)  # type: ignore[arg-type]
    assert sent + stream.finish(out) == final


def test_the_engine_ends_a_request_at_a_stop_string_and_frees_its_blocks():
    from prefixcache.engine.engine import Engine
    from prefixcache.engine.loader import load_model
    from serve_cases import serve_config

    engine = Engine(serve_config("radix").serving, model=load_model("tiny"))
    prompt = list(b"The quick brown fox jumps over the lazy dog. ")
    free = engine.generate([GenerationRequest(prompt=prompt, max_tokens=30, ignore_eos=True)])[0]
    stop = free.text[12:15]
    at = free.text.index(stop)
    out = engine.generate([GenerationRequest(prompt=prompt, max_tokens=30, ignore_eos=True, stop=("zzzz", stop))])[0]
    assert (out.text, out.finish_reason, out.stop_str) == (free.text[:at], "stop", stop)
    assert out.token_ids == free.token_ids[: len(out.token_ids)] and len(out.token_ids) < 30
    assert TOK.decode(out.token_ids).startswith(free.text[: at + len(stop)])  # every token drawn is kept
    assert not engine.has_unfinished()
    engine.check_invariants()
    with pytest.raises(ValueError, match="stop"):
        engine.add_request(GenerationRequest(prompt=prompt, stop=("",)))
    with pytest.raises(ValueError, match="^stop must be a sequence of str"):
        engine.add_request(GenerationRequest(prompt=prompt, stop="x"))  # type: ignore[arg-type]
    assert engine.add_request(GenerationRequest(prompt=prompt)) == "req-2"  # a refused request takes no id


def test_min_tokens_keeps_stop_tokens_and_strings_from_ending_a_request_early():
    """vLLM's min_tokens: stop tokens cannot be drawn, and stop strings are not looked for,
    until the output holds that many tokens."""
    from prefixcache.engine.engine import Engine
    from prefixcache.engine.loader import load_model
    from serve_cases import serve_config

    engine = Engine(serve_config("hash").serving, model=load_model("tiny"))
    prompt = list(b"The quick brown fox jumps over the lazy dog. ")
    free = engine.generate([GenerationRequest(prompt=prompt, max_tokens=30, ignore_eos=True)])[0]
    stop_id = free.token_ids[1]
    early = engine.generate([GenerationRequest(prompt=prompt, max_tokens=30, ignore_eos=True,
                                               stop_token_ids=(stop_id,))])[0]  # fmt: skip
    assert early.finish_reason == "stop" and len(early.token_ids) == 2
    held = engine.generate([GenerationRequest(prompt=prompt, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_id,),
                                              min_tokens=8)])[0]  # fmt: skip
    assert len(held.token_ids) >= 8 and stop_id not in held.token_ids[:8]
    stop = free.text[:2]  # completed by the second token (one character a token here)
    at_once = engine.generate([GenerationRequest(prompt=prompt, max_tokens=30, ignore_eos=True, stop=(stop,))])[0]
    assert (at_once.stop_str, len(at_once.token_ids)) == (stop, 2)
    late = engine.generate([GenerationRequest(prompt=prompt, max_tokens=30, ignore_eos=True, stop=(stop,),
                                              min_tokens=4)])[0]  # fmt: skip
    assert late.token_ids[:4] == free.token_ids[:4] and len(late.token_ids) > 4  # looked for past 4 tokens only
    for bad in (-1, 31, True):
        with pytest.raises(ValueError, match="^min_tokens must be an integer"):
            engine.add_request(GenerationRequest(prompt=prompt, max_tokens=30, min_tokens=bad))  # type: ignore[arg-type]
    assert not engine.has_unfinished()
    engine.check_invariants()


specials = st.lists(st.sampled_from([*b"ab\n", 0xC3, 0xA9, *ByteTokenizer(300).special_ids]), max_size=30)


@settings(max_examples=200, deadline=None)
@given(specials, st.integers(1, 4))
def test_skip_special_tokens_leaves_out_exactly_the_special_ids(ids, step):
    """vLLM's default: the text leaves out the tokenizer's special tokens, incrementally
    as at once; the raw text keeps them."""
    assert TOK.special_ids == {256, 257, 258}
    skipped = IncrementalDecoder(TOK, skip_special_tokens=True)
    plain = IncrementalDecoder(TOK)  # fed the same ids less the special ones
    for i in range(0, len(ids), step):
        chunk = ids[i : i + step]
        assert skipped.add(chunk) == plain.add([t for t in chunk if t < 256])
    assert skipped.text == plain.text
    assert TOK.decode(ids, skip_special_tokens=True) == bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")
    assert TOK.decode(ids) == b"".join(TOK.token_bytes(t) for t in ids).decode("utf-8", errors="replace")


def test_the_engine_leaves_special_tokens_out_of_the_text_unless_asked():
    from prefixcache.engine.engine import Engine
    from prefixcache.engine.loader import load_model
    from prefixcache.engine.sampling import SamplingParams
    from serve_cases import serve_config

    engine = Engine(serve_config("hash").serving, model=load_model("tiny"))
    start = TOK.encode("<|im_end|>")[0]  # the tiny model never draws <|im_start|>: its logit is -inf
    # +100 on <|im_end|> (the most a bias gives; ignore_eos: it does not stop) wins every draw.
    params = SamplingParams(logit_bias=((start, 100.0),))
    base = GenerationRequest(prompt=list(b"hello"), max_tokens=5, ignore_eos=True, sampling=params)
    default = engine.generate([base])[0]
    raw = engine.generate([replace(base, skip_special_tokens=False)])[0]
    assert default.token_ids == raw.token_ids == [start] * 5
    assert (default.text, raw.text) == ("", "<|im_end|>" * 5)
    # Stop strings read the text the request sees: the special token's only with it kept.
    assert engine.generate([replace(base, stop=("<|im_end|>",))])[0].finish_reason == "length"
    stopped = engine.generate([replace(base, stop=("<|im_end|>",), skip_special_tokens=False)])[0]
    assert (stopped.stop_str, stopped.text, stopped.token_ids) == ("<|im_end|>", "", [start])
    engine.check_invariants()
