// Argument conversions the bindings share: one rule each for ints, id lists and bytes, and
// the one way a vector of ids or floats goes back to Python as a list.
//
// Owns `saturated_int64`, `checked_int64`, `to_ids`, `bytes_view`, `ByteBuffer` and
// `to_list`. Token ids have a converter of their own, token_ids.h.
// A binding that declares an `int64_t` parameter makes pybind11
// answer a Python int beyond int64 with a TypeError ("incompatible function
// arguments"), and PyLong_AsLongLong with an OverflowError; neither is the
// IndexError / ValueError the project promises for a bad id or count. Saturating
// instead hands the callee a value its own range check rejects with its usual error
// (and a huge count, where any count is valid, reads as "all there are").
//
// Never does: range checks (the callee owns them), accept a non-integer where an int
// is due, or copy a bytes object.
//
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace prefixcache {

// repr(obj), cut to a readable length for an error message.
inline std::string short_repr(PyObject* obj) {
  PyObject* r = PyObject_Repr(obj);
  if (r == nullptr) {
    PyErr_Clear();
    return "?";
  }
  const char* utf8 = PyUnicode_AsUTF8(r);
  std::string out = utf8 != nullptr ? utf8 : "?";
  if (utf8 == nullptr) PyErr_Clear();
  Py_DECREF(r);
  return out.size() > 60 ? out.substr(0, 57) + "..." : out;
}

// `obj` (an int, or anything with __index__: numpy ints, bools) as int64; `overflow`
// is -1 / +1 below / beyond int64 (the value is then meaningless). TypeError naming
// `what` for anything else; an error __index__ raises itself is passed on.
inline int64_t index_int64(pybind11::handle obj, const char* what, int& overflow) {
  PyObject* index = PyNumber_Index(obj.ptr());
  if (index == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw pybind11::error_already_set();  // __index__'s own error
    PyErr_Clear();
    throw pybind11::type_error(std::string(what) + " must be an int, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  overflow = 0;
  long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
  Py_DECREF(index);
  if (v == -1 && overflow == 0 && PyErr_Occurred()) throw pybind11::error_already_set();
  return v;
}

// `obj` as int64, saturated beyond int64 (see the top of this file).
inline int64_t saturated_int64(pybind11::handle obj, const char* what) {
  int overflow = 0;
  const int64_t v = index_int64(obj, what, overflow);
  if (overflow > 0) return std::numeric_limits<int64_t>::max();
  if (overflow < 0) return std::numeric_limits<int64_t>::min();
  return v;
}

// `obj` as int64, for a value where every int64 is valid (a priority), so saturating
// would change its meaning: ValueError naming `what` beyond int64.
inline int64_t checked_int64(pybind11::handle obj, const char* what) {
  int overflow = 0;
  const int64_t v = index_int64(obj, what, overflow);
  if (overflow != 0) {
    throw pybind11::value_error(std::string(what) + ": expected an int64 in [-2**63, 2**63 - 1]; got " +
                                short_repr(obj.ptr()));
  }
  return v;
}

// `call(saturated_int64(obj, what))`; if `obj` was beyond int64 and the callee
// rejects the saturated value, its ValueError / IndexError shows the value passed
// (2**70), not the one it saw (9223372036854775807).
template <class F>
auto with_saturated_int64(pybind11::handle obj, const char* what, F&& call) {
  const int64_t v = saturated_int64(obj, what);
  auto reword = [&](const std::logic_error& e) {
    std::string msg = e.what();
    const std::string seen = std::to_string(v);
    const size_t at = msg.rfind(seen);
    // At an int64 limit the value may have been saturated; its repr is right either way.
    const bool limit = v == std::numeric_limits<int64_t>::max() || v == std::numeric_limits<int64_t>::min();
    if (limit && at != std::string::npos) msg.replace(at, seen.size(), short_repr(obj.ptr()));
    return msg;
  };
  try {
    return call(v);
  } catch (const std::out_of_range& e) {
    throw std::out_of_range(reword(e));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(reword(e));
  }
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
  pybind11::object snapshot;  // our own references, before the first __index__ runs
  std::vector<int64_t> ids(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    long long v = PyLong_CheckExact(item) ? PyLong_AsLongLong(item) : 0;
    if (!PyLong_CheckExact(item) || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();  // beyond int64, or not an exact int: the general rule
      if (!snapshot && PyList_Check(seq.ptr())) {  // __index__ may change the list and drop its items
        snapshot = pybind11::reinterpret_steal<pybind11::object>(PyList_AsTuple(seq.ptr()));
        if (!snapshot) throw pybind11::error_already_set();
        items = PySequence_Fast_ITEMS(snapshot.ptr());
        item = items[i];
      }
      v = saturated_int64(item, "block id");
    }
    ids[i] = v;
  }
  return ids;
}

// A read-only view of a bytes or bytearray object's buffer, held
// while the object lives: packed digests, which a request grows in a bytearray.
// TypeError naming `what` for anything else.
class ByteBuffer {
 public:
  ByteBuffer(pybind11::handle obj, const char* what) {
    const bool bytes_like = PyBytes_Check(obj.ptr()) || PyByteArray_Check(obj.ptr());
    if (!bytes_like || PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_SIMPLE) != 0) {
      PyErr_Clear();
      throw pybind11::type_error(std::string(what) + " must be bytes or bytearray, got " +
                                 Py_TYPE(obj.ptr())->tp_name);
    }
  }
  ~ByteBuffer() { PyBuffer_Release(&view_); }
  ByteBuffer(const ByteBuffer&) = delete;
  ByteBuffer& operator=(const ByteBuffer&) = delete;
  std::string_view view() const { return {static_cast<const char*>(view_.buf), static_cast<size_t>(view_.len)}; }

 private:
  Py_buffer view_{};
};

// A fresh array('i') / array('q') of n items (zeros) and a pointer to fill them through:
// sized in one allocation by repeating a one-item array, so a caller writes its ids
// straight into the array, with no intermediate buffer. The pointer is valid until the
// array is resized.
template <class T>
std::pair<pybind11::object, T*> new_int_array(size_t n) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8);
  static PyObject* one = [] {  // array('i'/'q', [0]), kept for the process
    pybind11::object type = pybind11::module_::import("array").attr("array");
    return type(sizeof(T) == 4 ? "i" : "q", pybind11::make_tuple(0)).release().ptr();
  }();
  auto out = pybind11::reinterpret_steal<pybind11::object>(PySequence_Repeat(one, static_cast<Py_ssize_t>(n)));
  if (!out) throw pybind11::error_already_set();
  Py_buffer view;
  if (PyObject_GetBuffer(out.ptr(), &view, PyBUF_WRITABLE) != 0) throw pybind11::error_already_set();
  T* data = static_cast<T*>(view.buf);
  PyBuffer_Release(&view);  // the array is ours and is not resized while the caller fills it
  return {std::move(out), data};
}

