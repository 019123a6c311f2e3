// The reconciled prefix-cache hit of a hybrid layout over one BlockPool's key index:
// vLLM 0.33's HybridKVCacheCoordinator.find_longest_cache_hit over its single-type
// managers (full attention, sliding window, chunked local attention, mamba).
//
// Owns `HybridHitFinder`: a layout's groups (kind, extent, key suffix) and how they are
// looked up together, fixed at construction; `find` reads the index, never changes it.
// The executable definition is the Python one (backends/hybrid_hash.py `_find_hit` and
// backends/hybrid_groups.py `find_hit`), which a test holds equal to this on random pools.
//
// Never does: pin, allocate, free or key a block, or decide what a group keeps.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "block_pool.h"

namespace prefixcache {

enum class HitKind : int { kFullAttention = 0, kSlidingWindow = 1, kChunkedLocal = 2, kMamba = 3 };

struct HitGroup {
  HitKind kind = HitKind::kFullAttention;
  int64_t window_blocks = 0;  // sliding window: BLOCKS a hit needs cached before the cut
  int64_t chunk = 0;          // chunked local: TOKENS per attention chunk
  std::string suffix;         // what follows a block hash in the group's key
};

struct HybridHit {
  int64_t length = 0;    // TOKENS every group accepts
  int64_t junction = 0;  // TOKENS full attention found beyond `length` (0: none)
  std::vector<std::vector<int32_t>> rows;  // per group, its hit blocks (-1: a block it skips)
};

class HybridHitFinder {
 public:
  // `spec_groups`: group indices looked up together, in lookup order (full attention
  // first); `single_pass`: one look-up round (full attention plus one other kind).
  HybridHitFinder(std::vector<HitGroup> groups, std::vector<std::vector<int>> spec_groups, bool single_pass,
                  int64_t block_size, int64_t digest_size);

  // The hit of at most `max_length` TOKENS for the packed block hashes `digests`.
  HybridHit find(const BlockPool& pool, std::string_view digests, int64_t max_length);

  // Single-block look-ups (all members of a spec group at one block) the last `find` made.
  int64_t last_probes() const { return probes_; }

 private:
  using Rows = std::vector<std::vector<int32_t>>;
  Rows chain(const BlockPool& pool, std::string_view digests, int64_t first, int64_t stop,
             const std::vector<int>& members);
  bool one(const BlockPool& pool, std::string_view digests, int64_t i, const std::vector<int>& members,
           std::vector<int32_t>& out);
  int64_t find_group(const BlockPool& pool, std::string_view digests, int64_t max_length,
                     const std::vector<int>& members, Rows& rows);

  std::vector<HitGroup> groups_;
  std::vector<std::vector<int>> spec_groups_;
  bool single_pass_;
  int64_t block_size_;
  int64_t digest_size_;
  std::string key_;  // scratch: one group key at a time
  int64_t probes_ = 0;
};

}  // namespace prefixcache
