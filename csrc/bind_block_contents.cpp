// Python binding of BlockContents: converts block ids, token ids and namespace
// bytes, nothing more.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "block_contents.h"
#include "py_args.h"
#include "token_ids.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

py::object fast_sequence(py::handle obj, const char* what) {
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj)) {
    throw py::type_error(std::string(what) + " must be a sequence of ints, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(obj.ptr(), what));
  if (!seq) throw py::error_already_set();
  return seq;
}

// Block ids; one that does not fit in int32 is out of any pool's range.
std::vector<int32_t> block_ids(py::handle obj) {
  py::object seq = fast_sequence(obj, "blocks");
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_Check(items[i]) || PyBool_Check(items[i])) {
      throw py::type_error("blocks[" + std::to_string(i) + "] must be an int, got " + Py_TYPE(items[i])->tp_name);
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) {
      throw std::out_of_range("block id " + py::repr(items[i]).cast<std::string>() + " is out of range");
    }
    out[i] = static_cast<int32_t>(v);
  }
  return out;
}

// tokens[begin : begin + count] as int64 (count clipped to what there is), and how
// many of them lead before the first id that int64 cannot hold (CBOR bignums). Read by
// the one token converter (token_ids.h), so the errors are the backends' own.
std::pair<std::vector<int64_t>, size_t> token_ids(py::handle obj, int64_t begin, int64_t count) {
  TokenIds<int64_t> all = read_token_ids<int64_t>(obj, "tokens");
  const auto n = static_cast<int64_t>(all.ids.size());
  if (begin < 0 || begin > n) {
    throw py::index_error("first token " + std::to_string(begin) + " is outside the " + std::to_string(n) + " tokens");
  }
  count = std::max<int64_t>(0, std::min<int64_t>(count, n - begin));
  std::vector<int64_t> out(all.ids.begin() + begin, all.ids.begin() + begin + count);
  const auto representable = static_cast<size_t>(
      std::clamp<int64_t>(static_cast<int64_t>(all.representable) - begin, 0, count));
  return {std::move(out), representable};
}

}  // namespace

void bind_block_contents(py::module_& m) {
  m.attr("MAX_VERIFIED_BLOCK_SIZE") = BlockContents::kMaxBlockSize;
  py::class_<BlockContents>(m, "BlockContents", R"doc(
Exactly what each cached block of a BlockPool was computed from: a per-block
immutable content node (its token ids, the node of the block before it, and at a
chain's start the namespace). Proves hits found through a non-cryptographic hash
(see csrc/block_contents.h and prefixcache/block_contents.py). Namespaces are
bytes compared exactly. Not thread-safe.
)doc")
      .def(py::init([](const BlockPool& pool, py::handle block_size) {
             return std::make_unique<BlockContents>(pool, saturated_int64(block_size, "block_size"));
           }),
           py::arg("pool"), py::arg("block_size"), py::keep_alive<1, 2>())
      .def_property_readonly("block_size", &BlockContents::block_size)
      .def_property_readonly("num_blocks", &BlockContents::num_blocks)
      .def_property_readonly("num_nodes", &BlockContents::num_nodes, "Content nodes alive.")
      .def_property_readonly("wide", &BlockContents::wide, "Whether token storage was widened to int64.")
      .def(
          "record",
          [](BlockContents& c, py::handle parent, py::handle blocks, py::handle tokens, py::handle first_token,
             py::handle ns) {
            std::vector<int32_t> ids = block_ids(blocks);
            auto [toks, representable] = token_ids(tokens, saturated_int64(first_token, "first_token"),
                                                   static_cast<int64_t>(ids.size()) * c.block_size());
            c.record(saturated_int64(parent, "parent"), ids, toks, bytes_view(ns, "namespace"),
                     static_cast<int64_t>(representable) / c.block_size());
          },
          py::arg("parent"), py::arg("blocks"), py::arg("tokens"), py::arg("first_token"), py::arg("namespace"),
          "blocks now hold tokens[first_token : first_token + len(blocks) * block_size]; blocks[0] follows "
          "`parent` (-1: it starts a chain in `namespace`).")
      .def(
          "lookup_chain",
          [](const BlockContents& c, py::handle keys, py::handle key_size_arg, py::handle tokens, py::handle ns) {
            ByteBuffer buffer(keys, "keys");
            std::string_view packed = buffer.view();
            const int64_t key_size = saturated_int64(key_size_arg, "key_size");
            int64_t num_keys = key_size > 0 ? static_cast<int64_t>(packed.size()) / key_size : 0;
            auto [toks, representable] = token_ids(tokens, 0, num_keys * c.block_size());
            toks.resize(representable);
            VerifiedChain r = c.lookup_chain(packed, key_size, toks, bytes_view(ns, "namespace"));
            return py::make_tuple(to_list(r.blocks), r.failed);
          },
          py::arg("keys"), py::arg("key_size"), py::arg("tokens"), py::arg("namespace"),
          "(blocks, failed): the hits among the packed keys' holders that prove the request's blocks, "
          "stopping at the first key that has none (failed: it had holders, none proved).")
      .def(
          "verify_table",
          [](const BlockContents& c, py::handle table, py::handle tokens, py::handle ns) {
            std::vector<int32_t> ids = block_ids(table);
            auto [toks, representable] = token_ids(tokens, 0, static_cast<int64_t>(ids.size()) * c.block_size());
            toks.resize(representable);
            return c.verify_table(ids, toks, bytes_view(ns, "namespace"));
          },
          py::arg("table"), py::arg("tokens"), py::arg("namespace"),
          "How many leading blocks of a request's table prove its first blocks.")
      .def(
          "verify_head",
          [](const BlockContents& c, py::handle block, py::handle proved, py::handle tokens, py::handle n,
             py::handle ns) {
            std::vector<int32_t> ids = block_ids(proved);
            const int64_t head = saturated_int64(n, "n");
            auto [toks, representable] =
                token_ids(tokens, 0, static_cast<int64_t>(ids.size()) * c.block_size() +
                                                std::clamp<int64_t>(head, 0, c.block_size()));
            toks.resize(representable);
            return c.verify_head(saturated_int64(block, "block"), ids, toks, head, bytes_view(ns, "namespace"));
          },
          py::arg("block"), py::arg("proved"), py::arg("tokens"), py::arg("n"), py::arg("namespace"),
          "Whether `block` holds the request's next n tokens (1 <= n <= block_size) as its head, computed "
          "after exactly the request's proved hits `proved` in `namespace`: a partial hit's source.")
      .def(
          "tokens", [](const BlockContents& c, py::handle id) { return c.tokens(saturated_int64(id, "id")); },
          py::arg("id"), "Token ids of the block's node ([] without one).")
      .def(
          "depth", [](const BlockContents& c, py::handle id) { return c.depth(saturated_int64(id, "id")); },
          py::arg("id"), "Nodes from the chain start through the block's (0: none).")
      .def("check_invariants", &BlockContents::check_invariants,
           "Raise InvariantError naming the first broken invariant.");
}

}  // namespace prefixcache
