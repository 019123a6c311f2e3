// Argument conversions the bindings share: one rule each for ints, id lists and bytes.
//
// Owns `saturated_int64`, `to_ids` and `bytes_view`. A binding that declares an `int64_t` parameter makes pybind11
// answer a Python int beyond int64 with a TypeError ("incompatible function
// arguments"), and PyLong_AsLongLong with an OverflowError; neither is the
// IndexError / ValueError the project promises for a bad id or count. Saturating
// instead hands the callee a value its own range check rejects with its usual error
// (and a huge count, where any count is valid, reads as "all there are").
//
// Never does: range checks (the callee owns them), accept a non-integer where an int
// is due, or copy a bytes object.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace prefixcache {

// `obj` (an int, or anything with __index__: numpy ints, bools) as int64, saturated
// beyond int64. TypeError naming `what` for anything else.
inline int64_t saturated_int64(pybind11::handle obj, const char* what) {
  PyObject* index = PyNumber_Index(obj.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw pybind11::type_error(std::string(what) + " must be an int, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  int overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
  Py_DECREF(index);
  if (overflow > 0) return std::numeric_limits<int64_t>::max();
  if (overflow < 0) return std::numeric_limits<int64_t>::min();
  if (v == -1 && PyErr_Occurred()) throw pybind11::error_already_set();
  return v;
}

// Block ids from any sequence of ints (saturated beyond int64: out of range). Lists
// (the common case) skip the sequence protocol; it costs most of a small call.
inline std::vector<int64_t> to_ids(pybind11::handle obj) {
  if (PyUnicode_Check(obj.ptr()) || PyBytes_Check(obj.ptr())) {
    throw pybind11::type_error(std::string("ids must be a sequence of ints, got ") + Py_TYPE(obj.ptr())->tp_name);
  }
  pybind11::object seq = pybind11::reinterpret_borrow<pybind11::object>(obj);
  if (!PyList_Check(seq.ptr())) {
    seq = pybind11::reinterpret_steal<pybind11::object>(PySequence_Fast(obj.ptr(), "ids must be a sequence of ints"));
    if (!seq) throw pybind11::error_already_set();
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    long long v = PyLong_CheckExact(item) ? PyLong_AsLongLong(item) : 0;
    if (!PyLong_CheckExact(item) || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();  // beyond int64, or not an exact int: the general rule
      v = saturated_int64(item, "block id");
    }
    ids[i] = v;
  }
  return ids;
}

// A view of a bytes object's buffer, valid while the caller holds the object.
// TypeError naming `what` for anything but bytes.
inline std::string_view bytes_view(pybind11::handle obj, const char* what) {
  if (!PyBytes_Check(obj.ptr())) {
    throw pybind11::type_error(std::string(what) + " must be bytes, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  return std::string_view(PyBytes_AS_STRING(obj.ptr()), PyBytes_GET_SIZE(obj.ptr()));
}

}  // namespace prefixcache
