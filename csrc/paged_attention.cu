// Paged attention on NVIDIA GPUs (sm_80, sm_90): the kernels behind prefixcache.attention
// impl="cuda" (compiled by setup.py with nvcc into prefixcache._C) and impl="cupy" (this
// same file compiled at first use by cupy.RawModule through NVRTC).
//
// Owns: three kernel families over one layer's KV cache laid out
// [num_blocks, 2, num_kv_heads, block_size, head_dim] (K then V):
//   pa_simt_<dtype>_d<D>_r<R>  CUDA-core kernel for any dtype and query count. One CTA per
//       (request, kv head, tile of R query rows, KV split); a row is one (query, query head
//       of the GQA group) pair, so every KV byte is read once per GQA group. Lanes are
//       grouped so one group holds one token row in 16-byte loads; each group keeps its
//       own online-softmax state for all R rows, and the CTA merges them at the end. This
//       is the decode kernel: it is bound by memory bandwidth, not arithmetic.
//   pa_mma_<dtype>_d<D>        fp16/bf16 tensor-core kernel (mma.sync m16n8k16, fp32
//       accumulation) for prefill on a cached prefix: 64 rows per CTA (16 per warp), KV
//       tiles double-buffered in shared memory with cp.async, FlashAttention-2 style
//       online softmax in registers.
//   pa_merge_<dtype>           combines split-KV partial results by their log-sum-exp.
// Split-KV (num_splits > 1): each CTA covers split_tokens keys and writes an fp32 partial
// output and LSE; the merge kernel then writes the final output. The Python layer chooses
// kernel, rows per CTA, splits and grid (prefixcache/_attention_cuda.py).
//
// Never does: validate. Every pointer, index and shape has been checked in Python before a
// launch. The device part stays NVRTC-clean (no standard headers, no INFINITY macro,
// conversions and MMA by inline PTX) so the cupy path compiles this exact file; host code
// is guarded by __CUDACC_RTC__.

typedef unsigned short pc_u16;
typedef unsigned int pc_u32;

