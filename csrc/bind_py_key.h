// A Python eviction policy's priority as a native heap key, ordered by
// Python's `<` (shared by the radix tree and block evictor bindings).
#pragma once

#include <pybind11/pybind11.h>

namespace prefixcache {

struct PyKey {
  pybind11::object value;
  bool operator<(const PyKey& other) const {
    int r = PyObject_RichCompareBool(value.ptr(), other.value.ptr(), Py_LT);
    if (r < 0) throw pybind11::error_already_set();
    return r == 1;
  }
};

}  // namespace prefixcache
