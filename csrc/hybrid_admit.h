// A new request's blocks in a hybrid layout over one BlockPool: vLLM 0.33's
// KVCacheManager.allocate_slots for a request admitted with a prefix hit, over its
// single-type managers (full attention, sliding window, chunked local attention, mamba).
//
// Owns `HybridAdmitter`: a layout's groups (kind, window, chunk), fixed at construction.
// `admit` checks room (get_num_blocks_to_allocate, summed over the groups, for the whole
// prompt and for its first chunk), then per group pins the hit blocks it still reads
// (add_local_computed_blocks) and grows its table to the first chunk
// (allocate_new_blocks). The executable definition is the Python one (backends/
// hybrid_groups.py `blocks_needed`, `add_hit`, `allocate`, and backends/hybrid_hash.py
// `admit`), which a test holds equal to this under random traffic.
//
// Never does: look a hit up, key, free or evict a block, or touch a request after its
// admission (commits, chunks and releases stay with the Python managers).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "block_pool.h"
#include "hybrid_hit.h"

namespace prefixcache {

struct AdmitGroup {
  HitKind kind = HitKind::kFullAttention;
  int64_t window = 0;  // sliding window: TOKENS
  int64_t chunk = 0;   // chunked local: TOKENS per attention chunk
};

struct HybridAdmission {
  std::vector<std::vector<int32_t>> tables;  // per group, its table (-1: a block it skips)
  std::vector<int64_t> num_cached;           // per group, entries the hit filled; -1 without a hit
  std::vector<int64_t> last_state;           // per group (mamba), the previous state's entry; -1: none
  bool took_blocks = false;  // whether a block was taken (then the pool's last_removed() is this admission's)
};

class HybridAdmitter {
 public:
  HybridAdmitter(std::vector<AdmitGroup> groups, int64_t block_size);

  // Admit a new request of `num_tokens` TOKENS whose hit is `hit` TOKENS in the per-group
  // blocks `rows` (HybridHitFinder::find's), its first chunk ending at `first_end`
  // TOKENS, with `free` blocks available to it: nullopt, changing nothing, when the
  // prompt or its first chunk does not fit.
  std::optional<HybridAdmission> admit(BlockPool& pool, const std::vector<std::vector<int32_t>>& rows, int64_t hit,
                                       int64_t num_tokens, int64_t first_end, int64_t free) const;

 private:
  int64_t skipped_tokens(const AdmitGroup& g, int64_t num_computed) const;
  int64_t blocks_needed(const BlockPool& pool, const AdmitGroup& g, const std::vector<int32_t>& row, int64_t hit,
                        int64_t num_tokens) const;

  std::vector<AdmitGroup> groups_;
  int64_t block_size_;
};

}  // namespace prefixcache