namespace pc_attn {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

struct F32 {
  typedef float T;
};
struct F16 {
  typedef pc_u16 T;
};
struct BF16 {
  typedef pc_u16 T;
};

__device__ __forceinline__ float to_float(F32, float x) { return x; }
__device__ __forceinline__ float to_float(F16, pc_u16 x) {
  float r;
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
  return r;
}
__device__ __forceinline__ float to_float(BF16, pc_u16 x) { return __int_as_float(((pc_u32)x) << 16); }

__device__ __forceinline__ float from_float(F32, float x) { return x; }
__device__ __forceinline__ pc_u16 from_float(F16, float x) {
  pc_u16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ pc_u16 from_float(BF16, float x) {
  pc_u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

// Two floats -> one register of two 16-bit values, `lo` in the low half (element order
// of mma fragments).
__device__ __forceinline__ pc_u32 pack2(F16, float lo, float hi) {
  pc_u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ pc_u32 pack2(BF16, float lo, float hi) {
  pc_u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// D += A * B for one m16n8k16 tile, fp32 accumulators.
__device__ __forceinline__ void mma16816(F16, float* d, const pc_u32* a, pc_u32 b0, pc_u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16816(BF16, float* d, const pc_u32* a, pc_u32 b0, pc_u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ pc_u32 smem_u32(const void* p) {
  pc_u32 r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
// 16-byte global -> shared copy; src_bytes 0 writes zeros (tokens past the end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

struct Params {
  const void* q;
  const void* kv;
  void* out;
  float* lse;       // natural log, [total_q, num_heads], or null
  float* part_o;    // [num_splits, total_q, num_heads, head_dim] when num_splits > 1
  float* part_lse;  // [num_splits, total_q, num_heads]
  const int* q_indptr;
  const int* kv_indptr;
  const int* kv_indices;
  const int* kv_lens;
  int batch, total_q, num_heads, num_kv_heads, head_dim, block_size, num_splits, split_tokens;
  float scale_log2;  // softmax scale * log2(e): scores live in the log2 domain
  int window_left;   // local attention: keys before a query it reads, -1: all
  int chunk_size;    // local attention: tokens per chunk, 0: none
};

// The first key a query at `pos` reads (0 without local attention); non-decreasing in pos.
__device__ __forceinline__ int first_key(const Params& p, int pos) {
  int lo = p.window_left >= 0 ? max(0, pos - p.window_left) : 0;
  if (p.chunk_size > 0) lo = max(lo, pos / p.chunk_size * p.chunk_size);
  return lo;
}

// Where one CTA's work sits: request b, kv head h, its rows [r0, r0 + nr) of the
// request's q_len * group rows, and its keys [t0, t1).
struct Tile {
  int b, h, group, q_start, q_len, kv_len, r0, nr, split, t0, t1;
  __device__ __forceinline__ int query_pos(int row) const { return kv_len - q_len + row / group; }
  // Flat (query, head) index of a row, as in lse[total_q, num_heads].
  __device__ __forceinline__ long long row_index(const Params& p, int row) const {
    return (long long)(q_start + row / group) * p.num_heads + h * group + row % group;
  }
};

// Fills `t` for this CTA; false if the CTA has no rows (grid is sized for the longest request).
__device__ __forceinline__ bool make_tile(const Params& p, int rows_per_cta, Tile& t) {
  t.b = blockIdx.z;
  t.h = blockIdx.y;
  t.split = blockIdx.x % p.num_splits;
  const int tile = blockIdx.x / p.num_splits;
  t.group = p.num_heads / p.num_kv_heads;
  t.q_start = p.q_indptr[t.b];
  t.q_len = p.q_indptr[t.b + 1] - t.q_start;
  t.kv_len = p.kv_lens[t.b];
  const int rows = t.q_len * t.group;
  t.r0 = tile * rows_per_cta;
  if (t.r0 >= rows) return false;
  t.nr = min(rows_per_cta, rows - t.r0);
  t.t0 = t.split * p.split_tokens;
  t.t1 = min(t.t0 + p.split_tokens, t.query_pos(t.r0 + t.nr - 1) + 1);
  // No row reads a key before its first row's first key (null blocks may sit there).
  t.t0 = max(t.t0, first_key(p, t.query_pos(t.r0)));
  return true;
}

// Writes one finished element: o = sum p*v / l, with m the running max (log2 domain).
// Unsplit: final output (+ natural-log LSE from the d == 0 writer); split: fp32 partials,
// with an empty split (l == 0) written as o = 0, lse = -inf so the merge ignores it.
template <class DT>
__device__ __forceinline__ void write_result(const Params& p, long long row_index, int d, float o, float m, float l,
                                             bool write_lse) {
  typedef typename DT::T T;
  const float lse = l > 0.f ? (m + log2f(l)) * kLn2 : neg_inf();
  const float value = l > 0.f ? o / l : 0.f;
  if (p.num_splits == 1) {
    static_cast<T*>(p.out)[row_index * p.head_dim + d] = from_float(DT(), value);
    if (write_lse && p.lse != nullptr) p.lse[row_index] = lse;
  } else {
    const long long split_row = (long long)blockIdx.x % p.num_splits * p.total_q * p.num_heads + row_index;
    p.part_o[split_row * p.head_dim + d] = value;
    if (write_lse) p.part_lse[split_row] = lse;
  }
}

// VEC consecutive elements held as raw 16-byte words, so loads can be issued early and
// converted to float only when used (fewer registers than floats for 16-bit types).
template <class DT, int VEC>
struct RawVec {
  uint4 w[VEC * sizeof(typename DT::T) / 16];
};

template <class DT, int VEC>
__device__ __forceinline__ void load_raw(const typename DT::T* src, RawVec<DT, VEC>& r) {
#pragma unroll
  for (int i = 0; i < VEC * (int)sizeof(typename DT::T) / 16; ++i) r.w[i] = __ldg(reinterpret_cast<const uint4*>(src) + i);
}

template <class DT, int VEC>
__device__ __forceinline__ void unpack(const RawVec<DT, VEC>& r, float* dst) {
  typedef typename DT::T T;
  const T* e = reinterpret_cast<const T*>(r.w);
#pragma unroll
  for (int i = 0; i < VEC; ++i) dst[i] = to_float(DT(), e[i]);
}

template <class DT, int D, int ROWS>
__device__ __forceinline__ void simt_attention(const Params& p) {
  typedef typename DT::T T;
  constexpr int kElem = sizeof(T);
  constexpr int VEC = (16 / kElem) > (D / 32) ? (16 / kElem) : (D / 32);  // elements per lane
  constexpr int LG = D / VEC;                                              // lanes per token
  constexpr int TPW = 32 / LG;                                             // tokens per warp step
  constexpr int NG = kWarps * TPW;                                         // token groups per CTA
  constexpr int U = 2;  // tokens per group per step: more loads in flight per thread
  __shared__ float s_o[NG][ROWS][D];
  __shared__ float s_m[NG][ROWS];
  __shared__ float s_l[NG][ROWS];

  Tile t;
  if (!make_tile(p, ROWS, t)) return;
  const int lane = threadIdx.x % 32;
  const int sub = lane % LG;
  const int g = (threadIdx.x / 32) * TPW + lane / LG;

  float qf[ROWS][VEC];
  int qpos[ROWS], qlo[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (r < t.nr) {
      const int row = t.r0 + r;
      RawVec<DT, VEC> raw;
      load_raw<DT, VEC>(static_cast<const T*>(p.q) + t.row_index(p, row) * D + sub * VEC, raw);
      unpack<DT, VEC>(raw, qf[r]);
#pragma unroll
      for (int i = 0; i < VEC; ++i) qf[r][i] *= p.scale_log2;
      qpos[r] = t.query_pos(row);
      qlo[r] = first_key(p, qpos[r]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) qf[r][i] = 0.f;
      qpos[r] = -1;  // sees nothing
      qlo[r] = 0;
    }
  }

  float m[ROWS], l[ROWS], acc[ROWS][VEC];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = neg_inf();
    l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[r][i] = 0.f;
  }

  const T* kv = static_cast<const T*>(p.kv);
  const int* blocks = p.kv_indices + p.kv_indptr[t.b];
  const int bs = p.block_size;
  const long long block_stride = 2LL * p.num_kv_heads * bs * D;
  const long long k_off = (long long)t.h * bs * D + sub * VEC;
  const long long v_off = (long long)(p.num_kv_heads + t.h) * bs * D + sub * VEC;

  // Software pipeline: the next step's K/V loads are in flight while this step computes,
  // so each thread always has 2 * U * VEC * sizeof(T) bytes outstanding.
  constexpr int STEP = NG * U;
  RawVec<DT, VEC> k_next[U], v_next[U];
  auto fetch = [&](int base) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int pos = base + u * NG + g;
      if (pos < t.t1) {
        const long long row = (long long)blocks[pos / bs] * block_stride + (long long)(pos % bs) * D;
        load_raw<DT, VEC>(kv + row + k_off, k_next[u]);
        load_raw<DT, VEC>(kv + row + v_off, v_next[u]);
      } else {
        k_next[u] = RawVec<DT, VEC>{};
        v_next[u] = RawVec<DT, VEC>{};
      }
    }
  };
  if (t.t0 < t.t1) fetch(t.t0);
  for (int base = t.t0; base < t.t1; base += STEP) {
    RawVec<DT, VEC> k_cur[U], v_cur[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      k_cur[u] = k_next[u];
      v_cur[u] = v_next[u];
    }
    if (base + STEP < t.t1) fetch(base + STEP);
    int pos[U];
    float kf[U][VEC], vf[U][VEC];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      pos[u] = base + u * NG + g;
      unpack<DT, VEC>(k_cur[u], kf[u]);
      unpack<DT, VEC>(v_cur[u], vf[u]);
    }
    float s[U][ROWS];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) x = fmaf(qf[r][i], kf[u][i], x);
#pragma unroll
        for (int off = LG / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
        s[u][r] = (pos[u] < t.t1 && pos[u] <= qpos[r] && pos[u] >= qlo[r]) ? x : neg_inf();
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float mx = m[r];
#pragma unroll
      for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][r]);
      const float ref = mx == neg_inf() ? 0.f : mx;  // keeps exp2 finite while nothing is visible
      const float alpha = exp2f(m[r] - ref);
      l[r] *= alpha;
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[r][i] *= alpha;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const float pu = exp2f(s[u][r] - ref);
        l[r] += pu;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[r][i] = fmaf(pu, vf[u][i], acc[r][i]);
      }
      m[r] = mx;
    }
  }

