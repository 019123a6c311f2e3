// Token ids from Python: THE converter every binding that takes tokens uses.
//
// Owns the protocol's rule for a token argument (prefixcache/protocol.py; docs/configuration.md "Token ids") and its
// messages, in one place:
//   * a buffer of integers (numpy int arrays of any width, array('b'..'Q'), a
//     memoryview with an integer format, strided or byte-swapped) is read straight
//     from its memory: no Python int is made;
//   * a list or tuple, anything with tolist() or the sequence protocol, whose items
//     are ints or have __index__ (numpy integers);
//   * never a bool (an int to Python, a bug as a token), a bool buffer ('?'), a float,
//     str, bytes or bytearray (a byte string is text, not ids), None or a set.
// Errors name the field and what is allowed, e.g.
//   tokens: expected a sequence of int token ids (list, tuple, numpy int array); got NoneType
//   tokens[2]: expected an int32 token id in [-2**31, 2**31); got float 1.0
//
// read_token_ids() reads the argument ONCE into the caller's own buffer (ids of type
// T, int32 or int64): nothing keeps a view of the caller's memory, so a callee may
// release the GIL, and the caller's object may change afterwards without effect.
// It also copies what it reads before any Python code runs: the items of a list are
// read from a tuple snapshot of it (our own references) as soon as one of them needs
// __index__, so an __index__ that empties or grows the list reads the ids the list
// held when conversion began, and cannot free what the converter is reading. An
// exception raised by tolist(), __index__ or an attribute look-up is passed on as it
// is (a RuntimeError from a cache that refused to be re-entered stays one); only a
// TypeError ("not an index") becomes the message naming `what[i]`.
// For T = int32 an id outside int32 is a ValueError naming it; for T = int64 an id
// beyond int64 (a valid Python int) is no error: `representable` says how many ids
// were read before the first one (the hash chain then hands them to CBOR bignums).
//
// Never does: keep a reference to the argument or to its items, range-check beyond
// what T holds, or decide what a backend stores.
#pragma once

#include <pybind11/pybind11.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "py_args.h"

namespace prefixcache {

// What each id may be, for messages, by what the reader stores.
template <class T>
constexpr const char* token_id_rule() {
  if constexpr (std::is_same_v<T, int32_t>) {
    return "an int32 token id in [-2**31, 2**31)";
  } else {
    return "an int token id";
  }
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
// one, else the list its tolist() returns, else the sequence protocol's. TypeError
// naming `what` for anything that is not a one-dimensional sequence.
inline pybind11::object token_sequence(pybind11::handle obj, const char* what) {
  PyObject* p = obj.ptr();
  if (PyList_Check(p) || PyTuple_Check(p)) return pybind11::reinterpret_borrow<pybind11::object>(obj);
  if (PyUnicode_Check(p) || PyBytes_Check(p) || PyByteArray_Check(p)) bad_token_sequence(obj, what);
  auto tolist = pybind11::reinterpret_steal<pybind11::object>(PyObject_GetAttrString(p, "tolist"));
  if (!tolist) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw pybind11::error_already_set();
    PyErr_Clear();
  } else {
    auto out = pybind11::reinterpret_steal<pybind11::object>(PyObject_CallNoArgs(tolist.ptr()));
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
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw pybind11::error_already_set();  // the callback's own
    PyErr_Clear();
  }
  throw pybind11::type_error(bad_token_message(item, what, i, allowed));
}

// The items of `seq` (a list or tuple) as a tuple of our own references, to read once
// Python code may run: __index__ may change a list, and drop the items it held.
inline pybind11::object item_snapshot(PyObject* seq) {
  if (PyTuple_Check(seq)) return pybind11::reinterpret_borrow<pybind11::object>(seq);  // immutable
  auto out = pybind11::reinterpret_steal<pybind11::object>(PyList_AsTuple(seq));
  if (!out) throw pybind11::error_already_set();
  return out;
}

// A token argument read into our own ids (see the top of this file).
template <class T>
struct TokenIds {
  std::vector<T> ids;
  size_t representable = 0;  // ids before the first beyond int64 (int64 readers only)

  bool complete() const { return representable == ids.size(); }
};

namespace token_ids_detail {

// A one-dimensional buffer of integers, held while reading.
class IntBuffer {
 public:
  explicit IntBuffer(PyObject* obj) {
    if (!PyObject_CheckBuffer(obj) || PyBytes_Check(obj) || PyByteArray_Check(obj)) return;
    if (PyObject_GetBuffer(obj, &view_, PyBUF_FORMAT | PyBUF_STRIDES) != 0) {
      PyErr_Clear();  // not exportable: read it as a sequence
      return;
    }
    if (view_.format != nullptr && std::string_view(view_.format).find('O') != std::string_view::npos) {
      PyBuffer_Release(&view_);  // Python objects (a numpy object array): read them as a sequence
      return;
    }
    held_ = true;
  }
  ~IntBuffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  IntBuffer(const IntBuffer&) = delete;
  IntBuffer& operator=(const IntBuffer&) = delete;

