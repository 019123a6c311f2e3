// A Python eviction policy's priority as a native heap key, ordered by Python's `<`
// (shared by the radix tree and block evictor bindings).
//
// A comparison that raises (keys of types that do not compare, a `__lt__` that calls
// back into a cache and is refused) leaves the Python error set and answers "not
// less"; while it is set every comparison answers the same without calling Python, and
// KeyCompare<PyKey>::check() (eviction_order.h) throws it once the heap operation is
// over. So a failing policy gets its own error, and no heap is left holding a null key.
#pragma once

#include <pybind11/pybind11.h>

#include "eviction_order.h"

namespace prefixcache {

struct PyKey {
  pybind11::object value;
  bool operator<(const PyKey& other) const noexcept {
    if (PyErr_Occurred() != nullptr) return false;  // an earlier comparison failed: check() raises it
    return PyObject_RichCompareBool(value.ptr(), other.value.ptr(), Py_LT) == 1;  // -1 keeps the error set
  }
};

// `value` (what a policy's priority() returned) as a key. A key must at least compare
// with itself (None or a dict does not): refused here, when it is made, so it never
// enters a heap that other keys then fail to compare with.
inline PyKey policy_key(pybind11::object value) {
  if (PyObject_RichCompareBool(value.ptr(), value.ptr(), Py_LT) < 0) throw pybind11::error_already_set();
  return PyKey{std::move(value)};
}

template <>
struct KeyCompare<PyKey> {
  static void check() {
    if (PyErr_Occurred() != nullptr) throw pybind11::error_already_set();
  }
  template <class F>
  static void unchecked(F&& f) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    f();
    PyErr_Clear();  // a failure while putting keys back: the first one is what is raised
    PyErr_Restore(type, value, traceback);
  }
};

}  // namespace prefixcache
