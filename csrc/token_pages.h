// TokenPages: the token ids of cached blocks, one page of block_size ids per block,
// shared by whoever holds the block (the tier manager's device mirror and its tiers'
// slots), so that a block moving between them moves a reference, not its ids. Ids are
// kept as wide as the strategy's (4 or 8 bytes each), packed.
//
// Owns: the pages, a reference count per page, and the free pages.
// Never does: know keys, tiers or devices; copy a page once it is made.
//
// A holder holds at most one page, so `capacity` = holders + 1 pages always suffice
// (the one extra: a holder makes its new page before it lets go of the old one).
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace prefixcache {

class TokenPages {
 public:
  static constexpr int32_t kNone = -1;

  // `page_bytes`: a block's ids, packed; `capacity` pages.
  TokenPages(int64_t page_bytes, int64_t capacity)
      : page_bytes_(static_cast<size_t>(page_bytes)),
        bytes_(static_cast<size_t>(page_bytes * capacity), 0),
        refs_(static_cast<size_t>(capacity), 0) {
    free_.reserve(static_cast<size_t>(capacity));
    for (int64_t p = capacity - 1; p >= 0; --p) free_.push_back(static_cast<int32_t>(p));
  }

  // A new page holding page_bytes of packed ids, with one reference.
  int32_t make(const char* ids) {
    if (free_.empty()) throw std::logic_error("TokenPages: every page is held (a holder holds more than one)");
    const int32_t p = free_.back();
    free_.pop_back();
    std::memcpy(bytes_.data() + static_cast<size_t>(p) * page_bytes_, ids, page_bytes_);
    refs_[p] = 1;
    return p;
  }

  // `holder` (kNone or a page it holds) now holds page `p` (kNone: nothing).
  void hold(int32_t& holder, int32_t p) {
    if (p != kNone) ++refs_[p];
    release(holder);
    holder = p;
  }

  // `holder` lets go of its page and holds a new one holding `ids`.
  void fill(int32_t& holder, const char* ids) {
    const int32_t p = make(ids);
    release(holder);
    holder = p;
  }

  // `holder` lets go of its page.
  void release(int32_t& holder) {
    if (holder != kNone && --refs_[holder] == 0) free_.push_back(holder);
    holder = kNone;
  }

  const char* data(int32_t p) const {
    return p == kNone ? nullptr : bytes_.data() + static_cast<size_t>(p) * page_bytes_;
  }
  size_t page_bytes() const { return page_bytes_; }
  int64_t refs(int32_t p) const { return refs_[p]; }
  int64_t capacity() const { return static_cast<int64_t>(refs_.size()); }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }

 private:
  size_t page_bytes_;
  std::vector<char> bytes_;
  std::vector<int64_t> refs_;
  std::vector<int32_t> free_;
};

}  // namespace prefixcache
