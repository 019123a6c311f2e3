// Python binding of the KV-router cost: converts load columns and overlaps, nothing more.
//
//   a load column  an int64 buffer (array('q'), a numpy int64 array) or a sequence of ints
//   overlaps       {candidate position: cached blocks}, the candidates not named at 0
#include <pybind11/pybind11.h>

#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kv_router_cost.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// A read-only int64 view of a load column: the buffer itself when `obj` exposes a
// contiguous int64 one (array('q'), numpy int64; per decision, so no copy and no
// pybind11 buffer_info), else a copy of a sequence of ints.
class Int64Column {
 public:
  Int64Column(py::handle obj, const char* what) {
    if (!PyObject_CheckBuffer(obj.ptr())) {
      copy_ = to_ids(obj);
      span_ = copy_;
      return;
    }
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
    held_ = true;
    const char* f = view_.format != nullptr ? view_.format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') ++f;
    if (view_.itemsize != 8 || view_.ndim != 1 || (std::strcmp(f, "q") != 0 && std::strcmp(f, "l") != 0)) {
      throw py::type_error(std::string(what) + ": expected a contiguous int64 column (array('q')), got format '" +
                           (view_.format != nullptr ? view_.format : "B") + "'");
    }
    span_ = std::span<const int64_t>(static_cast<const int64_t*>(view_.buf), static_cast<size_t>(view_.shape[0]));
  }
  Int64Column(const Int64Column&) = delete;
  Int64Column& operator=(const Int64Column&) = delete;
  ~Int64Column() {
    if (held_) PyBuffer_Release(&view_);
  }
  std::span<const int64_t> span() const { return span_; }

 private:
  Py_buffer view_{};
  bool held_ = false;
  std::vector<int64_t> copy_;
  std::span<const int64_t> span_;
};

std::vector<int32_t> overlap_column(py::handle overlaps, size_t n, const char* what = "overlaps") {
  const std::string name(what);
  if (overlaps.is_none()) return std::vector<int32_t>(n, 0);
  if (!PyDict_Check(overlaps.ptr())) {
    throw py::type_error(name + ": expected a dict {candidate position: blocks}, got " +
                         Py_TYPE(overlaps.ptr())->tp_name);
  }
  std::vector<int32_t> out(n, 0);
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(overlaps.ptr(), &pos, &key, &value)) {
    const int64_t i = saturated_int64(key, (name + " key").c_str());
    const int64_t blocks = saturated_int64(value, (name + " value").c_str());
    if (i < 0 || static_cast<size_t>(i) >= n) {
      throw py::index_error(name + ": candidate position " + std::to_string(i) + " is not in [0, " +
                            std::to_string(n) + ")");
    }
    if (blocks < 0 || blocks > INT32_MAX) {
      throw py::value_error(name + ": blocks must be in [0, 2**31), got " + std::to_string(blocks));
    }
    out[i] = static_cast<int32_t>(blocks);
  }
  return out;
}

std::vector<double> costs(py::handle prefill_tokens, py::handle active_blocks, py::handle overlaps,
                          py::handle prompt_tokens, py::handle block_size, double weight, py::handle active_overlaps) {
  const Int64Column prefill(prefill_tokens, "prefill_tokens");
  const Int64Column active(active_blocks, "active_blocks");
  const size_t n = prefill.span().size();
  return kv_router_costs(prefill.span(), active.span(), overlap_column(overlaps, n),
                         overlap_column(active_overlaps, n, "active_overlaps"),
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
block_size (TOKENS per block), weight (Dynamo's overlap_score_weight); active_overlaps:
{candidate position: blocks of the prompt among its active blocks}, None for none.)doc";
  m.def(
      "kv_router_costs",
      [](py::handle prefill, py::handle active, py::handle overlaps, py::handle prompt, py::handle bs, double weight,
         py::handle active_overlaps) {
        return to_list(costs(prefill, active, overlaps, prompt, bs, weight, active_overlaps));
      },
      py::arg("prefill_tokens"), py::arg("active_blocks"), py::arg("overlaps"), py::arg("prompt_tokens"),
      py::arg("block_size"), py::arg("weight"), py::arg("active_overlaps") = py::none(),
      (std::string("Dynamo's KV-router cost of each candidate: weight * max((prefill_tokens + P) / B -\n"
                   "overlap, 0) + active_blocks + max(floor(P / B) - active_overlap, 0).") +
       args_doc)
          .c_str());
  m.def(
      "kv_router_lowest",
      [](py::handle prefill, py::handle active, py::handle overlaps, py::handle prompt, py::handle bs, double weight,
         py::handle active_overlaps) {
        return to_list(lowest(costs(prefill, active, overlaps, prompt, bs, weight, active_overlaps)));
      },
      py::arg("prefill_tokens"), py::arg("active_blocks"), py::arg("overlaps"), py::arg("prompt_tokens"),
      py::arg("block_size"), py::arg("weight"), py::arg("active_overlaps") = py::none(),
      (std::string("The candidate positions tied at the lowest kv_router_costs, ascending.") + args_doc).c_str());
}

}  // namespace prefixcache
