// Python binding of token-id conversion: the protocol's token argument (token_ids.h)
// as a typed array or a list of ints, and workload token runs expanded into an array.
// Converts and checks, nothing more.
#include <pybind11/pybind11.h>

#include <cstring>
#include <string_view>

#include "py_args.h"
#include "token_ids.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// The ids of `obj` as a list of exact ints: `obj` itself when it already is one and
// `copy` is false (a decode step's list costs one type check per id), else a list of
// our own. Kept for ids beyond int64, which only Python ints hold (CBOR bignums).
// Items that need __index__ are read from a snapshot (token_ids.h), into a new list.
py::object token_list(py::handle obj, const char* what, bool copy) {
  constexpr const char* allowed = token_id_rule<int64_t>();
  py::object seq = token_sequence(obj, what);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  Py_ssize_t i = 0;
  while (i < n && PyLong_CheckExact(items[i])) ++i;
  if (i == n && PyList_Check(seq.ptr())) {
    // A list tolist() or the sequence protocol made, that nobody else holds, is ours.
    const bool ours = seq.ptr() != obj.ptr() && Py_REFCNT(seq.ptr()) == 1;
    if (ours || !copy) return seq;
  }
  py::object snapshot = item_snapshot(seq.ptr());
  items = PySequence_Fast_ITEMS(snapshot.ptr());
  py::list out(n);  // its slots start empty; a throw part-way frees what was set
  for (Py_ssize_t j = 0; j < n; ++j) PyList_SET_ITEM(out.ptr(), j, token_index(items[j], what, j, allowed));
  return std::move(out);
}

// token_list(tokens, what="tokens", copy=False) as a METH_FASTCALL function: pybind11's
// argument dispatch would cost more than the check on a decode step.
PyObject* token_list_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 3 || (nargs >= 2 && !PyUnicode_Check(args[1]))) {
    PyErr_SetString(PyExc_TypeError,
                    "token_list takes (tokens, what: str = 'tokens', copy: bool = False), positionally");
    return nullptr;
  }
  try {
    const char* what = nargs >= 2 ? PyUnicode_AsUTF8(args[1]) : "tokens";
    if (what == nullptr) throw py::error_already_set();
    const int copy = nargs == 3 ? PyObject_IsTrue(args[2]) : 0;
    if (copy < 0) throw py::error_already_set();
    return token_list(args[0], what, copy != 0).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  }
  return nullptr;
}

// A copy of `obj` when it already is an array.array (not a subclass) of the width
// asked for: every id such an array holds is valid, so the converter's read would be
// a memcpy into a vector and another into the result; an array slice is one. nullptr
// (no error set) otherwise.
PyObject* same_array_copy(PyObject* obj, long itemsize) {
  static PyObject* array_type = py::object(py::module_::import("array").attr("array")).release().ptr();
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(array_type)) return nullptr;
  Py_buffer view;
  if (PyObject_GetBuffer(obj, &view, PyBUF_FORMAT) != 0) {
    PyErr_Clear();
    return nullptr;
  }
  const bool same = view.itemsize == itemsize && view.format != nullptr &&
                    view.format[0] == (itemsize == 4 ? 'i' : 'q') && view.format[1] == '\0';
  PyBuffer_Release(&view);
  return same ? PySequence_GetSlice(obj, 0, PY_SSIZE_T_MAX) : nullptr;
}

// token_array(tokens, what="tokens", itemsize=8): the ids as array('q') (itemsize 8;
// None if an id is beyond int64) or array('i') (itemsize 4; ValueError beyond int32).
// METH_FASTCALL for the same reason as token_list: both backends call it per decode step.
PyObject* token_array_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 3 || (nargs >= 2 && !PyUnicode_Check(args[1])) || (nargs == 3 && !PyLong_Check(args[2]))) {
    PyErr_SetString(PyExc_TypeError, "token_array takes (tokens, what: str = 'tokens', itemsize: int = 8), positionally");
    return nullptr;
  }
  try {
    const char* what = nargs >= 2 ? PyUnicode_AsUTF8(args[1]) : "tokens";
    if (what == nullptr) throw py::error_already_set();
    const long itemsize = nargs == 3 ? PyLong_AsLong(args[2]) : 8;
    if (PyObject* copy = same_array_copy(args[0], itemsize)) return copy;
    if (PyErr_Occurred()) throw py::error_already_set();
    if (itemsize == 4) {
      TokenIds<int32_t> ids = read_token_ids<int32_t>(args[0], what);
      return int_array(ids.ids.data(), ids.ids.size()).release().ptr();
    }
    if (itemsize != 8) throw py::value_error("itemsize must be 4 or 8, got " + std::to_string(itemsize));
    TokenIds<int64_t> ids = read_token_ids<int64_t>(args[0], what);
    if (!ids.complete()) Py_RETURN_NONE;
    return int_array(ids.ids.data(), ids.ids.size()).release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  }
  return nullptr;
}

