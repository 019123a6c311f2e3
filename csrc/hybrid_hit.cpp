#include "hybrid_hit.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

namespace prefixcache {
namespace {
constexpr int32_t kNullBlock = -1;

void prepend_nulls(std::vector<std::vector<int32_t>>& rows, int64_t n) {
  for (auto& row : rows) row.insert(row.begin(), static_cast<size_t>(n), kNullBlock);
}
}  // namespace

HybridHitFinder::HybridHitFinder(std::vector<HitGroup> groups, std::vector<std::vector<int>> spec_groups,
                                 bool single_pass, int64_t block_size, int64_t digest_size)
    : groups_(std::move(groups)),
      spec_groups_(std::move(spec_groups)),
      single_pass_(single_pass),
      block_size_(block_size),
      digest_size_(digest_size) {
  if (block_size_ < 1 || digest_size_ < 1) {
    throw std::invalid_argument("HybridHitFinder: block_size and digest_size must be >= 1");
  }
  for (const auto& g : groups_) {
    if ((g.kind == HitKind::kChunkedLocal && g.chunk < 1) || g.window_blocks < 0) {
      throw std::invalid_argument("HybridHitFinder: a chunked group needs chunk >= 1, a window >= 0 blocks");
    }
  }
  for (const auto& ids : spec_groups_) {
    if (ids.empty()) throw std::invalid_argument("HybridHitFinder: an empty spec group");
    for (int g : ids) {
      if (g < 0 || g >= static_cast<int>(groups_.size())) {
        throw std::invalid_argument("HybridHitFinder: spec group names group " + std::to_string(g) + " of " +
                                    std::to_string(groups_.size()));
      }
    }
  }
}

// Per member, the cached blocks of the leading run of blocks [first, stop) every member holds.
HybridHitFinder::Rows HybridHitFinder::chain(const BlockPool& pool, std::string_view digests, int64_t first,
                                             int64_t stop, const std::vector<int>& members) {
  const int64_t have = static_cast<int64_t>(digests.size()) / digest_size_;
  stop = std::min(stop, have);
  first = std::min(first, stop);
  const std::string_view run = digests.substr(static_cast<size_t>(first * digest_size_),
                                              static_cast<size_t>((stop - first) * digest_size_));
  Rows rows;
  rows.reserve(members.size());
  size_t n = static_cast<size_t>(stop - first);
  for (int g : members) {
    rows.push_back(pool.lookup_chain_packed(run, digest_size_, groups_[g].suffix));
    n = std::min(n, rows.back().size());
  }
  for (auto& row : rows) row.resize(n);
  return rows;
}

// Per member, the cached block of block hash i; false if any member misses.
bool HybridHitFinder::one(const BlockPool& pool, std::string_view digests, int64_t i,
                          const std::vector<int>& members, std::vector<int32_t>& out) {
  ++probes_;
  out.clear();
  for (int g : members) {
    key_.assign(digests.substr(static_cast<size_t>(i * digest_size_), static_cast<size_t>(digest_size_)));
    key_.append(groups_[g].suffix);
    auto b = pool.lookup(key_);
    if (!b) return false;
    out.push_back(*b);
  }
  return true;
}

// One spec group's longest hit of at most max_length TOKENS (its rows into `rows`).
int64_t HybridHitFinder::find_group(const BlockPool& pool, std::string_view digests, int64_t max_length,
                                    const std::vector<int>& members, Rows& rows) {
  const HitGroup& group = groups_[members[0]];
  const int64_t bs = block_size_;
  const int64_t have = static_cast<int64_t>(digests.size()) / digest_size_;
  switch (group.kind) {
    case HitKind::kFullAttention: {
      rows = chain(pool, digests, 0, std::min(max_length / bs, have), members);
      return static_cast<int64_t>(rows[0].size()) * bs;
    }
    case HitKind::kChunkedLocal: {
      const int64_t start = (max_length > 0 ? max_length / group.chunk * group.chunk : 0) / bs;
      rows = chain(pool, digests, start, max_length / bs, members);
      prepend_nulls(rows, start);
      return static_cast<int64_t>(rows[0].size()) * bs;
    }
    case HitKind::kSlidingWindow: {
      const int64_t need = group.window_blocks;
      const int64_t max_blocks = std::min(max_length / bs, have);
      int64_t end = max_blocks - 1;
      std::vector<int32_t> probe;
      while (need && end - need + 1 >= 0) {
        const int64_t left = end - need + 1;
        if (!one(pool, digests, left, members, probe)) {
          end = left - 1;  // every window ending in [left, end] holds block `left`
          continue;
        }
        rows = chain(pool, digests, left, end + 1, members);
        const int64_t got = static_cast<int64_t>(rows[0].size());
        if (got == need) {
          prepend_nulls(rows, left);
          return (end + 1) * bs;
        }
        end = left + got - 1;  // windows ending at or past the first miss hold it
      }
      rows = chain(pool, digests, 0, need ? std::min(need, max_blocks) : max_blocks, members);
      return static_cast<int64_t>(rows[0].size()) * bs;
    }
    case HitKind::kMamba: {
      std::vector<int32_t> got;
      for (int64_t i = std::min(max_length / bs, have) - 1; i >= 0; --i) {
        if (one(pool, digests, i, members, got)) {
          rows.assign(members.size(), std::vector<int32_t>(static_cast<size_t>(i), kNullBlock));
          for (size_t k = 0; k < members.size(); ++k) rows[k].push_back(got[k]);
          return (i + 1) * bs;
        }
      }
      rows.assign(members.size(), {});
      return 0;
    }
  }
  throw std::logic_error("HybridHitFinder: unknown group kind");
}

HybridHit HybridHitFinder::find(const BlockPool& pool, std::string_view digests, int64_t max_length) {
  if (digests.size() % static_cast<size_t>(digest_size_) != 0) {
    throw std::invalid_argument("HybridHitFinder.find: " + std::to_string(digests.size()) +
                                " digest bytes are not whole digests of " + std::to_string(digest_size_));
  }
  probes_ = 0;
  const size_t num_groups = groups_.size();
  HybridHit out;
  out.rows.assign(num_groups, {});
  std::vector<bool> found(num_groups, false);
  std::vector<int64_t> lengths(num_groups, 0);
  int64_t hit_length = std::max<int64_t>(max_length, 0);
  int64_t longest = 0;
  Rows rows;
  // Per spec group, the length it was last asked for (-1: not yet): asked again for the
  // same length, it answers as before (a find never changes the index), so a round
  // after the one that lowered the hit looks up only the groups whose bound moved.
  std::vector<int64_t> asked(spec_groups_.size(), -1);
  while (true) {
    int64_t curr = hit_length;
    for (size_t s = 0; s < spec_groups_.size(); ++s) {
      const auto& ids = spec_groups_[s];
      const int first = ids[0];
      if (groups_[first].kind == HitKind::kFullAttention && found[first]) {
        curr = std::min(curr, lengths[first]);  // downward-closed: trim, never look up again
        continue;
      }
      if (asked[s] == curr) {
        curr = lengths[first];
        continue;
      }
      asked[s] = curr;
      curr = find_group(pool, digests, curr, ids, rows);
      for (size_t k = 0; k < ids.size(); ++k) {
        out.rows[ids[k]] = std::move(rows[k]);
        lengths[ids[k]] = curr;
        found[ids[k]] = true;
      }
      longest = std::max(longest, curr);
    }
    if (curr >= hit_length) break;
    hit_length = curr;
    if (single_pass_) break;
  }
  const size_t keep = static_cast<size_t>((hit_length + block_size_ - 1) / block_size_);
  for (size_t g = 0; g < num_groups; ++g) {
    if (groups_[g].kind == HitKind::kFullAttention && out.rows[g].size() > keep) out.rows[g].resize(keep);
  }
  out.length = hit_length;
  out.junction = longest > hit_length ? longest : 0;
  return out;
}

}  // namespace prefixcache
