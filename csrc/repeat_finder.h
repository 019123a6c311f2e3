// The first id that a list names twice, found in one pass over the list with a flag per
// possible id, so a call that takes many block ids checks them in O(len) without a set.
// BlockPool (free, touch, cache, evict_blocks) and RadixTree (the blocks an insert
// adopts) each own one, sized to the pool.
//
// Owns RepeatFinder. The caller words the error (its call's name, what the ids are) and
// has checked every id is in [0, size) first.
//
// Never does: keep anything between calls (the flags are all clear again on return), or
// throw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace prefixcache {

class RepeatFinder {
 public:
  explicit RepeatFinder(size_t size = 0) : seen_(size, 0) {}

  // The first id of `ids` that an earlier one equals; nullopt if all differ. const: the
  // flags are scratch, left as they were found.
  template <class Ids>
  std::optional<int64_t> first_repeat(const Ids& ids) const {
    std::optional<int64_t> repeated;
    for (auto id : ids) {
      if (seen_[static_cast<size_t>(id)]) {
        repeated = id;
        break;
      }
      seen_[static_cast<size_t>(id)] = 1;
    }
    for (auto id : ids) seen_[static_cast<size_t>(id)] = 0;
    return repeated;
  }

 private:
  mutable std::vector<uint8_t> seen_;  // one flag per id, all clear between calls
};

}  // namespace prefixcache
