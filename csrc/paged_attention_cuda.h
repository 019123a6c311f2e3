// Host entry points of the CUDA paged-attention kernels (csrc/paged_attention.cu), for
// the pybind11 binding. Present only in builds with PREFIXCACHE_WITH_CUDA (setup.py found
// nvcc). Pointers are device addresses handed over as integers by the Python layer,
// which has validated every shape, dtype, index and alignment; launch configuration
// (kernel, grid, splits) is chosen there too, identically for this path and the cupy path.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace prefixcache {

// The uniform argument list every attention kernel takes (see PC_ATTN_PARAMS in the .cu).
struct CudaAttentionArgs {
  uintptr_t q, kv, out, lse, part_o, part_lse;
  uintptr_t q_indptr, kv_indptr, kv_indices, kv_lens;
  int32_t batch, total_q, num_heads, num_kv_heads, head_dim, block_size, num_splits, split_tokens;
  float scale_log2;
  int32_t window_left, chunk_size;  // local attention (paged_attention_cpu.h); -1, 0: none
};

// Names of the compiled kernels (e.g. "pa_simt_bf16_d128_r4").
std::vector<std::string> cuda_attention_kernels();

// Launches kernel `name` on `device` and `stream` (a cudaStream_t as an integer; 0 is the
// legacy default stream). Throws std::invalid_argument for an unknown name and
// std::runtime_error carrying the CUDA error string if the launch fails.
void cuda_attention_launch(const std::string& name, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                           unsigned block, int device, uintptr_t stream, const CudaAttentionArgs& args);

}  // namespace prefixcache