  // Merge the NG groups' states: rescale each to the common max, then sum.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) s_o[g][r][sub * VEC + i] = acc[r][i];
    if (sub == 0) {
      s_m[g][r] = m[r];
      s_l[g][r] = l[r];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < t.nr * D; idx += kThreads) {
    const int r = idx / D;
    const int d = idx % D;
    float mx = neg_inf();
    for (int k = 0; k < NG; ++k) mx = fmaxf(mx, s_m[k][r]);
    const float ref = mx == neg_inf() ? 0.f : mx;
    float o = 0.f, sum = 0.f;
    for (int k = 0; k < NG; ++k) {
      const float w = exp2f(s_m[k][r] - ref);
      sum += s_l[k][r] * w;
      o += s_o[k][r][d] * w;
    }
    write_result<DT>(p, t.row_index(p, t.r0 + r), d, o, mx, sum, d == 0);
  }
}

template <class DT, int D>
__device__ __forceinline__ void mma_attention(const Params& p) {
  typedef typename DT::T T;
  constexpr int KT = D == 64 ? 64 : 32;  // KV tile (tokens); two stages fit in 48 KiB
  constexpr int LDS = D + 8;             // padded smem row (elements): conflict-free fragment loads
  constexpr int NK = D / 16;             // k-steps of S = Q K^T
  constexpr int NS = KT / 8;             // n-tiles of S
  constexpr int NO = D / 8;              // n-tiles of O
  constexpr int CHUNKS = KT * D / 8;     // 16-byte pieces of one K (or V) tile
  __shared__ __align__(16) T sk[2][KT * LDS];
  __shared__ __align__(16) T sv[2][KT * LDS];

  Tile t;
  if (!make_tile(p, 16 * kWarps, t)) return;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int gq = lane >> 2;  // fragment row (and B column) of this lane
  const int tq = lane & 3;   // fragment column pair of this lane
  const int rows = t.q_len * t.group;
  const int row_a = t.r0 + warp * 16 + gq;
  const int row_b = row_a + 8;
  const int pos_a = row_a < rows ? t.query_pos(row_a) : -1;
  const int pos_b = row_b < rows ? t.query_pos(row_b) : -1;
  const int lo_a = pos_a >= 0 ? first_key(p, pos_a) : 0;
  const int lo_b = pos_b >= 0 ? first_key(p, pos_b) : 0;

  pc_u32 qa[NK][4];
  {
    const T* q = static_cast<const T*>(p.q);
    const T* qa_row = q + (row_a < rows ? t.row_index(p, row_a) : 0) * D;
    const T* qb_row = q + (row_b < rows ? t.row_index(p, row_b) : 0) * D;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
      const int c = kk * 16 + tq * 2;
      qa[kk][0] = row_a < rows ? *reinterpret_cast<const pc_u32*>(qa_row + c) : 0u;
      qa[kk][1] = row_b < rows ? *reinterpret_cast<const pc_u32*>(qb_row + c) : 0u;
      qa[kk][2] = row_a < rows ? *reinterpret_cast<const pc_u32*>(qa_row + c + 8) : 0u;
      qa[kk][3] = row_b < rows ? *reinterpret_cast<const pc_u32*>(qb_row + c + 8) : 0u;
    }
  }

  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_a = neg_inf(), m_b = neg_inf(), l_a = 0.f, l_b = 0.f;

  const T* kv = static_cast<const T*>(p.kv);
  const int* blocks = p.kv_indices + p.kv_indptr[t.b];
  const int bs = p.block_size;
  const long long block_stride = 2LL * p.num_kv_heads * bs * D;
  const long long k_off = (long long)t.h * bs * D;
  const long long v_off = (long long)(p.num_kv_heads + t.h) * bs * D;
  auto load_tile = [&](int stage, int start) {
    for (int c = threadIdx.x; c < CHUNKS; c += kThreads) {
      const int tok = c / (D / 8);
      const int col = (c % (D / 8)) * 8;
      const int pos = start + tok;
      const bool ok = pos < t.t1;
      const long long row = ok ? (long long)blocks[pos / bs] * block_stride + (long long)(pos % bs) * D + col : 0;
      cp_async16(&sk[stage][tok * LDS + col], kv + (ok ? row + k_off : 0), ok ? 16 : 0);
      cp_async16(&sv[stage][tok * LDS + col], kv + (ok ? row + v_off : 0), ok ? 16 : 0);
    }
    cp_async_commit();
  };

  const int ntiles = t.t1 > t.t0 ? (t.t1 - t.t0 + KT - 1) / KT : 0;
  if (ntiles > 0) load_tile(0, t.t0);
  for (int it = 0; it < ntiles; ++it) {
    if (it + 1 < ntiles) {
      load_tile((it + 1) & 1, t.t0 + (it + 1) * KT);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* ks = sk[it & 1];
    const T* vs = sv[it & 1];
    const int start = t.t0 + it * KT;

    float s[NS][4];
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        const T* kr = ks + (j * 8 + gq) * LDS + kk * 16 + tq * 2;
        mma16816(DT(), s[j], qa[kk], *reinterpret_cast<const pc_u32*>(kr), *reinterpret_cast<const pc_u32*>(kr + 8));
      }
    }
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int j = 0; j < NS; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = start + j * 8 + tq * 2 + (e & 1);
        const int limit = e < 2 ? pos_a : pos_b;
        const int lo = e < 2 ? lo_a : lo_b;
        s[j][e] = (key < t.t1 && key <= limit && key >= lo) ? s[j][e] * p.scale_log2 : neg_inf();
      }
      mx_a = fmaxf(mx_a, fmaxf(s[j][0], s[j][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[j][2], s[j][3]));
    }
    // A row's scores are spread over the 4 lanes of a quad.
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    const float ref_a = mx_a == neg_inf() ? 0.f : mx_a;
    const float ref_b = mx_b == neg_inf() ? 0.f : mx_b;
    const float alpha_a = exp2f(m_a - ref_a), alpha_b = exp2f(m_b - ref_b);
    m_a = mx_a;
    m_b = mx_b;
    l_a *= alpha_a;
    l_b *= alpha_b;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][0] *= alpha_a;
      o[n][1] *= alpha_a;
      o[n][2] *= alpha_b;
      o[n][3] *= alpha_b;
    }
