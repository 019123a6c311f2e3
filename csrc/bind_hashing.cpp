// Python binding of block hashing: converts tokens and bytes, nothing more.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>
#include <limits>

#include "hashing.h"
#include "py_args.h"
#include "token_ids.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

py::bytes digest_bytes(const uint8_t* d, size_t n) { return py::bytes(reinterpret_cast<const char*>(d), n); }

std::optional<std::string_view> optional_bytes(py::handle obj, const char* what) {
  if (obj.is_none()) return std::nullopt;
  return bytes_view(obj, what);
}

// The chain of `algorithm` over the full blocks of `tokens`: packed bytes, or a list
// of digests; None if a token id does not fit int64 (hash those in Python).
py::object chain(HashAlgorithm algorithm, py::handle tokens, int64_t block_size, py::handle parent,
                 py::handle first_extra, py::handle later_extra, bool packed, const char* first_name = "first_extra",
                 const char* later_name = "later_extra") {
  if (block_size < 1) throw py::value_error("block_size must be >= 1, got " + std::to_string(block_size));
  std::string_view parent_bytes = bytes_view(parent, "parent");
  std::optional<std::string_view> extra = optional_bytes(first_extra, first_name);
  std::optional<std::string_view> later = optional_bytes(later_extra, later_name);
  // Only the full blocks are read: a partial tail is never hashed, so never checked here.
  TokenIds<int64_t> ids;
  read_token_ids<int64_t>(tokens, "tokens", ids, nullptr, static_cast<size_t>(block_size));
  const size_t hashed = ids.ids.size();
  if (!ids.complete()) return py::none();  // a full block holds an id beyond int64
  std::string out;
  {
    py::gil_scoped_release unlocked;  // parent and extras are immutable bytes we hold; ids are ours
    chain_digests(algorithm, parent_bytes, std::span<const int64_t>(ids.ids.data(), hashed), block_size, extra,
                  later, out);
  }
  if (packed) return py::bytes(out);
  const size_t ds = digest_size(algorithm);
  py::list digests(out.size() / ds);
  for (size_t i = 0; i < out.size() / ds; ++i) {
    PyList_SET_ITEM(digests.ptr(), i,
                    digest_bytes(reinterpret_cast<const uint8_t*>(out.data()) + i * ds, ds).release().ptr());
  }
  return std::move(digests);
}

}  // namespace

void bind_hashing(py::module_& m) {
  // block_size crosses into C++ as int64 (chain hashing here, the radix tree's page size).
  m.attr("MAX_BLOCK_SIZE") = std::numeric_limits<int64_t>::max();
  m.def(
      "chain_digests",
      [](py::handle tokens, int64_t block_size, const std::string& algorithm, py::handle parent, py::handle first_extra,
         py::handle later_extra, bool packed) {
        return chain(parse_hash_algorithm(algorithm), tokens, block_size, parent, first_extra, later_extra, packed);
      },
      py::arg("tokens"), py::arg("block_size"), py::arg("algorithm"), py::arg("parent"),
      py::arg("first_extra") = py::none(), py::arg("later_extra") = py::none(), py::arg("packed") = true, R"doc(
Chained block hashes of `algorithm` (sha256_cbor, sha256, xxhash, xxhash_cbor) over the
full blocks of `tokens` (any buffer or sequence of int ids), from `parent`.

Block i hashes H(enc((prev, tuple(block_tokens), extra))): prev is `parent` for block 0
and the previous digest after; extra is `first_extra` for block 0 and `later_extra`
after, already encoded for the algorithm (CBOR bytes; for the pickle algorithms the
opcodes pickle writes for extra_keys, see csrc/hashing.h), None for None. Returns the
digests packed back to back (packed=True) or as a list, or None if an id in a full
block does not fit int64 (hash those in Python). ValueError for a pickle link beyond
one pickle frame.
)doc");
  m.def(
      "sha256_cbor_chain",
      [](py::handle tokens, int64_t block_size, py::handle parent, py::handle first_extra_cbor,
         py::handle later_extra_cbor, bool packed) {
        return chain(HashAlgorithm::kSha256Cbor, tokens, block_size, parent, first_extra_cbor, later_extra_cbor, packed,
                     "first_extra_cbor", "later_extra_cbor");
      },
      py::arg("tokens"), py::arg("block_size"), py::arg("parent"), py::arg("first_extra_cbor") = py::none(),
      py::arg("later_extra_cbor") = py::none(), py::arg("packed") = false,
      "chain_digests(tokens, block_size, 'sha256_cbor', ...), a list of digests unless packed.");
  m.def(
      "sha256", [](py::bytes data) { return digest_bytes(sha256(std::string_view(data)).data(), 32); },
      py::arg("data"), "SHA-256 digest of `data` (the fastest implementation this CPU has).");
  m.def(
      "sha256_portable", [](py::bytes data) { return digest_bytes(sha256_portable(std::string_view(data)).data(), 32); },
      py::arg("data"), "SHA-256 digest of `data` on the portable implementation.");
  m.def(
      "xxh3_128", [](py::bytes data) { return digest_bytes(xxh3_128(std::string_view(data)).data(), 16); },
      py::arg("data"), "XXH3-128 digest of `data`, canonical byte order (python-xxhash's xxh3_128_digest).");
  m.def("sha256_uses_cpu_extensions", &sha256_uses_cpu_extensions,
        "Whether sha256 uses the x86 SHA extensions on this machine.");
  m.attr("MAX_PICKLE_LINK") = kMaxPickleLink;
}

}  // namespace prefixcache
