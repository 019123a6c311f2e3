// GhostTable: a bounded memory of content use that outlives the content, for
// policies that count reuse across evictions (ARC's ghost lists, in one table)
// and for a lower tier's reuse filter (TierManager's `store_threshold`).
//
// Owns: content key -> a use count (the content's when it was evicted; a tier's
// uses so far), for at most `capacity` keys; the oldest put is forgotten first
// (a FIFO by put order, re-putting a key moves it to the back). Mirrors
// GhostTable in tests/reference/ghost_table.py, entry for entry.
//
// Never does: know what a key means. Keys are 64-bit content hashes (a block
// hash's first 8 bytes, or a radix page's chained hash); a collision only
// makes a policy count a use it should not (or a tier store a block early),
// never a wrong hit.
// Cost: O(1) amortized per put / take; memory O(capacity).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <deque>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace prefixcache {

class GhostTable {
 public:
  explicit GhostTable(int64_t capacity = 0) : capacity_(capacity < 0 ? 0 : static_cast<size_t>(capacity)) {}

  bool enabled() const { return capacity_ > 0; }
  int64_t capacity() const { return static_cast<int64_t>(capacity_); }
  int64_t size() const { return static_cast<int64_t>(uses_.size()); }

  // Remember that content `key` was evicted after `uses` uses.
  void put(uint64_t key, int64_t uses) {
    if (capacity_ == 0) return;
    uint64_t seq = next_seq_++;
    uses_[key] = {uses, seq};
    order_.emplace_back(key, seq);
    while (uses_.size() > capacity_) pop_oldest();
    // Re-puts and takes leave stale entries in order_; drop them once they
    // outnumber the live ones, so memory stays O(capacity).
    if (order_.size() > 2 * capacity_ + 16) compact();
  }

  // The use count remembered for `key` (0 if none), leaving it where it is.
  int64_t peek(uint64_t key) const {
    auto it = uses_.find(key);
    return it == uses_.end() ? 0 : it->second.first;
  }

  // The use count remembered for `key` (0 if none), forgetting it.
  int64_t take(uint64_t key) {
    auto it = uses_.find(key);
    if (it == uses_.end()) return 0;
    int64_t uses = it->second.first;
    uses_.erase(it);
    return uses;
  }

  void clear() {
    uses_.clear();
    order_.clear();
  }

 private:
  void pop_oldest() {
    while (!order_.empty()) {
      auto [key, seq] = order_.front();
      order_.pop_front();
      auto it = uses_.find(key);
      if (it != uses_.end() && it->second.second == seq) {
        uses_.erase(it);
        return;
      }
    }
  }

  void compact() {
    std::deque<std::pair<uint64_t, uint64_t>> live;
    for (const auto& entry : order_) {
      auto it = uses_.find(entry.first);
      if (it != uses_.end() && it->second.second == entry.second) live.push_back(entry);
    }
    order_.swap(live);
  }

  size_t capacity_;
  uint64_t next_seq_ = 0;
  std::unordered_map<uint64_t, std::pair<int64_t, uint64_t>> uses_;  // key -> (uses, seq of its put)
  std::deque<std::pair<uint64_t, uint64_t>> order_;                  // (key, seq), oldest first
};

// The ghost key of a block hash: its first 8 bytes (hashes are uniform).
inline uint64_t block_ghost_key(std::string_view key) {
  uint64_t out = 0;
  std::memcpy(&out, key.data(), std::min<size_t>(8, key.size()));
  return out;
}

// The 64-bit content key of a radix page: its parent's key chained with the
// page's tokens (FNV-1a over 32-bit words, then a splitmix64 finalizer).
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

inline uint64_t chain_page_key(uint64_t parent, const int32_t* tokens, size_t n) {
  uint64_t h = parent ^ 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint32_t>(tokens[i])) * 0x100000001b3ULL;
  return mix64(h);
}

}  // namespace prefixcache
