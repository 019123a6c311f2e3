// Paged attention on the CPU. See paged_attention_cpu.h for the contract.
//
// Per work item (request, kv head, tile of up to kRowTile query rows):
//   1. the tile's queries, times `scale`, are converted to fp32 once;
//   2. keys are visited in chunks of kChunk tokens that may span several blocks (so
//      block_size 1 costs no more per token than block_size 32): fp32 K/V rows are read in
//      place from the cache, fp16/bf16 rows are converted once per chunk into scratch;
//   3. scores S = Q K^T for the chunk, causal mask, then one online-softmax step per row
//      (running max m, running sum l, rescale O only when the max moved), then O += P V.
// Each KV row is therefore read once per item, i.e. once per GQA group and query tile.
// The hot loops use 8-wide GCC vector types; on x86-64 Linux the item function is
// compiled twice (AVX2+FMA and baseline) and picked at load time, so one binary runs
// anywhere and uses FMA where the CPU has it.
#include "paged_attention_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define PC_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PC_MULTIVERSION
#endif
#define PC_INLINE inline __attribute__((always_inline))

// The 32-byte vector helpers are always inlined into one clone, so the ABI note GCC
// gives for passing them by value in the baseline clone never applies.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace prefixcache {
namespace {

constexpr int kChunk = 64;    // key tokens per online-softmax step
constexpr int kRowTile = 32;  // query rows (query x group head) per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float vf __attribute__((vector_size(32)));  // 8 floats

PC_INLINE vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
PC_INLINE void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
PC_INLINE float hsum(vf v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

typedef int32_t vi __attribute__((vector_size(32)));
PC_INLINE vf splat(float x) { return vf{x, x, x, x, x, x, x, x}; }
PC_INLINE float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) on 8 lanes, Cephes expf (about 1 ulp on [-87, 0], all the softmax needs: its
// arguments are scores minus the running max). Below -87, which includes the -inf of a
// masked key, the result is exactly 0. Scalar std::exp per score cost more than the
// dot products it follows.
PC_INLINE vf exp8(vf x) {
  const vi dead = x < splat(-87.f);
  x = dead ? splat(-87.f) : x;
  vf fx = x * splat(1.44269504088896341f) + splat(0.5f);
  vf n = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
  n = n > fx ? n - splat(1.f) : n;  // floor
  x = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
  vf y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * (x * x) + x + splat(1.f);
  const vi pow2 = (__builtin_convertvector(n, vi) + 127) << 23;
  return (vf)((vi)(y * (vf)pow2) & ~dead);
}

PC_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
PC_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> float, exact for every input (normals, subnormals, inf, NaN).
PC_INLINE float half_to_float(uint16_t h) {
  constexpr uint32_t shifted_exp = 0x7c00u << 13;
  uint32_t o = static_cast<uint32_t>(h & 0x7fff) << 13;
  const uint32_t exp = o & shifted_exp;
  o += (127u - 15u) << 23;
  if (exp == shifted_exp) {
    o += (128u - 16u) << 23;  // inf / NaN
  } else if (exp == 0) {
    o += 1u << 23;  // zero / subnormal: renormalise through a float subtraction
    o = float_to_bits(bits_to_float(o) - bits_to_float(113u << 23));
  }
  return bits_to_float(o | (static_cast<uint32_t>(h & 0x8000) << 16));
}

// float -> IEEE half, round to nearest even; overflow to inf, NaN stays NaN.
PC_INLINE uint16_t float_to_half(float value) {
  constexpr uint32_t f32_inf = 255u << 23;
  constexpr uint32_t f16_max = (127u + 16u) << 23;
  const float denorm_magic = bits_to_float(((127u - 15u) + (23u - 10u) + 1u) << 23);
  uint32_t f = float_to_bits(value);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint16_t o;
  if (f >= f16_max) {
    o = f > f32_inf ? 0x7e00 : 0x7c00;
  } else if (f < (113u << 23)) {
    o = static_cast<uint16_t>(float_to_bits(bits_to_float(f) + denorm_magic) - float_to_bits(denorm_magic));
  } else {
    const uint32_t mant_odd = (f >> 13) & 1;
    f += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff;
    f += mant_odd;
    o = static_cast<uint16_t>(f >> 13);
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

PC_INLINE float bf16_to_float(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// float -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
PC_INLINE uint16_t float_to_bf16(float value) {
  uint32_t u = float_to_bits(value);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

template <AttnDType DT>
struct Storage;
template <>
struct Storage<AttnDType::kFloat32> {
  using type = float;
  static PC_INLINE float load(float x) { return x; }
  static PC_INLINE float store(float x) { return x; }
};
template <>
struct Storage<AttnDType::kFloat16> {
  using type = uint16_t;
  static PC_INLINE float load(uint16_t x) { return half_to_float(x); }
  static PC_INLINE uint16_t store(float x) { return float_to_half(x); }
};
template <>
struct Storage<AttnDType::kBFloat16> {
  using type = uint16_t;
  static PC_INLINE float load(uint16_t x) { return bf16_to_float(x); }
  static PC_INLINE uint16_t store(float x) { return float_to_bf16(x); }
};

struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t row_begin;  // rows are (query, group head) pairs: row = query * group + head
  int32_t row_end;
  int64_t cost;       // rows x keys visited, for largest-first scheduling
};

// Per-thread buffers, sized once per call.
struct Scratch {
  explicit Scratch(int64_t d)
      : q(kRowTile * d), o(kRowTile * d), s(kRowTile * kChunk), m(kRowTile), l(kRowTile),
        kbuf(kChunk * d), vbuf(kChunk * d), zeros(d, 0.f) {}
  std::vector<float> q, o, s, m, l, kbuf, vbuf, zeros;  // zeros: a key row no query reads
  const float* krow[kChunk];
  const float* vrow[kChunk];
};

// S[r][j] = q_r . k_j for NR rows (row stride d) against n keys, two keys at a time.
template <int NR>
PC_INLINE void scores_rows(const float* q, int64_t d, const float* const* krow, int n, float* s) {
  int j = 0;
  for (; j + 2 <= n; j += 2) {
    vf a0[NR] = {}, a1[NR] = {};
    const float* k0 = krow[j];
    const float* k1 = krow[j + 1];
    for (int64_t x = 0; x < d; x += 8) {
      const vf kv0 = loadv(k0 + x), kv1 = loadv(k1 + x);
      for (int r = 0; r < NR; ++r) {
        const vf qv = loadv(q + r * d + x);
        a0[r] += qv * kv0;
        a1[r] += qv * kv1;
      }
    }
    for (int r = 0; r < NR; ++r) {
      s[r * kChunk + j] = hsum(a0[r]);
      s[r * kChunk + j + 1] = hsum(a1[r]);
    }
  }
  if (j < n) {
    vf a[NR] = {};
    for (int64_t x = 0; x < d; x += 8) {
      const vf kv0 = loadv(krow[j] + x);
      for (int r = 0; r < NR; ++r) a[r] += loadv(q + r * d + x) * kv0;
    }
    for (int r = 0; r < NR; ++r) s[r * kChunk + j] = hsum(a[r]);
  }
}

// One online-softmax step for one row over n <= kChunk scores in place: the running max
// m and sum l absorb the chunk, O is rescaled when the max moves, and s becomes P.
PC_INLINE void softmax_chunk(float* s, int n, float& m, float& l, float* o, int64_t d) {
  const int n8 = (n + 7) & ~7;
  for (int j = n; j < n8; ++j) s[j] = kNegInf;  // padding lanes: P = 0
  vf vmax = splat(m);
  for (int j = 0; j < n8; j += 8) {
    const vf x = loadv(s + j);
    vmax = x > vmax ? x : vmax;
  }
  const float mx = hmax(vmax);
  if (mx == kNegInf) {  // nothing visible to this row yet
    std::fill(s, s + n8, 0.f);
    return;
  }
  vf sum = {};
  for (int j = 0; j < n8; j += 8) {
    const vf p = exp8(loadv(s + j) - splat(mx));
    storev(s + j, p);
    sum += p;
  }
  if (mx != m) {
    const float alpha = std::exp(m - mx);  // 0 on the first visible chunk
    for (int64_t x = 0; x < d; ++x) o[x] *= alpha;
    l *= alpha;
    m = mx;
  }
  l += hsum(sum);
}

// O[r] += sum_j P[r][j] v_j for NR rows, 16 dims at a time held in registers.
template <int NR>
PC_INLINE void accumulate_rows(float* o, int64_t d, const float* p, const float* const* vrow, int n) {
  for (int64_t x = 0; x < d; x += 16) {
    vf c0[NR], c1[NR];
    for (int r = 0; r < NR; ++r) {
      c0[r] = loadv(o + r * d + x);
      c1[r] = loadv(o + r * d + x + 8);
    }
    for (int j = 0; j < n; ++j) {
      const vf v0 = loadv(vrow[j] + x), v1 = loadv(vrow[j] + x + 8);
      for (int r = 0; r < NR; ++r) {
        const float pj = p[r * kChunk + j];
        c0[r] += pj * v0;
        c1[r] += pj * v1;
      }
    }
    for (int r = 0; r < NR; ++r) {
      storev(o + r * d + x, c0[r]);
      storev(o + r * d + x + 8, c1[r]);
    }
  }
}

template <AttnDType DT>
PC_INLINE void run_item(const PagedAttentionArgs& a, const WorkItem& item, Scratch& sc) {
  using S = Storage<DT>;
  using T = typename S::type;
  const int64_t d = a.head_dim;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t bs = a.block_size;
  const int32_t b = item.request;
  const int64_t q_start = a.q_indptr[b];
  const int64_t q_len = a.q_indptr[b + 1] - q_start;
  const int64_t kv_len = a.kv_lens[b];
  const int32_t* blocks = a.kv_indices + a.kv_indptr[b];
  const int nr = item.row_end - item.row_begin;
  const T* q = static_cast<const T*>(a.q);
  const T* kv = static_cast<const T*>(a.kv);
  // Element offsets inside one block: K of head h at h*bs*d, V of head h at (Hkv+h)*bs*d.
  const int64_t k_head = item.kv_head * bs * d;
  const int64_t v_head = (a.num_kv_heads + item.kv_head) * bs * d;
  const int64_t block_stride = 2 * a.num_kv_heads * bs * d;

  // Query position of row r: the request's last q_len tokens end at kv_len - 1.
  auto row_pos = [&](int r) { return kv_len - q_len + (item.row_begin + r) / group; };
  // The first key a query at p reads (local attention; 0 without it). Non-decreasing in p.
  auto first_key = [&](int64_t p) {
    int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, p - a.window_left) : 0;
    if (a.chunk_size > 0) lo = std::max(lo, p / a.chunk_size * a.chunk_size);
    return lo;
  };
  auto row_offset = [&](int r) {
    const int64_t row = item.row_begin + r;
    return ((q_start + row / group) * a.num_heads + item.kv_head * group + row % group) * d;
  };

  for (int r = 0; r < nr; ++r) {
    const T* src = q + row_offset(r);
    float* dst = sc.q.data() + r * d;
    for (int64_t x = 0; x < d; ++x) dst[x] = S::load(src[x]) * a.scale;
    sc.m[r] = kNegInf;
    sc.l[r] = 0.f;
  }
  std::fill(sc.o.begin(), sc.o.begin() + nr * d, 0.f);

  const int64_t first_pos = row_pos(0);
  const int64_t key_end = row_pos(nr - 1) + 1;  // the tile's last row sees keys [0, key_end)
  // No row of the tile reads a key before first_key(first_pos); the chunks start on a
  // multiple of kChunk below it, so a row's keys fall in the same chunks whichever rows
  // share its tile (its result does not depend on how the queries were batched). The
  // keys before `unread_end` are masked for every row and their blocks may be null (-1):
  // they are read as zeros from scratch, never from the pool.
  const int64_t unread_end = first_key(first_pos);
  const int64_t key_begin = unread_end / kChunk * kChunk;
  const int64_t last_lo = first_key(row_pos(nr - 1));
  const bool local = a.window_left >= 0 || a.chunk_size > 0;
  // Blocks sit anywhere in the pool, so the hardware prefetcher stalls at every block
  // boundary; ask for the next chunk's K/V rows (into L2) while this chunk computes.
  constexpr int64_t kLine = 64;
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  auto prefetch_chunk = [&](int64_t c, int64_t head) {
    const int64_t end = std::min<int64_t>(key_end, c + kChunk);
    for (int64_t t = std::max(c, unread_end); t < end; ++t) {
      const char* row = reinterpret_cast<const char*>(kv + static_cast<int64_t>(blocks[t / bs]) * block_stride + (t % bs) * d + head);
      for (int64_t x = 0; x < row_bytes; x += kLine) __builtin_prefetch(row + x, 0, 2);
    }
  };
  prefetch_chunk(key_begin, k_head);
  prefetch_chunk(key_begin, v_head);
  for (int64_t c = key_begin; c < key_end; c += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, key_end - c));
    const bool more = c + kChunk < key_end;
    for (int j = 0; j < n; ++j) {
      const int64_t t = c + j;
      if (t < unread_end) {
        sc.krow[j] = sc.zeros.data();
        sc.vrow[j] = sc.zeros.data();
        continue;
      }
      const int64_t base = static_cast<int64_t>(blocks[t / bs]) * block_stride + (t % bs) * d;
      if constexpr (DT == AttnDType::kFloat32) {
        sc.krow[j] = kv + base + k_head;
        sc.vrow[j] = kv + base + v_head;
      } else {
        float* kd = sc.kbuf.data() + j * d;
        float* vd = sc.vbuf.data() + j * d;
        const T* ks = kv + base + k_head;
        const T* vs = kv + base + v_head;
        for (int64_t x = 0; x < d; ++x) kd[x] = S::load(ks[x]);
        for (int64_t x = 0; x < d; ++x) vd[x] = S::load(vs[x]);
        sc.krow[j] = kd;
        sc.vrow[j] = vd;
      }
    }

    if (more) prefetch_chunk(c + kChunk, k_head);
    int r = 0;
    for (; r + 4 <= nr; r += 4) scores_rows<4>(sc.q.data() + r * d, d, sc.krow, n, sc.s.data() + r * kChunk);
    for (; r < nr; ++r) scores_rows<1>(sc.q.data() + r * d, d, sc.krow, n, sc.s.data() + r * kChunk);

    const bool crosses_diagonal = c + n - 1 > first_pos;
    const bool crosses_window = local && c < last_lo;
    for (r = 0; r < nr; ++r) {
      float* s = sc.s.data() + r * kChunk;
      if (crosses_diagonal) {
        const int64_t visible = std::clamp<int64_t>(row_pos(r) + 1 - c, 0, n);
        for (int j = static_cast<int>(visible); j < n; ++j) s[j] = kNegInf;
      }
      if (crosses_window) {
        const int64_t hidden = std::clamp<int64_t>(first_key(row_pos(r)) - c, 0, n);
        for (int j = 0; j < static_cast<int>(hidden); ++j) s[j] = kNegInf;
      }
      softmax_chunk(s, n, sc.m[r], sc.l[r], sc.o.data() + r * d, d);
    }

    if (more) prefetch_chunk(c + kChunk, v_head);
    r = 0;
    for (; r + 4 <= nr; r += 4) accumulate_rows<4>(sc.o.data() + r * d, d, sc.s.data() + r * kChunk, sc.vrow, n);
    for (; r < nr; ++r) accumulate_rows<1>(sc.o.data() + r * d, d, sc.s.data() + r * kChunk, sc.vrow, n);
  }

  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < nr; ++r) {
    const float inv = 1.f / sc.l[r];
    const float* o = sc.o.data() + r * d;
    T* dst = out + row_offset(r);
    for (int64_t x = 0; x < d; ++x) dst[x] = S::store(o[x] * inv);
    if (a.lse != nullptr) a.lse[row_offset(r) / d] = sc.m[r] + std::log(sc.l[r]);
  }
}

PC_MULTIVERSION void run_item_f32(const PagedAttentionArgs& a, const WorkItem& w, Scratch& s) {
  run_item<AttnDType::kFloat32>(a, w, s);
}
PC_MULTIVERSION void run_item_f16(const PagedAttentionArgs& a, const WorkItem& w, Scratch& s) {
  run_item<AttnDType::kFloat16>(a, w, s);
}
PC_MULTIVERSION void run_item_bf16(const PagedAttentionArgs& a, const WorkItem& w, Scratch& s) {
  run_item<AttnDType::kBFloat16>(a, w, s);
}

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("paged_attention_cpu: " + msg); }

