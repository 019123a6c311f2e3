// Argument conversions the bindings share: one rule each for ints, id lists and bytes.
//
// Owns `saturated_int64`, `to_ids`, `bytes_view`, and the token-id rules every
// binding that takes tokens shares (`token_sequence`, `token_index`, their messages).
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
// Token ids. The protocol takes a sequence of ids (a list, a tuple, a numpy int array,
// anything with tolist() or the sequence protocol), each a Python int or a numpy
// integer (anything with __index__), never a bool: an int to Python, but almost
// certainly a bug as a token. Errors name the field and what is allowed, e.g.
//   tokens: expected a sequence of int token ids (list, tuple, numpy int array); got NoneType
//   tokens[2]: expected an int32 token id in [-2**31, 2**31); got float 1.0
// Each binding passes its own range in `allowed` (what its backend really stores).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
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

[[noreturn]] inline void bad_token_sequence(pybind11::handle obj, const char* what) {
  throw pybind11::type_error(std::string(what) +
                             ": expected a sequence of int token ids (list, tuple, numpy int array); got " +
                             Py_TYPE(obj.ptr())->tp_name);
}

// "what[i]: expected <allowed>; got <type> <repr>", the message for one bad id.
inline std::string bad_token_message(PyObject* item, const char* what, Py_ssize_t i, const char* allowed) {
  return std::string(what) + "[" + std::to_string(i) + "]: expected " + allowed + "; got " + Py_TYPE(item)->tp_name +
         " " + short_repr(item);
}

// `obj` as a list or tuple whose items PySequence_Fast_ITEMS reads: itself if it is
// one, else the list its tolist() returns (numpy arrays, array.array: one C call, no
// numpy scalar per id), else the sequence protocol's. TypeError naming `what` for
// anything that is not a one-dimensional sequence (None, an int, str, bytes, a set).
inline pybind11::object token_sequence(pybind11::handle obj, const char* what) {
  PyObject* p = obj.ptr();
  if (PyList_Check(p) || PyTuple_Check(p)) return pybind11::reinterpret_borrow<pybind11::object>(obj);
  if (PyUnicode_Check(p) || PyBytes_Check(p) || PyByteArray_Check(p)) bad_token_sequence(obj, what);
  if (PyObject_HasAttrString(p, "tolist")) {
    auto out = pybind11::reinterpret_steal<pybind11::object>(PyObject_CallMethod(p, "tolist", nullptr));
    if (!out) throw pybind11::error_already_set();
    if (!PyList_Check(out.ptr())) bad_token_sequence(obj, what);  // a 0-d array gives a scalar
    return out;
  }
  if (!PySequence_Check(p)) bad_token_sequence(obj, what);
  auto seq = pybind11::reinterpret_steal<pybind11::object>(PySequence_Fast(p, what));
  if (!seq) throw pybind11::error_already_set();
  return seq;
}

// Token id `item` (at `what[i]`) as an exact int, a new reference: an int subclass or
// a numpy integer through __index__. TypeError for a bool or anything else.
inline PyObject* token_index(PyObject* item, const char* what, Py_ssize_t i, const char* allowed) {
  if (PyLong_CheckExact(item)) {
    Py_INCREF(item);
    return item;
  }
  if (!PyBool_Check(item)) {
    PyObject* index = PyNumber_Index(item);  // an exact int since Python 3.10
    if (index != nullptr) return index;
    PyErr_Clear();
  }
  throw pybind11::type_error(bad_token_message(item, what, i, allowed));
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
