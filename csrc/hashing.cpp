// Block hashing implementation. See hashing.h for what it owns.
#include "hashing.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

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

// `v` stored big-endian at p.
template <class U>
void store_big_endian(uint8_t* p, U v) {
  if constexpr (std::endian::native == std::endian::little) {
    if constexpr (sizeof(U) == 2) v = __builtin_bswap16(v);
    if constexpr (sizeof(U) == 4) v = __builtin_bswap32(v);
    if constexpr (sizeof(U) == 8) v = __builtin_bswap64(v);
  }
  std::memcpy(p, &v, sizeof v);
}

// SHA-256's padding (0x80, zeros, the length in bits) takes at most this many bytes.
constexpr size_t kSha256Padding = 72;

// The digest of the bytes written from the state: big-endian words.
Digest digest_of(const uint32_t* state) {
  Digest out;
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = static_cast<uint8_t>(state[i] >> 24);
    out[4 * i + 1] = static_cast<uint8_t>(state[i] >> 16);
    out[4 * i + 2] = static_cast<uint8_t>(state[i] >> 8);
    out[4 * i + 3] = static_cast<uint8_t>(state[i]);
  }
  return out;
}

// SHA-256 of data[0, n), padding it in place: the buffer holds n + kSha256Padding bytes
// (what follows the message is overwritten). A chain's link is hashed with no copy.
Digest sha256_padding_in_place(uint8_t* data, size_t n) {
  const size_t total = (n + 9 + 63) / 64 * 64;
  data[n] = 0x80;
  std::memset(data + n + 1, 0, total - n - 9);
  store_big_endian(data + total - 8, static_cast<uint64_t>(n) * 8);
  uint32_t state[8];
  std::memcpy(state, kInitialState, sizeof state);
  best_compress(state, data, total / 64);
  return digest_of(state);
}

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
  return digest_of(state);
}

// ---------------------------------------------------------------- pickle

// Pickle protocol 5 opcodes (Lib/pickletools.py) the link uses.
constexpr uint8_t kProto = 0x80, kFrame = 0x95, kShortBinBytes = 'C', kMemoize = 0x94, kMark = '(',
                  kTuple = 't', kTuple1 = 0x85, kTuple2 = 0x86, kTuple3 = 0x87, kStop = '.', kNone = 'N',
                  kBinInt1 = 'K', kBinInt2 = 'M', kBinInt = 'J', kLong1 = 0x8a;

// A little-endian store of v's low bytes at p (all of v's bytes are written).
template <typename U>
void store_little_endian(uint8_t* p, U v) {
  if constexpr (std::endian::native == std::endian::big) {
    if constexpr (sizeof(U) == 4) v = __builtin_bswap32(v);
    if constexpr (sizeof(U) == 8) v = __builtin_bswap64(v);
  }
  std::memcpy(p, &v, sizeof v);
}

// One int as pickle's save_long writes it (protocol >= 2), at p; returns the end.
// Written through a pointer into a buffer sized for the whole link, with at least 5
// bytes after the end of any int: an int32 is one opcode and a 4-byte store, of which
// BININT1 keeps 1 and BININT2 2, chosen without a branch (token widths vary from
// one id to the next, and a mispredicted branch per token cost more than the SHA).
uint8_t* pickle_int(uint8_t* p, int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) [[likely]] {
    const unsigned width = (static_cast<uint64_t>(v) > 0xff) + (static_cast<uint64_t>(v) > 0xffff);  // 0..2
    static constexpr uint8_t kOp[3] = {kBinInt1, kBinInt2, kBinInt}, kBytes[3] = {1, 2, 4};
    p[0] = kOp[width];
    store_little_endian(p + 1, static_cast<uint32_t>(v));
    return p + 1 + kBytes[width];
  }
  // LONG1: little-endian two's complement in (bit_length(|v|) / 8 + 1) bytes, one
  // fewer for a negative value whose top byte is only sign (as save_long trims).
  const uint64_t magnitude = v < 0 ? ~static_cast<uint64_t>(v) + 1 : static_cast<uint64_t>(v);
  size_t nbytes = static_cast<size_t>(64 - __builtin_clzll(magnitude)) / 8 + 1;
  uint8_t bytes[9];
  const auto u = static_cast<uint64_t>(v);
  for (size_t i = 0; i < nbytes; ++i) bytes[i] = i < 8 ? static_cast<uint8_t>(u >> (8 * i)) : (v < 0 ? 0xff : 0);
  if (v < 0 && nbytes > 1 && bytes[nbytes - 1] == 0xff && (bytes[nbytes - 2] & 0x80) != 0) --nbytes;
  *p++ = kLong1;
  *p++ = static_cast<uint8_t>(nbytes);
  std::memcpy(p, bytes, nbytes);
  return p + nbytes;
}

