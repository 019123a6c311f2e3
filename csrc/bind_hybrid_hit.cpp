// Python binding of the hybrid hit finder: converts the layout's groups once, at
// construction, and each call's digests and rows, nothing more.
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "block_pool.h"
#include "hybrid_hit.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

std::vector<HitGroup> to_groups(py::handle groups) {
  std::vector<HitGroup> out;
  for (py::handle item : groups) {
    if (!py::isinstance<py::tuple>(item) || py::len(item) != 4) {
      throw py::type_error("groups: each group is (kind, window_blocks, chunk, suffix)");
    }
    auto fields = py::reinterpret_borrow<py::tuple>(item);
    const int64_t kind = saturated_int64(fields[0], "groups: kind");
    if (kind < 0 || kind > 3) throw py::value_error("groups: kind must be 0-3, got " + std::to_string(kind));
    HitGroup g;
    g.kind = static_cast<HitKind>(kind);
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

py::list to_rows(const std::vector<std::vector<int32_t>>& rows) {
  py::list out(rows.size());
  for (size_t g = 0; g < rows.size(); ++g) {
    py::list row(rows[g].size());
    for (size_t i = 0; i < rows[g].size(); ++i) PyList_SET_ITEM(row.ptr(), i, PyLong_FromLong(rows[g][i]));
    PyList_SET_ITEM(out.ptr(), g, row.release().ptr());
  }
  return out;
}

}  // namespace

void bind_hybrid_hit(py::module_& m) {
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
            return py::make_tuple(hit.length, hit.junction, to_rows(hit.rows));
          },
          py::arg("pool"), py::arg("digests"), py::arg("max_length"),
          "(hit TOKENS, junction TOKENS or 0, per group its hit blocks with -1 where it skips one) for the "
          "packed block hashes `digests`, at most max_length TOKENS.")
      .def_property_readonly("last_probes", &HybridHitFinder::last_probes,
                             "Single-block look-ups the last find made (a window's or a state's).");
}

}  // namespace prefixcache
