// Argument conversions the bindings share: one rule each for ints and bytes.
//
// Owns `saturated_int64` and `bytes_view`. A binding that declares an `int64_t` parameter makes pybind11
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

// A view of a bytes object's buffer, valid while the caller holds the object.
// TypeError naming `what` for anything but bytes.
inline std::string_view bytes_view(pybind11::handle obj, const char* what) {
  if (!PyBytes_Check(obj.ptr())) {
    throw pybind11::type_error(std::string(what) + " must be bytes, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  return std::string_view(PyBytes_AS_STRING(obj.ptr()), PyBytes_GET_SIZE(obj.ptr()));
}

}  // namespace prefixcache
