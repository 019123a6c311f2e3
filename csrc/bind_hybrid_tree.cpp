// Python binding of HybridTree (hybrid_tree.h): converts tokens, ids, optional ints and
// node references, and the tree's results, nothing more. One converter per kind of
// argument; tokens cross once, an int32 buffer (array('i')) read in place.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "hybrid_radix_admit.h"
#include "hybrid_tree.h"
#include "py_args.h"
#include "token_ids.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// Token ids as the tree keeps them: a contiguous native int32 buffer is read in place
// (exported for the call, so its owner cannot resize it meanwhile); anything else goes
// through the protocol's converter into our own copy.
class Int32Tokens {
 public:
  explicit Int32Tokens(py::handle obj) {
    borrowed_.emplace(obj.ptr());
    if (borrowed_->held() && packed(borrowed_->view())) {
      span_ = {static_cast<const int32_t*>(borrowed_->view().buf), static_cast<size_t>(borrowed_->view().shape[0])};
      return;
    }
    borrowed_.reset();
    copy_ = read_token_ids<int32_t>(obj, "tokens").ids;
    span_ = copy_;
  }
  Int32Tokens(const Int32Tokens&) = delete;
  Int32Tokens& operator=(const Int32Tokens&) = delete;
  std::span<const int32_t> span() const { return span_; }

 private:
  static bool packed(const Py_buffer& v) {
    if (v.ndim != 1 || v.itemsize != 4 || v.format == nullptr || v.shape == nullptr) return false;
    if (v.strides != nullptr && v.strides[0] != 4) return false;
    const std::string_view f(v.format);
    return f == "i" || f == "@i";
  }

  std::optional<token_ids_detail::IntBuffer> borrowed_;
  std::vector<int32_t> copy_;
  std::span<const int32_t> span_;
};

// Block or state ids: ints >= 0 (the tree keeps NULL_BLOCK, -1, out of its values).
std::vector<int64_t> block_ids(py::handle obj, const char* what) {
  std::vector<int64_t> ids = to_ids(obj);
  for (int64_t id : ids) {
    if (id < 0) throw std::invalid_argument(std::string(what) + ": expected block ids >= 0; got " + std::to_string(id));
  }
  return ids;
}

// None or an int: kHybridNone stands for None inside the tree.
int64_t optional_int(py::handle obj, const char* what) {
  if (obj.is_none()) return kHybridNone;
  const int64_t v = checked_int64(obj, what);
  if (v == kHybridNone) throw std::invalid_argument(std::string(what) + ": out of range");
  return v;
}

py::object none_or(int64_t v) { return v == kHybridNone ? py::none() : py::object(py::int_(v)); }

std::array<int64_t, 3> triple(py::handle obj, const char* what) {
  const std::vector<int64_t> v = to_ids(obj);
  if (v.size() != 3) throw std::invalid_argument(std::string(what) + ": expected (FULL, SWA, MAMBA)");
  return {v[0], v[1], v[2]};
}

py::tuple as_tuple(const std::array<int64_t, 3>& v) { return py::make_tuple(v[0], v[1], v[2]); }

py::list freed_list(std::vector<HybridFreed> freed) {
  py::list out(freed.size());
  for (size_t i = 0; i < freed.size(); ++i) {
    out[i] = py::make_tuple(freed[i].component, py::cast(freed[i].ids));
  }
  return out;
}

// Chained page hashes: a sequence of bytes.
std::vector<std::string> page_hashes(py::handle obj) {
  std::vector<std::string> out;
  for (py::handle h : py::reinterpret_borrow<py::sequence>(obj)) out.emplace_back(bytes_view(h, "hashes[i]"));
  return out;
}

py::tuple event_tuple(const HybridEvent& e) {
  py::tuple hashes(e.hashes.size());
  for (size_t i = 0; i < e.hashes.size(); ++i) hashes[i] = py::bytes(e.hashes[i]);
  py::object parent = e.parent_hash ? py::object(py::bytes(*e.parent_hash)) : py::none();
  py::tuple tokens(e.tokens.size());
  for (size_t i = 0; i < e.tokens.size(); ++i) tokens[i] = py::int_(e.tokens[i]);
  return py::make_tuple(e.stored, e.node_id, e.component, e.first, e.end, hashes, parent, e.depth, tokens, e.ns);
}

