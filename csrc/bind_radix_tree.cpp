// Python binding of RadixTree: converts tokens, block ids, namespaces and
// results, nothing more. Token ids and block ids in int32 buffers
// (array('i'), numpy int32) are read in place, without a per-element copy.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <type_traits>

#include "bind_py_key.h"
#include "py_args.h"
#include "token_ids.h"
#include "radix_tree.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// A writable one-dimensional int32 buffer (array('i'), numpy int32), held while
// insert() re-points its entries in place.
class WritableInt32s {
 public:
  explicit WritableInt32s(py::handle obj) {
    if (PyList_Check(obj.ptr()) || !PyObject_CheckBuffer(obj.ptr())) return;
    ok_ = PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) == 0;
    if (!ok_) PyErr_Clear();
  }
  ~WritableInt32s() {
    if (ok_) PyBuffer_Release(&view_);
  }
  WritableInt32s(const WritableInt32s&) = delete;
  WritableInt32s& operator=(const WritableInt32s&) = delete;

  std::optional<std::span<int32_t>> span() const {
    if (!ok_ || view_.ndim != 1 || view_.itemsize != 4 || view_.format == nullptr) return std::nullopt;
    std::string_view f(view_.format);
    if (!f.empty() && (f[0] == '@' || f[0] == '=' || f[0] == '<')) f.remove_prefix(1);
    if (f != "i" && f != "l") return std::nullopt;
    return std::span<int32_t>(static_cast<int32_t*>(view_.buf), static_cast<size_t>(view_.shape[0]));
  }

 private:
  Py_buffer view_{};
  bool ok_ = false;
};

// What the tree stores: int32 ids (docs/configuration.md: radix token ids must fit int32).
constexpr const char* kIds = "an int32 id in [-2**31, 2**31)";

// Token ids (what="tokens") or block ids as int32, by the one token converter.
std::vector<int32_t> int32_ids(py::handle obj, const char* what) {
  const bool tokens = std::string_view(what) == "tokens";
  return read_token_ids<int32_t>(obj, what, tokens ? nullptr : kIds).ids;
}

// The token ids of one tree call. A C-contiguous int32 buffer (a request's own
// array('i'), a memoryview of one) is read in place, its export held for the call so
// it cannot be resized, when the tree runs no Python code meanwhile (no Python policy
// whose keys it drops) and, as every tree call, holds the GIL: nothing can change the
// ids while they are read. Anything else is read by the one converter into a copy.
class TreeTokens {
 public:
  TreeTokens(const RadixTree& tree, py::handle obj) {
    if (!tree.has_ranker() && !PyList_Check(obj.ptr()) && PyObject_CheckBuffer(obj.ptr()) &&
        !PyBytes_Check(obj.ptr()) && !PyByteArray_Check(obj.ptr())) {
      if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        std::string_view f(view_.format != nullptr ? view_.format : "B");
        if (!f.empty() && (f[0] == '@' || f[0] == '=' || f[0] == '<')) f.remove_prefix(1);
        if (view_.ndim == 1 && view_.itemsize == 4 && (f == "i" || f == "l")) {
          held_ = true;
          return;
        }
        PyBuffer_Release(&view_);
      } else {
        PyErr_Clear();
      }
    }
    copy_ = int32_ids(obj, "tokens");
  }
  ~TreeTokens() {
    if (held_) PyBuffer_Release(&view_);
  }
  TreeTokens(const TreeTokens&) = delete;
  TreeTokens& operator=(const TreeTokens&) = delete;

  TokenSpan span() const {
    if (held_) return TokenSpan(static_cast<const int32_t*>(view_.buf), static_cast<size_t>(view_.shape[0]));
    return TokenSpan(copy_);
  }

 private:
  Py_buffer view_{};
  bool held_ = false;
  std::vector<int32_t> copy_;
};

Namespace to_namespace(py::handle obj) {
  if (obj.is_none()) return std::nullopt;
  if (!py::isinstance<py::str>(obj)) {
    throw py::type_error(std::string("namespace must be a str or None, got ") + Py_TYPE(obj.ptr())->tp_name);
  }
  Py_ssize_t size = 0;
  const char* utf8 = PyUnicode_AsUTF8AndSize(obj.ptr(), &size);
  if (utf8 == nullptr) {  // a lone surrogate: not text UTF-8 can carry
    PyErr_Clear();
    throw py::value_error("namespace must be valid Unicode (a lone surrogate cannot be encoded), got " +
                          py::repr(obj).cast<std::string>());
  }
  return std::string(utf8, static_cast<size_t>(size));
}

py::object from_namespace(const Namespace& ns) { return ns ? py::object(py::str(*ns)) : py::object(py::none()); }

