// Block hashing: vLLM's `sha256_cbor` chain, computed natively.
//
// Owns: SHA-256 (FIPS 180-4; the x86 SHA extensions when the CPU has them, a
// portable implementation otherwise), the canonical CBOR encoding of one chain
// link `(parent_hash, tuple(block_tokens), extra_keys)`, and the chain itself:
//
//   hash[0] = sha256(cbor((parent, tokens[0:bs], first_extra)))
//   hash[i] = sha256(cbor((hash[i-1], tokens[i*bs:(i+1)*bs], later_extra)))
//
// byte for byte what `sha256(cbor2.dumps(obj, canonical=True))` gives in Python
// (prefixcache/hashing.py is the readable reference; tests require equality).
//
// Never does: look anything up, cache anything, or hash a partial block. It
// does not encode arbitrary extra keys either: the caller passes the first
// block's and the later blocks' extra keys already CBOR-encoded (they are per
// request, not per block: a salt on the first block, a LoRA adapter on all).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace prefixcache {

using Digest = std::array<uint8_t, 32>;

// SHA-256 of `data`, on the fastest implementation this CPU has.
Digest sha256(std::string_view data);
// SHA-256 of `data` on the portable implementation (so tests cover it on any CPU).
Digest sha256_portable(std::string_view data);
// Whether sha256() uses the x86 SHA extensions on this machine.
bool sha256_uses_cpu_extensions();

// Appends canonical (RFC 8949 core deterministic) CBOR to a byte buffer: every
// length and integer in its shortest form, as cbor2's canonical mode writes.
class CborWriter {
 public:
  void array_header(uint64_t length) { head(4, length); }
  void byte_string(std::string_view bytes);
  // Major type 0 for v >= 0; major type 1 carrying -1 - v for v < 0, which is
  // ~v in two's complement (no overflow at INT64_MIN).
  void integer(int64_t v) { v >= 0 ? head(0, static_cast<uint64_t>(v)) : head(1, ~static_cast<uint64_t>(v)); }
  void null() { put(0xf6); }
  // Already-encoded CBOR, copied verbatim.
  void raw(std::string_view cbor) { append(reinterpret_cast<const uint8_t*>(cbor.data()), cbor.size()); }

  void clear() { size_ = 0; }
  void reserve(size_t n);
  std::string_view bytes() const { return {reinterpret_cast<const char*>(buf_.data()), size_}; }

 private:
  // A head is the major type in the top 3 bits and the argument: inline below
  // 24, else big-endian in the 1, 2, 4 or 8 bytes that follow (additional
  // information 24, 25, 26, 27). Per token, so it writes in place.
  void head(uint8_t major, uint64_t arg) {
    ensure(9);
    uint8_t* p = buf_.data() + size_;
    const uint8_t type = static_cast<uint8_t>(major << 5);
    int width = arg < 24 ? 0 : arg <= 0xff ? 1 : arg <= 0xffff ? 2 : arg <= 0xffffffffULL ? 4 : 8;
    if (width == 0) {
      p[0] = type | static_cast<uint8_t>(arg);
    } else {
      p[0] = type | static_cast<uint8_t>(width == 1 ? 24 : width == 2 ? 25 : width == 4 ? 26 : 27);
      for (int i = 0; i < width; ++i) p[width - i] = static_cast<uint8_t>(arg >> (8 * i));
    }
    size_ += 1 + width;
  }
  void put(uint8_t byte) {
    ensure(1);
    buf_[size_++] = byte;
  }
  void ensure(size_t n) {
    if (size_ + n > buf_.size()) buf_.resize(std::max(2 * buf_.size(), size_ + n));
  }
  void append(const uint8_t* data, size_t n);

  std::vector<uint8_t> buf_;  // capacity; the first size_ bytes are the encoding
  size_t size_ = 0;
};

// The sha256_cbor hashes of the FULL blocks of `tokens` (a partial tail is
// ignored), chained from `parent`. `first_extra_cbor` is the CBOR encoding of
// the first block's extra keys, `later_extra_cbor` that of every later block's;
// nullopt means None (0xf6). Throws std::invalid_argument if block_size < 1.
std::vector<Digest> sha256_cbor_chain(std::string_view parent, std::span<const int64_t> tokens,
                                      int64_t block_size, std::optional<std::string_view> first_extra_cbor,
                                      std::optional<std::string_view> later_extra_cbor = std::nullopt);

}  // namespace prefixcache