// Ids of one pickle width from `t` on, each an opcode and a fixed-size store, up to the
// first of another width (returned). Synthetic ids (a trace's hash ids times the block
// size, plus the offset) share one width for whole blocks: a fixed stride, and the one
// branch per id is always taken the same way.
template <unsigned Bytes>
const int64_t* pickle_run(uint8_t*& out, const int64_t* t, const int64_t* end) {
  uint8_t* p = out;  // a local: a byte store through `out` could alias it, as far as the compiler knows
  for (; t != end; ++t) {
    const auto u = static_cast<uint64_t>(*t);
    if constexpr (Bytes == 1) {
      if (u > 0xff) break;
      p[0] = kBinInt1;
    } else if constexpr (Bytes == 2) {
      if (u - 0x100 > 0xffff - 0x100) break;
      p[0] = kBinInt2;
    } else {  // an int32 outside [0, 0xffff]
      if (u - static_cast<uint64_t>(INT32_MIN) > UINT32_MAX || u <= 0xffff) break;
      p[0] = kBinInt;
    }
    store_little_endian(p + 1, static_cast<uint32_t>(u));
    p += 1 + Bytes;
  }
  out = p;
  return t;
}

// Every id as pickle_int writes it: a run of the first id's width (whole blocks of
// synthetic ids), then id by id without a branch (text mixes widths from one id to the next).
uint8_t* pickle_ints(uint8_t* p, std::span<const int64_t> tokens) {
  const int64_t *t = tokens.data(), *const end = t + tokens.size();
  if (t == end) return p;
  const auto first = static_cast<uint64_t>(*t);
  if (first <= 0xff) {
    t = pickle_run<1>(p, t, end);
  } else if (first <= 0xffff) {
    t = pickle_run<2>(p, t, end);
  } else if (first - static_cast<uint64_t>(INT32_MIN) <= UINT32_MAX) {
    t = pickle_run<4>(p, t, end);
  }
  for (; t != end; ++t) p = pickle_int(p, *t);
  return p;
}

// pickle.dumps((parent, tuple(tokens), extra), protocol=5) into `out`, which holds at
// least link_size_bound(...) bytes; returns its length. PROTO 5, one FRAME, the parent
// bytes (memo 0), the token tuple (memo 1), the caller-encoded extra keys (memo 2 on)
// or None, TUPLE3, MEMOIZE, STOP.
size_t pickle_link(uint8_t* out, std::string_view parent, std::span<const int64_t> tokens,
                   const std::optional<std::string_view>& extra) {
  uint8_t* p = out;
  *p++ = kProto;
  *p++ = 5;
  p += 9;  // FRAME and its 8-byte length, written below
  uint8_t* const body = p;
  *p++ = kShortBinBytes;  // digests are < 256 bytes
  *p++ = static_cast<uint8_t>(parent.size());
  std::memcpy(p, parent.data(), parent.size());
  p += parent.size();
  *p++ = kMemoize;
  if (tokens.size() > 3) *p++ = kMark;
  p = pickle_ints(p, tokens);
  static constexpr uint8_t kTupleOf[4] = {0, kTuple1, kTuple2, kTuple3};
  *p++ = tokens.size() > 3 ? kTuple : kTupleOf[tokens.size()];
  *p++ = kMemoize;
  if (extra) {
    std::memcpy(p, extra->data(), extra->size());
    p += extra->size();
  } else {
    *p++ = kNone;
  }
  *p++ = kTuple3;
  *p++ = kMemoize;
  *p++ = kStop;
  const uint64_t frame = static_cast<uint64_t>(p - body);
  if (frame > kMaxPickleLink) {
    throw std::invalid_argument("a pickle link of " + std::to_string(frame) + " bytes does not fit one pickle frame");
  }
  out[2] = kFrame;
  for (int i = 0; i < 8; ++i) out[3 + i] = static_cast<uint8_t>(frame >> (8 * i));
  return static_cast<size_t>(p - out);
}

