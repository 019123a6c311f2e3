// Python binding of block hashing: converts tokens and bytes, nothing more.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "hashing.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

py::bytes digest_bytes(const Digest& d) { return py::bytes(reinterpret_cast<const char*>(d.data()), d.size()); }

// The first `count` token ids as int64, or nullopt if one does not fit in
// int64 (the caller then hashes in Python, where CBOR has bignums). Anything
// but an int (bool included: CBOR would encode it as true/false) is a TypeError.
std::optional<std::vector<int64_t>> to_tokens(PyObject* seq, Py_ssize_t count) {
  PyObject** items = PySequence_Fast_ITEMS(seq);
  std::vector<int64_t> tokens(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = items[i];
    if (!PyLong_Check(item) || PyBool_Check(item)) {
      throw py::type_error("tokens[" + std::to_string(i) + "] must be an int, got " + Py_TYPE(item)->tp_name);
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0) return std::nullopt;
    tokens[i] = v;
  }
  return tokens;
}

py::object chain(py::handle tokens, int64_t block_size, py::handle parent, py::handle first_extra_cbor,
                 py::handle later_extra_cbor, bool packed) {
  if (block_size < 1) throw py::value_error("block_size must be >= 1, got " + std::to_string(block_size));
  std::string_view parent_bytes = bytes_view(parent, "parent");
  std::optional<std::string_view> extra, later;
  if (!first_extra_cbor.is_none()) extra = bytes_view(first_extra_cbor, "first_extra_cbor");
  if (!later_extra_cbor.is_none()) later = bytes_view(later_extra_cbor, "later_extra_cbor");

  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(tokens.ptr(), "tokens must be a sequence of ints"));
  if (!seq) throw py::error_already_set();
  Py_ssize_t size = PySequence_Fast_GET_SIZE(seq.ptr());
  auto ids = to_tokens(seq.ptr(), size - size % block_size);
  if (!ids) return py::none();

  std::vector<Digest> digests;
  {
    py::gil_scoped_release unlocked;  // parent and extra are immutable bytes we hold
    digests = sha256_cbor_chain(parent_bytes, *ids, block_size, extra, later);
  }
  if (packed) {
    static_assert(sizeof(Digest) == 32, "a vector of digests is their bytes back to back");
    return py::bytes(reinterpret_cast<const char*>(digests.data()), digests.size() * sizeof(Digest));
  }
  py::list out(digests.size());
  for (size_t i = 0; i < digests.size(); ++i) PyList_SET_ITEM(out.ptr(), i, digest_bytes(digests[i]).release().ptr());
  return out;
}

}  // namespace

void bind_hashing(py::module_& m) {
  // block_size crosses into C++ as int64 (chain hashing here, the radix tree's page size).
  m.attr("MAX_BLOCK_SIZE") = std::numeric_limits<int64_t>::max();
  m.def("sha256_cbor_chain", &chain, py::arg("tokens"), py::arg("block_size"), py::arg("parent"),
        py::arg("first_extra_cbor") = py::none(), py::arg("later_extra_cbor") = py::none(),
        py::arg("packed") = false, R"doc(
sha256_cbor hashes of the full blocks of `tokens`, chained from `parent`.

Block i hashes sha256(cbor((prev, tuple(block_tokens), extra))), where prev is
`parent` for block 0 and the previous digest after, and extra is the CBOR
`first_extra_cbor` for block 0 and `later_extra_cbor` after (None where not
given). Returns a
list of 32-byte digests (with packed=True, one bytes of them back to back), or
None if a token id does not fit in int64 (hash those in Python). TypeError for
a token that is not an int.
)doc");
  m.def(
      "sha256", [](py::bytes data) { return digest_bytes(sha256(std::string_view(data))); }, py::arg("data"),
      "SHA-256 digest of `data` (the fastest implementation this CPU has).");
  m.def(
      "sha256_portable", [](py::bytes data) { return digest_bytes(sha256_portable(std::string_view(data))); },
      py::arg("data"), "SHA-256 digest of `data` on the portable implementation.");
  m.def("sha256_uses_cpu_extensions", &sha256_uses_cpu_extensions,
        "Whether sha256 uses the x86 SHA extensions on this machine.");
}

}  // namespace prefixcache
