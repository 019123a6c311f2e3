"""Tokenizing and chat templating within bounds (issue 27): the tokenizers encode and
decode linearly and exactly, a streamed text adds up to the whole text, and a chat
template (untrusted under --no-import) cannot run past its deadline or build a string
past its size bound, whatever it does."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prefixcache.engine.chat_template import ChatTemplateError, render_chat
from prefixcache.engine.tokenizer import SMOLLM2_CHAT_TEMPLATE, ByteTokenizer
from prefixcache.serve.responses import IncrementalText

BYTES = ByteTokenizer(320)

HI = [{"role": "user", "content": "hi"}]


def test_the_byte_tokenizer_matches_specials_in_one_pass():
    text = "a<|im_start|>b<|endoftext|><|im_end|>é<|im_end" * 3
    ids = BYTES.encode(text)
    assert ids[:5] == [97, 257, 98, 256, 258]
    assert BYTES.decode(ids) == text
    assert BYTES.encode("<|im_end|>" * 50_000) == [258] * 50_000  # the shape that was quadratic


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 319), max_size=60), st.integers(1, 7))
@example([237, 160], 1)  # ED A0: held back as a sequence's start, decoded whole as two U+FFFD
def test_streamed_text_adds_up_to_the_decoded_text(ids, step):
    """Deltas from each token's bytes through an incremental UTF-8 decoder are exactly
    prefixes of `decode` (never re-decoding what was sent), and finish() completes it."""
    for skip in (True, False):  # special tokens left out (the default), and kept
        text = IncrementalText(BYTES, skip_special_tokens=skip)
        sent = "".join(text.add(ids[i:i + step]) for i in range(0, len(ids), step))
        whole = BYTES.decode(ids, skip_special_tokens=skip)
        # Held back: at most the 3 bytes of an unfinished UTF-8 sequence, which the whole
        # decode may turn into as many replacement characters.
        assert whole.startswith(sent) and len(whole) - len(sent) <= 3


def test_the_shipped_template_renders_as_before():
    assert render_chat(SMOLLM2_CHAT_TEMPLATE, HI) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


HOSTILE = {
    "nested loops with output": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "nested loops, silent": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "loops over a message list": "{% for a in range(10000000) %}{% for m in messages %}{% endfor %}{% endfor %}",
    "string times n": "{{ 'x' * 1000000000 }}",
    "a huge power": "{{ 2 ** 1000000000 }}",
    "the center filter": "{{ 'x'|center(1000000000) }}",
    "str.ljust": "{{ 'x'.ljust(1000000000) }}",
    "str.format width": "{{ '{:>1000000000}'.format(1) }}",
    "%-format width": "{{ '%01000000000d' % 1 }}",
    "doubling with ~": "{% set n = namespace(s='xx') %}{% for i in range(64) %}{% set n.s = n.s ~ n.s %}{% endfor %}",
    "doubling with +": "{% set n = namespace(s='xx') %}{% for i in range(64) %}{% set n.s = n.s + n.s %}{% endfor %}",
    "a long join": "{{ range(100000)|join('-' * 80) }}",
    "slice into a billion": "{{ messages|slice(1000000000)|list|length }}",
    "indent by a billion": "{{ ('a\n' * 1000)|indent(1000000) }}",
    "replace everywhere": "{{ ('a' * 100000)|replace('', 'x' * 50) }}",
    "endless recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "a syntax error": "{% for %}",
    "an undefined call": "{{ nothing() }}",
}


@pytest.mark.parametrize("template", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_template_ends_in_a_one_line_error_within_its_bounds(template):
    with pytest.raises(ChatTemplateError) as err:
        render_chat(template, HI, timeout_s=0.5, max_chars=100_000)
    assert "\n" not in str(err.value) and len(str(err.value)) < 300


def test_output_past_the_bound_is_refused_as_it_grows():
    many = [{"role": "user", "content": "x" * 1000}] * 200
    assert len(render_chat(SMOLLM2_CHAT_TEMPLATE, many, max_chars=1_000_000)) > 200_000
    with pytest.raises(ChatTemplateError, match="more than the 100,000 allowed"):
        render_chat(SMOLLM2_CHAT_TEMPLATE, many, max_chars=100_000)