// A CBOR head (major type `type`, pre-shifted, and argument `arg`) in its shortest form
// at p; returns the end. Written through a pointer into a buffer sized for the whole
// link, one store per width: per token, so no per-byte loop or capacity check.
uint8_t* cbor_head(uint8_t* p, uint8_t type, uint64_t arg) {
  if (arg < 24) {
    *p = type | static_cast<uint8_t>(arg);
    return p + 1;
  }
  if (arg <= 0xff) {
    p[0] = type | 24;
    p[1] = static_cast<uint8_t>(arg);
    return p + 2;
  }
  if (arg <= 0xffff) {
    p[0] = type | 25;
    store_big_endian(p + 1, static_cast<uint16_t>(arg));
    return p + 3;
  }
  if (arg <= 0xffffffffULL) {
    p[0] = type | 26;
    store_big_endian(p + 1, static_cast<uint32_t>(arg));
    return p + 5;
  }
  p[0] = type | 27;
  store_big_endian(p + 1, arg);
  return p + 9;
}

// A CBOR argument's encoding by its bit length (1..64): the head's additional
// information, the bytes after the head, and the shift that puts them at the top of a
// 64-bit word. Arguments below 24 (bit length <= 5) are inline: cbor_int checks that.
struct CborWidth {
  uint8_t info, bytes, shift;
};
constexpr std::array<CborWidth, 65> kCborWidths = [] {
  std::array<CborWidth, 65> w{};
  for (int bits = 0; bits <= 64; ++bits) {
    w[bits] = bits <= 8 ? CborWidth{24, 1, 56} : bits <= 16 ? CborWidth{25, 2, 48} : bits <= 32 ? CborWidth{26, 4, 32} : CborWidth{27, 8, 0};
  }
  return w;
}();

// One int as cbor_head would write it (major type 0 for v >= 0, 1 carrying -1 - v for
// v < 0), chosen without a branch: per token, where widths vary from one id to the
// next (two in five ids of English text are below 256) and a mispredicted branch per
// token cost more than the SHA. Always stores 9 bytes at p (the buffer holds 9 per
// token and more after; bytes past the returned end are overwritten or not hashed).
uint8_t* cbor_int(uint8_t* p, int64_t v) {
  const uint64_t sign = static_cast<uint64_t>(v >> 63);  // all ones for v < 0
  const uint64_t arg = static_cast<uint64_t>(v) ^ sign;   // ~v for v < 0
  const CborWidth w = kCborWidths[64 - std::countl_zero(arg | 1)];
  const bool inline_arg = arg < 24;
  p[0] = static_cast<uint8_t>((sign & (1 << 5)) | (inline_arg ? arg : w.info));
  store_big_endian(p + 1, arg << w.shift);
  return p + 1 + (inline_arg ? 0 : w.bytes);
}

