// Conversions shared by bindings: block ids and byte keys from Python. Only
// conversions live here, nothing that decides anything.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace prefixcache {

// Block ids from any sequence of ints. Lists (the common case) take a fast path
// that skips pybind11's generic sequence caster; it costs most of a small call.
inline std::vector<int64_t> to_ids(pybind11::handle obj) {
  PyObject* seq = obj.ptr();
  if (!PyList_Check(seq)) return pybind11::cast<std::vector<int64_t>>(obj);
  Py_ssize_t n = PyList_GET_SIZE(seq);
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long v = PyLong_AsLongLong(PyList_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
    ids[i] = v;
  }
  return ids;
}

// A view of a bytes object's buffer (valid while the caller holds it); TypeError naming `what`.
inline std::string_view bytes_view(pybind11::handle obj, const char* what) {
  if (!PyBytes_Check(obj.ptr())) {
    throw pybind11::type_error(std::string(what) + " must be bytes, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  return std::string_view(PyBytes_AS_STRING(obj.ptr()), PyBytes_GET_SIZE(obj.ptr()));
}

}  // namespace prefixcache