#pragma unroll
    for (int j = 0; j < NS; ++j) {
      s[j][0] = exp2f(s[j][0] - ref_a);
      s[j][1] = exp2f(s[j][1] - ref_a);
      s[j][2] = exp2f(s[j][2] - ref_b);
      s[j][3] = exp2f(s[j][3] - ref_b);
      l_a += s[j][0] + s[j][1];  // lane-partial sums; reduced over the quad at the end
      l_b += s[j][2] + s[j][3];
    }
    // O += P V: two S n-tiles form one A fragment (16 keys); V is the col-major B operand.
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
      const pc_u32 pa[4] = {pack2(DT(), s[2 * kk][0], s[2 * kk][1]), pack2(DT(), s[2 * kk][2], s[2 * kk][3]),
                            pack2(DT(), s[2 * kk + 1][0], s[2 * kk + 1][1]),
                            pack2(DT(), s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const T* v0 = vs + (kk * 16 + tq * 2) * LDS + gq;
#pragma unroll
      for (int n = 0; n < NO; ++n) {
        const T* vn = v0 + n * 8;
        const pc_u32 b0 = (pc_u32)vn[0] | ((pc_u32)vn[LDS] << 16);
        const pc_u32 b1 = (pc_u32)vn[8 * LDS] | ((pc_u32)vn[9 * LDS] << 16);
        mma16816(DT(), o[n], pa, b0, b1);
      }
    }
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
  }

  l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
  l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
  l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
