// Python binding of the KV-router cost: converts load columns and overlaps (bind_columns.h),
// nothing more.
#include <pybind11/pybind11.h>

#include <span>
#include <string>
#include <vector>

#include "bind_columns.h"
#include "kv_router_cost.h"
#include "py_args.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

std::vector<double> costs(py::handle prefill_tokens, py::handle active_blocks, py::handle overlaps,
                          py::handle prompt_tokens, py::handle block_size, double weight, py::handle active_overlaps) {
  const Int64Column prefill(prefill_tokens, "prefill_tokens");
  const Int64Column active(active_blocks, "active_blocks");
  const size_t n = prefill.span().size();
  return kv_router_costs(prefill.span(), active.span(), overlap_column(overlaps, n),
                         overlap_column(active_overlaps, n, "active_overlaps"),
                         saturated_int64(prompt_tokens, "prompt_tokens"), saturated_int64(block_size, "block_size"),
                         weight);
}

}  // namespace

void bind_kv_router_cost(py::module_& m) {
  const char* args_doc = R"doc(
prefill_tokens, active_blocks: one entry per candidate (int64 columns); overlaps:
{candidate position: blocks of the prompt cached there}; prompt_tokens (TOKENS),
block_size (TOKENS per block), weight (Dynamo's overlap_score_weight); active_overlaps:
{candidate position: blocks of the prompt among its active blocks}, None for none.)doc";
  m.def(
      "kv_router_costs",
      [](py::handle prefill, py::handle active, py::handle overlaps, py::handle prompt, py::handle bs, double weight,
         py::handle active_overlaps) {
        return to_list(costs(prefill, active, overlaps, prompt, bs, weight, active_overlaps));
      },
      py::arg("prefill_tokens"), py::arg("active_blocks"), py::arg("overlaps"), py::arg("prompt_tokens"),
      py::arg("block_size"), py::arg("weight"), py::arg("active_overlaps") = py::none(),
      (std::string("Dynamo's KV-router cost of each candidate: weight * max((prefill_tokens + P) / B -\n"
                   "overlap, 0) + active_blocks + max(floor(P / B) - active_overlap, 0).") +
       args_doc)
          .c_str());
  m.def(
      "kv_router_lowest",
      [](py::handle prefill, py::handle active, py::handle overlaps, py::handle prompt, py::handle bs, double weight,
         py::handle active_overlaps) {
        return to_list(lowest(costs(prefill, active, overlaps, prompt, bs, weight, active_overlaps)));
      },
      py::arg("prefill_tokens"), py::arg("active_blocks"), py::arg("overlaps"), py::arg("prompt_tokens"),
      py::arg("block_size"), py::arg("weight"), py::arg("active_overlaps") = py::none(),
      (std::string("The candidate positions tied at the lowest kv_router_costs, ascending.") + args_doc).c_str());
}

}  // namespace prefixcache
