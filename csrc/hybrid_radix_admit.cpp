// admit_hit (see hybrid_radix_admit.h).
#include "hybrid_radix_admit.h"

#include <algorithm>
#include <stdexcept>

namespace prefixcache {

std::optional<HybridAdmitHit> admit_hit(HybridTree& tree, const HybridMatch& probe, int64_t prompt_len,
                                        const std::array<int64_t, 3>& available, int64_t states_needed,
                                        int64_t window) {
  const int64_t bs = tree.page_size();
  if (prompt_len < 1) throw std::invalid_argument("prompt_len: expected an int >= 1");
  // _fits: the prompt's own pages against each pool's free and evictable size, less
  // what locking the hit would protect.
  const int64_t own = ((prompt_len + bs - 1) / bs - probe.num_tokens / bs) * bs;
  const std::array<int64_t, 3> cost = tree.lock_cost(probe);
  auto room = [&](int c) { return available[c] + tree.evictable(c) - cost[c]; };
  if (own > room(kHybridFull)) return std::nullopt;
  if (tree.has(kHybridSwa) && own > room(kHybridSwa)) return std::nullopt;
  if (tree.has(kHybridMamba) && states_needed > room(kHybridMamba)) return std::nullopt;
  HybridAdmitHit out;
  out.hit = tree.settle(probe);
  // Locked before the cache takes the running state slot: its copy-on-write locks this
  // node while it evicts for one, so holding the request's own lock then is the same.
  out.state = tree.state(out.hit.node);
  out.receipt = tree.lock(out.hit.node);
  out.full = tree.path_pages(out.hit.node);
  if (tree.has(kHybridSwa)) {
    out.swa = tree.hit_pages(out.hit, kHybridSwa);
    const size_t first = static_cast<size_t>(std::max<int64_t>(0, out.hit.num_tokens - window + 1) / bs);
    std::fill(out.swa.begin(), out.swa.begin() + std::min(first, out.swa.size()), int64_t{-1});
  }
  return out;
}

}  // namespace prefixcache
