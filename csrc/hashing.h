// Block hashing: vLLM's four block-hash algorithms, computed natively.
//
// Owns: SHA-256 (FIPS 180-4; the x86 SHA extensions when the CPU has them, a
// portable implementation otherwise), XXH3-128 (the xxHash library's own code,
// third_party/xxhash, BSD-2-Clause), the two encodings of one chain link
// `(parent_hash, tuple(block_tokens), extra_keys)` vLLM hashes -- canonical CBOR
// (`cbor2.dumps(obj, canonical=True)`) and pickle protocol 5 (`pickle.dumps(obj,
// protocol=5)`) -- and the chain itself:
//
//   hash[0] = H(enc((parent, tokens[0:bs], first_extra)))
//   hash[i] = H(enc((hash[i-1], tokens[i*bs:(i+1)*bs], later_extra)))
//
// byte for byte what prefixcache/hashing.py (the readable reference) gives for
// sha256_cbor, sha256 (pickle), xxhash (pickle) and xxhash_cbor; tests require equality.
//
// Never does: look anything up, cache anything, or hash a partial block. It does not
// encode arbitrary extra keys either: the caller passes the first block's and the
// later blocks' extra keys already encoded (they are per request, not per block: a
// salt on the first block, a LoRA adapter on all). For pickle that is the opcodes
// pickle writes for extra_keys as the third item of the link, memo numbering from 2
// (after the parent bytes and the token tuple), which only Python's pickle knows for
// every object: hashing.py computes it once per namespace. A pickle link must fit one
// pickle frame (< 64 KiB); hashing.py hashes longer blocks in Python.
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

// vLLM's block-hash algorithms: the link encoding and the digest.
enum class HashAlgorithm { kSha256Cbor, kSha256Pickle, kXxhashPickle, kXxhashCbor };

// Parses an algorithm name (sha256_cbor, sha256, xxhash, xxhash_cbor); std::invalid_argument
// names the allowed values.
HashAlgorithm parse_hash_algorithm(std::string_view name);
// Bytes per digest: 32 for SHA-256, 16 for XXH3-128.
size_t digest_size(HashAlgorithm algorithm);
// Bytes a pickle link may take (one pickle frame): links beyond it are not hashed here.
inline constexpr size_t kMaxPickleLink = 65535;
// An upper bound of one link's encoded size, for the caller's frame check.
size_t link_size_bound(size_t parent_size, size_t block_size, size_t extra_size);

// SHA-256 of `data`, on the fastest implementation this CPU has.
Digest sha256(std::string_view data);
// SHA-256 of `data` on the portable implementation (so tests cover it on any CPU).
Digest sha256_portable(std::string_view data);
// Whether sha256() uses the x86 SHA extensions on this machine.
bool sha256_uses_cpu_extensions();

// XXH3-128 of `data`, in the canonical (big-endian) byte order python-xxhash's
// xxh3_128_digest returns.
std::array<uint8_t, 16> xxh3_128(std::string_view data);

// Appends the digests of the FULL blocks of `tokens` (a partial tail is ignored),
// chained from `parent`, to `out`, packed back to back. The extras are encoded as
// the algorithm's link encoding needs (see the top of this file); nullopt means None.
// Throws std::invalid_argument if block_size < 1, or if a pickle link would not fit
// one frame.
void chain_digests(HashAlgorithm algorithm, std::string_view parent, std::span<const int64_t> tokens,
                   int64_t block_size, std::optional<std::string_view> first_extra,
                   std::optional<std::string_view> later_extra, std::string& out);

// The sha256_cbor hashes of the FULL blocks of `tokens` (a partial tail is
// ignored), chained from `parent`. `first_extra_cbor` is the CBOR encoding of
// the first block's extra keys, `later_extra_cbor` that of every later block's;
// nullopt means None (0xf6). Throws std::invalid_argument if block_size < 1.
std::vector<Digest> sha256_cbor_chain(std::string_view parent, std::span<const int64_t> tokens,
                                      int64_t block_size, std::optional<std::string_view> first_extra_cbor,
                                      std::optional<std::string_view> later_extra_cbor = std::nullopt);

}  // namespace prefixcache