// The concatenation of range(start, stop) for each (start, stop) in `runs`, as an int
// array of `itemsize` bytes: a workload's TokenRuns expanded without a Python int per id.
py::object expand_runs(py::handle runs, int itemsize) {
  if (itemsize != 4 && itemsize != 8) throw py::value_error("itemsize must be 4 or 8, got " + std::to_string(itemsize));
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(runs.ptr(), "runs must be a sequence of (start, stop)"));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  std::vector<std::pair<int64_t, int64_t>> spans(static_cast<size_t>(n));
  size_t total = 0;
  const int64_t lo = itemsize == 4 ? INT32_MIN : std::numeric_limits<int64_t>::min();
  const int64_t hi = itemsize == 4 ? int64_t{INT32_MAX} + 1 : std::numeric_limits<int64_t>::max();
  for (Py_ssize_t i = 0; i < n; ++i) {
    py::handle run = PySequence_Fast_GET_ITEM(seq.ptr(), i);
    if (!PyTuple_Check(run.ptr()) || PyTuple_GET_SIZE(run.ptr()) != 2) {
      throw py::type_error("runs[" + std::to_string(i) + "] must be a (start, stop) tuple");
    }
    int64_t start = saturated_int64(PyTuple_GET_ITEM(run.ptr(), 0), "start");
    int64_t stop = saturated_int64(PyTuple_GET_ITEM(run.ptr(), 1), "stop");
    if (start > stop || start < lo || stop > hi) {
      throw py::value_error("runs[" + std::to_string(i) + "] = (" + std::to_string(start) + ", " +
                            std::to_string(stop) + ") must have start <= stop, every id fitting " +
                            std::to_string(itemsize) + " bytes");
    }
    spans[i] = {start, stop};
    total += static_cast<size_t>(stop - start);
  }
  auto fill = [&](auto made) {  // straight into the array: one pass over the ids
    auto* out = made.second;
    for (auto [start, stop] : spans) {
      for (int64_t t = start; t < stop; ++t) *out++ = static_cast<std::remove_reference_t<decltype(*out)>>(t);
    }
    return std::move(made.first);
  };
  if (itemsize == 4) return fill(new_int_array<int32_t>(total));
  return fill(new_int_array<int64_t>(total));
}

PyMethodDef token_list_def = {"token_list",
                              reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(token_list_fastcall)),
                              METH_FASTCALL, R"doc(token_list(tokens, what='tokens', copy=False)

Token ids as a list of Python ints: `tokens` itself if it already is one and copy
is false, else a new list. TypeError naming `what` and the allowed values for anything
that is not a sequence of ids, or for an id that is a bool or not an integer (e.g.
"tokens[2]: expected an int token id; got float 1.0").
)doc"};

PyMethodDef token_array_def = {"token_array",
                               reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(token_array_fastcall)),
                               METH_FASTCALL, R"doc(token_array(tokens, what='tokens', itemsize=8)

Token ids as an array('q') (itemsize 8; None if an id does not fit int64) or array('i')
(itemsize 4; ValueError naming the id beyond int32), read once in C++ from any buffer
of integers (numpy int arrays, array.array, an integer memoryview) or sequence of ints
(list, tuple, numpy integers). TypeError naming `what` for anything else, a bool
included; bytes, bytearray and str are not token ids.
)doc"};


// Each of `tables` (lists of ids, or anything the token converter reads) as an int32
// array of type `cls` (array.array or a subclass, e.g. BlockIds), made by array's own
// constructor from the ids' bytes: the subclass's Python __new__ does not run.
py::tuple int32_arrays(py::handle cls, py::handle tables) {
  static PyObject* array_type = py::object(py::module_::import("array").attr("array")).release().ptr();  // kept for the process
  if (!PyType_Check(cls.ptr()) || !PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls.ptr()),
                                                    reinterpret_cast<PyTypeObject*>(array_type))) {
    throw py::type_error("cls must be array.array or a subclass of it");
  }
  py::object seq = py::reinterpret_steal<py::object>(PySequence_Fast(tables.ptr(), "tables must be a sequence"));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  newfunc make = reinterpret_cast<PyTypeObject*>(array_type)->tp_new;
  py::tuple out(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    TokenIds<int32_t> ids = read_token_ids<int32_t>(PySequence_Fast_GET_ITEM(seq.ptr(), i), "ids");
    py::bytes raw(reinterpret_cast<const char*>(ids.ids.data()), ids.ids.size() * sizeof(int32_t));
    py::tuple args = py::make_tuple("i", raw);
    PyObject* arr = make(reinterpret_cast<PyTypeObject*>(cls.ptr()), args.ptr(), nullptr);
    if (arr == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), i, arr);
  }
  return out;
}

}  // namespace

void bind_tokens(py::module_& m) {
  for (PyMethodDef* def : {&token_list_def, &token_array_def}) {
    auto fn = py::reinterpret_steal<py::object>(PyCFunction_NewEx(def, nullptr, m.attr("__name__").ptr()));
    if (!fn) throw py::error_already_set();
    m.add_object(def->ml_name, fn);
  }
  m.def("expand_runs", &expand_runs, py::arg("runs"), py::arg("itemsize") = 8,
        "The ids of runs ((start, stop), ...) back to back, as array('q') (itemsize 8) or array('i') (4).");
  m.def("int32_arrays", &int32_arrays, py::arg("cls"), py::arg("tables"),
        "Each table (ids) as an int32 array of type cls (array.array or a subclass: BlockIds), in one call.");
}

}  // namespace prefixcache
