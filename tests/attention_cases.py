"""Random paged-attention batches shared by the CPU and GPU attention tests.

Every batch is fresh random data (never zeros) in a pool larger than needed, with each
request's blocks drawn from a shuffled permutation, so block ids are non-contiguous and
out of order. Outputs are poisoned with NaN before a run so an unwritten element fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.attention import paged_attention

# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8.
HEADS = [(4, 4), (6, 2), (16, 2)]
BLOCK_SIZES = [1, 16, 32]
# Ragged lengths: a single token, one ending mid-block, exact multiples, a longer one.
DECODE = ([1, 1, 1, 1], [1, 37, 64, 130])
PREFILL = ([1, 5, 64, 40], [1, 37, 64, 130])  # queries are the last q tokens of each request
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass
class Batch:
    q: torch.Tensor
    kv: torch.Tensor
    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor

    def args(self):
        return self.q, self.kv, self.q_indptr, self.kv_indptr, self.kv_indices, self.kv_lens


def make_batch(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_blocks: int = 7,
    generator: torch.Generator | None = None,
) -> Batch:
    need = [(n + block_size - 1) // block_size for n in kv_lens]
    num_blocks = sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator)
    indices, indptr, start = [], [0], 0
    for n in need:
        indices += perm[start : start + n].tolist()
        start += n
        indptr.append(len(indices))
    q_indptr = [0]
    for n in q_lens:
        q_indptr.append(q_indptr[-1] + n)
    kv = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_dim, generator=generator).to(dtype)
    q = torch.randn(q_indptr[-1], num_heads, head_dim, generator=generator).to(dtype)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    return Batch(q.to(device), kv.to(device), ints(q_indptr), ints(indptr), ints(indices), ints(kv_lens))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def check_against_reference(batch: Batch, impl: str, dtype: torch.dtype) -> None:
    """Run `impl` into NaN-poisoned buffers and compare output and LSE with the reference."""
    out = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device=batch.q.device)
    got, got_lse = paged_attention(*batch.args(), return_lse=True, impl=impl, out=out, lse=lse)
    assert got is out and got_lse is lse
    want, want_lse = paged_attention(*batch.args(), return_lse=True, impl="reference")
    assert not torch.isnan(out).any(), "an output element was never written"
    assert not torch.isnan(lse).any(), "an LSE element was never written"
    err = relative_error(out, want)
    assert err < TOLERANCE[dtype], f"relative error {err:.3g} >= {TOLERANCE[dtype]}"
    assert (lse - want_lse).abs().max().item() < 1e-3