#pragma unroll
  for (int n = 0; n < NO; ++n) {
    const int d = n * 8 + tq * 2;
    if (row_a < rows) {
      const long long ri = t.row_index(p, row_a);
      write_result<DT>(p, ri, d, o[n][0], m_a, l_a, n == 0 && tq == 0);
      write_result<DT>(p, ri, d + 1, o[n][1], m_a, l_a, false);
    }
    if (row_b < rows) {
      const long long ri = t.row_index(p, row_b);
      write_result<DT>(p, ri, d, o[n][2], m_b, l_b, n == 0 && tq == 0);
      write_result<DT>(p, ri, d + 1, o[n][3], m_b, l_b, false);
    }
  }
}

// One thread per output element: weights exp(lse_s - max) over the splits.
template <class DT>
__device__ __forceinline__ void merge_states(const Params& p) {
  typedef typename DT::T T;
  const long long rows = (long long)p.total_q * p.num_heads;
  const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= rows * p.head_dim) return;
  const long long row = idx / p.head_dim;
  float mx = neg_inf();
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, p.part_lse[s * rows + row]);
  const float ref = mx == neg_inf() ? 0.f : mx;
  float o = 0.f, sum = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = expf(p.part_lse[s * rows + row] - ref);
    sum += w;
    o += w * p.part_o[s * rows * p.head_dim + idx];
  }
  static_cast<T*>(p.out)[idx] = from_float(DT(), sum > 0.f ? o / sum : 0.f);
  if (p.lse != nullptr && idx % p.head_dim == 0) p.lse[row] = sum > 0.f ? ref + logf(sum) : neg_inf();
}

}  // namespace pc_attn

