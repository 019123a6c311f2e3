"""Paged attention on the CPU: the C++ kernel against the torch reference, and every error path."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from attention_cases import (
    BLOCK_SIZES,
    DECODE,
    HEADS,
    PREFILL,
    check_against_reference,
    make_batch,
    relative_error,
)

from prefixcache import _C
from prefixcache.attention import (
    KV_LAYOUT,
    merge_attention_states,
    paged_attention,
    plan_paged_attention,
    write_kv,
)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_fp32_matches_reference(shape, head_dim, heads, block_size):
    batch = make_batch(*shape, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size)
    check_against_reference(batch, "cpu", torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("shape", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_half_types_match_reference(shape, block_size, dtype):
    batch = make_batch(*shape, num_heads=6, num_kv_heads=2, head_dim=128, block_size=block_size, dtype=dtype)
    check_against_reference(batch, "cpu", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_256_and_long_context(dtype):
    # Several 64-token chunks per request and a query tile that crosses the diagonal mid-chunk.
    batch = make_batch([3, 70], [300, 517], num_heads=8, num_kv_heads=1, head_dim=256, block_size=16, dtype=dtype)
    check_against_reference(batch, "cpu", dtype)


def test_auto_picks_the_cpu_kernel_and_default_scale():
    batch = make_batch(*DECODE, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    auto = paged_attention(*batch.args())
    explicit = paged_attention(*batch.args(), scale=1 / math.sqrt(64), impl="cpu")
    assert torch.equal(auto, explicit)
    other_scale = paged_attention(*batch.args(), scale=0.5, impl="cpu")
    assert relative_error(other_scale, paged_attention(*batch.args(), scale=0.5, impl="reference")) < 1e-5
    assert not torch.equal(other_scale, auto)


def test_plan_is_reused_across_layers():
    batch = make_batch(*PREFILL, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16)
    plan = plan_paged_attention(
        batch.q_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens,
        num_blocks=batch.kv.shape[0], block_size=16,
    )
    for _layer in range(2):
        kv = torch.randn_like(batch.kv)
        got = plan.run(batch.q, kv)
        want = paged_attention(batch.q, kv, batch.q_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_lens,
                               impl="reference")
        assert relative_error(got, want) < 1e-5
    assert (plan.max_q_len, plan.max_kv_len, plan.total_q) == (64, 130, 110)


def test_requests_without_queries_and_empty_batch():
    batch = make_batch([0, 3, 0], [5, 20, 0], num_heads=4, num_kv_heads=4, head_dim=64, block_size=4)
    check_against_reference(batch, "cpu", torch.float32)
    empty = make_batch([], [], num_heads=4, num_kv_heads=4, head_dim=64, block_size=4)
    assert paged_attention(*empty.args()).shape == (0, 4, 64)


def test_extra_trailing_blocks_are_never_read():
    batch = make_batch([1, 2], [10, 17], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, spare_blocks=0)
    want = paged_attention(*batch.args(), impl="reference")
    # Give request 0 one more block than it needs, then make that block's data NaN.
    extra = torch.cat([batch.kv, torch.full_like(batch.kv[:1], float("nan"))])
    indices = batch.kv_indices.tolist()
    n0 = int(batch.kv_indptr[1])
    indices.insert(n0, extra.shape[0] - 1)
    kv_indptr = torch.tensor([0, n0 + 1, len(indices)], dtype=torch.int32)
    got = paged_attention(batch.q, extra, batch.q_indptr, kv_indptr, torch.tensor(indices, dtype=torch.int32),
                          batch.kv_lens, impl="cpu")
    assert relative_error(got, want) < 1e-5


def test_matches_dense_attention_after_write_kv():
    # Independent of the reference's gather: store K/V token by token with write_kv, then
    # compare with SDPA on the dense tensors (the last 3 tokens query, bottom-right causal).
    num_kv_heads, group, d, bs, n = 2, 3, 64, 16, 45
    kv = torch.randn(9, 2, num_kv_heads, bs, d)
    blocks = [7, 2, 5]
    k, v = torch.randn(n, num_kv_heads, d), torch.randn(n, num_kv_heads, d)
    write_kv(kv, k, v, [blocks[t // bs] * bs + t % bs for t in range(n)])
    q = torch.randn(3, num_kv_heads * group, d)
    got = paged_attention(q, kv, [0, 3], [0, 3], blocks, [n])
    mask = torch.ones(3, n, dtype=torch.bool).tril(diagonal=n - 3)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, 0), v.transpose(0, 1).repeat_interleave(group, 0),
        attn_mask=mask,
    ).transpose(0, 1)
    assert relative_error(got, want) < 1e-5


def test_write_kv_round_trip_touches_only_its_slots():
    kv = torch.randn(6, 2, 3, 4, 64, dtype=torch.bfloat16)
    before = kv.clone()
    k = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    v = torch.randn(5, 3, 64, dtype=torch.bfloat16)
    slots = torch.tensor([22, 3, 4, 9, 0])
    write_kv(kv, k, v, slots)
    blocks, offsets = slots // 4, slots % 4
    for t in range(5):
        assert torch.equal(kv[blocks[t], 0, :, offsets[t]], k[t])
        assert torch.equal(kv[blocks[t], 1, :, offsets[t]], v[t])
    written = torch.zeros(6, 4, dtype=torch.bool)
    written[blocks, offsets] = True
    untouched = ~written[:, None, None, :, None].expand_as(kv)
    assert torch.equal(kv[untouched], before[untouched])


def test_merge_attention_states_rebuilds_full_attention():
    # Decode query over a request's keys split into a prefix and a suffix set of blocks.
    batch = make_batch([1], [100], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    full, full_lse = paged_attention(*batch.args(), return_lse=True)
    blocks = batch.kv_indices
    a, lse_a = paged_attention(batch.q, batch.kv, [0, 1], [0, 4], blocks[:4], [64], return_lse=True)
    b, lse_b = paged_attention(batch.q, batch.kv, [0, 1], [0, 3], blocks[4:], [36], return_lse=True)
    merged, merged_lse = merge_attention_states(a, lse_a, b, lse_b)
    assert relative_error(merged, full) < 1e-5
    assert torch.allclose(merged_lse, full_lse, atol=1e-5)
    # A side with no keys (lse = -inf) leaves the other side unchanged.
    empty = torch.full_like(lse_a, float("-inf"))
    same, same_lse = merge_attention_states(a, lse_a, torch.zeros_like(a), empty)
    assert torch.allclose(same, a) and torch.equal(same_lse, lse_a)


def test_layout_is_named_once():
    assert KV_LAYOUT == ("num_blocks", "kv", "num_kv_heads", "block_size", "head_dim")


def test_import_prefixcache_does_not_import_torch():
    code = "import sys, prefixcache; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- bad inputs: a clear error naming the field, before any pointer reaches C++ ----


@pytest.fixture
def good():
    return make_batch([1, 2], [10, 17], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)


def call(batch, **changes):
    args = dict(zip(["q", "kv", "q_indptr", "kv_indptr", "kv_indices", "kv_lens"], batch.args()))
    args.update(changes)
    return paged_attention(**args)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda b: {"q": b.q[0]}, ValueError, "q must be 3-D"),
        (lambda b: {"q": b.q.tolist()}, TypeError, "q must be a torch.Tensor"),
        (lambda b: {"kv": b.kv[:, :1].contiguous()}, ValueError, r"kv.shape\[1\] must be 2"),
        (lambda b: {"kv": b.kv.double()}, ValueError, "kv.dtype must be one of"),
        (lambda b: {"kv": b.kv.half()}, ValueError, r"kv.dtype \(torch.float16\) must equal q.dtype"),
        (lambda b: {"q": b.q.to(torch.int32)}, ValueError, "q.dtype must be one of"),
        (lambda b: {"kv": b.kv.to("meta")}, ValueError, "kv must be on a cpu or cuda device"),
        (lambda b: {"q": b.q[:, :3].contiguous()}, ValueError, "multiple of num_kv_heads"),
        (lambda b: {"q": b.q[..., :32].contiguous(), "kv": b.kv[..., :32].contiguous()}, ValueError, "head_dim must be one of"),
        (lambda b: {"kv": b.kv[..., :32]}, ValueError, "kv must be contiguous"),
        (lambda b: {"q": b.q.transpose(0, 1).contiguous().transpose(0, 1)}, ValueError, "q must be contiguous"),
        (lambda b: {"q": b.q[:2]}, ValueError, r"q has 2 tokens but q_indptr\[-1\] = 3"),
        (lambda b: {"kv_indices": b.kv_indices.clone().fill_(b.kv.shape[0])}, ValueError, "outside the pool"),
        (lambda b: {"kv_indices": b.kv_indices.clone().fill_(-1)}, ValueError, "block id -1, outside the pool"),
        (lambda b: {"kv_indices": b.kv_indices[:-1]}, ValueError, r"kv_indptr\[-1\] must equal len\(kv_indices\)"),
        (lambda b: {"kv_indices": b.kv_indices.float()}, ValueError, "kv_indices must be int32 or int64"),
        (lambda b: {"kv_lens": torch.tensor([10, 25], dtype=torch.int32)}, ValueError, "need 4 blocks of 8"),
        (lambda b: {"kv_lens": torch.tensor([0, 17], dtype=torch.int32)}, ValueError, "request 0 has 1 queries"),
        (lambda b: {"kv_lens": torch.tensor([-1, 17], dtype=torch.int32)}, ValueError, "kv_lens must be >= 0"),
        (lambda b: {"q_indptr": torch.tensor([0, 2, 1], dtype=torch.int32)}, ValueError, "non-decreasing"),
        (lambda b: {"q_indptr": torch.tensor([1, 3], dtype=torch.int32)}, ValueError, "batch_size \\+ 1 = 3"),
        (lambda b: {"kv_indptr": torch.tensor([[0, 2, 5]])}, ValueError, "kv_indptr must be 1-D"),
    ],
)
def test_bad_inputs(good, change, error, message):
    with pytest.raises(error, match=message):
        call(good, **change(good))


def test_bad_options(good):
    with pytest.raises(ValueError, match="impl must be one of"):
        paged_attention(*good.args(), impl="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        paged_attention(*good.args(), impl="cuda")
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        paged_attention(*good.args(), scale=float("nan"))
    with pytest.raises(ValueError, match="out must be"):
        paged_attention(*good.args(), out=torch.empty(3, 4, 32))
    with pytest.raises(ValueError, match="pass return_lse=True"):
        paged_attention(*good.args(), lse=torch.empty(3, 4))
    with pytest.raises(ValueError, match="lse must be"):
        paged_attention(*good.args(), return_lse=True, lse=torch.empty(3, 4, dtype=torch.float16))


def test_plan_checks_kv_against_itself(good):
    plan = plan_paged_attention(good.q_indptr, good.kv_indptr, good.kv_indices, good.kv_lens,
                                num_blocks=good.kv.shape[0], block_size=8)
    with pytest.raises(ValueError, match="plan was made for num_blocks"):
        plan.run(good.q, good.kv[:-1].contiguous())
    with pytest.raises(ValueError, match="plan was made for block_size=8"):
        plan.run(good.q, good.kv.reshape(good.kv.shape[0], 2, 2, 4, 128)[..., :64].contiguous())
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        plan_paged_attention([0], [0], [], [], num_blocks=4, block_size=0)


def test_native_kernel_rechecks_indices(good):
    # Called directly (bypassing the Python checks), a block id outside the pool is still a
    # ValueError from C++, not an out-of-bounds read.
    bad_indices = good.kv_indices.clone()
    bad_indices[0] = 1 << 20
    out = torch.empty_like(good.q)
    with pytest.raises(ValueError, match="outside"):
        _C.paged_attention_cpu(
            good.q.data_ptr(), good.kv.data_ptr(), out.data_ptr(), 0, good.q_indptr.data_ptr(),
            good.kv_indptr.data_ptr(), bad_indices.data_ptr(), good.kv_lens.data_ptr(), 2, 4, 2, 64,
            good.kv.shape[0], 8, bad_indices.numel(), 0.125, "float32",
        )
    with pytest.raises(ValueError, match="dtype must be one of"):
        _C.paged_attention_cpu(0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 2, 64, 1, 8, 0, 0.125, "float64")


def test_write_kv_bad_inputs():
    kv = torch.randn(4, 2, 2, 8, 64)
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="outside \\[0, 32\\)"):
        write_kv(kv, k, k, [0, 1, 32])
    with pytest.raises(ValueError, match="slot twice"):
        write_kv(kv, k, k, [0, 1, 1])
    with pytest.raises(ValueError, match="3 tokens"):
        write_kv(kv, k, k, [0, 1])
    with pytest.raises(ValueError, match=r"k must be \[num_tokens, 2, 64\]"):
        write_kv(kv, torch.randn(3, 1, 64), k, [0, 1, 2])
    with pytest.raises(ValueError, match="v must be torch.float32"):
        write_kv(kv, k, k.half(), [0, 1, 2])
    with pytest.raises(ValueError, match="kv must be contiguous"):
        write_kv(kv.transpose(0, 1), k, k, [0, 1, 2])
