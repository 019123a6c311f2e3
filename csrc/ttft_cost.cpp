// The estimated-TTFT router's cost. See ttft_cost.h for the formula and where the policy lives.
#include "ttft_cost.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace prefixcache {
namespace {

void check(const TtftModel& m) {
  for (const double v : {m.token_s, m.pair_s, m.weights_s, m.overhead_s, m.load_weight, m.decode_weight}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      throw std::invalid_argument("the service model's rates and the charges' weights must be finite and >= 0");
    }
  }
  if (!(m.decode_cap_s >= 0)) throw std::invalid_argument("decode_cap_s must be >= 0 (inf: no cap)");
  if (m.budget < 1) throw std::invalid_argument("budget must be >= 1, got " + std::to_string(m.budget));
}

// Query-key pairs of prefilling n tokens from position h.
double own_pairs(double n, double h) { return n * h + n * (n + 1) / 2; }

}  // namespace

double estimated_ttft(int64_t backlog_tokens, int64_t running, int64_t cached_tokens, int64_t prompt_tokens,
                      const TtftModel& m) {
  const double n = static_cast<double>(prompt_tokens - cached_tokens);
  const double b = static_cast<double>(std::max<int64_t>(running, 0));
  const double x = static_cast<double>(std::max<int64_t>(backlog_tokens, 0)) + n;
  const double chunk = std::max(static_cast<double>(m.budget) - b, 1.0);
  const double steps = x / chunk;
  const double compute = m.token_s * (x + b * steps) + m.pair_s * own_pairs(n, static_cast<double>(cached_tokens));
  return steps * m.overhead_s + std::max(compute, steps * m.weights_s);
}

std::vector<double> estimated_ttft_costs(std::span<const int64_t> prefill_tokens,
                                         std::span<const int64_t> num_requests,
                                         std::span<const int64_t> queued_requests,
                                         std::span<const int32_t> overlap_blocks, int64_t prompt_tokens,
                                         int64_t block_size, const TtftModel& model, std::vector<double>* ttfts) {
  const size_t n = prefill_tokens.size();
  if (num_requests.size() != n || queued_requests.size() != n || overlap_blocks.size() != n) {
    throw std::invalid_argument(
        "prefill_tokens, num_requests, queued_requests and overlaps must have one entry per candidate, got " +
        std::to_string(n) + ", " + std::to_string(num_requests.size()) + ", " +
        std::to_string(queued_requests.size()) + " and " + std::to_string(overlap_blocks.size()));
  }
  if (block_size < 1) throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  if (prompt_tokens < 1) {
    throw std::invalid_argument("prompt_tokens must be >= 1, got " + std::to_string(prompt_tokens));
  }
  check(model);
  const int64_t most_cached = (prompt_tokens - 1) / block_size * block_size;
  std::vector<double> out(n);
  if (ttfts != nullptr) ttfts->assign(n, 0.0);
  for (size_t i = 0; i < n; ++i) {
    const int64_t cached = std::min<int64_t>(static_cast<int64_t>(overlap_blocks[i]) * block_size, most_cached);
    const double n = static_cast<double>(prompt_tokens - cached);
    const double own = model.token_s * n + model.pair_s * own_pairs(n, static_cast<double>(cached));
    const int64_t running = std::max<int64_t>(num_requests[i] - queued_requests[i], 0);
    const double ttft = estimated_ttft(prefill_tokens[i], running, cached, prompt_tokens, model);
    if (ttfts != nullptr) (*ttfts)[i] = ttft;
    out[i] = ttft + model.load_weight * own +
             model.decode_weight * static_cast<double>(running) * std::min(own, model.decode_cap_s);
  }
  return out;
}

std::vector<int32_t> estimated_ttft_choice(std::span<const double> costs, std::span<const int32_t> overlap_blocks,
                                           int64_t prompt_tokens, int64_t block_size, double stick_s,
                                           std::span<const double> ttfts, double stick_ttft_s) {
  if (overlap_blocks.size() != costs.size()) {
    throw std::invalid_argument("costs and overlaps must have one entry per candidate, got " +
                                std::to_string(costs.size()) + " and " + std::to_string(overlap_blocks.size()));
  }
  if (!(stick_s >= 0)) throw std::invalid_argument("stick_s must be >= 0, got " + std::to_string(stick_s));
  if (!(stick_ttft_s >= 0)) {
    throw std::invalid_argument("stick_ttft_s must be >= 0, got " + std::to_string(stick_ttft_s));
  }
  const bool bounded = stick_ttft_s < std::numeric_limits<double>::infinity();
  if (bounded && ttfts.size() != costs.size()) {
    throw std::invalid_argument("a finite stick_ttft_s needs one ttft per candidate, got " +
                                std::to_string(ttfts.size()) + " for " + std::to_string(costs.size()));
  }
  if (block_size < 1) throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  if (prompt_tokens < 1) {
    throw std::invalid_argument("prompt_tokens must be >= 1, got " + std::to_string(prompt_tokens));
  }
  std::vector<int32_t> out;
  if (costs.empty()) return out;
  const double low = *std::min_element(costs.begin(), costs.end());
  const int64_t usable = (prompt_tokens - 1) / block_size;  // blocks a hit can cover
  auto hit = [&](size_t i) { return std::min<int64_t>(overlap_blocks[i], usable); };
  int64_t most = 0;
  for (size_t i = 0; i < costs.size(); ++i) most = std::max(most, hit(i));
  if (most > 0 && stick_s > 0) {
    // The holders of the longest run, at their lowest cost: kept if that is close enough.
    double held = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < costs.size(); ++i) {
      if (hit(i) == most) held = std::min(held, costs[i]);
    }
    if (held <= low + stick_s) {
      for (size_t i = 0; i < costs.size(); ++i) {
        if (hit(i) == most && costs[i] == held && (!bounded || ttfts[i] <= stick_ttft_s)) {
          out.push_back(static_cast<int32_t>(i));
        }
      }
      if (!out.empty()) return out;
    }
  }
  for (size_t i = 0; i < costs.size(); ++i) {
    if (costs[i] == low) out.push_back(static_cast<int32_t>(i));
  }
  return out;
}

}  // namespace prefixcache
