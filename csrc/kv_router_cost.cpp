// KV-router cost. See kv_router_cost.h for the formula and where the policy lives.
#include "kv_router_cost.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace prefixcache {

std::vector<double> kv_router_costs(std::span<const int64_t> prefill_tokens, std::span<const int64_t> active_blocks,
                                    std::span<const int32_t> overlap_blocks, int64_t prompt_tokens, int64_t block_size,
                                    double weight) {
  const size_t n = prefill_tokens.size();
  if (active_blocks.size() != n || overlap_blocks.size() != n) {
    throw std::invalid_argument("prefill_tokens, active_blocks and overlaps must have one entry per candidate, got " +
                                std::to_string(n) + ", " + std::to_string(active_blocks.size()) + " and " +
                                std::to_string(overlap_blocks.size()));
  }
  if (block_size < 1) throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  if (prompt_tokens < 0) {
    throw std::invalid_argument("prompt_tokens must be >= 0, got " + std::to_string(prompt_tokens));
  }
  if (!(weight >= 0)) throw std::invalid_argument("weight must be >= 0");
  const double per_token = weight / static_cast<double>(block_size);
  const int64_t prompt_blocks = (prompt_tokens + block_size - 1) / block_size;
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t o = overlap_blocks[i];
    const int64_t prefill = prefill_tokens[i] + std::max<int64_t>(prompt_tokens - o * block_size, 0);
    out[i] = per_token * static_cast<double>(prefill) + static_cast<double>(active_blocks[i]) +
             static_cast<double>(std::max<int64_t>(prompt_blocks - o, 0));
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
