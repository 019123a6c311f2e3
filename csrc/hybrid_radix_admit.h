// The tree's part of a `radix` admission over a hybrid layout, in one call: from the
// prompt's match (HybridTree::match, made by the caller, who may have trimmed it) to
// the hit the request starts from, locked, and the pages its tables start with.
//
// Owns: the order of that sequence as backends/hybrid_radix.py's admit defines it (the
// room check its _fits made, then settle, lock, the hit's FULL pages, the SWA pages
// the first query reads, the matched state), so the cache makes one native call where
// it made seven, and nothing else.
//
// Never does: allocate, evict, or decide anything the cache decides (whether the
// request waits is the room check's answer, with the numbers the cache passes). A
// request that does not fit leaves the tree as it was.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "hybrid_tree.h"

namespace prefixcache {

struct HybridAdmitHit {
  HybridMatch hit;  // settled
  HybridReceipt receipt;
  std::vector<int64_t> full;  // FULL pages of the hit, root first
  std::vector<int64_t> swa;   // SWA pages, -1 (NULL_BLOCK) before the first query's window
  int64_t state = kHybridNone;  // the matched node's state
};

// `available`: what each pool (FULL, SWA TOKENS; states) hands out now; `states_needed`:
// the slots the request takes (0 without MAMBA); `window`: TOKENS a query reads (the
// layout's window; 0 without SWA). nullopt: the prompt does not fit even after evicting
// everything evictable, less what locking the hit protects.
std::optional<HybridAdmitHit> admit_hit(HybridTree& tree, const HybridMatch& probe, int64_t prompt_len,
                                        const std::array<int64_t, 3>& available, int64_t states_needed,
                                        int64_t window);

}  // namespace prefixcache