// Every kernel takes the same arguments, so one host launcher (and one cupy call) serves all.
#define PC_ATTN_PARAMS                                                                                    \
  const void *q, const void *kv, void *out, float *lse, float *part_o, float *part_lse, const int *q_indptr, \
      const int *kv_indptr, const int *kv_indices, const int *kv_lens, int batch, int total_q, int num_heads, \
      int num_kv_heads, int head_dim, int block_size, int num_splits, int split_tokens, float scale_log2,    \
      int window_left, int chunk_size
#define PC_ATTN_PACK                                                                                        \
  pc_attn::Params {                                                                                         \
    q, kv, out, lse, part_o, part_lse, q_indptr, kv_indptr, kv_indices, kv_lens, batch, total_q, num_heads, \
        num_kv_heads, head_dim, block_size, num_splits, split_tokens, scale_log2, window_left, chunk_size    \
  }

// The instantiated kernels: X(tag, dtype, head_dim, rows) for pa_simt, X(tag, dtype, head_dim)
// for pa_mma, X(tag, dtype) for pa_merge. Each one costs compile time, so keep the lists short.
#define PC_SIMT_ROWS(X, tag, DT, D) X(tag, DT, D, 1) X(tag, DT, D, 2) X(tag, DT, D, 4) X(tag, DT, D, 8)
#define PC_SIMT_DIMS(X, tag, DT) PC_SIMT_ROWS(X, tag, DT, 64) PC_SIMT_ROWS(X, tag, DT, 128) PC_SIMT_ROWS(X, tag, DT, 256)
#define PC_FOR_EACH_SIMT(X) PC_SIMT_DIMS(X, f32, F32) PC_SIMT_DIMS(X, f16, F16) PC_SIMT_DIMS(X, bf16, BF16)
#define PC_FOR_EACH_MMA(X) X(f16, F16, 64) X(f16, F16, 128) X(bf16, BF16, 64) X(bf16, BF16, 128)
#define PC_FOR_EACH_MERGE(X) X(f32, F32) X(f16, F16) X(bf16, BF16)

#define PC_DEFINE_SIMT(tag, DT, D, R)                                                                     \
  extern "C" __global__ void __launch_bounds__(pc_attn::kThreads) pa_simt_##tag##_d##D##_r##R(PC_ATTN_PARAMS) { \
    pc_attn::simt_attention<pc_attn::DT, D, R>(PC_ATTN_PACK);                                             \
  }
