"""The CUDA kernels: launch planning and compilation on any machine; numerics where a GPU is.

The compile tests run without a GPU: NVRTC (cuda-bindings + nvidia-cuda-nvrtc, the nvrtc
extra) must turn csrc/paged_attention.cu into PTX, as the cupy path does at first use, and
nvcc must assemble it for sm_80 and sm_90 (skipped only where nvcc is absent). The GPU
tests run the CPU suite's comparisons against the torch reference through every GPU path
that is available ("cuda": compiled into _C; "cupy": NVRTC at run time).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from attention_cases import BLOCK_SIZES, DECODE, HEADS, PREFILL, check_against_reference, make_batch

from prefixcache import _C
from prefixcache._attention_cuda import MMA_HEAD_DIMS, SIMT_ROWS, kernel_source, launch_config
from prefixcache.attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, available_gpu_impls

SOURCE = kernel_source()
TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def expected_kernels() -> set[str]:
    """Every kernel name launch_config can ask for."""
    names = set()
    for dtype, tag in TAGS.items():
        names.add(f"pa_merge_{tag}")
        for d in SUPPORTED_HEAD_DIMS:
            names |= {f"pa_simt_{tag}_d{d}_r{r}" for r in SIMT_ROWS}
            if dtype != torch.float32 and d in MMA_HEAD_DIMS:
                names.add(f"pa_mma_{tag}_d{d}")
    return names


# ---- launch planning (pure, runs everywhere) ----


def test_decode_benchmark_shape_splits_into_equal_parts():
    # 64 requests x 8 KV heads = 512 CTAs would be 1.3 waves; 3 equal splits make 3.9.
    cfg = launch_config(torch.bfloat16, 128, 4, 8, 64, 1, 4096, num_sms=132)
    assert cfg.kernel == "pa_simt_bf16_d128_r4"
    assert (cfg.grid, cfg.num_splits, cfg.split_tokens) == ((3, 8, 64), 3, 1408)


def test_small_batch_long_context_splits_kv():
    cfg = launch_config(torch.bfloat16, 128, 4, 8, 1, 1, 32768, num_sms=132)
    assert cfg.split_tokens >= 256 and cfg.split_tokens % 64 == 0
    assert cfg.num_splits * cfg.split_tokens >= 32768 > (cfg.num_splits - 1) * cfg.split_tokens
    assert cfg.grid == (cfg.num_splits, 8, 1)
    # Capped by the minimum split size: 128 splits of 256 keys, 1,024 CTAs for 132 SMs.
    assert (cfg.num_splits, cfg.split_tokens) == (128, 256)


def test_short_contexts_and_big_batches_do_not_split():
    assert launch_config(torch.bfloat16, 128, 4, 8, 4, 1, 300, num_sms=132).num_splits == 1
    assert launch_config(torch.bfloat16, 128, 4, 8, 256, 1, 4096, num_sms=132).num_splits == 1


def test_prefill_uses_tensor_cores_for_half_types_only():
    assert launch_config(torch.float16, 64, 4, 8, 1, 512, 4096, 132).kernel == "pa_mma_f16_d64"
    cfg = launch_config(torch.bfloat16, 128, 4, 8, 1, 512, 4096, 132)
    assert (cfg.kernel, cfg.rows_per_cta, cfg.grid[0]) == ("pa_mma_bf16_d128", 64, 32)
    assert launch_config(torch.float32, 128, 4, 8, 1, 512, 4096, 132).kernel == "pa_simt_f32_d128_r8"
    assert launch_config(torch.bfloat16, 256, 4, 8, 1, 512, 4096, 132).kernel == "pa_simt_bf16_d256_r8"


@pytest.mark.parametrize("group, rows", [(1, 1), (2, 2), (3, 4), (4, 4), (6, 8), (8, 8)])
def test_decode_row_tile_covers_the_gqa_group(group, rows):
    assert launch_config(torch.float16, 64, group, 2, 3, 1, 100, 132).rows_per_cta == rows


def test_compiled_kernel_table_matches_the_planner():
    if not _C.cuda_compiled:
        pytest.skip("prefixcache._C was built without CUDA (nvcc absent or PREFIXCACHE_CUDA=0)")
    assert set(_C.cuda_attention_kernels()) == expected_kernels()


# ---- compilation (no GPU needed) ----


def test_source_is_nvrtc_clean():
    device_part = SOURCE.read_text().split("#ifndef __CUDACC_RTC__")[0]
    device_part = re.sub(r"//.*", "", device_part)  # comments may name what the code avoids
    assert "#include" not in device_part
    assert not re.search(r"\bINFINITY\b|<stdint\.h>|\bint32_t\b|\buint32_t\b", device_part)


def test_nvrtc_compiles_every_kernel_to_ptx():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="the `nvrtc` extra (cuda-bindings) is not installed")
    try:
        err, prog = nvrtc.nvrtcCreateProgram(SOURCE.read_bytes(), b"paged_attention.cu", 0, [], [])
    except RuntimeError as e:  # the NVRTC shared library itself is missing
        pytest.skip(f"NVRTC library not loadable: {e}")
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [b"--gpu-architecture=compute_80", b"--std=c++17"]
    (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    _, log_size = nvrtc.nvrtcGetProgramLogSize(prog)
    # NVRTC writes into the buffer it is given: a bytearray, never `b" " * n`, which for
    # n == 1 is CPython's shared one-byte object (an empty log would turn every b" " in
    # the process into b"\x00").
    log = bytearray(log_size)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")
    _, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = bytearray(size)
    nvrtc.nvrtcGetPTX(prog, ptx)
    entries = set(re.findall(rb"\.entry (\w+)\(", ptx))
    assert {n.encode() for n in expected_kernels()} <= entries


def _nvcc() -> str | None:
    for candidate in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.mark.parametrize("arch", ["80", "90"])
def test_nvcc_assembles_for_each_target(tmp_path, arch):
    if _C.cuda_compiled:
        # setup.py already ran nvcc for sm_80 and sm_90; _C holds the result.
        assert set(_C.cuda_attention_kernels()) == expected_kernels()
        return
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    out = tmp_path / f"pa_sm{arch}.cubin"
    cmd = [nvcc, "-cubin", f"-arch=sm_{arch}", "-O3", "-std=c++17", "-Icsrc", str(SOURCE), "-o", str(out)]
    subprocess.run(cmd, check=True, cwd=SOURCE.parent.parent)
    assert out.stat().st_size > 0


# ---- numerics on a GPU ----


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
IMPLS = available_gpu_impls() or ["cuda"]


@needs_gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("shape", [DECODE, PREFILL], ids=["decode", "prefill"])
def test_gpu_matches_reference(shape, head_dim, heads, block_size, dtype, impl):
    if impl not in available_gpu_impls():
        pytest.skip(f"{impl} path not available")
    batch = make_batch(*shape, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, block_size=block_size,
                       dtype=dtype, device="cuda")
    check_against_reference(batch, impl, dtype)


@needs_gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_len", [1, 300])
def test_gpu_split_kv_and_head_dim_256(q_len, dtype, impl):
    if impl not in available_gpu_impls():
        pytest.skip(f"{impl} path not available")
    # One request with a long context: few CTAs, so the planner splits the keys.
    for head_dim in (128, 256):
        batch = make_batch([q_len], [5000], num_heads=8, num_kv_heads=2, head_dim=head_dim, block_size=16,
                           dtype=dtype, device="cuda")
        check_against_reference(batch, impl, dtype)
