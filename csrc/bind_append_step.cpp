// append_step: a request's append in one native call, for the outcome nearly every
// decode step has (the tokens fit the table, or a fresh block does).
//
// Owns the arithmetic a blockwise append shares across backends: read the new ids
// once (the one converter, token_ids.h), append them to the request's buffer, see
// whether its table needs blocks for them, and if the pool can give them without
// eviction, add them. Where it cannot (eviction, a backend's own rule for chunks) it
// says how many ids it appended and the backend allocates the general way in Python;
// ids beyond int64, or a request that keeps its ids in a list, it leaves alone.
//
// Never does: evict, record events or stats, or decide what is cached. Errors are the
// converter's, raised before anything changed.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <utility>
#include <vector>
#include <string>

#include "block_pool.h"
#include "py_args.h"
#include "token_buffer.h"
#include "token_ids.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// The ids of a token argument, read for a buffer of `itemsize` bytes per id: `count`
// of them at `data`. A single exact int (a decode step) is read without a vector.
struct NewIds {
  int64_t one = 0;
  PyObject* one_object = nullptr;  // the exact int itself, borrowed from the argument
  TokenIds<int32_t> narrow;
  TokenIds<int64_t> wide;
  size_t count = 0;
  bool representable = true;  // false: an id beyond int64 (the caller keeps a list)

  NewIds(PyObject* tokens, Py_ssize_t itemsize) {
    if ((PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) && Py_SIZE(tokens) == 1) {
      PyObject* item = PyList_CheckExact(tokens) ? PyList_GET_ITEM(tokens, 0) : PyTuple_GET_ITEM(tokens, 0);
      if (PyLong_CheckExact(item)) {
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow == 0 && !(v == -1 && PyErr_Occurred()) && (itemsize == 8 || (v >= INT32_MIN && v <= INT32_MAX))) {
          one = v;
          one_object = item;
          count = 1;
          return;
        }
        PyErr_Clear();  // out of range: the converter below words the error (or says beyond int64)
      }
    }
    if (itemsize == 4) {
      narrow = read_token_ids<int32_t>(tokens, "tokens");
      count = narrow.ids.size();
    } else {
      wide = read_token_ids<int64_t>(tokens, "tokens");
      count = wide.ids.size();
      representable = wide.complete();
    }
  }

  void append_to(PyObject* buffer, Py_ssize_t itemsize) const {
    if (one_object != nullptr) {
      append_id(buffer, one_object);
    } else if (itemsize == 4) {
      append_ids(buffer, narrow.ids.data(), narrow.ids.size() * 4);
    } else {
      append_ids(buffer, wide.ids.data(), wide.ids.size() * 8);
    }
  }
};

int64_t positive(PyObject* obj, const char* what) {
  const int64_t v = saturated_int64(obj, what);
  if (v < 0) throw py::value_error(std::string(what) + ": expected an int >= 0; got " + std::to_string(v));
  return v;
}

// append_step(buffer, tokens, table, block_size, pool, min_free, max_tokens)
PyObject* append_step_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7) {
    PyErr_SetString(PyExc_TypeError,
                    "append_step takes (buffer, tokens, table, block_size, pool, min_free, max_tokens), positionally");
    return nullptr;
  }
  try {
    PyObject* buffer = args[0];
    PyObject* table = args[2];
    Py_ssize_t itemsize = 0, length = 0;
    if (!PyList_CheckExact(table) || !int_buffer_shape(buffer, itemsize, length)) Py_RETURN_NONE;
    const int64_t block_size = positive(args[3], "block_size");
    if (block_size == 0) throw py::value_error("block_size: expected an int >= 1; got 0");
    BlockPool* pool = args[4] == Py_None ? nullptr : py::handle(args[4]).cast<BlockPool*>();
    const int64_t min_free = positive(args[5], "min_free");
    const int64_t max_tokens = positive(args[6], "max_tokens");

    const NewIds ids(args[1], itemsize);
    if (!ids.representable) Py_RETURN_NONE;
    // The ids are read once (a token object's __index__ runs once) and appended whatever
    // the table needs: a caller that allocates the general way continues from here.
    ids.append_to(buffer, itemsize);
    const int64_t total = static_cast<int64_t>(length) + static_cast<int64_t>(ids.count);
    const int64_t needed = (total + block_size - 1) / block_size - static_cast<int64_t>(PyList_GET_SIZE(table));
    const int64_t free_blocks = pool != nullptr ? pool->num_free() : 0;
    if ((max_tokens > 0 && ids.count > static_cast<size_t>(max_tokens)) || (needed > 0 && pool == nullptr) ||
        free_blocks < std::max<int64_t>(needed, pool != nullptr ? min_free : 0)) {
      return PyLong_FromSize_t(ids.count);
    }
    py::list added(needed > 0 ? needed : 0);  // its slots start empty; a throw frees what was set
    if (needed > 0) {
      // Checked above: the pool has them, so allocation succeeds. One block (a decode
      // step's) is taken without a vector; more in one allocate, so last_removed() lists all.
      std::vector<int32_t> many;
      if (needed > 1) many = std::move(*pool->allocate(needed));
      for (int64_t i = 0; i < needed; ++i) {
        PyObject* id = PyLong_FromLong(needed == 1 ? pool->allocate_one() : many[i]);
        if (id == nullptr || PyList_Append(table, id) != 0) {
          Py_XDECREF(id);
          throw py::error_already_set();
        }
        PyList_SET_ITEM(added.ptr(), i, id);  // the list's own reference; the table holds another
      }
    }
    return added.release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef append_step_def = {
    "append_step", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(append_step_fastcall)), METH_FASTCALL,
    R"doc(append_step(buffer, tokens, table, block_size, pool, min_free, max_tokens)

A request's append in one call when it needs no eviction. `buffer` is the request's
array('i') or array('q') of token ids, `tokens` the new ids (read once, as token_array
reads them), `table` its block table (a list of block ids), `block_size` in TOKENS.
The ids are appended to `buffer`; then the blocks the table lacks for the new length
are taken from `pool`'s free blocks if `pool` is given, it has them and `min_free`
besides, and the step took at most `max_tokens` ids (0: any number). Returns the block
ids added to `table` (a new list, often empty): the append is done. Returns the number
of ids appended when the table still lacks blocks (or the step had more ids than
`max_tokens`): the caller allocates them the general way, and takes the ids back if it
cannot. Returns None with nothing changed for an id beyond int64, or when `buffer` is
not such an array (the caller keeps its ids in a list). The converter's errors are
raised before anything changed.
)doc"};

}  // namespace

void bind_append_step(py::module_& m) {
  auto fn = py::reinterpret_steal<py::object>(PyCFunction_NewEx(&append_step_def, nullptr, m.attr("__name__").ptr()));
  if (!fn) throw py::error_already_set();
  m.add_object(append_step_def.ml_name, fn);
}

}  // namespace prefixcache
