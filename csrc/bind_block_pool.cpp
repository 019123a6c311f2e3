// Python binding of BlockPool: converts ids and byte keys, nothing more.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "block_pool.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

std::optional<py::bytes> to_bytes(const std::optional<std::string>& key) {
  if (!key) return std::nullopt;
  return py::bytes(*key);
}

int64_t arg(py::handle obj, const char* what) { return saturated_int64(obj, what); }

std::string_view key_view(py::handle obj) { return bytes_view(obj, "keys"); }

std::vector<std::string_view> key_views(py::handle obj) {
  std::vector<std::string_view> keys;
  for (py::handle item : obj) keys.push_back(key_view(item));
  return keys;
}


}  // namespace

void bind_block_pool(py::module_& m) {
  m.attr("MAX_NUM_BLOCKS") = kMaxBlocks;
  // register_exception (not just py::exception) so a thrown InvariantError is translated.
  py::register_exception<InvariantError>(m, "InvariantError", PyExc_AssertionError);

  py::class_<BlockPool>(m, "BlockPool", R"doc(
Fixed pool of KV blocks shared by every prefix-cache strategy.

Per-block reference counts, an O(1) intrusive free queue (front is reused
first; keyless blocks are freed to the front, keyed blocks to the tail), and a
key -> blocks index of cached blocks. Bad arguments raise IndexError/ValueError
and leave the pool unchanged. Not thread-safe: call it from one thread.
)doc")
      .def(py::init([](py::handle n) {
             return with_saturated_int64(n, "num_blocks", [](int64_t v) { return std::make_unique<BlockPool>(v); });
           }),
           py::arg("num_blocks"))
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free", &BlockPool::num_free, "Blocks in the free queue (ref 0).")
      .def_property_readonly("num_pinned", &BlockPool::num_pinned, "Blocks with ref > 0.")
      .def_property_readonly("num_cached", &BlockPool::num_cached, "Blocks holding a key.")
      .def_property_readonly("num_evicted", &BlockPool::num_evicted,
                             "Cached blocks whose key allocate(), evict_front() or evict_blocks() dropped, since construction.")
      .def(
          "allocate",
          [](BlockPool& p, py::handle n) -> py::object {
            auto ids = with_saturated_int64(n, "n", [&](int64_t v) { return p.allocate(v); });
            if (!ids) return py::none();
            return to_list(*ids);
          },
          py::arg("n"),
           "Take n blocks (ref 1) from the front of the free queue; None if fewer are free.")
      .def(
          "free", [](BlockPool& p, py::handle ids) { p.free(to_ids(ids)); }, py::arg("ids"),
           "Drop one reference from each block; at zero keyless go to the front, keyed to the tail.")
      .def(
          "touch", [](BlockPool& p, py::handle ids) { p.touch(to_ids(ids)); }, py::arg("ids"),
           "Add one reference to each block; a free block leaves the queue.")
      .def(
          "count_free", [](const BlockPool& p, py::handle ids) { return p.count_free(to_ids(ids)); },
          py::arg("ids"), "How many of the blocks are free (ref 0), i.e. what touch(ids) takes from the queue.")
      .def(
          "cache",
          [](BlockPool& p, py::handle id, py::handle key) {
            with_saturated_int64(id, "id", [&](int64_t v) { p.cache(v, key_view(key)); });
          },
          py::arg("id"),
          py::arg("key"), "Record that in-use, keyless block `id` holds `key`.")
      .def(
          "cache_many",
          [](BlockPool& p, py::handle ids, py::handle keys) { p.cache_many(to_ids(ids), key_views(keys)); },
          py::arg("ids"), py::arg("keys"), "cache(ids[i], keys[i]) for each i, all or nothing.")
      .def(
          "cache_many_packed",
          [](BlockPool& p, py::handle ids, py::handle keys, py::handle key_size, py::handle suffix) {
            ByteBuffer packed(keys, "keys");
            p.cache_many_packed(to_ids(ids), packed.view(), arg(key_size, "key_size"), bytes_view(suffix, "suffix"));
          },
          py::arg("ids"), py::arg("keys"), py::arg("key_size"), py::arg("suffix") = py::bytes(),
          "cache_many with the keys packed back to back in one bytes, key_size bytes each, each "
          "followed by `suffix`.")
      .def(
          "uncache", [](BlockPool& p, py::handle id) { return to_bytes(p.uncache(arg(id, "id"))); }, py::arg("id"),
          "Drop block `id`'s key; return it (None if it had none).")
      .def("uncache_all", &BlockPool::uncache_all, "Drop every key; return how many blocks lost one.")
      .def(
          "lookup", [](const BlockPool& p, py::handle key) { return p.lookup(key_view(key)); }, py::arg("key"),
          "Earliest-cached block still holding `key`, or None.")
      .def(
          "lookup_chain",
          [](const BlockPool& p, py::handle keys) { return to_list(p.lookup_chain(key_views(keys))); },
          py::arg("keys"), "Blocks for the keys in order, stopping at the first miss.")
      .def(
          "lookup_chain_packed",
          [](const BlockPool& p, py::handle keys, py::handle key_size, py::handle suffix) {
            ByteBuffer packed(keys, "keys");
            return to_list(p.lookup_chain_packed(packed.view(), arg(key_size, "key_size"), bytes_view(suffix, "suffix")));
          },
          py::arg("keys"), py::arg("key_size"), py::arg("suffix") = py::bytes(),
          "lookup_chain over keys packed back to back in one bytes, key_size bytes each, each "
          "followed by `suffix`.")
      .def(
          "evict_front",
          [](BlockPool& p, py::handle n) {
            py::list out;
            auto keys = with_saturated_int64(n, "n", [&](int64_t v) { return p.evict_front(v); });
            for (const auto& k : keys) out.append(py::bytes(k));
            return out;
          },
          py::arg("n"), "Drop the keys of the first n keyed free blocks (LRU first); return them.")
      .def(
          "evict_blocks",
          [](BlockPool& p, py::handle ids) {
            py::list out;
            for (const auto& k : p.evict_blocks(to_ids(ids))) out.append(py::bytes(k));
            return out;
          },
          py::arg("ids"),
          "Drop the keys of these free, keyed blocks and move them to the front of the free queue\n"
          "(reused next), in the given order; return their keys. All or nothing.")
      .def(
          "last_removed",
          [](const BlockPool& p) {
            py::list out;
            for (std::string_view k : p.last_removed()) out.append(py::bytes(k.data(), k.size()));
            return out;
          },
          "Keys dropped by the most recent allocate() call.")
      .def(
          "ref_count", [](const BlockPool& p, py::handle id) { return p.ref_count(arg(id, "id")); }, py::arg("id"))
      .def(
          "key", [](const BlockPool& p, py::handle id) { return to_bytes(p.key(arg(id, "id"))); }, py::arg("id"))
      .def(
          "free_queue", [](const BlockPool& p) { return to_list(p.free_queue()); }, "Free queue from front (reused first) to tail.")
      .def(
          "blocks_for", [](const BlockPool& p, py::handle key) { return to_list(p.blocks_for(key_view(key))); },
          py::arg("key"))
      .def("check_invariants", &BlockPool::check_invariants,
           "Raise InvariantError naming the first broken invariant.");
}

}  // namespace prefixcache