// Ids of one CBOR head (sign and argument width) from `t` on, each a fixed-size store,
// up to the first of another (returned): pickle_run's fast path for CBOR. Bytes is the
// argument's size after the head, 0 for an argument inside it (below 24).
template <unsigned Bytes>
const int64_t* cbor_run(uint8_t*& out, const int64_t* t, const int64_t* end, uint64_t sign) {
  uint8_t* p = out;  // a local, as in pickle_run
  constexpr uint64_t lo = Bytes == 0 ? 0 : Bytes == 1 ? 24 : Bytes == 2 ? 0x100 : Bytes == 4 ? 0x10000 : 1ULL << 32;
  constexpr uint64_t hi = Bytes == 0 ? 23 : Bytes == 1 ? 0xff : Bytes == 2 ? 0xffff : Bytes == 4 ? 0xffffffffULL : ~0ULL;
  constexpr uint8_t info = Bytes == 1 ? 24 : Bytes == 2 ? 25 : Bytes == 4 ? 26 : 27;
  const auto major = static_cast<uint8_t>(sign & (1 << 5));
  for (; t != end; ++t) {
    const auto s = static_cast<uint64_t>(*t >> 63);
    const uint64_t arg = static_cast<uint64_t>(*t) ^ s;
    if (s != sign || arg - lo > hi - lo) break;
    if constexpr (Bytes == 0) {
      *p = major | static_cast<uint8_t>(arg);
    } else {
      p[0] = major | info;
      if constexpr (Bytes == 1) p[1] = static_cast<uint8_t>(arg);
      if constexpr (Bytes == 2) store_big_endian(p + 1, static_cast<uint16_t>(arg));
      if constexpr (Bytes == 4) store_big_endian(p + 1, static_cast<uint32_t>(arg));
      if constexpr (Bytes == 8) store_big_endian(p + 1, arg);
    }
    p += 1 + Bytes;
  }
  out = p;
  return t;
}

// Every id as cbor_int writes it: a run of the first id's head, then id by id without
// a branch (pickle_ints says why).
uint8_t* cbor_ints(uint8_t* p, std::span<const int64_t> tokens) {
  const int64_t *t = tokens.data(), *const end = t + tokens.size();
  if (t == end) return p;
  const auto sign = static_cast<uint64_t>(*t >> 63);
  const uint64_t arg = static_cast<uint64_t>(*t) ^ sign;
  if (arg < 24) {
    t = cbor_run<0>(p, t, end, sign);
  } else if (arg <= 0xff) {
    t = cbor_run<1>(p, t, end, sign);
  } else if (arg <= 0xffff) {
    t = cbor_run<2>(p, t, end, sign);
  } else if (arg <= 0xffffffffULL) {
    t = cbor_run<4>(p, t, end, sign);
  } else {
    t = cbor_run<8>(p, t, end, sign);
  }
  for (; t != end; ++t) p = cbor_int(p, *t);
  return p;
}

// cbor2.dumps((parent, tuple(tokens), extra), canonical=True) into `out`, which holds
// at least link_size_bound(...) bytes; returns its length. Integers: major type 0 for
// v >= 0, major type 1 carrying -1 - v (~v in two's complement) for v < 0.
size_t cbor_link(uint8_t* out, std::string_view parent, std::span<const int64_t> tokens,
                 const std::optional<std::string_view>& extra) {
  uint8_t* p = cbor_head(out, 4 << 5, 3);
  p = cbor_head(p, 2 << 5, parent.size());
  std::memcpy(p, parent.data(), parent.size());
  p += parent.size();
  p = cbor_head(p, 4 << 5, tokens.size());
  p = cbor_ints(p, tokens);
  if (extra) {
    std::memcpy(p, extra->data(), extra->size());
    p += extra->size();
  } else {
    *p++ = 0xf6;  // null
  }
  return static_cast<size_t>(p - out);
}

}  // namespace

size_t link_size_bound(size_t parent_size, size_t block_size, size_t extra_size) {
  // CBOR: array head, parent byte string, token array head, 9 bytes per token (and
  // cbor_int's 9-byte store), the extra keys. Pickle: 11 header bytes, 2 + parent + 1,
  // 2 tuple bytes, at most 10 bytes per token (pickle_int's stores are 5), the extra
  // keys, 3 closing bytes.
  return 16 + parent_size + 10 * block_size + extra_size + 16;
}

