// Python binding of KvIndex: converts block hashes, replica ids and KV events, nothing more.
//
// One converter per kind of argument:
//   a block hash    an int (its low 64 bits) or a digest (bytes: the low 64 bits of its
//                   big-endian value, `int.from_bytes(d, "big") & (2**64 - 1)`, as vLLM
//                   publishes hashes); anything else, bool included, is a TypeError
//   hashes          a sequence of block hashes (list and tuple skip the sequence protocol)
//   packed digests  bytes of digests back to back, `digest_size` bytes each
//   events          a sequence of prefixcache.events BlockStored / BlockRemoved /
//                   AllBlocksCleared, flattened into a KvEventBatch before anything is
//                   applied, so a bad event changes nothing
//   replica         an int in [0, num_replicas) (add_replica: [0, KvIndex.max_replicas))
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "kv_index.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// Big-endian value of the last (up to) 8 bytes: the digest's low 64 bits.
uint64_t low64(const char* data, Py_ssize_t size) {
  uint64_t v = 0;
  for (Py_ssize_t i = size > 8 ? size - 8 : 0; i < size; ++i) v = (v << 8) | static_cast<uint8_t>(data[i]);
  return v;
}

// The hash of `item`, or false for anything but an int (not a bool) or bytes.
bool try_block_hash(PyObject* item, uint64_t& out) {
  if (PyLong_CheckExact(item) || (PyLong_Check(item) && !PyBool_Check(item))) {
    out = PyLong_AsUnsignedLongLongMask(item);
    if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) throw py::error_already_set();
    return true;
  }
  if (PyBytes_Check(item)) {
    out = low64(PyBytes_AS_STRING(item), PyBytes_GET_SIZE(item));
    return true;
  }
  return false;
}

[[noreturn]] void bad_hash(PyObject* item, const std::string& what) {
  throw py::type_error(what + ": expected a block hash (an int, or a digest as bytes); got " + Py_TYPE(item)->tp_name +
                       " " + short_repr(item));
}

uint64_t block_hash(PyObject* item, const std::string& what) {
  uint64_t v;
  if (!try_block_hash(item, v)) bad_hash(item, what);
  return v;
}

// Appends the hashes of `obj` (a sequence of block hashes) to `out`. `what` names the
// argument in errors; it is a function so the label is built only for an error.
template <class What>
void append_hashes(py::handle obj, const What& what, std::vector<uint64_t>& out) {
  PyObject* p = obj.ptr();
  if (PyUnicode_Check(p) || PyBytes_Check(p) || PyByteArray_Check(p)) {
    throw py::type_error(what() + ": expected a sequence of block hashes (a list of ints or digests); got " +
                         Py_TYPE(p)->tp_name);
  }
  py::object seq = py::reinterpret_borrow<py::object>(obj);
  if (!PyList_Check(p) && !PyTuple_Check(p)) {
    seq = py::reinterpret_steal<py::object>(PySequence_Fast(p, "expected a sequence of block hashes"));
    if (!seq) throw py::error_already_set();
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint64_t v;
    if (!try_block_hash(items[i], v)) bad_hash(items[i], what() + "[" + std::to_string(i) + "]");
    out.push_back(v);
  }
}

std::vector<uint64_t> to_hashes(py::handle obj) {
  std::vector<uint64_t> out;
  append_hashes(obj, [] { return std::string("hashes"); }, out);
  return out;
}

std::vector<uint64_t> packed_hashes(py::handle digests, py::handle size) {
  std::string_view bytes = bytes_view(digests, "digests");
  const int64_t ds = saturated_int64(size, "digest_size");
  if (ds < 1 || static_cast<int64_t>(bytes.size()) % ds != 0) {
    throw py::value_error("digest_size must be >= 1 and divide len(digests)=" + std::to_string(bytes.size()) +
                          ", got " + std::to_string(ds));
  }
  std::vector<uint64_t> out(bytes.size() / ds);
  for (size_t i = 0; i < out.size(); ++i) out[i] = low64(bytes.data() + i * ds, ds);
  return out;
}

// The three event classes of prefixcache.events, looked up once (kept for the life of
// the interpreter: a module-level reference outliving it would be torn down too late).
struct EventTypes {
  PyObject* stored;
  PyObject* removed;
  PyObject* cleared;
};

const EventTypes& event_types() {
  static const EventTypes types = [] {
    py::module_ events = py::module_::import("prefixcache.events");
    return EventTypes{py::object(events.attr("BlockStored")).release().ptr(),
                      py::object(events.attr("BlockRemoved")).release().ptr(),
                      py::object(events.attr("AllBlocksCleared")).release().ptr()};
  }();
  return types;
}

