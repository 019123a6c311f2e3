// Python binding of token-id checking for backends that keep tokens as Python ints
// (`hash`): converts and checks, nothing more. The rules and messages are py_args.h's.
#include <pybind11/pybind11.h>

#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// Any int: the hash chain encodes ids beyond int64 as CBOR bignums.
constexpr const char* kAnyIntTokenId = "an int token id";

// The ids of `obj` as a list of exact ints: `obj` itself when it already is one (a
// decode step's list costs one type check per id and no copy), else a new list.
py::object token_list(py::handle obj, const std::string& what) {
  py::object seq = token_sequence(obj, what.c_str());
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  Py_ssize_t i = 0;
  while (i < n && PyLong_CheckExact(items[i])) ++i;
  const bool is_list = PyList_Check(seq.ptr());
  if (i == n && is_list) return seq;
  // A list tolist() or the sequence protocol made is ours to edit; the caller's is not.
  const bool ours = is_list && seq.ptr() != obj.ptr();
  py::list out = ours ? py::reinterpret_borrow<py::list>(seq) : py::list(n);
  for (Py_ssize_t j = ours ? i : 0; j < n; ++j) {
    PyObject* index = token_index(items[j], what.c_str(), j, kAnyIntTokenId);
    if (ours) {
      PyList_SetItem(out.ptr(), j, index);  // steals index, drops the numpy scalar
    } else {
      PyList_SET_ITEM(out.ptr(), j, index);  // a fresh list's slots are empty
    }
  }
  return std::move(out);
}

}  // namespace

void bind_tokens(py::module_& m) {
  m.def("token_list", &token_list, py::arg("tokens"), py::arg("what") = "tokens", R"doc(
Token ids as a list of Python ints: `tokens` itself if it already is one, else a new
list (from a tuple, a numpy int array, anything with tolist() or the sequence
protocol; numpy integers become ints). TypeError naming `what` and the allowed
values for anything that is not a sequence of ids, or for an id that is a bool or
not an integer (e.g. "tokens[2]: expected an int token id; got float 1.0").
)doc");
}

}  // namespace prefixcache