py::tuple path_entry(const std::pair<HybridNodeRef, int64_t>& e) { return py::make_tuple(e.first, e.second); }

}  // namespace

void bind_hybrid_tree(py::module_& m) {
  using T = HybridTree;
  py::class_<HybridNodeRef>(m, "HybridNodeRef", "A node of a HybridTree: its slot and id (checked on every use).")
      .def_readonly("id", &HybridNodeRef::id)
      .def("__eq__", [](const HybridNodeRef& a, const HybridNodeRef& b) { return a == b; })
      .def("__hash__", [](const HybridNodeRef& a) { return py::hash(py::make_tuple(a.slot, a.id)); })
      .def("__repr__", [](const HybridNodeRef& a) { return "HybridNodeRef(" + std::to_string(a.id) + ")"; });
  py::class_<HybridMatch>(m, "HybridMatch", "A match: hit TOKENS, its node, the full-attention run, branching points.")
      .def_readonly("num_tokens", &HybridMatch::num_tokens)
      .def_readonly("node", &HybridMatch::node)
      .def_readonly("full_hit", &HybridMatch::full_hit)
      .def_property_readonly("swa_branching", [](const HybridMatch& h) { return none_or(h.swa_branching); })
      .def_property_readonly("mamba_branching", [](const HybridMatch& h) { return none_or(h.mamba_branching); })
      .def_property_readonly("path", [](const HybridMatch& h) {
        py::list out(h.path.size());
        for (size_t i = 0; i < h.path.size(); ++i) out[i] = path_entry(h.path[i]);
        return out;
      })
      .def_property_readonly("inside", [](const HybridMatch& h) -> py::object {
        return h.inside ? py::object(path_entry(*h.inside)) : py::none();
      });
  py::class_<HybridReceipt>(m, "HybridReceipt", "What an unlock replays: the node and the SWA segment's stamp.")
      .def_readonly("node", &HybridReceipt::node)
      .def_property_readonly("swa_uuid", [](const HybridReceipt& r) { return none_or(r.swa_uuid); });
  py::class_<HybridInsert>(m, "HybridInsert", "An insert: TOKENS already there, the node holding the key's end.")
      .def_readonly("prefix_len", &HybridInsert::prefix_len)
      .def_readonly("node", &HybridInsert::node)
      .def_readonly("mamba_exist", &HybridInsert::mamba_exist)
      .def_readonly("swa_branch_inserted", &HybridInsert::swa_branch_inserted);
  py::class_<T>(m, "HybridTree", "SGLang's unified radix tree (csrc/hybrid_tree.h); frees and events go to logs.")
      .def(py::init([](py::handle page_size, bool has_swa, bool has_mamba, py::handle window, py::handle state_grid,
                       bool no_tail_cliff, bool record_events) {
             return new T(checked_int64(page_size, "page_size"), has_swa, has_mamba,
                          window.is_none() ? 0 : checked_int64(window, "window"), checked_int64(state_grid, "state_grid"),
                          no_tail_cliff, record_events);
           }),
           py::arg("page_size"), py::arg("has_swa"), py::arg("has_mamba"), py::arg("window"), py::arg("state_grid"),
           py::arg("no_tail_cliff"), py::arg("record_events"))
      .def("reset", &T::reset)
      .def("match", [](const T& t, py::handle tokens, py::handle ns) {
        Int32Tokens toks(tokens);
        return t.match(toks.span(), checked_int64(ns, "ns"));
      }, py::arg("tokens"), py::arg("ns"))
      .def("settle", &T::settle)
      .def("admit_hit", [](T& t, const HybridMatch& probe, py::handle prompt_len, py::handle available,
                           py::handle states_needed, py::handle window) -> py::object {
        auto got = admit_hit(t, probe, checked_int64(prompt_len, "prompt_len"), triple(available, "available"),
                             checked_int64(states_needed, "states_needed"), checked_int64(window, "window"));
        if (!got) return py::none();
        return py::make_tuple(std::move(got->hit), got->receipt, py::list(py::cast(got->full)),
                              py::list(py::cast(got->swa)), none_or(got->state));
      }, py::arg("probe"), py::arg("prompt_len"), py::arg("available"), py::arg("states_needed"), py::arg("window"),
      "csrc/hybrid_radix_admit.h: None, or (settled hit, receipt, FULL pages, SWA pages, state).")
      .def("lock_cost", [](const T& t, const HybridMatch& h) { return as_tuple(t.lock_cost(h)); })
      .def("lock", &T::lock)
      .def("unlock", &T::unlock)
      .def("insert", [](T& t, py::handle tokens, py::handle ns, py::handle pages, py::handle swa_pages,
                        py::handle prev_prefix_len, py::handle swa_evicted, py::handle swa_branching,
                        py::handle mamba_value, py::handle hashes) {
             Int32Tokens toks(tokens);
             const std::vector<int64_t> full = block_ids(pages, "pages");
             std::vector<int64_t> swa;
             HybridInsertArgs a;
             a.tokens = toks.span();
             a.ns = checked_int64(ns, "ns");
             a.pages = full;
             if (!swa_pages.is_none()) {
               swa = to_ids(swa_pages);  // NULL_BLOCK (-1) where the request freed them
               a.swa_pages = std::span<const int64_t>(swa);
             }
             a.prev_prefix_len = checked_int64(prev_prefix_len, "prev_prefix_len");
             a.swa_evicted = checked_int64(swa_evicted, "swa_evicted");
             a.swa_branching = optional_int(swa_branching, "swa_branching");
             a.mamba_value = optional_int(mamba_value, "mamba_value");
             if (a.mamba_value != kHybridNone && a.mamba_value < 0) throw std::invalid_argument("mamba_value: a state id >= 0");
             if (!hashes.is_none()) a.hashes = page_hashes(hashes);
             return t.insert(a);
           },
           py::arg("tokens"), py::arg("ns"), py::arg("pages"), py::arg("swa_pages"), py::kw_only(),
           py::arg("prev_prefix_len"), py::arg("swa_evicted") = 0, py::arg("swa_branching") = py::none(),
           py::arg("mamba_value") = py::none(), py::arg("hashes") = py::none())
      .def("evict", [](T& t, py::handle want, py::handle reach) {
        return as_tuple(t.evict(triple(want, "want"), triple(reach, "reach")));
      }, py::arg("want"), py::arg("reach"))
      .def("drop_states", &T::drop_states)
      .def("path_pages", [](const T& t, HybridNodeRef n) {
        const auto ids = t.path_pages(n);
        return py::list(py::cast(ids));
      })
      .def("hit_pages", [](const T& t, const HybridMatch& h, int c) { return py::list(py::cast(t.hit_pages(h, c))); })
      .def("state", [](const T& t, HybridNodeRef n) { return none_or(t.state(n)); })
      .def("path_swa", [](const T& t, HybridNodeRef n) { return py::list(py::cast(t.path_swa(n))); })
      .def("path_nodes", &T::path_nodes)
      .def("nodes", &T::nodes)
      .def("nodes_below", &T::children, "A node's children, in insertion order.")
      .def("parent", [](const T& t, HybridNodeRef n) -> py::object {
        const HybridNodeRef p = t.parent(n);
        return p.slot < 0 ? py::none() : py::cast(p);
      })
      .def("view", [](const T& t, HybridNodeRef n) {
        const HybridNodeView v = t.view(n);
        return py::make_tuple(v.id, v.parent_id, v.key, v.full, v.swa, none_or(v.mamba), v.locks,
                              none_or(v.swa_uuid), v.last_access, v.stamps, v.ns, v.children);
      }, "(id, parent id, key, full, swa, mamba, locks, swa_uuid, last_access, stamps, ns, child ids).")
      .def("lru_order", &T::lru_order)
      .def_property_readonly("root", &T::root)
      .def("check_invariants", &T::check_invariants)
      .def("take_freed", [](T& t) { return freed_list(t.take_freed()); })
      .def("take_events", [](T& t) {
        py::list out;
        for (const auto& e : t.take_events()) out.append(event_tuple(e));
        return out;
      }, "(stored, node id, component, first page, end page, hashes, parent hash, depth, tokens, ns) each.")
      .def("set_walk_every_state", &T::set_walk_every_state)
      .def("evictable", &T::evictable)
      .def("protected_size", &T::protected_size)
      .def_property_readonly("num_nodes", &T::num_nodes);
}

}  // namespace prefixcache