bool is_instance(PyObject* obj, PyObject* cls) {
  int r = PyObject_IsInstance(obj, cls);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// The event's kind: its exact class first (the usual case, a pointer compare), then
// subclasses; -1 for anything else.
int event_kind(PyObject* event, const EventTypes& types) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(event));
  if (type == types.stored) return KvEventBatch::kStored;
  if (type == types.removed) return KvEventBatch::kRemoved;
  if (type == types.cleared) return KvEventBatch::kCleared;
  if (is_instance(event, types.stored)) return KvEventBatch::kStored;
  if (is_instance(event, types.removed)) return KvEventBatch::kRemoved;
  if (is_instance(event, types.cleared)) return KvEventBatch::kCleared;
  return -1;
}

// `name` as an interned str, made once: attribute look-ups by it skip building a str.
PyObject* interned(const char* name) {
  PyObject* s = PyUnicode_InternFromString(name);
  if (s == nullptr) throw py::error_already_set();
  return s;  // kept for the life of the interpreter
}

// Whether an event's medium (None: any) is the one the caller tracks (None: every one).
bool same_medium(PyObject* event, py::handle medium) {
  if (medium.is_none()) return true;
  static PyObject* const attr = interned("medium");
  py::object own = py::reinterpret_steal<py::object>(PyObject_GetAttr(event, attr));
  if (!own) throw py::error_already_set();
  if (own.is_none() || own.ptr() == medium.ptr()) return true;
  int r = PyObject_RichCompareBool(own.ptr(), medium.ptr(), Py_EQ);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

KvEventBatch to_event_batch(py::handle events, py::handle medium) {
  if (!medium.is_none() && !PyUnicode_Check(medium.ptr())) {
    throw py::type_error(std::string("medium must be a str or None, got ") + Py_TYPE(medium.ptr())->tp_name);
  }
  const EventTypes& types = event_types();
  py::object seq =
      py::reinterpret_steal<py::object>(PySequence_Fast(events.ptr(), "events must be a sequence of KV events"));
  if (!seq) throw py::error_already_set();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
  PyObject** items = PySequence_Fast_ITEMS(seq.ptr());
  KvEventBatch batch;
  batch.kinds.reserve(n);
  batch.ends.reserve(n);
  batch.hashes.reserve(n);
  static PyObject* const hashes_attr = interned("block_hashes");
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* event = items[i];
    auto where = [i] { return "events[" + std::to_string(i) + "]"; };
    const int kind = event_kind(event, types);
    if (kind < 0) {
      throw py::type_error(where() + ": expected BlockStored, BlockRemoved or AllBlocksCleared; got " +
                           Py_TYPE(event)->tp_name);
    }
    if (!same_medium(event, medium)) {
      ++batch.skipped;
      continue;
    }
    if (kind != KvEventBatch::kCleared) {
      py::object hashes = py::reinterpret_steal<py::object>(PyObject_GetAttr(event, hashes_attr));
      if (!hashes) throw py::error_already_set();
      append_hashes(hashes, [&] { return where() + ".block_hashes"; }, batch.hashes);
      if (batch.hashes.size() > UINT32_MAX) throw py::value_error("events: more than 2**32 block hashes in one call");
    }
    batch.kinds.push_back(static_cast<uint8_t>(kind));
    batch.ends.push_back(static_cast<uint32_t>(batch.hashes.size()));
  }
  return batch;
}

int32_t replica_arg(const KvIndex& index, py::handle obj) {
  const int64_t r = saturated_int64(obj, "replica");
  if (r < 0 || r >= index.num_replicas()) {
    throw py::index_error("replica " + short_repr(obj.ptr()) + " is not in the index (replicas: 0.." +
                          std::to_string(index.num_replicas() - 1) + "; add_replica first)");
  }
  return static_cast<int32_t>(r);
}

// {replica: depth} for every replica holding at least the first block.
py::dict overlaps(const KvIndex& index, const std::vector<uint64_t>& hashes) {
  thread_local std::vector<int32_t> depth;
  index.longest_prefix(hashes, depth);
  py::dict out;
  for (size_t r = 0; r < depth.size(); ++r) {
    if (depth[r] > 0) out[py::int_(r)] = py::int_(depth[r]);
  }
  return out;
}

}  // namespace