py::tuple to_tuple(const std::vector<int32_t>& ids) {
  py::tuple out(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) PyTuple_SET_ITEM(out.ptr(), i, PyLong_FromLong(ids[i]));
  return out;
}

// insert() and extend() re-point `blocks` in place: a writable int32 buffer is
// edited directly; a list is converted, and the entries that changed are written back.
template <class Insert>
InsertResult with_blocks(py::handle blocks, Insert&& insert) {
  WritableInt32s buffer(blocks);
  if (auto view = buffer.span()) return insert(*view);
  if (!PyList_Check(blocks.ptr())) {
    throw py::type_error(std::string("blocks must be a list or a writable int32 buffer (array('i')), got ") +
                         Py_TYPE(blocks.ptr())->tp_name);
  }
  std::vector<int32_t> ids = int32_ids(blocks, "blocks");
  const std::vector<int32_t> before = ids;
  InsertResult out = insert(std::span<int32_t>(ids));
  for (size_t i = 0; i < ids.size(); ++i) {
    if (before[i] != ids[i]) PyList_SetItem(blocks.ptr(), static_cast<Py_ssize_t>(i), PyLong_FromLong(ids[i]));
  }
  return out;
}

InsertResult insert(RadixTree& tree, py::handle tokens, py::handle blocks, py::handle ns, py::handle priority_arg,
                    py::handle start_arg, py::handle inserted_arg) {
  const int64_t priority = checked_int64(priority_arg, "priority");
  const int64_t start = saturated_int64(start_arg, "start");  // beyond int64: out of range either way
  const int64_t inserted = saturated_int64(inserted_arg, "inserted");
  const TreeTokens toks(tree, tokens);
  Namespace name = to_namespace(ns);
  return with_blocks(blocks, [&](std::span<int32_t> ids) { return tree.insert(toks.span(), ids, name, priority, start, inserted); });
}

InsertResult extend(RadixTree& tree, py::handle node_arg, py::handle tokens, py::handle blocks, py::handle priority_arg) {
  const int64_t priority = checked_int64(priority_arg, "priority");
  const TreeTokens toks(tree, tokens);
  return with_saturated_int64(node_arg, "node", [&](int64_t node) {
    return with_blocks(blocks, [&](std::span<int32_t> ids) { return tree.extend(node, toks.span(), ids, priority); });
  });
}

// A Python policy's priority() as the tree's LeafRanker: keys are the Python objects
// it returns, compared with Python's `<`, held in slots the tree names by handle.
class PyRanker final : public LeafRanker {
 public:
  explicit PyRanker(py::object rank) : rank_(std::move(rank)) {}

  uint64_t rank(const EvictionCandidate& candidate) override {
    py::object key = rank_(candidate);
    if (free_.empty()) {
      keys_.push_back(std::move(key));
      return keys_.size() - 1;
    }
    const uint64_t slot = free_.back();
    free_.pop_back();
    keys_[slot] = std::move(key);
    return slot;
  }
  bool less(uint64_t a, uint64_t b) const override {
    const int r = PyObject_RichCompareBool(keys_[a].ptr(), keys_[b].ptr(), Py_LT);
    if (r < 0) throw py::error_already_set();
    return r == 1;
  }
  void release(uint64_t key) noexcept override {
    keys_[key] = py::object();
    free_.push_back(key);
  }

 private:
  py::object rank_;
  std::vector<py::object> keys_;
  std::vector<uint64_t> free_;
};

}  // namespace

