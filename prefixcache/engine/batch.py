"""One forward step's batch: which tokens of which requests, where their K/V goes, what
each query attends to. Planned once per step; every layer reuses it.

Owns `SeqChunk` (one request's slice of a step) and `StepPlan`: token ids, positions,
RoPE cos/sin gathered at those positions, the validated paged-attention plan and KV
write plan (`prefixcache.attention`), and which rows need logits. Everything here
depends only on the batch's shape, never on a layer's tensors (FlashInfer's plan/run
split), so a 30-layer model validates and gathers once per step, not 30 times.

Must never: read or write KV, run the model, or know which caching strategy produced
the block tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixcache.attention import KVWritePlan, PagedAttentionPlan, plan_paged_attention, plan_write_kv

__all__ = ["SeqChunk", "StepPlan", "logit_rows", "plan_step"]


@dataclass(frozen=True)
class SeqChunk:
    """Compute `token_ids` at positions `start, start+1, ...` of one request whose KV
    lives in `block_table` (the request's blocks in token order; the KV of positions
    `< start` is already written). `want_logits`: return logits for the last token.
    `prompt_rows`: the chunk's tokens (indices into `token_ids`) whose logits are returned
    too, after every chunk's last-token row (a request's prompt logprobs)."""

    token_ids: Sequence[int]
    start: int  # TOKENS already in the cache for this request
    block_table: Sequence[int]
    want_logits: bool
    #: Hybrid layouts: each group's block table (`PrefixCache.block_tables`); empty: one table.
    group_tables: tuple[Sequence[int], ...] = ()
    #: The request (a recurrent layer's running state is kept per request).
    request_id: object = None
    #: The request's first chunk since it was admitted: a recurrent layer starts from
    #: the cached state at `start` (zeros at 0), not from a running state.
    fresh: bool = False
    prompt_rows: range = range(0)


def logit_rows(chunks: Sequence[SeqChunk]) -> list[int]:
    """The rows of a step's ragged batch (chunks laid out in order) whose logits a model
    returns, in the order it returns them: each chunk's last row if it `want_logits`,
    then each chunk's `prompt_rows`. ValueError for a prompt row outside its chunk."""
    last, prompt, first = [], [], 0
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        if c.want_logits:
            last.append(first + n - 1)
        if c.prompt_rows:
            if c.prompt_rows.step != 1 or c.prompt_rows.start < 0 or c.prompt_rows.stop > n:
                raise ValueError(f"chunk {i}: prompt_rows {c.prompt_rows} outside its {n} tokens")
            prompt.extend(first + j for j in c.prompt_rows)
        first += n
    return last + prompt


@dataclass(frozen=True, eq=False)
class StepPlan:
    """A planned step (see the module docstring). `logit_rows[j]` is the row of the
    j-th chunk that wants logits, in chunk order, followed by every chunk's prompt rows
    (`logit_rows`)."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [T, head_dim]
    sin: torch.Tensor  # [T, head_dim]
    attention: PagedAttentionPlan
    kv_write: KVWritePlan
    logit_rows: torch.Tensor  # [n] int64

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def plan_step(
    chunks: Sequence[SeqChunk],
    *,
    num_blocks: int,
    block_size: int,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    device: torch.device | str = "cpu",
) -> StepPlan:
    """Lay out `chunks` as one ragged batch. `cos_table`/`sin_table` are the model's
    ``[max_position, head_dim]`` RoPE tables; a position past them is a ValueError."""
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    max_position = cos_table.shape[0]
    q_indptr, kv_indptr, kv_lens, kv_indices, token_ids, positions, slots = [0], [0], [], [], [], [], []
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        if n < 1 or c.start < 0:
            raise ValueError(f"chunk {i}: needs >= 1 token and start >= 0, got {n} tokens at {c.start}")
        end = c.start + n
        if end > max_position:
            raise ValueError(f"chunk {i}: position {end - 1} is past the model's context length {max_position}")
        used = -(-end // block_size)
        if len(c.block_table) < used:
            raise ValueError(f"chunk {i}: {end} tokens need {used} blocks of {block_size}, block table has {len(c.block_table)}")
        table = c.block_table[:used]
        kv_indices.extend(table)
        kv_indptr.append(kv_indptr[-1] + used)
        kv_lens.append(end)
        q_indptr.append(q_indptr[-1] + n)
        token_ids.extend(c.token_ids)
        pos = range(c.start, end)
        positions.extend(pos)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
    pos_t = torch.tensor(positions, dtype=torch.int64)
    attention = plan_paged_attention(
        q_indptr, kv_indptr, kv_indices, kv_lens, num_blocks=num_blocks, block_size=block_size, device=device
    )
    kv_write = plan_write_kv(slots, num_blocks=num_blocks, block_size=block_size, device=device)
    pos_dev = pos_t.to(device)
    return StepPlan(
        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=pos_dev,
        cos=cos_table.index_select(0, pos_dev),
        sin=sin_table.index_select(0, pos_dev),
        attention=attention,
        kv_write=kv_write,
        logit_rows=torch.tensor(logit_rows(chunks), dtype=torch.int64, device=device),
    )