void bind_kv_index(py::module_& m) {
  py::class_<KvIndex>(m, "KvIndex", R"doc(
Cluster KV index: block hash -> the replicas holding it, with copies counted.

Replicas are dense ints [0, num_replicas). Block hashes are ints (low 64 bits
taken) or digests (bytes: the low 64 bits of their big-endian value, as vLLM
publishes them). Storing a hash a replica holds already adds a copy; a removal
drops one copy, and the replica holds the block until its last copy goes. A
removal of a hash the replica does not hold is counted (unknown_removed) and
otherwise ignored. Bad arguments raise TypeError/ValueError/IndexError and leave
the index unchanged. Every call holds the GIL: calls from several threads are
serialized, never interleaved.
)doc")
      .def(py::init<>())
      .def_property_readonly_static("max_replicas", [](py::handle) { return KvIndex::kMaxReplicas; })
      .def_property_readonly("num_replicas", &KvIndex::num_replicas)
      .def(
          "add_replica",
          [](KvIndex& index, py::handle r) {
            const int64_t v = saturated_int64(r, "replica");
            if (v < 0 || v >= KvIndex::kMaxReplicas) {
              throw py::value_error("replica must be in [0, " + std::to_string(KvIndex::kMaxReplicas) + "), got " +
                                    short_repr(r.ptr()));
            }
            index.add_replica(static_cast<int32_t>(v));
          },
          py::arg("replica"), "Make replica ids 0..replica valid (new ones hold nothing).")
      .def(
          "clear", [](KvIndex& index, py::handle r) { index.clear(replica_arg(index, r)); }, py::arg("replica"),
          "Drop every block of the replica (O(table)).")
      .def(
          "store",
          [](KvIndex& index, py::handle r, py::handle hashes) {
            index.store(replica_arg(index, r), to_hashes(hashes));
          },
          py::arg("replica"), py::arg("hashes"), "The replica now holds one more copy of each hash.")
      .def(
          "remove",
          [](KvIndex& index, py::handle r, py::handle hashes) {
            index.remove(replica_arg(index, r), to_hashes(hashes));
          },
          py::arg("replica"), py::arg("hashes"), "The replica dropped one copy of each hash.")
      .def(
          "apply",
          [](KvIndex& index, py::handle r, py::handle events, py::handle medium) {
            const int32_t replica = replica_arg(index, r);
            index.apply(replica, to_event_batch(events, medium));
          },
          py::arg("replica"), py::arg("events"), py::arg("medium") = py::none(),
          "Apply the replica's KV events in order; with `medium`, events of another medium\n"
          "(not None and not equal) are skipped and counted.")
      .def(
          "longest_prefix",
          [](const KvIndex& index, py::handle hashes) { return overlaps(index, to_hashes(hashes)); },
          py::arg("hashes"),
          "{replica: blocks} of every replica holding at least the first hash: how many\n"
          "leading hashes of the chain it holds.")
      .def(
          "longest_prefix_packed",
          [](const KvIndex& index, py::handle digests, py::handle digest_size) {
            return overlaps(index, packed_hashes(digests, digest_size));
          },
          py::arg("digests"), py::arg("digest_size"),
          "longest_prefix over digests packed back to back in one bytes, digest_size bytes each.")
      .def(
          "copies_of",
          [](const KvIndex& index, py::handle hash, py::handle r) {
            return index.copies_of(block_hash(hash.ptr(), "hash"), replica_arg(index, r));
          },
          py::arg("hash"), py::arg("replica"), "Copies of the hash the replica holds.")
      .def(
          "blocks", [](const KvIndex& index, py::handle r) { return index.blocks(replica_arg(index, r)); },
          py::arg("replica"), "Distinct block hashes the replica holds.")
      .def(
          "copies", [](const KvIndex& index, py::handle r) { return index.copies(replica_arg(index, r)); },
          py::arg("replica"), "Copies the replica holds (blocks computed twice count twice).")
      .def_property_readonly("num_hashes", &KvIndex::num_hashes, "Distinct hashes held by any replica.")
      .def_property_readonly("num_pairs", &KvIndex::num_pairs, "(hash, replica) pairs held.")
      .def_property_readonly("memory_bytes", &KvIndex::memory_bytes, "Heap bytes the index holds.")
      .def(
          "counters",
          [](const KvIndex& index) {
            const KvIndexCounters& c = index.counters();
            py::dict out;
            out["stored"] = c.stored;
            out["removed"] = c.removed;
            out["unknown_removed"] = c.unknown_removed;
            out["cleared"] = c.cleared;
            out["skipped"] = c.skipped;
            return out;
          },
          "Ingest counters: hashes stored / removed / removed but unknown, clears, skipped events.")
      .def("check_invariants", &KvIndex::check_invariants, "Raise InvariantError naming the first broken invariant.");
  m.def(
      "block_hash_int", [](py::handle hash) { return block_hash(hash.ptr(), "hash"); }, py::arg("hash"),
      "A block hash in the index's int form: an int's low 64 bits, a digest's low 64 bits big-endian.");
}

}  // namespace prefixcache