// array('i') / array('q') holding data[:n]: one copy, no Python int per id (the role a
// torch index tensor plays in SGLang).
template <class T>
pybind11::object int_array(const T* data, size_t n) {
  auto [out, dst] = new_int_array<T>(n);
  if (n > 0) std::memcpy(dst, data, n * sizeof(T));
  return std::move(out);
}

// A view of a bytes object's buffer, valid while the caller holds the object.
// TypeError naming `what` for anything but bytes.
inline std::string_view bytes_view(pybind11::handle obj, const char* what) {
  if (!PyBytes_Check(obj.ptr())) {
    throw pybind11::type_error(std::string(what) + " must be bytes, got " + Py_TYPE(obj.ptr())->tp_name);
  }
  return std::string_view(PyBytes_AS_STRING(obj.ptr()), PyBytes_GET_SIZE(obj.ptr()));
}

// A list of Python ints (ids, positions) or floats (SECONDS, costs), built in one pass.
inline PyObject* to_py(int32_t v) { return PyLong_FromLong(v); }
inline PyObject* to_py(double v) { return PyFloat_FromDouble(v); }

template <typename T>
pybind11::list to_list(const std::vector<T>& values) {
  pybind11::list out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = to_py(values[i]);
    if (item == nullptr) throw pybind11::error_already_set();
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

}  // namespace prefixcache
