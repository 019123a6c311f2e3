"""Paged attention: the native kernels vs the torch reference (gather + SDPA), side by side.

CPU (default): decode of 8 requests x 4,096 tokens and prefill of 512 new tokens on 3,584
cached ones, 32 query / 8 KV heads (GQA 4), head_dim 64 and 128, fp32, block_size 16, block
ids shuffled. Each kernel and the reference run alternately on the same plan; best of
--repeat rounds. Printed: us per call, reference/kernel ratio, achieved GB/s (KV + q + out
bytes over the time) and its share of this machine's streaming read bandwidth, measured
here first with a large multi-threaded torch sum. Targets: ratio >= 1.0, decode >= 50%.

GPU (--gpu): decode of 64 requests x 4,096 tokens, 32/8 heads, head_dim 128, bf16 (target
<= 320 us on an H200, >= 80% of 4.3 TB/s), a small-batch long-context decode that uses
split-KV, and an fp16/bf16 prefill on the tensor-core kernel; every GPU path available
("cuda" in _C, "cupy" via NVRTC) is checked against the reference, then timed with CUDA
events.

    python benchmarks/bench_attention.py [--repeat 5] [--json out.json]
    python benchmarks/bench_attention.py --gpu [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prefixcache import _C
from prefixcache.attention import PagedAttentionPlan, available_gpu_impls, plan_paged_attention

H200_BANDWIDTH_GBS = 4300.0


@dataclass
class Case:
    name: str
    q_lens: list[int]
    kv_lens: list[int]
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.float32


def build(case: Case, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionPlan]:
    g = torch.Generator().manual_seed(seed)
    bs = case.block_size
    need = [(n + bs - 1) // bs for n in case.kv_lens]
    num_blocks = sum(need) + 16
    perm = torch.randperm(num_blocks, generator=g)
    indices, indptr = [], [0]
    for n in need:
        indices += perm[indptr[-1] : indptr[-1] + n].tolist()
        indptr.append(len(indices))
    q_indptr = [0]
    for n in case.q_lens:
        q_indptr.append(q_indptr[-1] + n)
    kv = torch.randn(num_blocks, 2, case.num_kv_heads, bs, case.head_dim, generator=g).to(case.dtype).to(device)
    q = torch.randn(q_indptr[-1], case.num_heads, case.head_dim, generator=g).to(case.dtype).to(device)
    plan = plan_paged_attention(q_indptr, indptr, indices, case.kv_lens, num_blocks=num_blocks, block_size=bs,
                                device=device)
    return q, kv, plan


def bytes_moved(case: Case) -> int:
    """KV of every visited token (read once per GQA group), plus q read and out written."""
    elem = torch.finfo(case.dtype).bits // 8
    kv = sum(case.kv_lens) * 2 * case.num_kv_heads * case.head_dim * elem
    return kv + 2 * sum(case.q_lens) * case.num_heads * case.head_dim * elem


def flops(case: Case) -> int:
    """2 x (QK^T + PV) multiply-adds over the keys each query sees (causal)."""
    visible = sum(sum(kv - q + i + 1 for i in range(q)) for q, kv in zip(case.q_lens, case.kv_lens))
    return 4 * visible * case.num_heads * case.head_dim


def time_cpu(fn: Callable[[], object], min_seconds: float = 0.3) -> float:
    """Seconds per call: a loop of at least `min_seconds`, after one warm-up call."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / n