void validate(const PagedAttentionArgs& a) {
  if (a.batch_size < 0) bad("batch_size must be >= 0");
  if (a.num_kv_heads < 1 || a.num_heads < 1 || a.num_heads % a.num_kv_heads != 0) {
    bad("num_heads must be a positive multiple of num_kv_heads");
  }
  if (a.head_dim < 16 || a.head_dim > 1024 || a.head_dim % 16 != 0) bad("head_dim must be a multiple of 16 in [16, 1024]");
  if (a.block_size < 1) bad("block_size must be >= 1");
  if (a.num_blocks < 1) bad("num_blocks must be >= 1");
  if (a.num_kv_indices < 0) bad("num_kv_indices must be >= 0");
  if (!(a.scale > 0.f) || !std::isfinite(a.scale)) bad("scale must be finite and > 0");
  if (a.window_left < -1) bad("window_left must be >= -1 (-1: no window)");
  if (a.chunk_size < 0) bad("chunk_size must be >= 0 (0: none)");
  if (a.q_indptr == nullptr || a.kv_indptr == nullptr) bad("q_indptr and kv_indptr must not be null");
  if (a.batch_size > 0 && a.kv_lens == nullptr) bad("kv_lens must not be null");
  if (a.num_kv_indices > 0 && a.kv_indices == nullptr) bad("kv_indices must not be null");
  if (a.q_indptr[0] != 0 || a.kv_indptr[0] != 0) bad("q_indptr[0] and kv_indptr[0] must be 0");
  for (int64_t i = 0; i < a.batch_size; ++i) {
    const int64_t n_q = static_cast<int64_t>(a.q_indptr[i + 1]) - a.q_indptr[i];
    const int64_t n_blocks = static_cast<int64_t>(a.kv_indptr[i + 1]) - a.kv_indptr[i];
    const int64_t kv_len = a.kv_lens[i];
    if (n_q < 0 || n_blocks < 0) bad("q_indptr and kv_indptr must be non-decreasing");
    if (kv_len < 0) bad("kv_lens must be >= 0");
    if (n_q > kv_len) bad("request " + std::to_string(i) + " has more queries than kv_lens");
    if (n_blocks * a.block_size < kv_len) bad("request " + std::to_string(i) + " has fewer blocks than kv_lens needs");
  }
  if (a.kv_indptr[a.batch_size] != a.num_kv_indices) bad("kv_indptr[-1] must equal num_kv_indices");
  for (int64_t b = 0; b < a.batch_size; ++b) {
    // Blocks wholly before the first key of the request's first query are never read:
    // with local attention they may be -1 (null).
    int64_t unread = 0;
    const int64_t n_q = static_cast<int64_t>(a.q_indptr[b + 1]) - a.q_indptr[b];
    if ((a.window_left >= 0 || a.chunk_size > 0) && n_q > 0) {
      const int64_t p = a.kv_lens[b] - n_q;
      int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, p - a.window_left) : 0;
      if (a.chunk_size > 0) lo = std::max(lo, p / a.chunk_size * a.chunk_size);
      unread = lo / a.block_size;
    }
    for (int64_t i = a.kv_indptr[b]; i < a.kv_indptr[b + 1]; ++i) {
      const int32_t id = a.kv_indices[i];
      if (id == -1 && i - a.kv_indptr[b] < unread) continue;
      if (id < 0 || id >= a.num_blocks) {
        bad("kv_indices[" + std::to_string(i) + "] = " + std::to_string(id) +
            " is outside [0, num_blocks)" + (id == -1 ? " (a null block a query reads)" : ""));
      }
    }
  }
  const bool has_queries = a.batch_size > 0 && a.q_indptr[a.batch_size] > 0;
  if (has_queries && (a.q == nullptr || a.kv == nullptr || a.out == nullptr)) bad("q, kv and out must not be null");
}

