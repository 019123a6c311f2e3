// prefixcache._C: the native core. This file only assembles the module; each
// concept binds itself in its own bind_*.cpp, which converts types and nothing more.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace prefixcache {
void bind_block_pool(py::module_& m);
void bind_hashing(py::module_& m);
void bind_radix_tree(py::module_& m);
void bind_block_evictor(py::module_& m);
void bind_attention(py::module_& m);
void bind_block_contents(py::module_& m);
void bind_tokens(py::module_& m);
void bind_kv_index(py::module_& m);
void bind_kv_router_cost(py::module_& m);
void bind_ttft_cost(py::module_& m);
void bind_call_guard(py::module_& m);
void bind_decode_step(py::module_& m);
void bind_tiers(py::module_& m);
void bind_hybrid_hit(py::module_& m);
void bind_hybrid_tree(py::module_& m);
}  // namespace prefixcache

PYBIND11_MODULE(_C, m) {
  m.doc() = "prefixcache native core: block pool, hashing, radix tree, paged attention (CPU).";
  prefixcache::bind_block_pool(m);
  prefixcache::bind_hashing(m);
  prefixcache::bind_radix_tree(m);
  prefixcache::bind_block_evictor(m);
  prefixcache::bind_attention(m);
  prefixcache::bind_block_contents(m);
  prefixcache::bind_tokens(m);
  prefixcache::bind_kv_index(m);
  prefixcache::bind_kv_router_cost(m);
  prefixcache::bind_ttft_cost(m);
  prefixcache::bind_call_guard(m);
  prefixcache::bind_decode_step(m);
  prefixcache::bind_tiers(m);
  prefixcache::bind_hybrid_hit(m);
  prefixcache::bind_hybrid_tree(m);
}
