// Paged attention on the CPU: the C++ kernel behind prefixcache.attention (impl="cpu").
//
// Owns: attention of a ragged batch of queries over one layer's paged KV cache, laid out
// [num_blocks, 2, num_kv_heads, block_size, head_dim] (K then V), for fp32/fp16/bf16 data
// with fp32 accumulation and an online softmax. Request i's queries are its LAST tokens and
// attend causally, bottom-right aligned, to kv_lens[i] tokens held in blocks
// kv_indices[kv_indptr[i] .. kv_indptr[i+1]). Query head h reads KV head h / (H / Hkv).
// Local attention narrows what a query at position p reads to [lo(p), p]: with
// window_left >= 0, lo(p) >= p - window_left (a sliding window of window_left + 1 tokens,
// FlashInfer's window_left); with chunk_size > 0, lo(p) >= p / chunk_size * chunk_size
// (chunked local attention). A block no query of a request reads may be -1 in kv_indices
// (a null block: the cache no longer holds it); it is never dereferenced.
//
// Work is split into items (request, kv head, tile of query rows); a row is one (query,
// query head of the GQA group) pair, so all query heads of a group share one pass over the
// pages. Items run in parallel with OpenMP when the build has it.
//
// Never does: allocate or own tensors, know about torch, or trust its caller blindly. The
// caller (prefixcache/attention.py) checks shapes, dtypes and buffer sizes; this code
// re-checks every index array it reads (host memory it is handed) and throws
// std::invalid_argument before touching the KV cache, so a bad block id can never become
// an out-of-bounds read and nothing here aborts the interpreter.
#pragma once

#include <cstdint>

namespace prefixcache {

enum class AttnDType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct PagedAttentionArgs {
  const void* q = nullptr;        // [total_q, num_heads, head_dim]
  const void* kv = nullptr;       // [num_blocks, 2, num_kv_heads, block_size, head_dim]
  void* out = nullptr;            // like q
  float* lse = nullptr;           // [total_q, num_heads] natural log, or null
  const int32_t* q_indptr = nullptr;    // [batch_size + 1]
  const int32_t* kv_indptr = nullptr;   // [batch_size + 1]
  const int32_t* kv_indices = nullptr;  // [num_kv_indices]
  const int32_t* kv_lens = nullptr;     // [batch_size], tokens
  int64_t batch_size = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t num_blocks = 0;
  int64_t block_size = 0;         // tokens per block
  int64_t num_kv_indices = 0;
  float scale = 0.f;              // multiplies q.k before the softmax
  AttnDType dtype = AttnDType::kFloat32;
  int64_t window_left = -1;       // tokens before a query it may read; -1: all
  int64_t chunk_size = 0;         // tokens per attention chunk; 0: none
};

// Validates the index arrays and sizes (std::invalid_argument naming the field), then
// writes every element of out (and lse if given). Releases nothing it did not allocate.
void paged_attention_cpu(const PagedAttentionArgs& args);

// Whether this build runs work items on several threads (OpenMP).
bool paged_attention_cpu_parallel();

}  // namespace prefixcache
