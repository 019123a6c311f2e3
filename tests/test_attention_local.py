"""Local attention in the paged kernel: a sliding window (`window_left`) and chunks (`chunk_size`).

The C++ kernel against the torch reference (the same masks built with SDPA), with null
blocks (-1) where no query reads; a query's result does not depend on the other queries
of its call; bad arguments and a null block a query reads are ValueErrors naming them.
The CUDA kernels take the same arguments (test_attention_cuda.py compiles them); on a
machine with a GPU the same cases run through each GPU path against the reference
(`benchmarks/gpu_check.sh` runs this file).
"""

from __future__ import annotations

import pytest
import torch

from prefixcache.attention import available_gpu_impls, paged_attention


def _case(seed: int, kv_len: int, n_q: int, bs: int = 16, heads: int = 4, kv_heads: int = 2):
    g = torch.Generator().manual_seed(seed)
    blocks = -(-kv_len // bs)
    kv = torch.randn(blocks + 3, 2, kv_heads, bs, 64, generator=g)
    q = torch.randn(n_q, heads, 64, generator=g)
    table = torch.randperm(blocks + 3, generator=g)[:blocks].tolist()
    return q, kv, table


@pytest.mark.parametrize(("window_left", "chunk_size"), [(47, 0), (15, 0), (0, 0), (-1, 64), (-1, 40), (100, 64)])
@pytest.mark.parametrize(("kv_len", "n_q"), [(200, 1), (200, 37), (130, 130), (65, 3)])
def test_cpu_kernel_matches_the_reference(window_left, chunk_size, kv_len, n_q):
    q, kv, table = _case(kv_len * 7 + n_q, kv_len, n_q)
    args = (q, kv, [0, n_q], [0, len(table)], table, [kv_len])
    want = paged_attention(*args, impl="reference", window_left=window_left, chunk_size=chunk_size)
    got = paged_attention(*args, impl="cpu", window_left=window_left, chunk_size=chunk_size)
    assert float((got - want).abs().max()) < 2e-5
    full = paged_attention(*args, impl="cpu")
    if kv_len - n_q > (window_left if window_left >= 0 else 10**9) or chunk_size:
        assert not torch.allclose(full, got)  # the mask changed something


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("impl", available_gpu_impls() or ["cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("window_left", "chunk_size"), [(47, 0), (511, 0), (-1, 64), (100, 64)])
@pytest.mark.parametrize(("kv_len", "n_q"), [(200, 1), (1300, 1), (130, 130), (900, 300)])
def test_gpu_kernels_mask_as_the_reference(window_left, chunk_size, kv_len, n_q, dtype, impl):
    """Gemma 3's 512-token window (window_left 511) and the shapes above, decode and
    prefill, on the GPU paths: the sliding-window model's attention on CUDA."""
    if impl not in available_gpu_impls():
        pytest.skip(f"{impl} path not available")
    q, kv, table = _case(kv_len * 5 + n_q, kv_len, n_q)
    q, kv = q.to("cuda", dtype), kv.to("cuda", dtype)
    args = (q, kv, [0, n_q], [0, len(table)], table, [kv_len])
    want = paged_attention(*args, impl="reference", window_left=window_left, chunk_size=chunk_size)
    got = paged_attention(*args, impl=impl, window_left=window_left, chunk_size=chunk_size)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert float((got.float() - want.float()).abs().max()) < tol


def test_null_blocks_before_the_window_are_never_read():
    q, kv, table = _case(1, 200, 5)
    first = 200 - 5 - 47  # the first query reads from token 148: blocks 0..8 are unread
    nulled = [-1] * (first // 16) + table[first // 16 :]
    args = (q, kv, [0, 5], [0, len(table)])
    want = paged_attention(*args, table, [200], window_left=47, impl="reference")
    for impl in ("cpu", "reference"):
        got = paged_attention(*args, nulled, [200], window_left=47, impl=impl)
        assert float((got - want).abs().max()) < 2e-5


def test_a_query_does_not_depend_on_the_others_in_its_call():
    q, kv, table = _case(2, 300, 90)
    for window_left, chunk in ((47, 0), (-1, 64), (-1, 0)):
        all_at_once = paged_attention(q, kv, [0, 90], [0, len(table)], table, [300], window_left=window_left, chunk_size=chunk)
        one_by_one = torch.cat([
            paged_attention(q[i : i + 1], kv, [0, 1], [0, len(table)], table, [211 + i], window_left=window_left, chunk_size=chunk)
            for i in range(90)
        ])  # fmt: skip
        assert torch.equal(all_at_once, one_by_one)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window_left": -2}, "window_left must be an int >= -1"),
        ({"chunk_size": -1}, "chunk_size must be an int >= 0"),
        ({"window_left": True}, "window_left must be an int"),
    ],
)
def test_bad_local_arguments_name_themselves(kwargs, message):
    q, kv, table = _case(3, 40, 2)
    with pytest.raises(ValueError, match=message):
        paged_attention(q, kv, [0, 2], [0, len(table)], table, [40], **kwargs)


def test_a_null_block_a_query_reads_is_refused():
    q, kv, table = _case(4, 100, 2)
    nulled = [-1] + table[1:]
    with pytest.raises(ValueError, match="outside the pool"):
        paged_attention(q, kv, [0, 2], [0, len(table)], nulled, [100], window_left=95)
    with pytest.raises(ValueError, match="outside the pool"):
        paged_attention(q, kv, [0, 2], [0, len(table)], nulled, [100])