  bool held() const { return held_; }
  const Py_buffer& view() const { return view_; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// struct-module item format -> (kind, bytes, swapped). kind: 'i' signed, 'u' unsigned,
// '?' bool, 'f' floating, 0 anything else.
struct Format {
  char kind = 0;
  size_t size = 0;
  bool swapped = false;
};

inline Format parse_format(const char* fmt, Py_ssize_t itemsize) {
  Format f;
  std::string_view s = fmt != nullptr ? fmt : "B";
  char order = '@';
  if (!s.empty() && (s[0] == '@' || s[0] == '=' || s[0] == '<' || s[0] == '>' || s[0] == '!')) {
    order = s[0];
    s.remove_prefix(1);
  }
  if (s.size() != 1) return f;
  constexpr bool little = std::endian::native == std::endian::little;
  f.swapped = (order == '<' && !little) || ((order == '>' || order == '!') && little);
  switch (s[0]) {
    case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': f.kind = 'i'; break;
    case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': f.kind = 'u'; break;
    case '?': f.kind = '?'; break;
    case 'e': case 'f': case 'd': f.kind = 'f'; break;
    default: return f;
  }
  f.size = static_cast<size_t>(itemsize);
  if (f.kind != 'f' && f.size != 1 && f.size != 2 && f.size != 4 && f.size != 8) f.kind = 0;
  return f;
}

// The raw item at p as (value, fits int64).
inline std::pair<int64_t, bool> load_int(const char* p, const Format& f) {
  uint64_t raw = 0;
  std::memcpy(&raw, p, f.size);  // little-endian hosts keep the low bytes first
  if constexpr (std::endian::native == std::endian::big) raw >>= 8 * (8 - f.size);
  if (f.swapped) raw = __builtin_bswap64(raw) >> (8 * (8 - f.size));
  if (f.kind == 'u') {
    if (f.size == 8 && raw > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return {0, false};
    return {static_cast<int64_t>(raw), true};
  }
  const int shift = static_cast<int>(64 - 8 * f.size);
  return {static_cast<int64_t>(raw << shift) >> shift, true};  // sign-extend
}

// A scalar of a non-integer buffer at p, as a Python object for the message.
inline PyObject* scalar_object(const char* p, const Format& f) {
  if (f.kind == '?') return PyBool_FromLong(*p != 0);
  double v = 0;
  if (f.size == 4) {
    float x;
    std::memcpy(&x, p, 4);
    v = x;
  } else if (f.size == 8) {
    std::memcpy(&v, p, 8);
  } else if (f.size == 2) {
    v = PyFloat_Unpack2(p, std::endian::native == std::endian::little ? 1 : 0);
  }
  return PyFloat_FromDouble(v);
}

[[noreturn]] inline void out_of_range(const char* what, size_t i, int64_t v, bool beyond_int64, const char* allowed) {
  std::string value = beyond_int64 ? "beyond int64" : std::to_string(v);
  throw pybind11::value_error(std::string(what) + "[" + std::to_string(i) + "]: expected " + allowed + "; got int " +
                              value);
}

template <class T>
bool store(TokenIds<T>& out, size_t i, int64_t v, bool fits, const char* what, const char* allowed) {
  if constexpr (std::is_same_v<T, int32_t>) {
    if (!fits || v < INT32_MIN || v > INT32_MAX) out_of_range(what, i, v, !fits, allowed);
    out.ids[i] = static_cast<int32_t>(v);
  } else {
    if (!fits) {
      if (out.representable == out.ids.size()) out.representable = i;
      return false;
    }
    out.ids[i] = v;
  }
  return true;
}

template <class T>
void read_buffer(const Py_buffer& view, PyObject* obj, const char* what, const char* allowed, size_t multiple,
                 TokenIds<T>& out) {
  if (view.ndim != 1) bad_token_sequence(obj, what);
  const Format f = parse_format(view.format, view.itemsize);
  auto n = static_cast<size_t>(view.shape[0]);
  n -= n % multiple;
  const Py_ssize_t stride = view.strides != nullptr ? view.strides[0] : view.itemsize;
  const char* base = static_cast<const char*>(view.buf);
  if (f.kind == 0) bad_token_sequence(obj, what);
  if (f.kind == '?' || f.kind == 'f') {
    if (n == 0) {
      out.ids.clear();
      out.representable = 0;
      return;
    }
    auto item = pybind11::reinterpret_steal<pybind11::object>(scalar_object(base, f));
    throw pybind11::type_error(bad_token_message(item.ptr(), what, 0, allowed));
  }
  out.representable = n;
  if (n == 0) {  // (an empty buffer's memory may be null, which memcpy must not be given)
    out.ids.clear();
    return;
  }
  // A contiguous signed buffer of T or narrower (radix's array('i') read as int64 ids),
  // aligned as its items are (every array and numpy array): one typed pass, widening as it
  // copies, with nothing zero-filled first.
  auto copy_aligned = [&](auto narrow) {
    using N = decltype(narrow);
    if (reinterpret_cast<uintptr_t>(base) % alignof(N) != 0) return false;
    const N* items = reinterpret_cast<const N*>(base);
    out.ids.assign(items, items + n);
    return true;
  };
  if (!f.swapped && f.kind == 'i' && f.size <= sizeof(T) && stride == static_cast<Py_ssize_t>(f.size)) {
    bool done = false;
    switch (f.size) {
      case 1: done = copy_aligned(int8_t{}); break;
      case 2: done = copy_aligned(int16_t{}); break;
      case 4: done = copy_aligned(int32_t{}); break;
      case 8: done = copy_aligned(int64_t{}); break;
      default: break;
    }
    if (done) return;
  }
  out.ids.resize(n);
  if (!f.swapped && f.size == sizeof(T) && f.kind == 'i' && stride == static_cast<Py_ssize_t>(sizeof(T))) {
    std::memcpy(out.ids.data(), base, n * sizeof(T));  // unaligned: one copy
    return;
  }
  if (!f.swapped && f.kind == 'i' && f.size < sizeof(T) && stride == static_cast<Py_ssize_t>(f.size)) {
    // Narrower and unaligned: widened in one typed loop, not item by item through load_int.
    auto widen = [&](auto narrow) {
      using N = decltype(narrow);
      for (size_t i = 0; i < n; ++i) {
        N v;
        std::memcpy(&v, base + i * sizeof(N), sizeof(N));
        out.ids[i] = v;
      }
    };
    switch (f.size) {
      case 1: widen(int8_t{}); return;
      case 2: widen(int16_t{}); return;
      case 4: widen(int32_t{}); return;
      default: break;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    auto [v, fits] = load_int(base + static_cast<Py_ssize_t>(i) * stride, f);
    store(out, i, v, fits, what, allowed);
  }
}

template <class T>
void read_items(PyObject* seq, const char* what, const char* allowed, size_t multiple, TokenIds<T>& out) {
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  n -= n % static_cast<Py_ssize_t>(multiple);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  pybind11::object snapshot;  // set before the first __index__ call (see the top of this file)
  out.ids.resize(static_cast<size_t>(n));
  out.representable = static_cast<size_t>(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = items[i];
    int overflow = 0;
    long long v = 0;
    if (PyLong_CheckExact(item)) {
      v = PyLong_AsLongLongAndOverflow(item, &overflow);  // runs no Python code
    } else {
      if (!snapshot) {
        snapshot = item_snapshot(seq);
        items = PySequence_Fast_ITEMS(snapshot.ptr());
        item = items[i];
      }
      auto index = pybind11::reinterpret_steal<pybind11::object>(token_index(item, what, i, allowed));
      v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    }
    if constexpr (std::is_same_v<T, int32_t>) {
      if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) {
        throw pybind11::value_error(bad_token_message(item, what, i, allowed));
      }
    }
    store(out, static_cast<size_t>(i), v, overflow == 0, what, allowed);
  }
}

}  // namespace token_ids_detail

// Reads the token argument `obj` (field name `what`) into `out` (see the top of this
// file). `allowed` words what an id may be in messages (default: token_id_rule<T>()).
// With `multiple` > 1 only the first len - len % multiple ids are read (and checked):
// the full blocks a hash chain covers.
template <class T>
void read_token_ids(pybind11::handle obj, const char* what, TokenIds<T>& out, const char* allowed = nullptr,
                    size_t multiple = 1) {
  if (allowed == nullptr) allowed = token_id_rule<T>();
  if (multiple < 1) multiple = 1;
  static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>);
  PyObject* p = obj.ptr();
  if (!PyList_Check(p) && !PyTuple_Check(p)) {
    token_ids_detail::IntBuffer buffer(p);
    if (buffer.held()) {
      token_ids_detail::read_buffer(buffer.view(), p, what, allowed, multiple, out);
      return;
    }
  }
  pybind11::object seq = token_sequence(obj, what);
  token_ids_detail::read_items(seq.ptr(), what, allowed, multiple, out);
}

template <class T>
TokenIds<T> read_token_ids(pybind11::handle obj, const char* what, const char* allowed = nullptr) {
  TokenIds<T> out;
  read_token_ids(obj, what, out, allowed);
  return out;
}

}  // namespace prefixcache
