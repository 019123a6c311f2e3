// Python binding of paged attention: converts integers to pointers and names to enums,
// nothing more.
//
// Tensors cross as raw addresses (Python ints from torch's Tensor.data_ptr()) plus shapes,
// so the extension is not built against torch's C++ API and does not depend on the buffer
// protocol (torch tensors do not export it; bf16 has no buffer format). The price is that
// this layer cannot check buffer sizes: prefixcache/attention.py validates every shape,
// dtype, device, contiguity and index range before calling, and the C++ kernel re-checks
// the index arrays it reads.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "paged_attention_cpu.h"
#ifdef PREFIXCACHE_WITH_CUDA
#include "paged_attention_cuda.h"
#endif

namespace py = pybind11;

namespace prefixcache {
namespace {

AttnDType to_dtype(const std::string& name) {
  if (name == "float32") return AttnDType::kFloat32;
  if (name == "float16") return AttnDType::kFloat16;
  if (name == "bfloat16") return AttnDType::kBFloat16;
  throw std::invalid_argument("dtype must be one of float32, float16, bfloat16; got '" + name + "'");
}

template <class T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

}  // namespace

void bind_attention(py::module_& m) {
  m.def(
      "paged_attention_cpu",
      [](uintptr_t q, uintptr_t kv, uintptr_t out, uintptr_t lse, uintptr_t q_indptr, uintptr_t kv_indptr,
         uintptr_t kv_indices, uintptr_t kv_lens, int64_t batch_size, int64_t num_heads, int64_t num_kv_heads,
         int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t num_kv_indices, float scale,
         const std::string& dtype, int64_t window_left, int64_t chunk_size) {
        PagedAttentionArgs a;
        a.q = ptr<const void>(q);
        a.kv = ptr<const void>(kv);
        a.out = ptr<void>(out);
        a.lse = ptr<float>(lse);
        a.q_indptr = ptr<const int32_t>(q_indptr);
        a.kv_indptr = ptr<const int32_t>(kv_indptr);
        a.kv_indices = ptr<const int32_t>(kv_indices);
        a.kv_lens = ptr<const int32_t>(kv_lens);
        a.batch_size = batch_size;
        a.num_heads = num_heads;
        a.num_kv_heads = num_kv_heads;
        a.head_dim = head_dim;
        a.num_blocks = num_blocks;
        a.block_size = block_size;
        a.num_kv_indices = num_kv_indices;
        a.scale = scale;
        a.dtype = to_dtype(dtype);
        a.window_left = window_left;
        a.chunk_size = chunk_size;
        py::gil_scoped_release release;
        paged_attention_cpu(a);
      },
      py::arg("q"), py::arg("kv"), py::arg("out"), py::arg("lse"), py::arg("q_indptr"), py::arg("kv_indptr"),
      py::arg("kv_indices"), py::arg("kv_lens"), py::arg("batch_size"), py::arg("num_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("num_blocks"), py::arg("block_size"),
      py::arg("num_kv_indices"), py::arg("scale"), py::arg("dtype"), py::arg("window_left") = -1,
      py::arg("chunk_size") = 0,
      "Paged attention on host memory given as addresses (int32 index arrays; lse 0 = none). "
      "Use prefixcache.attention.paged_attention, which validates the buffers first.");
  m.attr("cpu_attention_parallel") = paged_attention_cpu_parallel();

#ifdef PREFIXCACHE_WITH_CUDA
  m.attr("cuda_compiled") = true;
  m.def("cuda_attention_kernels", &cuda_attention_kernels, "Names of the compiled CUDA attention kernels.");
  m.def(
      "cuda_attention_launch",
      [](const std::string& name, unsigned gx, unsigned gy, unsigned gz, unsigned block, int device,
         uintptr_t stream, uintptr_t q, uintptr_t kv, uintptr_t out, uintptr_t lse, uintptr_t part_o,
         uintptr_t part_lse, uintptr_t q_indptr, uintptr_t kv_indptr, uintptr_t kv_indices, uintptr_t kv_lens,
         int32_t batch, int32_t total_q, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
         int32_t block_size, int32_t num_splits, int32_t split_tokens, float scale_log2, int32_t window_left,
         int32_t chunk_size) {
        CudaAttentionArgs a{q,     kv,      out,       lse,          part_o,   part_lse,   q_indptr,
                            kv_indptr, kv_indices, kv_lens, batch, total_q, num_heads, num_kv_heads,
                            head_dim, block_size, num_splits, split_tokens, scale_log2, window_left, chunk_size};
        cuda_attention_launch(name, gx, gy, gz, block, device, stream, a);
      },
      "Launch one attention kernel on device addresses; prefixcache._attention_cuda plans the call.");
#else
  m.attr("cuda_compiled") = false;
#endif
}

}  // namespace prefixcache