void bind_radix_tree(py::module_& m) {
  // The ranges the tree stores: token ids (TokenSpan's element type) and priorities.
  using Token = std::remove_cv_t<TokenSpan::element_type>;
  m.attr("RADIX_TOKEN_MIN") = std::numeric_limits<Token>::min();
  m.attr("RADIX_TOKEN_MAX") = std::numeric_limits<Token>::max();
  m.attr("PRIORITY_MIN") = std::numeric_limits<decltype(RadixNode::priority)>::min();
  m.attr("PRIORITY_MAX") = std::numeric_limits<decltype(RadixNode::priority)>::max();
  m.def(
      "int32_array",
      [](py::handle ids, const std::string& what) {
        const std::vector<int32_t> out = int32_ids(ids, what.c_str());
        return int_array(out.data(), out.size());
      },
      py::arg("ids"), py::arg("what") = "ids",
      "Token or block ids as an array('i') the radix tree reads in place: TypeError naming `what` for a\n"
      "non-sequence, a bool or a non-integer id, ValueError beyond int32.");
  py::class_<MatchResult>(m, "RadixMatch", "A look-up: num_tokens matched (whole pages) in block_ids.")
      .def_readonly("num_tokens", &MatchResult::num_tokens)
      .def_property_readonly("block_ids", [](const MatchResult& r) { return to_list(r.blocks); })
      .def_readonly("node", &MatchResult::node, "Last node reached (0 if the namespace has no root).")
      .def_readonly("unlocked_tokens", &MatchResult::unlocked_tokens,
                    "Matched tokens in nodes with lock_ref 0 (what locking the match protects).");

  py::class_<InsertResult>(m, "RadixInsert", "An insert: prefix_len tokens were already present.")
      .def_readonly("prefix_len", &InsertResult::prefix_len)
      .def_readonly("node", &InsertResult::node, "The node ending at the key's end.")
      .def_property_readonly("displaced", [](const InsertResult& r) { return to_list(r.displaced); },
                             "Caller block ids replaced by the tree's (duplicates; the caller frees them).");

  auto node_info = py::class_<NodeInfo>(m, "RadixNodeInfo", "A copy of one tree node.");
  node_info.def_readonly("id", &NodeInfo::id)
      .def_readonly("parent", &NodeInfo::parent)
      .def_property_readonly("namespace", [](const NodeInfo& n) { return from_namespace(n.ns); })
      .def_property_readonly("tokens", [](const NodeInfo& n) { return to_tuple(n.tokens); })
      .def_property_readonly("block_ids", [](const NodeInfo& n) { return to_tuple(n.blocks); })
      .def_readonly("lock_ref", &NodeInfo::lock_ref)
      .def_property_readonly("children", [](const NodeInfo& n) {
        py::dict out;
        for (const auto& [page, id] : n.children) out[to_tuple(page)] = id;
        return out;
      }, "{first page as a tuple: child id}, oldest child first.");
#define PREFIXCACHE_BIND_NODE_STAMP(name, doc) node_info.def_readonly(#name, &NodeInfo::name, doc);
  PREFIXCACHE_CANDIDATE_STAMPS(PREFIXCACHE_BIND_NODE_STAMP)
#undef PREFIXCACHE_BIND_NODE_STAMP

  py::class_<RadixTree>(m, "RadixTree", R"doc(
SGLang RadixAttention prefix tree over a BlockPool (see tests/reference/radix_tree.py
for the reference model and the full contract).

The tree owns one pool reference per block it holds. Sizes are in tokens.
`eviction` is a native order (lru, lfu, fifo, mru, filo, priority, slru, tlru, gslru), a callable
ranking EvictionCandidate (a Python policy's priority: asked once when a leaf becomes a candidate
or changes, its keys kept in the tree's leaf order), or None, in which case evict() needs
`priority=` (asked once per candidate per call).
`protect_tokens` / `size_weight` parameterize gslru; `ghost_capacity` (pages) keeps
the use counts of evicted content (0: none). Not thread-safe.
)doc")
      .def(py::init([](BlockPool& pool, int64_t page_size, py::object eviction,
                       int64_t protect_tokens, int64_t size_weight, int64_t ghost_capacity, int64_t protected_threshold,
                       int64_t tlru_threshold, int64_t next_prompt_estimate) {
             std::optional<EvictionOrder> order;
             std::unique_ptr<LeafRanker> ranker;
             if (py::isinstance<py::str>(eviction)) {
               order = parse_eviction_order(eviction.cast<std::string>());
             } else if (PyCallable_Check(eviction.ptr())) {
               ranker = std::make_unique<PyRanker>(eviction);
             } else if (!eviction.is_none()) {
               throw py::type_error(std::string("eviction must be a native order's name, a callable or None, got ") +
                                    Py_TYPE(eviction.ptr())->tp_name);
             }
             OrderParams params{protect_tokens, size_weight, protected_threshold, tlru_threshold, next_prompt_estimate};
             return std::make_unique<RadixTree>(pool, page_size, order, params, ghost_capacity, std::move(ranker));
           }),
           py::arg("pool"), py::arg("page_size"), py::arg("eviction") = "lru", py::arg("protect_tokens") = 0,
           py::arg("size_weight") = 0, py::arg("ghost_capacity") = 0, py::arg("protected_threshold") = 2,
           py::arg("tlru_threshold") = 0, py::arg("next_prompt_estimate") = 0, py::keep_alive<1, 2>())
      .def_property_readonly("page_size", &RadixTree::page_size)
      .def_property_readonly("total_size", &RadixTree::total_size, "Tokens in the tree.")
      .def_property_readonly("evictable_size", &RadixTree::evictable_size, "Tokens in unlocked nodes.")
      .def_property_readonly("protected_size", &RadixTree::protected_size, "Tokens in locked nodes.")
      .def_property_readonly("num_nodes", &RadixTree::num_nodes, "Nodes, namespace roots included.")
      .def_property_readonly("clock", &RadixTree::clock, "The logical clock's current tick.")
      .def_property_readonly("traffic", &RadixTree::traffic, "TOKENS (whole pages) match_prefix was asked for.")
      .def_property_readonly("ghost_size", [](const RadixTree& t) { return t.ghost().size(); },
                             "Evicted pages whose use count is remembered.")
      .def(
          "match",
          [](const RadixTree& t, py::handle tokens, py::handle ns) {
            const TreeTokens toks(t, tokens);
            return t.match(toks.span(), to_namespace(ns));
          },
          py::arg("tokens"), py::arg("namespace") = py::none(),
          "Pure look-up of the longest cached whole-page prefix; changes nothing.")
      .def(
          "match_prefix",
          [](RadixTree& t, py::handle tokens, py::handle ns) {
            const TreeTokens toks(t, tokens);
            return t.match_prefix(toks.span(), to_namespace(ns));
          },
          py::arg("tokens"), py::arg("namespace") = py::none(),
          "SGLang match_prefix: splits at the match's end, refreshes recency, counts a hit.")
      .def("insert", &insert, py::arg("tokens"), py::arg("blocks"), py::arg("namespace") = py::none(),
           py::arg("priority") = 0, py::arg("start") = 0, py::arg("inserted") = -1,
           "Insert whole pages; blocks hold the pages from token `start` on, and the entries of pages\n"
           "already in the tree are re-pointed to the tree's blocks in place.")
      .def("extend", &extend, py::arg("node"), py::arg("tokens"), py::arg("blocks"), py::arg("priority") = 0,
           "insert() of node's path + tokens with start = inserted = the node's depth: a caller holding the\n"
           "path to `node` adds the pages after it (blocks: one per page of `tokens`, re-pointed in place).\n"
           "O(tokens) when `node` is locked; prefix_len counts from the root.")
      .def(
          "relock",
          [](RadixTree& t, py::handle from, py::handle to) {
            with_saturated_int64(from, "from_node", [&](int64_t f) {
              with_saturated_int64(to, "to_node", [&](int64_t n) { t.relock(f, n); });
            });
          },
          py::arg("from_node"), py::arg("to_node"),
          "lock(to_node) then unlock(from_node) (0: no node), in O(nodes between) when to_node is at or\n"
          "below from_node.")
      .def(
          "lock", [](RadixTree& t, py::handle node) { with_saturated_int64(node, "node", [&](int64_t id) { t.lock(id); }); },
          py::arg("node"), "Lock root -> node (0: no node, a no-op).")
      .def(
          "unlock",
          [](RadixTree& t, py::handle node) { with_saturated_int64(node, "node", [&](int64_t id) { t.unlock(id); }); },
          py::arg("node"), "Unlock root -> node (0: no node, a no-op); a root left without children or locks goes.")
      .def(
          "evict",
          [](RadixTree& t, py::handle num_tokens_arg, py::object priority) {
            const int64_t num_tokens = saturated_int64(num_tokens_arg, "num_tokens");  // beyond int64: all
            if (priority.is_none()) return t.evict(num_tokens);
            return t.evict_by<PyKey>(num_tokens, [&](const RadixNode& n) { return policy_key(priority(t.candidate(n))); });
          },
          py::arg("num_tokens"), py::arg("priority") = py::none(),
          "Evict unlocked leaves until num_tokens are freed; returns tokens evicted.")
      .def(
          "last_evicted", [](const RadixTree& t) { return to_list(t.last_evicted()); },
          "Blocks freed by the latest evict call, in order (also after it raised).")
      .def("reset", &RadixTree::reset, "Free every block and drop every node; ValueError if any is locked.")
      .def(
          "root", [](const RadixTree& t, py::handle ns) { return t.root(to_namespace(ns)); },
          py::arg("namespace") = py::none(), "Id of the namespace's root, or None.")
      .def(
          "namespaces",
          [](const RadixTree& t) {
            py::list out;
            for (const auto& ns : t.namespaces()) out.append(from_namespace(ns));
            return out;
          },
          "Namespaces with a root (None first, then sorted).")
      .def(
          "node", [](const RadixTree& t, py::handle id) { return with_saturated_int64(id, "id", [&](int64_t v) { return t.node(v); }); },
          py::arg("id"), "A copy of node `id` (O(1)).")
      .def("check_invariants", &RadixTree::check_invariants, py::arg("locked_nodes") = py::none(),
           "Raise InvariantError naming the first broken invariant.");
}

}  // namespace prefixcache