std::vector<WorkItem> plan_items(const PagedAttentionArgs& a) {
  const int64_t group = a.num_heads / a.num_kv_heads;
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < a.batch_size; ++b) {
    const int64_t q_len = a.q_indptr[b + 1] - a.q_indptr[b];
    const int64_t rows = q_len * group;
    const int64_t kv_len = a.kv_lens[b];
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t r1 = std::min<int64_t>(rows, r0 + kRowTile);
      const int64_t last = kv_len - q_len + (r1 - 1) / group;
      int64_t lo = a.window_left >= 0 ? std::max<int64_t>(0, kv_len - q_len + r0 / group - a.window_left) : 0;
      if (a.chunk_size > 0) lo = std::max(lo, (kv_len - q_len + r0 / group) / a.chunk_size * a.chunk_size);
      const int64_t keys = last + 1 - lo;
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(h), static_cast<int32_t>(r0),
                         static_cast<int32_t>(r1), (r1 - r0 + 4) * keys});
      }
    }
  }
  // Largest first, so the last items to finish are short ones (better balance).
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return items;
}

}  // namespace

bool paged_attention_cpu_parallel() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

void paged_attention_cpu(const PagedAttentionArgs& args) {
  validate(args);
  const std::vector<WorkItem> items = plan_items(args);
  if (items.empty()) return;
  auto run = args.dtype == AttnDType::kFloat32   ? run_item_f32
             : args.dtype == AttnDType::kFloat16 ? run_item_f16
                                                 : run_item_bf16;
  const int64_t n = static_cast<int64_t>(items.size());
#ifdef _OPENMP
  const int threads = static_cast<int>(std::min<int64_t>(n, omp_get_max_threads()));
#else
  const int threads = 1;
#endif
  // Scratch is allocated here, where bad_alloc can still propagate; nothing inside the
  // parallel region throws, so no exception can cross it.
  std::vector<Scratch> scratch;
  scratch.reserve(threads);
  for (int t = 0; t < threads; ++t) scratch.emplace_back(args.head_dim);
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t i = 0; i < n; ++i) {
#ifdef _OPENMP
    Scratch& mine = scratch[omp_get_thread_num()];
#else
    Scratch& mine = scratch[0];
#endif
    run(args, items[i], mine);
  }
}

}  // namespace prefixcache
