// Python binding of the hybrid hit finder and admitter: converts the layout's groups
// once, at construction, and each call's digests and rows, nothing more. The rows a
// find returns stay native (`HitRows`) until Python reads one, so the admitter takes
// them back without a conversion either way.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "hybrid_admit.h"
#include "hybrid_hit.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

// One layout group: a tuple of `shape`'s arity whose first field is a kind (0-3).
std::pair<HitKind, py::tuple> group_fields(py::handle item, size_t arity, const char* shape) {
  if (!py::isinstance<py::tuple>(item) || py::len(item) != arity) {
    throw py::type_error(std::string("groups: each group is ") + shape);
  }
  auto fields = py::reinterpret_borrow<py::tuple>(item);
  const int64_t kind = saturated_int64(fields[0], "groups: kind");
  if (kind < 0 || kind > 3) throw py::value_error("groups: kind must be 0-3, got " + std::to_string(kind));
  return {static_cast<HitKind>(kind), fields};
}

std::vector<HitGroup> to_groups(py::handle groups) {
  std::vector<HitGroup> out;
  for (py::handle item : groups) {
    auto [kind, fields] = group_fields(item, 4, "(kind, window_blocks, chunk, suffix)");
    HitGroup g;
    g.kind = kind;
    g.window_blocks = saturated_int64(fields[1], "groups: window_blocks");
    g.chunk = saturated_int64(fields[2], "groups: chunk");
    g.suffix = std::string(bytes_view(fields[3], "groups: suffix"));
    out.push_back(std::move(g));
  }
  return out;
}

std::vector<std::vector<int>> to_spec_groups(py::handle spec_groups) {
  std::vector<std::vector<int>> out;
  for (py::handle ids : spec_groups) {
    std::vector<int> members;
    for (py::handle g : ids) members.push_back(static_cast<int>(checked_int64(g, "spec_groups")));
    out.push_back(std::move(members));
  }
  return out;
}

std::vector<AdmitGroup> to_admit_groups(py::handle groups) {
  std::vector<AdmitGroup> out;
  for (py::handle item : groups) {
    auto [kind, fields] = group_fields(item, 3, "(kind, window, chunk)");
    out.push_back({kind, saturated_int64(fields[1], "groups: window"), saturated_int64(fields[2], "groups: chunk")});
  }
  return out;
}

// A find's per-group hit blocks, held as found: a read-only sequence of rows to Python
// (each read converts one row to a list of ints).
struct HitRows {
  std::vector<std::vector<int32_t>> rows;
};

// Rows of block ids (-1: a block a group skips) from Python lists.
std::vector<std::vector<int32_t>> from_rows(py::handle rows) {
  std::vector<std::vector<int32_t>> out;
  for (py::handle row : rows) {
    std::vector<int64_t> ids = to_ids(row);
    std::vector<int32_t> narrow(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < -1 || ids[i] > INT32_MAX) {
        throw py::value_error("rows: block id " + std::to_string(ids[i]) + " is neither -1 nor a block");
      }
      narrow[i] = static_cast<int32_t>(ids[i]);
    }
    out.push_back(std::move(narrow));
  }
  return out;
}

py::list to_rows(const std::vector<std::vector<int32_t>>& rows) {
  py::list out(rows.size());
  for (size_t g = 0; g < rows.size(); ++g) PyList_SET_ITEM(out.ptr(), g, to_list(rows[g]).release().ptr());
  return out;
}

}  // namespace