def streaming_read_gbs(nbytes: int = 1 << 30) -> float:
    """This machine's read bandwidth: best of 5 multi-threaded sums over `nbytes` of fp32."""
    x = torch.ones(nbytes // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def run_cpu(repeat: int) -> dict:
    stream = streaming_read_gbs()
    threads = torch.get_num_threads()
    print(f"# bench_attention (CPU): {platform.processor() or platform.machine()}, {threads} threads, "
          f"OpenMP={_C.cpu_attention_parallel}, torch {torch.__version__}")
    print(f"# streaming read bandwidth (torch sum over 1 GiB fp32): {stream:.1f} GB/s")
    cases = [
        Case("decode 8x4096 d64", [1] * 8, [4096] * 8, head_dim=64),
        Case("decode 8x4096 d128", [1] * 8, [4096] * 8, head_dim=128),
        Case("prefill 512 on 3584 d64", [512], [4096], head_dim=64),
        Case("prefill 512 on 3584 d128", [512], [4096], head_dim=128),
    ]
    print(f"{'case (fp32, GQA 32/8, bs 16)':<28} {'kernel us':>11} {'ref us':>11} {'ratio':>7} {'GB/s':>7} "
          f"{'% stream':>9} {'GFLOP/s':>8} {'rel err':>8}")
    rows = []
    for case in cases:
        q, kv, plan = build(case, "cpu")
        err = relative_error(plan.run(q, kv, impl="cpu"), plan.run(q, kv, impl="reference"))
        kernel = ref = float("inf")
        for _ in range(repeat):  # alternate so machine noise hits both sides alike
            kernel = min(kernel, time_cpu(lambda: plan.run(q, kv, impl="cpu")))
            ref = min(ref, time_cpu(lambda: plan.run(q, kv, impl="reference")))
        gbs = bytes_moved(case) / kernel / 1e9
        gflops = flops(case) / kernel / 1e9
        rows.append({"case": case.name, "kernel_us": kernel * 1e6, "reference_us": ref * 1e6, "ratio": ref / kernel,
                     "gb_per_s": gbs, "percent_of_stream": 100 * gbs / stream, "gflop_per_s": gflops,
                     "relative_error": err})
        print(f"{case.name:<28} {kernel * 1e6:>11.0f} {ref * 1e6:>11.0f} {ref / kernel:>6.2f}x {gbs:>7.1f} "
              f"{100 * gbs / stream:>8.0f}% {gflops:>8.1f} {err:>8.1e}")
    return {"device": "cpu", "threads": threads, "stream_gb_per_s": stream, "rows": rows}


def time_gpu(fn: Callable[[], object], iters: int = 50) -> float:
    """Seconds per call from CUDA events around `iters` back-to-back calls, after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def run_gpu() -> dict:
    from prefixcache import _attention_cuda

    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU and a CUDA build of torch")
    impls = available_gpu_impls()
    props = torch.cuda.get_device_properties(0)
    print(f"# bench_attention (GPU): {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"paths {impls}")
    cases = [
        Case("decode 64x4096 d128 bf16", [1] * 64, [4096] * 64, dtype=torch.bfloat16),
        Case("decode 4x32768 d128 bf16 (split)", [1] * 4, [32768] * 4, dtype=torch.bfloat16),
        Case("prefill 8x512 on 3584 d128 bf16", [512] * 8, [4096] * 8, dtype=torch.bfloat16),
        Case("prefill 8x512 on 3584 d128 f16", [512] * 8, [4096] * 8, dtype=torch.float16),
    ]
    print(f"{'case (GQA 32/8, bs 16)':<34} {'impl':<5} {'kernel':<22} {'us':>8} {'ref us':>9} {'GB/s':>7} "
          f"{'% 4.3TB/s':>9} {'TFLOP/s':>8} {'rel err':>8}")
    rows = []
    for case in cases:
        q, kv, plan = build(case, "cuda")
        want = plan.run(q, kv, impl="reference")
        ref = time_gpu(lambda: plan.run(q, kv, impl="reference"), iters=3)
        cfg = _attention_cuda.launch_config(case.dtype, case.head_dim, case.num_heads // case.num_kv_heads,
                                            case.num_kv_heads, plan.batch_size, plan.max_q_len, plan.max_kv_len,
                                            props.multi_processor_count)
        for impl in impls:
            err = relative_error(plan.run(q, kv, impl=impl), want)
            t = time_gpu(lambda: plan.run(q, kv, impl=impl))
            gbs = bytes_moved(case) / t / 1e9
            tflops = flops(case) / t / 1e12
            kernel = f"{cfg.kernel}x{cfg.num_splits}"
            rows.append({"case": case.name, "impl": impl, "kernel": kernel, "us": t * 1e6, "reference_us": ref * 1e6,
                         "gb_per_s": gbs, "percent_of_peak": 100 * gbs / H200_BANDWIDTH_GBS, "tflop_per_s": tflops,
                         "relative_error": err})
            print(f"{case.name:<34} {impl:<5} {kernel:<22} {t * 1e6:>8.1f} {ref * 1e6:>9.0f} {gbs:>7.0f} "
                  f"{100 * gbs / H200_BANDWIDTH_GBS:>8.1f}% {tflops:>8.1f} {err:>8.1e}")
        del q, kv, plan, want
        torch.cuda.empty_cache()
    print("# targets: decode 64x4096 <= 320 us and >= 80% of 4.3 TB/s on an H200")
    return {"device": props.name, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="benchmark the CUDA paths instead of the CPU kernel")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds per CPU case")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    result = run_gpu() if args.gpu else run_cpu(args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if not math.isfinite(sum(r.get("relative_error", 0.0) for r in result["rows"])):
        raise SystemExit("a result was not finite")


if __name__ == "__main__":
    main()