HashAlgorithm parse_hash_algorithm(std::string_view name) {
  if (name == "sha256_cbor") return HashAlgorithm::kSha256Cbor;
  if (name == "sha256") return HashAlgorithm::kSha256Pickle;
  if (name == "xxhash") return HashAlgorithm::kXxhashPickle;
  if (name == "xxhash_cbor") return HashAlgorithm::kXxhashCbor;
  throw std::invalid_argument("unknown hash algorithm '" + std::string(name) +
                              "'; allowed values: sha256_cbor, sha256, xxhash, xxhash_cbor");
}

size_t digest_size(HashAlgorithm algorithm) {
  return algorithm == HashAlgorithm::kSha256Cbor || algorithm == HashAlgorithm::kSha256Pickle ? 32 : 16;
}

std::array<uint8_t, 16> xxh3_128(std::string_view data) {
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, XXH3_128bits(data.data(), data.size()));
  std::array<uint8_t, 16> out;
  std::memcpy(out.data(), canonical.digest, out.size());
  return out;
}

void chain_digests(HashAlgorithm algorithm, std::string_view parent, std::span<const int64_t> tokens,
                   int64_t block_size, std::optional<std::string_view> first_extra,
                   std::optional<std::string_view> later_extra, std::string& out) {
  if (block_size < 1) throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  const size_t bs = static_cast<size_t>(block_size);
  const size_t num_blocks = tokens.size() / bs;
  if (num_blocks == 0) return;  // also keeps a huge block_size from sizing a buffer
  const size_t ds = digest_size(algorithm);
  const bool pickle = algorithm == HashAlgorithm::kSha256Pickle || algorithm == HashAlgorithm::kXxhashPickle;
  const bool sha = ds == 32;
  const size_t start = out.size();
  out.resize(start + num_blocks * ds);
  const size_t extra_size = std::max(first_extra ? first_extra->size() : 0, later_extra ? later_extra->size() : 0);
  // One buffer for every link, with room after it for SHA-256's padding.
  std::vector<uint8_t> encoded(link_size_bound(std::max(parent.size(), ds), bs, extra_size) + kSha256Padding);
  std::string_view prev = parent;
  for (size_t b = 0; b < num_blocks; ++b) {
    const auto block = tokens.subspan(b * bs, bs);
    const std::optional<std::string_view>& extra = b == 0 ? first_extra : later_extra;
    const size_t n = pickle ? pickle_link(encoded.data(), prev, block, extra) : cbor_link(encoded.data(), prev, block, extra);
    const std::string_view link(reinterpret_cast<const char*>(encoded.data()), n);
    char* digest = out.data() + start + b * ds;
    if (sha) {
      const Digest d = sha256_padding_in_place(encoded.data(), n);
      std::memcpy(digest, d.data(), ds);
    } else {
      const auto d = xxh3_128(link);
      std::memcpy(digest, d.data(), ds);
    }
    prev = std::string_view(digest, ds);
  }
}

Digest sha256(std::string_view data) { return sha256_with(best_compress, data); }

Digest sha256_portable(std::string_view data) { return sha256_with(compress_portable, data); }

bool sha256_uses_cpu_extensions() { return best_compress != compress_portable; }

std::vector<Digest> sha256_cbor_chain(std::string_view parent, std::span<const int64_t> tokens,
                                      int64_t block_size, std::optional<std::string_view> first_extra_cbor,
                                      std::optional<std::string_view> later_extra_cbor) {
  std::string packed;
  chain_digests(HashAlgorithm::kSha256Cbor, parent, tokens, block_size, first_extra_cbor, later_extra_cbor, packed);
  std::vector<Digest> out(packed.size() / sizeof(Digest));
  std::memcpy(out.data(), packed.data(), packed.size());
  return out;
}

}  // namespace prefixcache