#define PC_DEFINE_MMA(tag, DT, D)                                                                    \
  extern "C" __global__ void __launch_bounds__(pc_attn::kThreads) pa_mma_##tag##_d##D(PC_ATTN_PARAMS) { \
    pc_attn::mma_attention<pc_attn::DT, D>(PC_ATTN_PACK);                                            \
  }
#define PC_DEFINE_MERGE(tag, DT) \
  extern "C" __global__ void pa_merge_##tag(PC_ATTN_PARAMS) { pc_attn::merge_states<pc_attn::DT>(PC_ATTN_PACK); }

PC_FOR_EACH_SIMT(PC_DEFINE_SIMT)
PC_FOR_EACH_MMA(PC_DEFINE_MMA)
PC_FOR_EACH_MERGE(PC_DEFINE_MERGE)

#ifndef __CUDACC_RTC__
// Host side (nvcc builds only): a name -> kernel table and the launcher the binding calls.
#include <cuda_runtime.h>

#include <stdexcept>

#include "paged_attention_cuda.h"

namespace prefixcache {
namespace {

struct KernelEntry {
  const char* name;
  const void* fn;
};

#define PC_ENTRY_SIMT(tag, DT, D, R) {"pa_simt_" #tag "_d" #D "_r" #R, (const void*)&pa_simt_##tag##_d##D##_r##R},
#define PC_ENTRY_MMA(tag, DT, D) {"pa_mma_" #tag "_d" #D, (const void*)&pa_mma_##tag##_d##D},
#define PC_ENTRY_MERGE(tag, DT) {"pa_merge_" #tag, (const void*)&pa_merge_##tag},
const KernelEntry kKernels[] = {PC_FOR_EACH_SIMT(PC_ENTRY_SIMT) PC_FOR_EACH_MMA(PC_ENTRY_MMA)
                                    PC_FOR_EACH_MERGE(PC_ENTRY_MERGE)};

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("paged attention: ") + what + ": " + cudaGetErrorString(err));
  }
}

}  // namespace

std::vector<std::string> cuda_attention_kernels() {
  std::vector<std::string> names;
  for (const KernelEntry& k : kKernels) names.emplace_back(k.name);
  return names;
}

void cuda_attention_launch(const std::string& name, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                           unsigned block, int device, uintptr_t stream, const CudaAttentionArgs& a) {
  const void* fn = nullptr;
  for (const KernelEntry& k : kKernels) {
    if (name == k.name) fn = k.fn;
  }
  if (fn == nullptr) throw std::invalid_argument("paged attention: no CUDA kernel named '" + name + "'");
  check(cudaSetDevice(device), "cudaSetDevice");
  const void* q = reinterpret_cast<const void*>(a.q);
  const void* kv = reinterpret_cast<const void*>(a.kv);
  void* out = reinterpret_cast<void*>(a.out);
  float* lse = reinterpret_cast<float*>(a.lse);
  float* part_o = reinterpret_cast<float*>(a.part_o);
  float* part_lse = reinterpret_cast<float*>(a.part_lse);
  const int* q_indptr = reinterpret_cast<const int*>(a.q_indptr);
  const int* kv_indptr = reinterpret_cast<const int*>(a.kv_indptr);
  const int* kv_indices = reinterpret_cast<const int*>(a.kv_indices);
  const int* kv_lens = reinterpret_cast<const int*>(a.kv_lens);
  int ints[] = {a.batch, a.total_q, a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, a.num_splits,
                a.split_tokens};
  float scale_log2 = a.scale_log2;
  int local[] = {a.window_left, a.chunk_size};
  void* args[] = {&q,        &kv,      &out,     &lse,     &part_o,  &part_lse, &q_indptr, &kv_indptr, &kv_indices,
                  &kv_lens,  &ints[0], &ints[1], &ints[2], &ints[3], &ints[4],  &ints[5],  &ints[6],   &ints[7],
                  &scale_log2, &local[0], &local[1]};
  check(cudaLaunchKernel(fn, dim3(grid_x, grid_y, grid_z), dim3(block), args, 0,
                         reinterpret_cast<cudaStream_t>(stream)),
        name.c_str());
}

}  // namespace prefixcache
#endif  // __CUDACC_RTC__
