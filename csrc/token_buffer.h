// A request's own token buffer (an array('i') or array('q') a backend keeps): reading
// its width and length, and appending ids to it, for the bindings that grow one.
//
// Owns only the array's side: what goes in has been read by the one converter
// (token_ids.h) or checked by the caller. Never does: convert a token argument, or keep
// a view of the array past a call (appending resizes it, and a held export forbids that).
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>

namespace prefixcache {

// Item size (4 or 8) and length of `obj` if it is a one-dimensional buffer of signed
// ints of that size (array('i'), array('l'), array('q')); false otherwise, no error set.
inline bool int_buffer_shape(PyObject* obj, Py_ssize_t& itemsize, Py_ssize_t& length) {
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT) != 0) {
    PyErr_Clear();
    return false;
  }
  const char f = view.format != nullptr ? view.format[0] : 'B';
  const bool ints = (f == 'i' || f == 'q' || f == 'l') && view.format[1] == '\0';
  itemsize = view.itemsize;
  length = itemsize > 0 ? view.len / itemsize : 0;
  PyBuffer_Release(&view);
  return ints && (itemsize == 4 || itemsize == 8);
}

// `bytes` bytes of ids (the array's own width) appended to the array in one copy.
inline void append_ids(PyObject* array, const void* data, size_t bytes) {
  if (bytes == 0) return;
  static PyObject* frombytes = PyUnicode_InternFromString("frombytes");
  auto mv = pybind11::reinterpret_steal<pybind11::object>(PyMemoryView_FromMemory(
      static_cast<char*>(const_cast<void*>(data)), static_cast<Py_ssize_t>(bytes), PyBUF_READ));
  if (!mv) throw pybind11::error_already_set();
  auto done = pybind11::reinterpret_steal<pybind11::object>(PyObject_CallMethodOneArg(array, frombytes, mv.ptr()));
  if (!done) throw pybind11::error_already_set();
}

// One id (an exact int the caller range-checked for the array's width) appended.
// An array.array (the buffers backends keep) is called through array.append itself,
// found once: a decode step's one id then costs no method look-up.
inline void append_id(PyObject* array, PyObject* id) {
  static PyObject* const array_type = [] {
    PyObject* module = PyImport_ImportModule("array");
    PyObject* type = module != nullptr ? PyObject_GetAttrString(module, "array") : nullptr;
    Py_XDECREF(module);
    PyErr_Clear();
    return type;  // kept for the process; nullptr: always look the method up
  }();
  static PyObject* const array_append =
      array_type != nullptr ? PyObject_GetAttrString(array_type, "append") : nullptr;
  PyObject* done;
  if (array_append != nullptr && Py_IS_TYPE(array, reinterpret_cast<PyTypeObject*>(array_type))) {
    PyObject* call[] = {array, id};
    done = PyObject_Vectorcall(array_append, call, 2, nullptr);
  } else {
    static PyObject* append = PyUnicode_InternFromString("append");
    done = PyObject_CallMethodOneArg(array, append, id);
  }
  if (done == nullptr) throw pybind11::error_already_set();
  Py_DECREF(done);
}

}  // namespace prefixcache
