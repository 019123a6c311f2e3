// Python binding of BlockEvictor and of EvictionCandidate: converts ids, keys
// and candidates, nothing more. `BlockEvictor` ranks with a native order;
// `CallbackBlockEvictor` calls a Python priority function once per candidate.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "py_args.h"
#include "bind_py_key.h"
#include "block_evictor.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

py::list to_bytes_list(const std::vector<std::string>& keys) {
  py::list out;
  for (const auto& k : keys) out.append(py::bytes(k));
  return out;
}

template <class Key>
py::class_<BlockEvictor<Key>> bind_evictor(py::module_& m, const char* name, const char* doc) {
  using E = BlockEvictor<Key>;
  py::class_<E> cls(m, name, doc);
  cls
      .def_property_readonly("clock", &E::clock, "Logical clock: one tick per admission with hits, per cache call, per freed cached block.")
      .def_property_readonly("traffic", &E::traffic, "Traffic clock: TOKENS of prompts admitted so far.")
      .def_property_readonly("num_candidates", &E::num_candidates, "Free blocks that hold a key (evictable).")
      .def_property_readonly("ghost_size", [](const E& e) { return e.ghost().size(); }, "Evicted hashes remembered.")
      .def(
          "admit",
          [](E& e, py::handle hits, py::handle tokens, py::handle priority) {
            e.admit(to_ids(hits), saturated_int64(tokens, "tokens"), checked_int64(priority, "priority"));
          },
          py::arg("hits"), py::arg("tokens"), py::arg("priority") = 0,
          "Advance the traffic clock by `tokens`, pin the hit blocks (pool.touch), count a hit and a use on each.")
      .def(
          "cached",
          [](E& e, py::handle ids, py::handle keys, py::handle key_size, py::handle priority) {
            e.cached(to_ids(ids), bytes_view(keys, "keys"), saturated_int64(key_size, "key_size"),
                     checked_int64(priority, "priority"));
          },
          py::arg("ids"), py::arg("keys"), py::arg("key_size"), py::arg("priority") = 0,
          "These in-use blocks were just cached under the packed keys (after pool.cache_many_packed).")
      .def(
          "free",
          [](E& e, py::handle ids, py::handle request_tokens) {
            e.free(to_ids(ids), saturated_int64(request_tokens, "request_tokens"));
          },
          py::arg("ids"), py::arg("request_tokens") = 0,
          "pool.free(ids); blocks that become free and cached are ranked once and become candidates.")
      .def(
          "make_room",
          [](E& e, py::handle n, py::handle keep) {
            return to_bytes_list(e.make_room(saturated_int64(n, "n"), to_ids(keep)));  // beyond int64: all
          },
          py::arg("n"), py::arg("keep") = py::tuple(),
          "Evict by policy until n free blocks hold no key, never a block of `keep`; return the dropped keys.")
      .def("evict", [](E& e, py::handle n) { return to_bytes_list(e.evict(saturated_int64(n, "n"))); }, py::arg("n"),
           "Evict up to n candidates by policy; return the dropped keys.")
      .def("reset", &E::reset, "Forget every candidate and the history (after pool.uncache_all()).")
      .def(
          "candidate",
          [](const E& e, py::handle id) { return with_saturated_int64(id, "id", [&](int64_t v) { return e.candidate(v); }); },
          py::arg("id"), "What a policy reads about block `id`.")
      .def("order", &E::order, "Candidates in eviction order (first evicted first).")
      .def("check_invariants", &E::check_invariants, "Raise InvariantError naming the first broken invariant.");
  return cls;
}

}  // namespace

void bind_block_evictor(py::module_& m) {
  auto candidate = py::class_<EvictionCandidate>(
      m, "EvictionCandidate", "What an eviction policy reads about a candidate (a radix leaf or a free cached block).");
  candidate.def_readonly("node", &EvictionCandidate::id, "Node id (radix).")
      .def_readonly("block", &EvictionCandidate::id, "Block id (hash).");
  py::list fields;
#define PREFIXCACHE_BIND_CANDIDATE_FIELD(name, doc)              \
  candidate.def_readonly(#name, &EvictionCandidate::name, doc); \
  fields.append(#name);
  PREFIXCACHE_CANDIDATE_FIELDS(PREFIXCACHE_BIND_CANDIDATE_FIELD)
#undef PREFIXCACHE_BIND_CANDIDATE_FIELD
  m.attr("CANDIDATE_FIELDS") = py::tuple(fields);

  auto native = bind_evictor<NativeKey>(m, "BlockEvictor", R"doc(
Policy-ordered eviction of free cached blocks for the hash strategy, with a native
order: BlockEvictor(pool, block_size, eviction, protect_tokens=0, size_weight=0,
ghost_capacity=0). See csrc/block_evictor.h.
)doc");
  auto callback = bind_evictor<PyKey>(m, "CallbackBlockEvictor", R"doc(
BlockEvictor ranking with a Python function: CallbackBlockEvictor(pool, block_size,
priority, ghost_capacity=0); priority(EvictionCandidate) is called once per block when
it becomes a candidate.
)doc");
  native.def(py::init([](BlockPool& pool, int64_t block_size, const std::string& eviction, int64_t protect_tokens,
                       int64_t size_weight, int64_t ghost_capacity, int64_t protected_threshold, int64_t tlru_threshold,
                       int64_t next_prompt_estimate) {
             EvictionOrder order = parse_eviction_order(eviction);
             OrderParams params{protect_tokens, size_weight, protected_threshold, tlru_threshold, next_prompt_estimate};
             return std::make_unique<BlockEvictor<NativeKey>>(
                 pool, block_size, [order, params](const EvictionCandidate& c) { return native_key(order, params, c); },
                 ghost_capacity);
           }),
           py::arg("pool"), py::arg("block_size"), py::arg("eviction"), py::arg("protect_tokens") = 0,
           py::arg("size_weight") = 0, py::arg("ghost_capacity") = 0, py::arg("protected_threshold") = 2,
           py::arg("tlru_threshold") = 0, py::arg("next_prompt_estimate") = 0, py::keep_alive<1, 2>());
  callback.def(py::init([](BlockPool& pool, int64_t block_size, py::function priority, int64_t ghost_capacity) {
             return std::make_unique<BlockEvictor<PyKey>>(
                 pool, block_size, [priority](const EvictionCandidate& c) { return policy_key(priority(c)); },
                 ghost_capacity);
           }),
           py::arg("pool"), py::arg("block_size"), py::arg("priority"), py::arg("ghost_capacity") = 0,
           py::keep_alive<1, 2>());
}

}  // namespace prefixcache
