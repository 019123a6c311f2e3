// Python binding of the estimated-TTFT cost: converts load columns and overlaps
// (bind_columns.h) and the service model's rates, nothing more.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "bind_columns.h"
#include "py_args.h"
#include "ttft_cost.h"

namespace py = pybind11;

namespace prefixcache {
namespace {

std::vector<double> costs(py::handle prefill_tokens, py::handle num_requests, py::handle queued_requests,
                          py::handle overlaps, py::handle prompt_tokens, py::handle block_size, double token_s,
                          double pair_s, double weights_s, double overhead_s, py::handle budget, double load_weight,
                          double decode_weight, double decode_cap_s, std::vector<int32_t>* overlap_out = nullptr,
                          std::vector<double>* ttfts = nullptr) {
  const Int64Column prefill(prefill_tokens, "prefill_tokens");
  const Int64Column requests(num_requests, "num_requests");
  const Int64Column queued(queued_requests, "queued_requests");
  const TtftModel model{token_s,     pair_s,        weights_s,   overhead_s, saturated_int64(budget, "budget"),
                        load_weight, decode_weight, decode_cap_s};
  std::vector<int32_t> overlap = overlap_column(overlaps, prefill.span().size());
  std::vector<double> out = estimated_ttft_costs(prefill.span(), requests.span(), queued.span(), overlap,
                                                 saturated_int64(prompt_tokens, "prompt_tokens"),
                                                 saturated_int64(block_size, "block_size"), model, ttfts);
  if (overlap_out != nullptr) *overlap_out = std::move(overlap);
  return out;
}

}  // namespace

void bind_ttft_cost(py::module_& m) {
  m.def(
      "estimated_ttft_costs",
      [](py::handle prefill, py::handle requests, py::handle queued, py::handle overlaps, py::handle prompt,
         py::handle bs, double token_s, double pair_s, double weights_s, double overhead_s, py::handle budget,
         double load_weight, double decode_weight, double decode_cap_s, bool with_ttft) -> py::object {
        std::vector<double> ttfts;
        const std::vector<double> values = costs(prefill, requests, queued, overlaps, prompt, bs, token_s, pair_s,
                                                 weights_s, overhead_s, budget, load_weight, decode_weight,
                                                 decode_cap_s, nullptr, with_ttft ? &ttfts : nullptr);
        if (with_ttft) return py::make_tuple(to_list(values), to_list(ttfts));
        return to_list(values);
      },
      py::arg("prefill_tokens"), py::arg("num_requests"), py::arg("queued_requests"), py::arg("overlaps"),
      py::arg("prompt_tokens"), py::arg("block_size"), py::arg("token_s"), py::arg("pair_s"), py::arg("weights_s"),
      py::arg("overhead_s"), py::arg("budget"), py::arg("load_weight"), py::arg("decode_weight") = 0.0,
      py::arg("decode_cap_s") = std::numeric_limits<double>::infinity(), py::kw_only(),
      py::arg("with_ttft") = false,
      R"doc(The estimated-TTFT router's cost of each candidate, SECONDS (csrc/ttft_cost.h):
its estimated TTFT there plus load_weight x its own prefill time plus decode_weight x the
requests running there x its own prefill time up to decode_cap_s. with_ttft: a pair, the
costs and each candidate's estimated TTFT alone.

prefill_tokens, num_requests, queued_requests: one entry per candidate (int64 columns);
overlaps: {candidate position: blocks of the prompt cached there}; prompt_tokens and
block_size (TOKENS); token_s, pair_s, weights_s, overhead_s, budget: the service model's
rates (SECONDS per token, per query-key pair, for the weights, per step; TOKENS a step
takes); load_weight, decode_weight, decode_cap_s: the charges' weights and cap.)doc");
  m.def(
      "estimated_ttft_lowest",
      [](py::handle prefill, py::handle requests, py::handle queued, py::handle overlaps, py::handle prompt,
         py::handle bs, double token_s, double pair_s, double weights_s, double overhead_s, py::handle budget,
         double load_weight, double decode_weight, double decode_cap_s, double stick_s, double stick_ttft_s) {
        std::vector<int32_t> overlap;
        std::vector<double> ttfts;
        const std::vector<double> values = costs(prefill, requests, queued, overlaps, prompt, bs, token_s, pair_s,
                                                 weights_s, overhead_s, budget, load_weight, decode_weight,
                                                 decode_cap_s, &overlap, &ttfts);
        return to_list(estimated_ttft_choice(values, overlap, saturated_int64(prompt, "prompt_tokens"),
                                             saturated_int64(bs, "block_size"), stick_s, ttfts, stick_ttft_s));
      },
      py::arg("prefill_tokens"), py::arg("num_requests"), py::arg("queued_requests"), py::arg("overlaps"),
      py::arg("prompt_tokens"), py::arg("block_size"), py::arg("token_s"), py::arg("pair_s"), py::arg("weights_s"),
      py::arg("overhead_s"), py::arg("budget"), py::arg("load_weight"), py::arg("decode_weight") = 0.0,
      py::arg("decode_cap_s") = std::numeric_limits<double>::infinity(), py::arg("stick_s") = 0.0,
      py::arg("stick_ttft_s") = std::numeric_limits<double>::infinity(),
      R"doc(The candidate positions chosen from estimated_ttft_costs, ascending (one native call
per decision: the costs never become Python floats): those tied at the lowest cost, or,
with stick_s SECONDS > 0, the holders of the prompt's longest cached run at their lowest
cost where that is within stick_s of the lowest and their estimated TTFT at most
stick_ttft_s SECONDS (estimated_ttft_choice).)doc");
  m.def(
      "estimated_ttft_choice",
      [](const std::vector<double>& costs, py::handle overlaps, py::handle prompt, py::handle bs, double stick_s,
         const std::vector<double>& ttfts, double stick_ttft_s) {
        return to_list(estimated_ttft_choice(costs, overlap_column(overlaps, costs.size()),
                                             saturated_int64(prompt, "prompt_tokens"),
                                             saturated_int64(bs, "block_size"), stick_s, ttfts, stick_ttft_s));
      },
      py::arg("costs"), py::arg("overlaps"), py::arg("prompt_tokens"), py::arg("block_size"), py::arg("stick_s"),
      py::arg("ttfts") = std::vector<double>{}, py::arg("stick_ttft_s") = std::numeric_limits<double>::infinity(),
      R"doc(estimated_ttft_lowest's choice over costs already computed (SECONDS, one per
candidate), {candidate position: cached BLOCKS of the prompt} and, where stick_ttft_s is
finite, each candidate's estimated TTFT (SECONDS).)doc");
}

}  // namespace prefixcache
