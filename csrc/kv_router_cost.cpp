// KV-router cost. See kv_router_cost.h for the formula and where the policy lives.
#include "kv_router_cost.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace prefixcache {

std::vector<double> kv_router_costs(std::span<const int64_t> prefill_tokens, std::span<const int64_t> active_blocks,
                                    std::span<const int32_t> overlap_blocks,
                                    std::span<const int32_t> active_overlap_blocks, int64_t prompt_tokens,
                                    int64_t block_size, double weight) {
  const size_t n = prefill_tokens.size();
  if (active_blocks.size() != n || overlap_blocks.size() != n || active_overlap_blocks.size() != n) {
    throw std::invalid_argument(
        "prefill_tokens, active_blocks, overlaps and active_overlaps must have one entry per candidate, got " +
        std::to_string(n) + ", " + std::to_string(active_blocks.size()) + ", " + std::to_string(overlap_blocks.size()) +
        " and " + std::to_string(active_overlap_blocks.size()));
  }
  if (block_size < 1) throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  if (prompt_tokens < 0) {
    throw std::invalid_argument("prompt_tokens must be >= 0, got " + std::to_string(prompt_tokens));
  }
  if (!(weight >= 0)) throw std::invalid_argument("weight must be >= 0");
  const double bs = static_cast<double>(block_size);
  const int64_t full_blocks = prompt_tokens / block_size;
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    // Dynamo's order: the prompt whole, then the cached blocks taken off (in blocks).
    const double prefill = static_cast<double>(prefill_tokens[i] + prompt_tokens) / bs -
                           static_cast<double>(overlap_blocks[i]);
    const int64_t new_blocks = std::max<int64_t>(full_blocks - active_overlap_blocks[i], 0);
    out[i] = weight * std::max(prefill, 0.0) + static_cast<double>(active_blocks[i]) + static_cast<double>(new_blocks);
  }
  return out;
}

std::vector<int32_t> lowest(const std::vector<double>& costs) {
  std::vector<int32_t> out;
  if (costs.empty()) return out;
  const double low = *std::min_element(costs.begin(), costs.end());
  for (size_t i = 0; i < costs.size(); ++i) {
    if (costs[i] == low) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

}  // namespace prefixcache
