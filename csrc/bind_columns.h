// The arguments the router bindings share: a load column, and overlaps by candidate.
//
//   a load column  an int64 buffer (array('q'), a numpy int64 array) or a sequence of ints
//   overlaps       {candidate position: blocks}, the candidates not named at 0
//
// Owns `Int64Column` and `overlap_column`, used by every binding of a router's native cost
// (bind_kv_router_cost.cpp, bind_ttft_cost.cpp). Never does: range checks beyond what a
// column or an overlap is (the cost functions own theirs).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "py_args.h"

namespace prefixcache {

// A read-only int64 view of a load column: the buffer itself when `obj` exposes a
// contiguous int64 one (array('q'), numpy int64; per decision, so no copy and no
// pybind11 buffer_info), else a copy of a sequence of ints.
class Int64Column {
 public:
  Int64Column(pybind11::handle obj, const char* what) {
    if (!PyObject_CheckBuffer(obj.ptr())) {
      copy_ = to_ids(obj);
      span_ = copy_;
      return;
    }
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
      throw pybind11::error_already_set();
    }
    held_ = true;
    const char* f = view_.format != nullptr ? view_.format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') ++f;
    if (view_.itemsize != 8 || view_.ndim != 1 || (std::strcmp(f, "q") != 0 && std::strcmp(f, "l") != 0)) {
      throw pybind11::type_error(std::string(what) +
                                 ": expected a contiguous int64 column (array('q')), got format '" +
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

inline std::vector<int32_t> overlap_column(pybind11::handle overlaps, size_t n, const char* what = "overlaps") {
  const std::string name(what);
  if (overlaps.is_none()) return std::vector<int32_t>(n, 0);
  if (!PyDict_Check(overlaps.ptr())) {
    throw pybind11::type_error(name + ": expected a dict {candidate position: blocks}, got " +
                               Py_TYPE(overlaps.ptr())->tp_name);
  }
  std::vector<int32_t> out(n, 0);
  PyObject *key, *value;
  Py_ssize_t pos = 0;
  while (PyDict_Next(overlaps.ptr(), &pos, &key, &value)) {
    const int64_t i = saturated_int64(key, (name + " key").c_str());
    const int64_t blocks = saturated_int64(value, (name + " value").c_str());
    if (i < 0 || static_cast<size_t>(i) >= n) {
      throw pybind11::index_error(name + ": candidate position " + std::to_string(i) + " is not in [0, " +
                                  std::to_string(n) + ")");
    }
    if (blocks < 0 || blocks > INT32_MAX) {
      throw pybind11::value_error(name + ": blocks must be in [0, 2**31), got " + std::to_string(blocks));
    }
    out[i] = static_cast<int32_t>(blocks);
  }
  return out;
}

}  // namespace prefixcache
