// Block hashing implementation. See hashing.h for what it owns.
#include "hashing.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#define PREFIXCACHE_X86 1
#include <immintrin.h>
#endif

namespace prefixcache {

namespace {

// ---------------------------------------------------------------- SHA-256

constexpr uint32_t kInitialState[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                       0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

alignas(16) constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

inline uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }

inline uint32_t load_be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// One compression per 64-byte block, straight from FIPS 180-4 section 6.2.2.
void compress_portable(uint32_t state[8], const uint8_t* data, size_t num_blocks) {
  uint32_t w[64];
  for (; num_blocks > 0; --num_blocks, data += 64) {
    for (int t = 0; t < 16; ++t) w[t] = load_be32(data + 4 * t);
    for (int t = 16; t < 64; ++t) {
      uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
    for (int t = 0; t < 64; ++t) {
      uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[t] + w[t];
      uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      h = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
    state[4] += e;
    state[5] += f;
    state[6] += g;
    state[7] += h;
  }
}

#ifdef PREFIXCACHE_X86
// The SHA extensions run two rounds per sha256rnds2 on the state split as
// (A,B,E,F) and (C,D,G,H); the message schedule is four words per register,
// extended by sha256msg1 (the sigma0 term) and sha256msg2 (the sigma1 terms).
__attribute__((target("sha,sse4.1"))) void compress_sha_ni(uint32_t state[8], const uint8_t* data,
                                                              size_t num_blocks) {
  const __m128i byteswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
  __m128i dcba = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state));
  __m128i hgfe = _mm_loadu_si128(reinterpret_cast<const __m128i*>(state + 4));
  __m128i cdab = _mm_shuffle_epi32(dcba, 0xb1);
  __m128i efgh = _mm_shuffle_epi32(hgfe, 0x1b);
  __m128i abef = _mm_alignr_epi8(cdab, efgh, 8);
  __m128i cdgh = _mm_blend_epi16(efgh, cdab, 0xf0);

  for (; num_blocks > 0; --num_blocks, data += 64) {
    const __m128i abef_in = abef, cdgh_in = cdgh;
    __m128i w[4];  // message words of the last four groups, w[g % 4] is group g
#pragma GCC unroll 16
    for (int g = 0; g < 16; ++g) {
      __m128i words;
      if (g < 4) {
        words = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(data + 16 * g)), byteswap);
      } else {
        // W[t] = W[t-16] + s0(W[t-15]) + W[t-7] + s1(W[t-2]), four at a time.
        __m128i partial = _mm_sha256msg1_epu32(w[g % 4], w[(g + 1) % 4]);
        partial = _mm_add_epi32(partial, _mm_alignr_epi8(w[(g + 3) % 4], w[(g + 2) % 4], 4));
        words = _mm_sha256msg2_epu32(partial, w[(g + 3) % 4]);
      }
      w[g % 4] = words;
      __m128i msg = _mm_add_epi32(words, _mm_load_si128(reinterpret_cast<const __m128i*>(kRound + 4 * g)));
      cdgh = _mm_sha256rnds2_epu32(cdgh, abef, msg);
      abef = _mm_sha256rnds2_epu32(abef, cdgh, _mm_shuffle_epi32(msg, 0x0e));
    }
    abef = _mm_add_epi32(abef, abef_in);
    cdgh = _mm_add_epi32(cdgh, cdgh_in);
  }

  __m128i feba = _mm_shuffle_epi32(abef, 0x1b);
  __m128i dchg = _mm_shuffle_epi32(cdgh, 0xb1);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state), _mm_blend_epi16(feba, dchg, 0xf0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(state + 4), _mm_alignr_epi8(dchg, feba, 8));
}
#endif

using CompressFn = void (*)(uint32_t*, const uint8_t*, size_t);

bool cpu_has_sha_extensions() {
#ifdef PREFIXCACHE_X86
  return __builtin_cpu_supports("sha") && __builtin_cpu_supports("sse4.1");
#else
  return false;
#endif
}

