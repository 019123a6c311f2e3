// Python binding of the KV-router cost: converts load columns and overlaps, nothing more.
//
//   a load column  an int64 buffer (array('q'), a numpy int64 array) or a sequence of ints
//   overlaps       {candidate position: cached blocks}, the candidates not named at 0
#include <pybind11/pybind11.h>

#include <cstring>
#include <string>
#include <vector>

#include "kv_router_cost.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

std::vector<int64_t> int64_column(py::handle obj, const char* what) {
  if (PyObject_CheckBuffer(obj.ptr())) {
    py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
    const bool int64 = info.itemsize == 8 && (info.format == "q" || info.format == "l" || info.format == "<q" ||
                                              info.format == "<l" || info.format == "=q" || info.format == "=l");
    if (!int64 || info.ndim != 1 || info.strides[0] != 8) {
      throw py::type_error(std::string(what) + ": expected a contiguous int64 column (array('q')), got format '" +
                           info.format + "'");
    }
    std::vector<int64_t> out(static_cast<size_t>(info.shape[0]));
    if (!out.empty()) std::memcpy(out.data(), info.ptr, out.size() * sizeof(int64_t));
    return out;
  }
  return to_ids(obj);
}

std::vector<int32_t> overlap_column(py::handle overlaps, size_t n) {
  if (!PyDict_Check(overlaps.ptr())) {
    throw py::type_error(std::string("overlaps: expected a dict {candidate position: blocks}, got ") +
                         Py_TYPE(overlaps.ptr())->tp_name);
  }
  std::vector<int32_t> out(n, 0);
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(overlaps.ptr(), &pos, &key, &value)) {
    const int64_t i = saturated_int64(key, "overlaps key");
    const int64_t blocks = saturated_int64(value, "overlaps value");
    if (i < 0 || static_cast<size_t>(i) >= n) {
      throw py::index_error("overlaps: candidate position " + std::to_string(i) + " is not in [0, " +
                            std::to_string(n) + ")");
    }
    if (blocks < 0 || blocks > INT32_MAX) throw py::value_error("overlaps: blocks must be in [0, 2**31), got " + std::to_string(blocks));
    out[i] = static_cast<int32_t>(blocks);
  }
  return out;
}

std::vector<double> costs(py::handle prefill_tokens, py::handle active_blocks, py::handle overlaps,
                          py::handle prompt_tokens, py::handle block_size, double weight) {
  std::vector<int64_t> prefill = int64_column(prefill_tokens, "prefill_tokens");
  std::vector<int64_t> active = int64_column(active_blocks, "active_blocks");
  return kv_router_costs(prefill, active, overlap_column(overlaps, prefill.size()),
                         saturated_int64(prompt_tokens, "prompt_tokens"), saturated_int64(block_size, "block_size"),
                         weight);
}

py::list to_list(const std::vector<double>& values) {
  py::list out(values.size());
  for (size_t i = 0; i < values.size(); ++i) PyList_SET_ITEM(out.ptr(), i, PyFloat_FromDouble(values[i]));
  return out;
}

py::list to_list(const std::vector<int32_t>& rows) {
  py::list out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) PyList_SET_ITEM(out.ptr(), i, PyLong_FromLong(rows[i]));
  return out;
}

}  // namespace

void bind_kv_router_cost(py::module_& m) {
  const char* args_doc = R"doc(
prefill_tokens, active_blocks: one entry per candidate (int64 columns); overlaps:
{candidate position: blocks of the prompt cached there}; prompt_tokens (TOKENS),
block_size (TOKENS per block), weight (Dynamo's overlap_score_weight).)doc";
  m.def(
      "kv_router_costs",
      [](py::handle prefill, py::handle active, py::handle overlaps, py::handle prompt, py::handle bs, double weight) {
        return to_list(costs(prefill, active, overlaps, prompt, bs, weight));
      },
      py::arg("prefill_tokens"), py::arg("active_blocks"), py::arg("overlaps"), py::arg("prompt_tokens"),
      py::arg("block_size"), py::arg("weight"),
      (std::string("Dynamo's KV-router cost of each candidate:\n"
                   "weight * (prefill_tokens + max(P - overlap * B, 0)) / B + active_blocks + max(ceil(P/B) - overlap, 0).") +
       args_doc)
          .c_str());
  m.def(
      "kv_router_lowest",
      [](py::handle prefill, py::handle active, py::handle overlaps, py::handle prompt, py::handle bs, double weight) {
        return to_list(lowest(costs(prefill, active, overlaps, prompt, bs, weight)));
      },
      py::arg("prefill_tokens"), py::arg("active_blocks"), py::arg("overlaps"), py::arg("prompt_tokens"),
      py::arg("block_size"), py::arg("weight"),
      (std::string("The candidate positions tied at the lowest kv_router_costs, ascending.") + args_doc).c_str());
}

}  // namespace prefixcache
