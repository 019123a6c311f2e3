"""GPU launches of the paged-attention kernels in csrc/paged_attention.cu.

Owns: choosing the kernel (CUDA-core `pa_simt` for decode and fp32, tensor-core `pa_mma`
for fp16/bf16 prefill), the rows per CTA, the split-KV partition and the grid, and
launching them either through the nvcc-built extension (`impl="cuda"`) or through
`cupy.RawModule`, which compiles the same .cu with NVRTC at first use (`impl="cupy"`).
Both paths get identical launches from `launch_config`.

Must never: be imported by `import prefixcache` (attention.py imports it only for CUDA
tensors), or launch before prefixcache.attention has validated the batch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache import _C

__all__ = ["LaunchConfig", "launch_config", "launch", "kernel_source"]

THREADS = 128  # pc_attn::kThreads
MMA_ROWS = 64  # rows (query x group head) per pa_mma CTA: 4 warps x 16
MMA_HEAD_DIMS = (64, 128)
SIMT_ROWS = (1, 2, 4, 8)  # the instantiated pa_simt row tiles
MIN_SPLIT_TOKENS = 256  # below this a split costs more in merging than it gains
SIMT_CTAS_PER_SM = 8
_LOG2E = 1.4426950408889634
_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class LaunchConfig:
    kernel: str
    grid: tuple[int, int, int]  # (row tiles x splits, kv heads, requests)
    rows_per_cta: int
    num_splits: int
    split_tokens: int  # keys per split


def launch_config(
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    num_kv_heads: int,
    batch_size: int,
    max_q_len: int,
    max_kv_len: int,
    num_sms: int,
) -> LaunchConfig:
    """The kernel and grid for one batch. Pure: depends on shapes only (tested on CPU).

    Split-KV kicks in when the batch alone gives too few CTAs: the bandwidth-bound decode
    kernel wants SIMT_CTAS_PER_SM per SM (several waves of its ~3 resident CTAs per SM, so
    the last wave is not a long tail), the compute-bound MMA kernel one per SM. Keys are cut
    into equal splits of at least MIN_SPLIT_TOKENS; the merge costs one small extra kernel.
    """
    tag = _TAGS[dtype]
    max_rows = max_q_len * group
    if dtype != torch.float32 and head_dim in MMA_HEAD_DIMS and max_rows >= 16:
        kernel, rows, target = f"pa_mma_{tag}_d{head_dim}", MMA_ROWS, num_sms
    else:
        rows = next(r for r in SIMT_ROWS if r >= min(max_rows, SIMT_ROWS[-1]))
        kernel, target = f"pa_simt_{tag}_d{head_dim}_r{rows}", SIMT_CTAS_PER_SM * num_sms
    row_tiles = max(1, math.ceil(max_rows / rows))
    base = row_tiles * num_kv_heads * batch_size
    num_splits, split_tokens = 1, max(1, max_kv_len)
    if base < target and max_kv_len >= 2 * MIN_SPLIT_TOKENS:
        wanted = min(math.ceil(target / base), max_kv_len // MIN_SPLIT_TOKENS)
        split_tokens = 64 * math.ceil(max_kv_len / wanted / 64)
        num_splits = math.ceil(max_kv_len / split_tokens)
    if batch_size > 65535 or num_kv_heads > 65535:
        raise ValueError(f"batch_size and num_kv_heads must be <= 65535 on CUDA, got {batch_size}, {num_kv_heads}")
    return LaunchConfig(kernel, (row_tiles * num_splits, num_kv_heads, batch_size), rows, num_splits, split_tokens)


def kernel_source() -> Path:
    """csrc/paged_attention.cu: beside the extension in an installed wheel, else in the repo."""
    for candidate in (
        Path(__file__).with_name("paged_attention.cu"),
        Path(__file__).resolve().parent.parent / "csrc" / "paged_attention.cu",
    ):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError("paged_attention.cu is neither beside prefixcache/ nor in ../csrc/")


@functools.lru_cache(maxsize=None)
def _cupy_module(device_index: int):
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=kernel_source().read_text(), options=("--std=c++17",))


def launch(
    backend: str,
    plan,
    q: torch.Tensor,
    kv: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Run attention for a validated `plan` (prefixcache.attention.PagedAttentionPlan)."""
    for name, t in (("q", q), ("kv", kv), ("out", out)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must be 16-byte aligned for the CUDA kernels (its storage offset is not)")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv.shape[2]
    device = q.device
    cfg = launch_config(
        q.dtype,
        head_dim,
        num_heads // num_kv_heads,
        num_kv_heads,
        plan.batch_size,
        plan.max_q_len,
        plan.max_kv_len,
        torch.cuda.get_device_properties(device).multi_processor_count,
    )
    if plan.total_q == 0:
        return
    part_o = part_lse = None
    if cfg.num_splits > 1:
        part_o = torch.empty((cfg.num_splits, plan.total_q, num_heads, head_dim), dtype=torch.float32, device=device)
        part_lse = torch.empty((cfg.num_splits, plan.total_q, num_heads), dtype=torch.float32, device=device)

    def ptr(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr()

    pointers = [ptr(t) for t in (q, kv, out, lse, part_o, part_lse)]
    pointers += [t.data_ptr() for t in (plan.q_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_lens)]
    ints = [plan.batch_size, plan.total_q, num_heads, num_kv_heads, head_dim, plan.block_size, cfg.num_splits]
    ints.append(cfg.split_tokens)
    scale_log2 = scale * _LOG2E
    local = (plan.window_left, plan.chunk_size)
    launches = [(cfg.kernel, cfg.grid, THREADS)]
    if cfg.num_splits > 1:
        elements = plan.total_q * num_heads * head_dim
        launches.append((f"pa_merge_{_TAGS[q.dtype]}", (math.ceil(elements / 256), 1, 1), 256))
    stream = torch.cuda.current_stream(device).cuda_stream
    if backend == "cuda":
        for kernel, grid, block in launches:
            _C.cuda_attention_launch(
                kernel, *grid, block, device.index, stream, *pointers, *ints, scale_log2, *local
            )
        return
    import cupy
    import numpy as np

    module = _cupy_module(device.index)
    args = tuple(np.uint64(p) for p in pointers) + tuple(np.int32(i) for i in ints) + (np.float32(scale_log2),)
    args += tuple(np.int32(i) for i in local)
    with cupy.cuda.Device(device.index), cupy.cuda.ExternalStream(stream):
        for kernel, grid, block in launches:
            module.get_function(kernel)(grid, (block,), args)
