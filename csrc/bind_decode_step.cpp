// A decode step's bookkeeping in one native call each, for the outcomes nearly every
// step has: append_step (the new ids and, if the pool has one free, the block they
// start) and commit_blocks (hash the request's newly full blocks and index them).
//
// append_step owns the arithmetic a blockwise append shares across backends: read the
// new ids once (the one converter, token_ids.h), append them to the request's buffer,
// see whether its table needs blocks for them, and if the pool can give them without
// eviction, add them. Where it cannot (eviction, a backend's own rule for chunks) it
// says how many ids it appended and the backend allocates the general way in Python;
// ids beyond int64, or a request that keeps its ids in a list, it leaves alone.
//
// commit_blocks is the `hash` backend's commit when caching a block is the chain and
// the pool's index and nothing else (no hit verification, eviction policy, events or
// namespace to carry): the chain extended from the request's last digest (hashing.h),
// then the blocks keyed in the pool (all or nothing), in one call.
//
// Never does: evict, record events or stats, or decide what is cached. Errors are the
// converter's or the pool's, raised before the pool or the table changed.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <span>
#include <utility>
#include <vector>
#include <string>

#include "block_pool.h"
#include "hashing.h"
#include "py_args.h"
#include "token_buffer.h"
#include "token_ids.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// The ids of a token argument, read for a buffer of `itemsize` bytes per id: `count` of
// them. A single exact int in range (a decode step's) is kept as the object itself, read
// without a vector; anything else goes through the one converter.
struct NewIds {
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
  // An exact int that fits (every call's block size and counts) without pybind11.
  int overflow = 0;
  const int64_t v = PyLong_CheckExact(obj) ? PyLong_AsLongLongAndOverflow(obj, &overflow) : saturated_int64(obj, what);
  if (overflow != 0) return saturated_int64(obj, what);
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

// The request's int64 ids in place: an array('q') (or 'l' of 8 bytes) held for the
// call, so it cannot be resized; the call runs no Python code and keeps the GIL.
class Int64s {
 public:
  explicit Int64s(PyObject* obj) {
    if (PyList_Check(obj) || !PyObject_CheckBuffer(obj)) return;
    if (PyObject_GetBuffer(obj, &view_, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      return;
    }
    const char f = view_.format != nullptr ? view_.format[0] : 'B';
    held_ = true;
    ok_ = view_.ndim == 1 && view_.itemsize == 8 && (f == 'q' || f == 'l') && view_.format[1] == '\0';
  }
  ~Int64s() {
    if (held_) PyBuffer_Release(&view_);
  }
  Int64s(const Int64s&) = delete;
  Int64s& operator=(const Int64s&) = delete;

  bool ok() const { return ok_; }
  std::span<const int64_t> span() const {
    return {static_cast<const int64_t*>(view_.buf), static_cast<size_t>(view_.shape[0])};
  }

 private:
  Py_buffer view_{};
  bool held_ = false;
  bool ok_ = false;
};

// commit_blocks(pool, digests, tokens, table, start, stop, block_size, algorithm, root)
PyObject* commit_blocks_fastcall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError,
                    "commit_blocks takes (pool, digests, tokens, table, start, stop, block_size, algorithm, root), "
                    "positionally");
    return nullptr;
  }
  try {
    BlockPool& pool = py::handle(args[0]).cast<BlockPool&>();
    PyObject* digests = args[1];
    PyObject* table = args[3];
    if (!PyByteArray_CheckExact(digests)) throw py::type_error("commit_blocks: digests must be a bytearray");
    if (!PyList_CheckExact(table)) throw py::type_error("commit_blocks: table must be a list");
    const int64_t start = positive(args[4], "start");
    const int64_t stop = positive(args[5], "stop");
    const int64_t block_size = positive(args[6], "block_size");
    if (!PyUnicode_Check(args[7])) throw py::type_error("commit_blocks: algorithm must be a str");
    const HashAlgorithm algorithm = parse_hash_algorithm(PyUnicode_AsUTF8(args[7]));
    const std::string_view root = bytes_view(args[8], "root");
    const size_t ds = digest_size(algorithm);
    if (block_size == 0 || start > stop || stop > PyList_GET_SIZE(table) || root.size() != ds) {
      throw py::value_error("commit_blocks: need 1 <= block_size, start <= stop <= len(table), a root digest");
    }
    const Int64s tokens(args[2]);
    if (!tokens.ok()) Py_RETURN_FALSE;  // ids beyond int64 kept in a list: the general way
    const auto num_hashed = static_cast<int64_t>(static_cast<size_t>(PyByteArray_GET_SIZE(digests)) / ds);
    if (static_cast<int64_t>(tokens.span().size()) < stop * block_size || num_hashed < start) {
      throw py::value_error("commit_blocks: the request has fewer full blocks or digests than asked");
    }
    // The chain of the blocks not hashed yet, from the last digest the request has.
    std::string chained;
    if (num_hashed < stop) {
      const char* have = PyByteArray_AS_STRING(digests);
      const std::string parent = num_hashed > 0 ? std::string(have + (num_hashed - 1) * ds, ds) : std::string(root);
      chain_digests(algorithm, parent, tokens.span().subspan(num_hashed * block_size, (stop - num_hashed) * block_size),
                    block_size, std::nullopt, std::nullopt, chained);
    }
    std::vector<int64_t> ids(static_cast<size_t>(stop - start));
    for (int64_t i = start; i < stop; ++i) {
      PyObject* id = PyList_GET_ITEM(table, i);
      ids[i - start] = PyLong_AsLongLong(id);
      if (ids[i - start] == -1 && PyErr_Occurred()) throw py::error_already_set();
    }
    // Keys: the digests the request has from `start`, then the ones just chained.
    std::string keys(PyByteArray_AS_STRING(digests) + start * ds, PyByteArray_AS_STRING(digests) + std::min(num_hashed, stop) * ds);
    keys += chained;
    if (!chained.empty()) {
      // The request's hashes first, as the Python path grows them: they are its chain
      // whether or not the pool then takes the keys.
      const Py_ssize_t had = PyByteArray_GET_SIZE(digests);
      if (PyByteArray_Resize(digests, had + static_cast<Py_ssize_t>(chained.size())) != 0) throw py::error_already_set();
      std::memcpy(PyByteArray_AS_STRING(digests) + had, chained.data(), chained.size());
    }
    pool.cache_many_packed(ids, keys, static_cast<int64_t>(ds));  // all or nothing
    Py_RETURN_TRUE;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef commit_blocks_def = {
    "commit_blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(commit_blocks_fastcall)), METH_FASTCALL,
    R"doc(commit_blocks(pool, digests, tokens, table, start, stop, block_size, algorithm, root)

Blocks [start, stop) of a `hash` request's table cached in one call: `digests` (a
bytearray of the request's packed block hashes) is extended with the chain of the
blocks it lacks up to `stop` (from its last digest, or `root` for block 0; no extra
keys: a request without a namespace), over `tokens` (the request's array('q'), read
in place), then `pool` keys table[start:stop] with digests[start:stop] (all or
nothing). `block_size` in TOKENS. True when done; False, nothing changed, if `tokens`
is not such an array (the caller caches the general way). Bad arguments (too few
tokens or digests) raise before anything changed; a block the pool refuses (not in
use, already keyed) raises with the pool unchanged and `digests` grown by the chain,
as the Python path leaves them.
)doc"};

}  // namespace

void bind_decode_step(py::module_& m) {
  for (PyMethodDef* def : {&append_step_def, &commit_blocks_def}) {
    auto fn = py::reinterpret_steal<py::object>(PyCFunction_NewEx(def, nullptr, m.attr("__name__").ptr()));
    if (!fn) throw py::error_already_set();
    m.add_object(def->ml_name, fn);
  }
}

}  // namespace prefixcache