// Chosen once per process; both implementations give identical digests.
const CompressFn best_compress = [] {
#ifdef PREFIXCACHE_X86
  if (cpu_has_sha_extensions()) return static_cast<CompressFn>(compress_sha_ni);
#endif
  return static_cast<CompressFn>(compress_portable);
}();

Digest sha256_with(CompressFn compress, std::string_view data) {
  uint32_t state[8];
  std::memcpy(state, kInitialState, sizeof state);
  const auto* bytes = reinterpret_cast<const uint8_t*>(data.data());
  size_t full = data.size() / 64;
  compress(state, bytes, full);

  // Padding: 0x80, zeros, then the message length in bits, big-endian, so the
  // total is a multiple of 64 bytes (one or two more blocks).
  uint8_t tail[128] = {};
  size_t rest = data.size() - full * 64;
  std::memcpy(tail, bytes + full * 64, rest);
  tail[rest] = 0x80;
  size_t tail_size = rest + 9 <= 64 ? 64 : 128;
  uint64_t bits = static_cast<uint64_t>(data.size()) * 8;
  for (int i = 0; i < 8; ++i) tail[tail_size - 1 - i] = static_cast<uint8_t>(bits >> (8 * i));
  compress(state, tail, tail_size / 64);

  Digest out;
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = static_cast<uint8_t>(state[i] >> 24);
    out[4 * i + 1] = static_cast<uint8_t>(state[i] >> 16);
    out[4 * i + 2] = static_cast<uint8_t>(state[i] >> 8);
    out[4 * i + 3] = static_cast<uint8_t>(state[i]);
  }
  return out;
}

// ---------------------------------------------------------------- CBOR

// Upper bound of one encoded link: array head, parent byte string, token
// array head, 9 bytes per token, and the extra keys.
size_t link_size_bound(size_t parent_size, size_t block_size, size_t extra_size) {
  return 1 + 9 + parent_size + 9 + 9 * block_size + extra_size + 1;
}

}  // namespace

Digest sha256(std::string_view data) { return sha256_with(best_compress, data); }

Digest sha256_portable(std::string_view data) { return sha256_with(compress_portable, data); }

bool sha256_uses_cpu_extensions() { return best_compress != compress_portable; }

void CborWriter::reserve(size_t n) {
  if (buf_.size() < n) buf_.resize(n);
}

void CborWriter::append(const uint8_t* data, size_t n) {
  ensure(n);
  std::memcpy(buf_.data() + size_, data, n);
  size_ += n;
}

void CborWriter::byte_string(std::string_view bytes) {
  head(2, bytes.size());
  raw(bytes);
}

std::vector<Digest> sha256_cbor_chain(std::string_view parent, std::span<const int64_t> tokens,
                                      int64_t block_size, std::optional<std::string_view> first_extra_cbor,
                                      std::optional<std::string_view> later_extra_cbor) {
  if (block_size < 1) {
    throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  }
  const size_t bs = static_cast<size_t>(block_size);
  const size_t num_blocks = tokens.size() / bs;
  std::vector<Digest> out(num_blocks);
  if (num_blocks == 0) return out;  // also keeps a huge block_size from sizing the buffer
  CborWriter link;
  link.reserve(link_size_bound(std::max(parent.size(), sizeof(Digest)), bs,
                               std::max(first_extra_cbor ? first_extra_cbor->size() : 0,
                                        later_extra_cbor ? later_extra_cbor->size() : 0)));
  std::string_view prev = parent;
  for (size_t b = 0; b < num_blocks; ++b) {
    link.clear();
    link.array_header(3);
    link.byte_string(prev);
    link.array_header(bs);
    for (int64_t token : tokens.subspan(b * bs, bs)) link.integer(token);
    const std::optional<std::string_view>& extra = b == 0 ? first_extra_cbor : later_extra_cbor;
    if (extra) {
      link.raw(*extra);
    } else {
      link.null();
    }
    out[b] = sha256(link.bytes());
    prev = std::string_view(reinterpret_cast<const char*>(out[b].data()), out[b].size());
  }
  return out;
}

}  // namespace prefixcache
