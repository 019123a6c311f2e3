// Python binding of token-id checking for backends that keep tokens as Python ints
// (`hash`): converts and checks, nothing more. The rules and messages are py_args.h's.
#include <pybind11/pybind11.h>

#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// Any int: the hash chain encodes ids beyond int64 as CBOR bignums.
constexpr const char* kAnyIntTokenId = "an int token id";

// The ids of `obj` as a list of exact ints: `obj` itself when it already is one and
// `copy` is false (a decode step's list costs one type check per id), else a list of
// our own; a copy checks each id as it takes its reference, in the same pass.
py::object token_list(py::handle obj, const char* what, bool copy) {
  py::object seq = token_sequence(obj, what);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  // A list tolist() or the sequence protocol made is ours to edit; the caller's is not.
  const bool ours = PyList_Check(seq.ptr()) && seq.ptr() != obj.ptr();
  if (ours || (!copy && PyList_Check(seq.ptr()))) {
    Py_ssize_t i = 0;
    while (i < n && PyLong_CheckExact(items[i])) ++i;
    if (i == n) return seq;
    if (ours) {
      for (; i < n; ++i) {
        if (!PyLong_CheckExact(items[i])) PyList_SetItem(seq.ptr(), i, token_index(items[i], what, i, kAnyIntTokenId));
      }
      return seq;
    }
  }
  py::list out(n);  // its slots start empty; a throw part-way frees what was set
  for (Py_ssize_t i = 0; i < n; ++i) PyList_SET_ITEM(out.ptr(), i, token_index(items[i], what, i, kAnyIntTokenId));
  return std::move(out);
}

// token_list(tokens, what="tokens", copy=False) as a METH_FASTCALL function: `hash` calls it on
// every decode step, where pybind11's argument dispatch would cost more than the check.
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

PyMethodDef token_list_def = {"token_list",
                              reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(token_list_fastcall)),
                              METH_FASTCALL, R"doc(token_list(tokens, what='tokens', copy=False)

Token ids as a list of Python ints: `tokens` itself if it already is one and copy
is false, else a new list (from a tuple, a numpy int array, anything with tolist() or the sequence
protocol; numpy integers become ints). TypeError naming `what` and the allowed
values for anything that is not a sequence of ids, or for an id that is a bool or
not an integer (e.g. "tokens[2]: expected an int token id; got float 1.0").
)doc"};

}  // namespace

void bind_tokens(py::module_& m) {
  auto fn = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&token_list_def, nullptr, m.attr("__name__").ptr()));
  if (!fn) throw py::error_already_set();
  m.add_object("token_list", fn);
}

}  // namespace prefixcache
