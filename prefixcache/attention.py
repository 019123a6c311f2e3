"""Paged attention over the block pool: one entry point for decode and prefill-on-cached-prefix.

Owns: the KV layout (`KV_LAYOUT`, named once here), validation of a ragged batch, dispatch to
the three implementations, the torch reference every other implementation is tested against,
`write_kv` / `plan_write_kv` (storing new tokens' K/V into their blocks, validated once per
batch) and `merge_attention_states`.

Implementations (`impl=`):
- ``"cpu"``: the C++ kernel in `prefixcache._C` (csrc/paged_attention_cpu.cpp), CPU tensors.
- ``"cuda"``: csrc/paged_attention.cu compiled into `_C` by setup.py (when nvcc was found).
- ``"cupy"``: the same .cu compiled at first use by `cupy.RawModule` (NVRTC), for a build
  without CUDA on a machine with a GPU.
- ``"reference"``: gather each request's blocks, then `scaled_dot_product_attention`.
- ``"auto"``: cpu for CPU tensors; cuda if compiled in, else cupy, for CUDA tensors.

Batch semantics (docs/attention.md): request ``i`` owns queries
``q[q_indptr[i]:q_indptr[i+1]]``, which are its LAST tokens, and attends causally, bottom-right
aligned, to ``kv_lens[i]`` tokens held in blocks ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``
(token ``t`` lives in slot ``t % block_size`` of the ``t // block_size``-th block). Query
head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (grouped-query attention).

Must never: let a pointer reach native code before every shape, dtype, device, contiguity and
index range has been checked here (a block id outside the pool is a ValueError, never an
out-of-bounds read); import torch at `import prefixcache` time (this module is imported
only by code that asks for attention); know anything about which strategy handed out the
blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from prefixcache import _C

__all__ = [
    "KV_LAYOUT",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "PagedAttentionPlan",
    "plan_paged_attention",
    "paged_attention",
    "write_kv",
    "KVWritePlan",
    "plan_write_kv",
    "merge_attention_states",
    "available_gpu_impls",
]

#: One layer's KV cache: ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``, K at index 0
#: and V at index 1 of dim 1 ("HND" per block, the layout FlashInfer also reads). A block id
#: means the same slot in every layer. Every function here takes exactly this layout.
KV_LAYOUT = ("num_blocks", "kv", "num_kv_heads", "block_size", "head_dim")

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Head sizes every implementation is built for (64: small models, 128: Llama/Qwen/Mistral,
#: 256: Gemma). The CUDA kernels are instantiated per size, so each one costs compile time.
SUPPORTED_HEAD_DIMS = (64, 128, 256)

Impl = Literal["auto", "cpu", "cuda", "cupy", "reference"]
_IMPLS = ("auto", "cpu", "cuda", "cupy", "reference")
_INT32_MAX = 2**31 - 1
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def available_gpu_impls() -> list[str]:
    """The GPU paths this install has, best first: "cuda" (compiled into _C), "cupy" (NVRTC)."""
    return (["cuda"] if _C.cuda_compiled else []) + (["cupy"] if _has_cupy() else [])


def _host_ints(name: str, value: object) -> torch.Tensor:
    """A 1-D int64 CPU copy of an index argument (tensor of any device, or sequence of ints)."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {value.dtype}")
        t = value.detach().to("cpu", torch.int64)
    else:
        try:
            t = torch.as_tensor(value, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{name} must be a 1-D sequence of ints: {e}") from None
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    return t


def _max_or_zero(t: torch.Tensor) -> int:
    return int(t.max()) if t.numel() else 0


def _check_indptr(name: str, indptr: torch.Tensor, batch_size: int, end: int, end_name: str) -> None:
    if indptr.numel() != batch_size + 1:
        raise ValueError(f"{name} must have batch_size + 1 = {batch_size + 1} entries, got {indptr.numel()}")
    if int(indptr[0]) != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(indptr[0])}")
    if bool((indptr[1:] < indptr[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if int(indptr[-1]) != end:
        raise ValueError(f"{name}[-1] must equal {end_name} = {end}, got {int(indptr[-1])}")


@dataclass(frozen=True, eq=False)
class PagedAttentionPlan:
    """A validated ragged batch, reusable by every layer of one forward step.

    Built by `plan_paged_attention`; everything here depends only on the batch, not on a
    layer's tensors, so an engine plans once per step and calls `run` per layer. The index
    tensors are int32 on `device`; `host_*` are the same values on the CPU.
    """

    batch_size: int
    total_q: int  # tokens
    num_blocks: int  # blocks in the pool (kv.shape[0])
    block_size: int  # tokens per block
    max_q_len: int  # tokens
    max_kv_len: int  # tokens
    device: torch.device
    q_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    host_q_indptr: torch.Tensor
    host_kv_indptr: torch.Tensor
    host_kv_indices: torch.Tensor
    host_kv_lens: torch.Tensor
    window_left: int = -1  # TOKENS before a query it reads (a window of window_left + 1); -1: all
    chunk_size: int = 0  # TOKENS per local-attention chunk; 0: none

    def first_key(self, pos: torch.Tensor) -> torch.Tensor:
        """The first key position a query at `pos` reads (0 without local attention)."""
        lo = torch.zeros_like(pos)
        if self.window_left >= 0:
            lo = torch.clamp(pos - self.window_left, min=0)
        if self.chunk_size > 0:
            lo = torch.maximum(lo, pos // self.chunk_size * self.chunk_size)
        return lo

    def run(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        scale: float | None = None,
        *,
        return_lse: bool = False,
        impl: Impl = "auto",
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of `q` over one layer's `kv` for this batch; see `paged_attention`."""
        _check_q_kv(q, kv)
        if q.shape[0] != self.total_q:
            raise ValueError(f"q has {q.shape[0]} tokens but q_indptr[-1] = {self.total_q}")
        if kv.shape[0] != self.num_blocks:
            raise ValueError(f"kv has {kv.shape[0]} blocks but the plan was made for num_blocks={self.num_blocks}")
        if kv.shape[3] != self.block_size:
            raise ValueError(f"kv has block_size {kv.shape[3]} but the plan was made for block_size={self.block_size}")
        if q.device != self.device:
            raise ValueError(f"q is on {q.device} but the plan's index tensors are on {self.device}")
        head_dim = q.shape[2]
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
        if impl not in _IMPLS:
            raise ValueError(f"impl must be one of {', '.join(_IMPLS)}; got {impl!r}")
        if lse is not None and not return_lse:
            raise ValueError("lse= is an output buffer for return_lse=True; pass return_lse=True")
        out = _output(out, "out", q.shape, q.dtype, q.device)
        lse_shape = (q.shape[0], q.shape[1])
        lse_buf = _output(lse, "lse", lse_shape, torch.float32, q.device) if return_lse else None

        chosen = _choose_impl(impl, q.device)
        if chosen == "reference":
            _reference(self, q, kv, scale, out, lse_buf)
        elif chosen == "cpu":
            _run_cpu(self, q, kv, scale, out, lse_buf)
        else:
            from prefixcache import _attention_cuda

            _attention_cuda.launch(chosen, self, q, kv, scale, out, lse_buf)
        return (out, lse_buf) if return_lse else out


def plan_paged_attention(
    q_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    *,
    num_blocks: int,
    block_size: int,
    device: torch.device | str = "cpu",
    window_left: int = -1,
    chunk_size: int = 0,
) -> PagedAttentionPlan:
    """Validate a ragged batch once and return the plan every layer reuses.

    Index arguments are torch int32/int64 tensors (any device) or sequences of ints; they
    are checked on the host. `num_blocks` is the pool size in blocks, `block_size` in
    tokens. Each request needs at least ``ceil(kv_lens[i] / block_size)`` blocks (extra
    trailing blocks are allowed and never read) and at most ``kv_lens[i]`` queries.
    Local attention (hybrid layouts): a query at position p reads keys from
    ``p - window_left`` (`window_left` >= 0: a sliding window of window_left + 1 TOKENS,
    FlashInfer's name) and from ``p // chunk_size * chunk_size`` (`chunk_size` > 0:
    chunked local attention) on; then a block before the first key of the request's
    first query may be -1 (`prefixcache.layout.NULL_BLOCK`: the cache no longer holds
    it), and is never read. Raises ValueError naming the field on any violation.
    """
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1 (TOKENS; -1: no window), got {window_left!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
        raise ValueError(f"chunk_size must be an int >= 0 (TOKENS; 0: none), got {chunk_size!r}")
    if not isinstance(num_blocks, int) or not 1 <= num_blocks <= _INT32_MAX:
        raise ValueError(f"num_blocks must be an int in [1, 2**31 - 1], got {num_blocks!r}")
    if not isinstance(block_size, int) or not 1 <= block_size <= _INT32_MAX:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    qi = _host_ints("q_indptr", q_indptr)
    ki = _host_ints("kv_indptr", kv_indptr)
    idx = _host_ints("kv_indices", kv_indices)
    lens = _host_ints("kv_lens", kv_lens)
    batch_size = lens.numel()
    if qi.numel() == 0:
        raise ValueError("q_indptr must have batch_size + 1 >= 1 entries, got 0")
    _check_indptr("q_indptr", qi, batch_size, int(qi[-1]), "q_indptr[-1]")
    _check_indptr("kv_indptr", ki, batch_size, idx.numel(), "len(kv_indices)")
    if bool((lens < 0).any()):
        raise ValueError("kv_lens must be >= 0")
    if _max_or_zero(lens) > _INT32_MAX or int(qi[-1]) > _INT32_MAX:
        raise ValueError("kv_lens and the number of queries must fit in int32")
    q_counts = qi[1:] - qi[:-1]
    bad = torch.nonzero(q_counts > lens)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"request {i} has {int(q_counts[i])} queries but kv_lens[{i}] = {int(lens[i])}: queries are the "
            "request's last tokens, so their K/V must already be in the cache (write_kv first)"
        )
    need = (lens + block_size - 1) // block_size
    have = ki[1:] - ki[:-1]
    bad = torch.nonzero(have < need)
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"request {i} has kv_lens[{i}] = {int(lens[i])} tokens, which need {int(need[i])} blocks of "
            f"{block_size}, but kv_indptr gives it {int(have[i])}"
        )
    if idx.numel():
        checked = idx
        if window_left >= 0 or chunk_size > 0:
            # Blocks wholly before the first query's first key are never read: -1 is allowed there.
            first_q = (lens - q_counts).to(torch.int64)
            lo = torch.zeros_like(first_q)
            if window_left >= 0:
                lo = torch.clamp(first_q - window_left, min=0)
            if chunk_size > 0:
                lo = torch.maximum(lo, first_q // chunk_size * chunk_size)
            unread = torch.where(q_counts > 0, lo // block_size, torch.zeros_like(lo))
            position = torch.arange(idx.numel()) - torch.repeat_interleave(ki[:-1], have)
            owner_unread = torch.repeat_interleave(unread, have)
            checked = idx[~((idx == -1) & (position < owner_unread))]
        if checked.numel():
            lo_id, hi = int(checked.min()), int(checked.max())
            if lo_id < 0 or hi >= num_blocks:
                bad_id = lo_id if lo_id < 0 else hi
                raise ValueError(f"kv_indices holds block id {bad_id}, outside the pool [0, {num_blocks})")

    host = [t.to(torch.int32).contiguous() for t in (qi, ki, idx, lens)]
    dev = [t.to(device) for t in host] if torch.device(device).type != "cpu" else host
    device = dev[0].device  # "cuda" becomes "cuda:0", as q.device reads
    return PagedAttentionPlan(
        batch_size=batch_size,
        total_q=int(qi[-1]),
        num_blocks=num_blocks,
        block_size=block_size,
        max_q_len=_max_or_zero(q_counts),
        max_kv_len=_max_or_zero(lens),
        device=device,
        q_indptr=dev[0],
        kv_indptr=dev[1],
        kv_indices=dev[2],
        kv_lens=dev[3],
        host_q_indptr=host[0],
        host_kv_indptr=host[1],
        host_kv_indices=host[2],
        host_kv_lens=host[3],
        window_left=window_left,
        chunk_size=chunk_size,
    )


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    scale: float | None = None,
    *,
    return_lse: bool = False,
    impl: Impl = "auto",
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    chunk_size: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a ragged batch of queries over paged KV; decode and prefill alike.

    q: ``[total_q, num_heads, head_dim]``; kv: one layer in `KV_LAYOUT`, same dtype
    (fp32/fp16/bf16) and device as q, both contiguous. `scale` defaults to
    ``1/sqrt(head_dim)``. Returns ``out`` (q's shape and dtype) and, with `return_lse`,
    the natural-log sum of exp of the scaled scores per (query, head), fp32
    ``[total_q, num_heads]``. `out`/`lse` may be given as preallocated buffers.
    Accumulation is fp32 with an online softmax in every implementation.
    `window_left` and `chunk_size`: local attention (`plan_paged_attention`).
    """
    _check_q_kv(q, kv)
    plan = plan_paged_attention(
        q_indptr, kv_indptr, kv_indices, kv_lens, num_blocks=kv.shape[0], block_size=kv.shape[3], device=q.device,
        window_left=window_left, chunk_size=chunk_size,
    )  # fmt: skip
    return plan.run(q, kv, scale, return_lse=return_lse, impl=impl, out=out, lse=lse)


def _check_tensor(name: str, t: object, dims: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {shape_doc}, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {shape_doc}, got shape {tuple(t.shape)}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype must be one of float32, float16, bfloat16; got {t.dtype}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on a cpu or cuda device, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t


def _check_q_kv(q: torch.Tensor, kv: torch.Tensor) -> None:
    _check_tensor("q", q, 3, "[total_q, num_heads, head_dim]")
    _check_tensor("kv", kv, 5, "[num_blocks, 2, num_kv_heads, block_size, head_dim]")
    if kv.dtype != q.dtype:
        raise ValueError(f"kv.dtype ({kv.dtype}) must equal q.dtype ({q.dtype})")
    if kv.device != q.device:
        raise ValueError(f"kv is on {kv.device} but q is on {q.device}")
    if kv.shape[1] != 2:
        raise ValueError(f"kv.shape[1] must be 2 (K then V), got {kv.shape[1]}")
    head_dim = q.shape[2]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if kv.shape[4] != head_dim:
        raise ValueError(f"kv head_dim ({kv.shape[4]}) must equal q head_dim ({head_dim})")
    num_heads, num_kv_heads = q.shape[1], kv.shape[2]
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if kv.shape[0] < 1 or kv.shape[0] > _INT32_MAX or kv.shape[3] < 1:
        raise ValueError(f"kv must have 1..2**31-1 blocks and block_size >= 1, got shape {tuple(kv.shape)}")


def _output(buf: torch.Tensor | None, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or buf.device != device:
        raise ValueError(
            f"{name} must be {dtype} {tuple(shape)} on {device}, got {buf.dtype} {tuple(buf.shape)} on {buf.device}"
        )
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return buf


def _choose_impl(impl: str, device: torch.device) -> str:
    if impl == "reference":
        return impl
    if device.type == "cpu":
        if impl not in ("auto", "cpu"):
            raise ValueError(f"impl={impl!r} needs CUDA tensors; these are on the CPU (use 'cpu' or 'auto')")
        return "cpu"
    if impl == "cpu":
        raise ValueError("impl='cpu' needs CPU tensors; these are on a CUDA device")
    if impl == "auto":
        impl = (available_gpu_impls() or ["cuda"])[0]
    if impl == "cupy" and not _has_cupy():
        raise RuntimeError("impl='cupy' needs the cupy package (pip install 'prefixcache[cupy]')")
    if impl == "cuda" and not _C.cuda_compiled:
        raise RuntimeError(
            "prefixcache._C was built without CUDA (nvcc not found or PREFIXCACHE_CUDA=0); rebuild with "
            "PREFIXCACHE_CUDA=1, install cupy for the NVRTC path, or use impl='reference'"
        )
    return impl


def _run_cpu(
    plan: PagedAttentionPlan,
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    if plan.total_q == 0:
        return
    _C.paged_attention_cpu(
        q.data_ptr(),
        kv.data_ptr(),
        out.data_ptr(),
        0 if lse is None else lse.data_ptr(),
        plan.host_q_indptr.data_ptr(),
        plan.host_kv_indptr.data_ptr(),
        plan.host_kv_indices.data_ptr(),
        plan.host_kv_lens.data_ptr(),
        plan.batch_size,
        q.shape[1],
        kv.shape[2],
        q.shape[2],
        plan.num_blocks,
        plan.block_size,
        plan.host_kv_indices.numel(),
        scale,
        _DTYPE_NAMES[q.dtype],
        plan.window_left,
        plan.chunk_size,
    )


def _reference(
    plan: PagedAttentionPlan,
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """The oracle: gather each request's blocks, then SDPA in fp32 with a bottom-right causal mask."""
    import torch.nn.functional as F

    num_heads, num_kv_heads, head_dim = q.shape[1], kv.shape[2], q.shape[2]
    group = num_heads // num_kv_heads
    bs = plan.block_size
    for i in range(plan.batch_size):
        q0, q1 = int(plan.host_q_indptr[i]), int(plan.host_q_indptr[i + 1])
        kv_len = int(plan.host_kv_lens[i])
        if q1 == q0:
            continue
        k0 = int(plan.host_kv_indptr[i])
        # A null block (-1, never read under local attention) gathers block 0; the mask hides it.
        blocks = plan.kv_indices[k0 : k0 + (kv_len + bs - 1) // bs].long().clamp(min=0)
        pages = kv.index_select(0, blocks).float()  # [n, 2, Hkv, bs, D]
        k, v = (pages[:, j].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :kv_len] for j in (0, 1))
        qi = q[q0:q1].float().transpose(0, 1)  # [H, n_q, D]
        n_q = q1 - q0
        # Query j is token kv_len - n_q + j: it sees keys 0..that position (bottom-right aligned).
        pos = torch.arange(kv_len - n_q, kv_len, device=q.device)
        keys = torch.arange(kv_len, device=q.device)[None, :]
        mask = keys <= pos[:, None]
        local = plan.window_left >= 0 or plan.chunk_size > 0
        if local:
            mask &= keys >= plan.first_key(pos)[:, None]
        # Query head h reads KV head h // group (enable_gqa); one query sees every key.
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=None if n_q == 1 and not local else mask, scale=scale, enable_gqa=group > 1
        )
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
        if lse is not None:
            scores = (qi @ k.repeat_interleave(group, dim=0).transpose(1, 2)) * scale
            lse[q0:q1] = scores.masked_fill(~mask, float("-inf")).logsumexp(-1).transpose(0, 1)


@dataclass(frozen=True, eq=False)
class KVWritePlan:
    """Validated destination slots for one step's new tokens, reusable by every layer.

    Built by `plan_write_kv`; `blocks`/`offsets` (int64 on `device`) are each token's
    block id and slot within the block, so a layer's write is one indexed store.
    """

    num_tokens: int
    num_blocks: int  # blocks in the pool
    block_size: int  # tokens per block
    device: torch.device
    blocks: torch.Tensor
    offsets: torch.Tensor

    def run(self, kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store `k`, `v` (``[num_tokens, num_kv_heads, head_dim]``) into one layer's `kv`."""
        _check_tensor("kv", kv, 5, "[num_blocks, 2, num_kv_heads, block_size, head_dim]")
        num_blocks, two, num_kv_heads, block_size, head_dim = kv.shape
        if two != 2:
            raise ValueError(f"kv.shape[1] must be 2 (K then V), got {two}")
        if (num_blocks, block_size) != (self.num_blocks, self.block_size) or kv.device != self.device:
            raise ValueError(
                f"kv is {num_blocks} blocks of {block_size} on {kv.device} but the plan was made for "
                f"{self.num_blocks} blocks of {self.block_size} on {self.device}"
            )
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
                raise ValueError(
                    f"{name} must be [num_tokens, {num_kv_heads}, {head_dim}] to match kv, got {tuple(t.shape)}"
                )
            if t.dtype != kv.dtype or t.device != kv.device:
                raise ValueError(f"{name} must be {kv.dtype} on {kv.device}, got {t.dtype} on {t.device}")
            if t.shape[0] != self.num_tokens:
                raise ValueError(f"slot_mapping has {self.num_tokens} entries for {t.shape[0]} tokens in {name}")
        # Advanced indices split by the head slice put the token dim first: [T, Hkv, D], like k.
        kv[self.blocks, 0, :, self.offsets] = k
        kv[self.blocks, 1, :, self.offsets] = v


def plan_write_kv(
    slot_mapping, *, num_blocks: int, block_size: int, device: torch.device | str = "cpu"
) -> KVWritePlan:
    """Validate new tokens' slots once (``block_id * block_size + offset`` each) and return
    the plan every layer's write reuses. Slots must be in the pool and distinct (two
    tokens in one slot is a bug upstream, so a ValueError)."""
    slots = _host_ints("slot_mapping", slot_mapping)
    if slots.numel():
        capacity = num_blocks * block_size
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= capacity:
            raise ValueError(f"slot_mapping holds slot {lo if lo < 0 else hi}, outside [0, {capacity})")
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slot_mapping holds a slot twice")
    slots = slots.to(device)
    return KVWritePlan(
        num_tokens=slots.numel(),
        num_blocks=num_blocks,
        block_size=block_size,
        device=slots.device,
        blocks=slots // block_size,
        offsets=slots % block_size,
    )


def write_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping) -> None:
    """Store new tokens' K and V (``[num_tokens, num_kv_heads, head_dim]``) into `kv`.

    `slot_mapping[t]` is token t's slot, ``block_id * block_size + offset``. Slots must be
    in the pool and distinct (two tokens in one slot is a bug upstream, so a ValueError).
    For one batch written into many layers, `plan_write_kv` once and `run` per layer.
    """
    _check_tensor("kv", kv, 5, "[num_blocks, 2, num_kv_heads, block_size, head_dim]")
    if kv.shape[1] != 2:
        raise ValueError(f"kv.shape[1] must be 2 (K then V), got {kv.shape[1]}")
    plan = plan_write_kv(slot_mapping, num_blocks=kv.shape[0], block_size=kv.shape[3], device=kv.device)
    plan.run(kv, k, v)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets into attention over their union.

    `out_*`: ``[n, num_heads, head_dim]``, `lse_*`: ``[n, num_heads]`` natural-log sums
    (as returned with ``return_lse=True``). A row with no keys on one side has lse -inf
    there and takes the other side unchanged. Computed in fp32; out in out_a's dtype.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or tuple(lse_a.shape) != tuple(out_a.shape[:2]):
        raise ValueError(
            f"shapes must be out [n, H, D] and lse [n, H] on both sides, got {tuple(out_a.shape)}, "
            f"{tuple(lse_a.shape)}, {tuple(out_b.shape)}, {tuple(lse_b.shape)}"
        )
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a.float() - safe).unsqueeze(-1)
    w_b = torch.exp(lse_b.float() - safe).unsqueeze(-1)
    out = w_a * out_a.float() + w_b * out_b.float()
    return out.to(out_a.dtype), lse