void bind_hybrid_hit(py::module_& m) {
  py::class_<HitRows>(m, "HitRows",
                      "Per layout group, the blocks of a hybrid hit (-1 where the group skips one), as "
                      "HybridHitFinder.find found them: a read-only sequence of lists of ints.")
      .def("__len__", [](const HitRows& r) { return r.rows.size(); })
      .def("__getitem__",
           [](const HitRows& r, py::handle index) {
             int64_t g = checked_int64(index, "index");
             const auto n = static_cast<int64_t>(r.rows.size());
             if (g < 0) g += n;
             if (g < 0 || g >= n) throw py::index_error("HitRows index out of range");
             return to_list(r.rows[static_cast<size_t>(g)]);
           })
      .def("tolist", [](const HitRows& r) { return to_rows(r.rows); }, "Every row, as a list of lists.")
      .def(
          "__eq__",
          [](const HitRows& r, py::handle other) -> py::object {
            if (py::isinstance<HitRows>(other)) return py::bool_(r.rows == other.cast<const HitRows&>().rows);
            if (!PySequence_Check(other.ptr()) || PyUnicode_Check(other.ptr()) || PyBytes_Check(other.ptr())) {
              return py::reinterpret_borrow<py::object>(Py_NotImplemented);
            }
            return py::bool_(to_rows(r.rows).equal(py::list(py::reinterpret_borrow<py::object>(other))));
          },
          py::is_operator())
      .def("__repr__", [](const HitRows& r) { return "HitRows(" + py::repr(to_rows(r.rows)).cast<std::string>() + ")"; });
  py::class_<HybridHitFinder>(m, "HybridHitFinder",
                              "A hybrid layout's reconciled hit over a BlockPool's index (csrc/hybrid_hit.h).")
      .def(py::init([](py::handle groups, py::handle spec_groups, bool single_pass, py::handle block_size,
                       py::handle digest_size) {
             return HybridHitFinder(to_groups(groups), to_spec_groups(spec_groups), single_pass,
                                    saturated_int64(block_size, "block_size"),
                                    saturated_int64(digest_size, "digest_size"));
           }),
           py::arg("groups"), py::arg("spec_groups"), py::arg("single_pass"), py::arg("block_size"),
           py::arg("digest_size"),
           "groups: per layout group (kind 0 full / 1 sliding window / 2 chunked local / 3 mamba, window "
           "BLOCKS, chunk TOKENS, key suffix); spec_groups: group indices looked up together, in order.")
      .def(
          "find",
          [](HybridHitFinder& f, const BlockPool& pool, py::handle digests, py::handle max_length) {
            ByteBuffer packed(digests, "digests");
            HybridHit hit = f.find(pool, packed.view(), saturated_int64(max_length, "max_length"));
            return py::make_tuple(hit.length, hit.junction, HitRows{std::move(hit.rows)});
          },
          py::arg("pool"), py::arg("digests"), py::arg("max_length"),
          "(hit TOKENS, junction TOKENS or 0, HitRows: per group its hit blocks with -1 where it skips one) "
          "for the packed block hashes `digests`, at most max_length TOKENS.")
      .def_property_readonly("last_probes", &HybridHitFinder::last_probes,
                             "Single-block look-ups the last find made (a window's or a state's).");

  py::class_<HybridAdmitter>(m, "HybridAdmitter",
                             "A new request's blocks in a hybrid layout (csrc/hybrid_admit.h).")
      .def(py::init([](py::handle groups, py::handle block_size) {
             return HybridAdmitter(to_admit_groups(groups), saturated_int64(block_size, "block_size"));
           }),
           py::arg("groups"), py::arg("block_size"),
           "groups: per layout group (kind 0 full / 1 sliding window / 2 chunked local / 3 mamba, window "
           "TOKENS, chunk TOKENS).")
      .def(
          "admit",
          [](const HybridAdmitter& a, BlockPool& pool, py::handle rows, py::handle hit, py::handle num_tokens,
             py::handle first_end, py::handle free) -> py::object {
            std::vector<std::vector<int32_t>> converted;
            const bool found = py::isinstance<HitRows>(rows);
            if (!found) converted = from_rows(rows);
            auto got = a.admit(pool, found ? rows.cast<const HitRows&>().rows : converted, saturated_int64(hit, "hit"),
                               saturated_int64(num_tokens, "num_tokens"), saturated_int64(first_end, "first_end"),
                               saturated_int64(free, "free"));
            if (!got) return py::none();
            auto optional = [](const std::vector<int64_t>& values) {
              py::list out(values.size());
              for (size_t i = 0; i < values.size(); ++i) {
                PyList_SET_ITEM(out.ptr(), i, values[i] < 0 ? py::none().release().ptr() : PyLong_FromLongLong(values[i]));
              }
              return out;
            };
            return py::make_tuple(to_rows(got->tables), optional(got->num_cached), optional(got->last_state),
                                  got->took_blocks);
          },
          py::arg("pool"), py::arg("rows"), py::arg("hit"), py::arg("num_tokens"), py::arg("first_end"),
          py::arg("free"),
          "(per group its table, its num_cached or None, its last state entry or None, whether blocks were "
          "taken), or None without room: a request of num_tokens TOKENS with a hit of `hit` TOKENS in `rows` "
          "(a find's HitRows, or lists of ints), "
          "its first chunk ending at first_end TOKENS, `free` blocks available to it.");
}

}  // namespace prefixcache
