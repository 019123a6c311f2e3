"""A Llama-architecture decoder in torch whose attention reads and writes the paged KV pool.

Owns the forward pass: token embedding, per layer RMSNorm -> q/k/v projections -> RoPE
(Hugging Face's half rotation, see `weights` for the GGUF row order) -> K/V written to the
layer's KV tensor -> paged attention over the request's blocks (grouped-query) -> output
projection, RMSNorm -> SwiGLU MLP, a final RMSNorm and the LM head (tied or not) on the
rows that need logits only. Also owns the KV pool tensors: one per layer, in
`prefixcache.attention.KV_LAYOUT` ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``,
so a block id means the same slot in every layer.

A step's `StepPlan` (batch.py) is built once and read by every layer. Inference only,
fp32 on the CPU by default.

Must never: decide which tokens to compute or which blocks a request uses (the
scheduler and the cache do), or allocate per layer what depends only on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from prefixcache.engine.batch import SeqChunk, StepPlan, plan_step
from prefixcache.engine.weights import LlamaConfig, Weights

__all__ = ["LlamaModel", "rope_tables", "apply_rope"]


def rope_tables(config: LlamaConfig, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``[max_position, head_dim]`` each, for HF's half-rotation RoPE."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.outer(torch.arange(config.max_position, dtype=torch.float64), inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().float().to(device).contiguous(), emb.sin().float().to(device).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [T, heads, head_dim]`` with ``cos/sin [T, head_dim]``: dimension i is
    rotated with i + head_dim/2 (HF `rotate_half`)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class LlamaModel:
    """The decoder over `weights`, with a KV pool of `num_blocks` blocks of `block_size`
    TOKENS allocated by `allocate_kv` (its size is the cache config's)."""

    def __init__(self, weights: Weights, *, attention_impl: str = "auto", device: torch.device | str = "cpu") -> None:
        self.weights = weights
        self.config = weights.config
        self.device = torch.device(device)
        self.attention_impl = attention_impl
        self.cos_table, self.sin_table = rope_tables(self.config, self.device)
        self.kv: list[torch.Tensor] = []
        self.num_blocks = 0
        self.block_size = 0

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32) -> None:
        """One zeroed KV tensor per layer in KV_LAYOUT (replaces any previous pool).
        Bytes: num_layers * num_blocks * 2 * num_kv_heads * block_size * head_dim * 4."""
        c = self.config
        shape = (num_blocks, 2, c.num_kv_heads, block_size, c.head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Apply an admission's copy-on-write list: the first `n` TOKENS of block `src`
        into block `dst`, K and V, in every layer (`Admission.copies`)."""
        for src, dst, n in copies:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks and 0 <= n <= self.block_size):
                raise ValueError(f"copy ({src}, {dst}, {n}) is outside a pool of {self.num_blocks} blocks of {self.block_size}")
            for kv in self.kv:
                kv[dst, :, :, :n] = kv[src, :, :, :n]

    def plan(self, chunks: Sequence[SeqChunk]) -> StepPlan:
        """The batch of one step, laid out for every layer (batch.plan_step)."""
        if not self.kv:
            raise RuntimeError("allocate_kv(num_blocks, block_size) before planning a step")
        return plan_step(
            chunks,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            cos_table=self.cos_table,
            sin_table=self.sin_table,
            device=self.device,
        )

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> torch.Tensor:
        """Run one step: writes the K/V of every planned token into the pool and returns
        fp32 logits ``[len(plan.logit_rows), vocab_size]``."""
        c, w = self.config, self.weights
        t = plan.num_tokens
        x = w.embed.index_select(0, plan.token_ids)
        for layer, kv in zip(w.layers, self.kv):
            h = _rms_norm(x, layer["input_layernorm"], c.rms_norm_eps)
            q = F.linear(h, layer["q_proj"]).view(t, c.num_heads, c.head_dim)
            k = F.linear(h, layer["k_proj"]).view(t, c.num_kv_heads, c.head_dim)
            v = F.linear(h, layer["v_proj"]).view(t, c.num_kv_heads, c.head_dim)
            q = apply_rope(q, plan.cos, plan.sin).contiguous()
            k = apply_rope(k, plan.cos, plan.sin).contiguous()
            plan.kv_write.run(kv, k, v.contiguous())
            attn = plan.attention.run(q, kv, impl=self.attention_impl)
            x = x + F.linear(attn.view(t, c.num_heads * c.head_dim), layer["o_proj"])
            h = _rms_norm(x, layer["post_attention_layernorm"], c.rms_norm_eps)
            x = x + F.linear(F.silu(F.linear(h, layer["gate_proj"])) * F.linear(h, layer["up_proj"]), layer["down_proj"])
        last = x.index_select(0, plan.logit_rows)
        return F.linear(_rms_norm(last, w.norm, c.rms_norm_eps), w.lm_head, w.lm_head_bias)
