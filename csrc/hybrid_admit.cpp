#include "hybrid_admit.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace prefixcache {
namespace {
constexpr int32_t kNullBlock = -1;

// Python's //: the managers' arithmetic floors (a mamba group skips num_computed - 1 tokens).
int64_t floor_div(int64_t a, int64_t b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

int64_t cdiv(int64_t a, int64_t b) { return -floor_div(-a, b); }

// The entries of row[from:] that are blocks (not -1), as the pool's ids.
std::vector<int64_t> live(const std::vector<int32_t>& row, int64_t from) {
  std::vector<int64_t> out;
  for (size_t i = static_cast<size_t>(std::clamp<int64_t>(from, 0, static_cast<int64_t>(row.size()))); i < row.size();
       ++i) {
    if (row[i] != kNullBlock) out.push_back(row[i]);
  }
  return out;
}
}  // namespace

HybridAdmitter::HybridAdmitter(std::vector<AdmitGroup> groups, int64_t block_size)
    : groups_(std::move(groups)), block_size_(block_size) {
  if (block_size_ < 1) throw std::invalid_argument("HybridAdmitter: block_size must be >= 1");
  for (const auto& g : groups_) {
    if ((g.kind == HitKind::kChunkedLocal && g.chunk < 1) || (g.kind == HitKind::kSlidingWindow && g.window < 1)) {
      throw std::invalid_argument("HybridAdmitter: a chunked group needs chunk >= 1, a sliding window window >= 1");
    }
  }
}

// vLLM get_num_skipped_tokens (LayerGroup.skipped_tokens).
int64_t HybridAdmitter::skipped_tokens(const AdmitGroup& g, int64_t num_computed) const {
  switch (g.kind) {
    case HitKind::kSlidingWindow:
      return std::max<int64_t>(0, num_computed - g.window + 1);
    case HitKind::kChunkedLocal:
      return floor_div(num_computed, g.chunk) * g.chunk;
    case HitKind::kMamba:
      return num_computed - 1;
    case HitKind::kFullAttention:
      break;
  }
  return 0;
}

// get_num_blocks_to_allocate of a request no group holds anything for yet (GroupManager
// and MambaGroup `blocks_needed` with an empty state).
int64_t HybridAdmitter::blocks_needed(const BlockPool& pool, const AdmitGroup& g, const std::vector<int32_t>& row,
                                      int64_t hit, int64_t num_tokens) const {
  const int64_t required = cdiv(num_tokens, block_size_);
  const auto held = static_cast<int64_t>(row.size());
  if (g.kind == HitKind::kMamba) {
    int64_t fresh = required - held;
    if (fresh > 0) fresh = std::min<int64_t>(fresh, 1);  // one physical block a chunk
    const auto pinned = live(row, 0);
    return fresh + (pinned.empty() ? 0 : pool.count_free(pinned));
  }
  const int64_t skipped = floor_div(skipped_tokens(g, hit), block_size_);
  const int64_t fresh = std::max<int64_t>(required - std::max(skipped, held), 0);
  const auto pinned = live(row, std::max<int64_t>(0, skipped));
  return fresh + (pinned.empty() ? 0 : pool.count_free(pinned));
}

std::optional<HybridAdmission> HybridAdmitter::admit(BlockPool& pool, const std::vector<std::vector<int32_t>>& rows,
                                                     int64_t hit, int64_t num_tokens, int64_t first_end,
                                                     int64_t free) const {
  const size_t n = groups_.size();
  if (rows.size() != n) {
    throw std::invalid_argument("HybridAdmitter.admit: " + std::to_string(rows.size()) + " rows for " +
                                std::to_string(n) + " groups");
  }
  if (hit < 0 || first_end < 0 || num_tokens < first_end) {
    throw std::invalid_argument("HybridAdmitter.admit: needs 0 <= hit and 0 <= first_end <= num_tokens");
  }
  auto needed = [&](int64_t tokens) {
    int64_t sum = 0;
    for (size_t g = 0; g < n; ++g) sum += blocks_needed(pool, groups_[g], rows[g], hit, tokens);
    return sum;
  };
  if (needed(num_tokens) > free || (first_end < num_tokens && needed(first_end) > free)) return std::nullopt;

  HybridAdmission out;
  out.tables.resize(n);
  out.num_cached.assign(n, -1);
  out.last_state.assign(n, -1);
  // add_local_computed_blocks: vLLM adds computed blocks only when some group hit.
  if (hit > 0) {
    for (size_t g = 0; g < n; ++g) {
      const auto& row = rows[g];
      const int64_t skipped = floor_div(skipped_tokens(groups_[g], hit), block_size_);
      const int64_t from = std::clamp<int64_t>(skipped, 0, static_cast<int64_t>(row.size()));
      const auto pinned = live(row, from);
      if (!pinned.empty()) pool.touch(pinned);
      auto& table = out.tables[g];
      table.assign(static_cast<size_t>(std::max<int64_t>(skipped, 0)), kNullBlock);
      table.insert(table.end(), row.begin() + from, row.end());
      out.num_cached[g] = static_cast<int64_t>(table.size());
    }
  }
  // allocate_new_blocks up to the first chunk, group by group: how many each takes
  // depends only on its table, so one allocation hands them out in the same order.
  const int64_t required = cdiv(first_end, block_size_);
  std::vector<int64_t> takes(n, 0);
  for (size_t g = 0; g < n; ++g) {
    auto& table = out.tables[g];
    const auto held = static_cast<int64_t>(table.size());
    if (groups_[g].kind == HitKind::kMamba) {
      if (required <= held) continue;
      if (held > 0) out.last_state[g] = held - 1;  // a fresh request has not allocated before
      if (held < required - 1) table.resize(static_cast<size_t>(required - 1), kNullBlock);
      takes[g] = required - static_cast<int64_t>(table.size());
    } else {
      takes[g] = std::max<int64_t>(required - held, 0);
    }
  }
  int64_t total = 0;
  for (int64_t t : takes) total += t;
  if (total > 0) {
    auto blocks = pool.allocate(total);
    if (!blocks) throw std::logic_error("HybridAdmitter.admit: the room check passed but the pool is short");
    out.took_blocks = true;
    auto next = blocks->begin();
    for (size_t g = 0; g < n; ++g) {
      out.tables[g].insert(out.tables[g].end(), next, next + takes[g]);
      next += takes[g];
    }
  }
  return out;
}

}  // namespace prefixcache
