// KvIndex implementation. See kv_index.h for the layout and why.
#include "kv_index.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "block_pool.h"

namespace prefixcache {

namespace {

constexpr uint64_t kMinSlots = 64;

// splitmix64's finalizer: block hashes are random already, but ids in tests and
// traces (0, 1, 2, ...) are not, and linear probing needs spread-out home slots.
inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline bool has_bit(const uint64_t* mask, int32_t r) { return (mask[r >> 6] >> (r & 63)) & 1; }

}  // namespace

constexpr size_t kHugePage = size_t{2} << 20;

TableWords::TableWords(size_t n) : size_(n) {
  const size_t bytes = n * sizeof(uint64_t);
  const size_t align = bytes >= kHugePage ? kHugePage : alignof(std::max_align_t);
  bytes_ = (bytes + align - 1) / align * align;
  data_ = static_cast<uint64_t*>(std::aligned_alloc(align, bytes_));
  if (data_ == nullptr) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == kHugePage) madvise(data_, bytes_, MADV_HUGEPAGE);  // a hint: no huge pages is fine
#endif
  std::memset(data_, 0, bytes_);
}

TableWords::~TableWords() { std::free(data_); }

KvIndex::KvIndex() : table_(kMinSlots * 2), mask_(kMinSlots - 1) {}

bool KvIndex::empty_slot(const uint64_t* s) const {
  for (int32_t w = 0; w < words_; ++w) {
    if (s[1 + w] != 0) return false;
  }
  return true;
}

int64_t KvIndex::find(uint64_t hash) const {
  for (uint64_t i = mix(hash) & mask_;; i = (i + 1) & mask_) {
    const uint64_t* s = slot(i);
    if (empty_slot(s)) return -1;
    if (s[0] == hash) return static_cast<int64_t>(i);
  }
}

uint64_t KvIndex::find_or_insert(uint64_t hash) {
  if (static_cast<uint64_t>(size_ + 1) * 4 > capacity() * 3) rebuild(capacity() * 2, words_);
  for (uint64_t i = mix(hash) & mask_;; i = (i + 1) & mask_) {
    uint64_t* s = slot(i);
    if (empty_slot(s)) {
      s[0] = hash;  // a new entry: its mask is set by the caller
      ++size_;
      return i;
    }
    if (s[0] == hash) return i;
  }
}

void KvIndex::prefetch(uint64_t hash) const { __builtin_prefetch(slot(mix(hash) & mask_)); }

void KvIndex::erase_slot(uint64_t i) {
  // Backward-shift deletion: pull later entries of the probe run into the gap
  // unless that would move one before its home slot. No tombstones needed.
  const uint64_t n = stride();
  uint64_t gap = i;
  for (uint64_t j = (i + 1) & mask_; !empty_slot(slot(j)); j = (j + 1) & mask_) {
    uint64_t home = mix(slot(j)[0]) & mask_;
    bool stays = gap <= j ? (gap < home && home <= j) : (gap < home || home <= j);
    if (stays) continue;
    std::copy_n(slot(j), n, slot(gap));
    gap = j;
  }
  std::fill_n(slot(gap), n, 0);
  --size_;
}

void KvIndex::rebuild(uint64_t new_capacity, int32_t words) {
  TableWords old(new_capacity * (1 + static_cast<uint64_t>(words)));
  old.swap(table_);
  const uint64_t old_stride = stride();
  const int32_t old_words = words_;
  const uint64_t old_slots = old.size() / old_stride;
  words_ = words;
  mask_ = new_capacity - 1;
  size_ = 0;
  for (uint64_t k = 0; k < old_slots; ++k) {
    const uint64_t* s = old.data() + k * old_stride;
    bool held = false;
    for (int32_t w = 0; w < old_words; ++w) held = held || s[1 + w] != 0;
    if (!held) continue;
    uint64_t i = mix(s[0]) & mask_;
    while (!empty_slot(slot(i))) i = (i + 1) & mask_;
    uint64_t* d = slot(i);
    d[0] = s[0];
    std::copy_n(s + 1, std::min(old_words, words_), d + 1);
    ++size_;
  }
}

void KvIndex::add_replica(int32_t r) {
  if (r < num_replicas_) return;
  const int32_t words = (r >> 6) + 1;
  if (words > words_) rebuild(capacity(), words);
  num_replicas_ = r + 1;
  blocks_.resize(num_replicas_, 0);
  copies_.resize(num_replicas_, 0);
}

void KvIndex::store_one(int32_t r, uint64_t hash) {
  uint64_t* s = slot(find_or_insert(hash));
  ++copies_[r];
  ++counters_.stored;
  if (has_bit(s + 1, r)) {
    ++extra_[{hash, r}];
    return;
  }
  s[1 + (r >> 6)] |= uint64_t{1} << (r & 63);
  ++blocks_[r];
}

void KvIndex::remove_one(int32_t r, uint64_t hash) {
  int64_t found = find(hash);
  if (found < 0 || !has_bit(slot(found) + 1, r)) {
    ++counters_.unknown_removed;
    return;
  }
  ++counters_.removed;
  --copies_[r];
  if (!extra_.empty()) {
    auto it = extra_.find({hash, r});
    if (it != extra_.end()) {
      if (--it->second == 0) extra_.erase(it);
      return;  // the replica still holds another copy
    }
  }
  uint64_t* s = slot(found);
  s[1 + (r >> 6)] &= ~(uint64_t{1} << (r & 63));
  --blocks_[r];
  if (empty_slot(s)) erase_slot(static_cast<uint64_t>(found));
}

// Batches touch random slots of a big table: fetch a few hashes ahead so the cache
// misses overlap (the query does the same, and says why).
constexpr size_t kAhead = 8;

void KvIndex::store(int32_t r, std::span<const uint64_t> hashes) {
  for (size_t k = 0; k < hashes.size(); ++k) {
    if (k + kAhead < hashes.size()) prefetch(hashes[k + kAhead]);
    store_one(r, hashes[k]);
  }
}

void KvIndex::remove(int32_t r, std::span<const uint64_t> hashes) {
  for (size_t k = 0; k < hashes.size(); ++k) {
    if (k + kAhead < hashes.size()) prefetch(hashes[k + kAhead]);
    remove_one(r, hashes[k]);
  }
}

void KvIndex::clear(int32_t r) {
  if (copies_[r] == 0) return;
  const uint64_t bit = uint64_t{1} << (r & 63);
  const int32_t w = r >> 6;
  bool emptied = false;
  for (uint64_t i = 0; i < capacity(); ++i) {
    uint64_t* s = slot(i);
    if (s[1 + w] & bit) {
      s[1 + w] &= ~bit;
      emptied = emptied || empty_slot(s);
    }
  }
  for (auto it = extra_.begin(); it != extra_.end();) {
    it = it->first.second == r ? extra_.erase(it) : std::next(it);
  }
  blocks_[r] = copies_[r] = 0;
  // Slots left with an empty mask read as free and would cut probe runs short:
  // rehash what is still held, at the same size.
  if (emptied) rebuild(capacity(), words_);
}

void KvIndex::apply(int32_t r, const KvEventBatch& batch) {
  counters_.skipped += batch.skipped;
  uint32_t begin = 0;
  for (size_t e = 0; e < batch.kinds.size(); ++e) {
    std::span<const uint64_t> hashes(batch.hashes.data() + begin, batch.ends[e] - begin);
    switch (batch.kinds[e]) {
      case KvEventBatch::kStored: store(r, hashes); break;
      case KvEventBatch::kRemoved: remove(r, hashes); break;
      default: clear(r); ++counters_.cleared; break;
    }
    begin = batch.ends[e];
  }
}

void KvIndex::longest_prefix(std::span<const uint64_t> hashes, std::vector<int32_t>& out) const {
  out.assign(num_replicas_, 0);
  if (num_replicas_ == 0) return;
  // `alive`: replicas that hold every hash so far. A replica leaves it at the first
  // hash it lacks, and its depth is that position.
  std::vector<uint64_t> alive(words_, 0);
  for (int32_t r = 0; r < num_replicas_; ++r) alive[r >> 6] |= uint64_t{1} << (r & 63);
  // A long chain in a big table is a cache miss per block; the hashes are all known,
  // so fetch the home slots a few blocks ahead and let the misses overlap.
  for (size_t d = 0; d < std::min(kAhead, hashes.size()); ++d) prefetch(hashes[d]);
  for (size_t depth = 0; depth < hashes.size(); ++depth) {
    if (depth + kAhead < hashes.size()) prefetch(hashes[depth + kAhead]);
    int64_t found = find(hashes[depth]);
    const uint64_t* held = found >= 0 ? slot(found) + 1 : nullptr;
    bool any = false;
    for (int32_t w = 0; w < words_; ++w) {
      uint64_t keep = held != nullptr ? alive[w] & held[w] : 0;
      for (uint64_t gone = alive[w] & ~keep; gone != 0; gone &= gone - 1) {
        out[w * 64 + std::countr_zero(gone)] = static_cast<int32_t>(depth);
      }
      alive[w] = keep;
      any = any || keep != 0;
    }
    if (!any) return;
  }
  for (int32_t w = 0; w < words_; ++w) {
    for (uint64_t left = alive[w]; left != 0; left &= left - 1) {
      out[w * 64 + std::countr_zero(left)] = static_cast<int32_t>(hashes.size());
    }
  }
}

int64_t KvIndex::copies_of(uint64_t hash, int32_t r) const {
  int64_t found = find(hash);
  if (found < 0 || !has_bit(slot(found) + 1, r)) return 0;
  auto it = extra_.find({hash, r});
  return 1 + (it == extra_.end() ? 0 : it->second);
}

int64_t KvIndex::num_pairs() const {
  int64_t pairs = 0;
  for (int64_t b : blocks_) pairs += b;
  return pairs;
}

int64_t KvIndex::memory_bytes() const {
  // The side map: a node (key, count, next pointer, cached hash) per entry plus its buckets.
  const int64_t node = sizeof(std::pair<const std::pair<uint64_t, int32_t>, int64_t>) + 2 * sizeof(void*);
  return static_cast<int64_t>(table_.bytes()) +
         static_cast<int64_t>(extra_.size()) * node + static_cast<int64_t>(extra_.bucket_count() * sizeof(void*)) +
         static_cast<int64_t>((blocks_.capacity() + copies_.capacity()) * sizeof(int64_t));
}

void KvIndex::check_invariants() const {
  auto fail = [](const std::string& msg) { throw InvariantError("KvIndex: " + msg); };
  std::vector<int64_t> blocks(num_replicas_, 0), copies(num_replicas_, 0);
  int64_t occupied = 0;
  for (uint64_t i = 0; i < capacity(); ++i) {
    const uint64_t* s = slot(i);
    if (empty_slot(s)) continue;
    ++occupied;
    for (uint64_t j = mix(s[0]) & mask_; j != i; j = (j + 1) & mask_) {
      if (empty_slot(slot(j))) fail("slot " + std::to_string(i) + " is unreachable from its home slot");
    }
    for (int32_t w = 0; w < words_; ++w) {
      for (uint64_t m = s[1 + w]; m != 0; m &= m - 1) {
        int32_t r = w * 64 + std::countr_zero(m);
        if (r >= num_replicas_) fail("hash held by replica " + std::to_string(r) + ", beyond the replicas added");
        ++blocks[r];
        ++copies[r];
      }
    }
  }
  if (occupied != size_) fail("counts " + std::to_string(size_) + " hashes, table holds " + std::to_string(occupied));
  for (const auto& [key, extra] : extra_) {
    const auto& [hash, r] = key;
    int64_t found = find(hash);
    if (r < 0 || r >= num_replicas_ || found < 0 || !has_bit(slot(found) + 1, r) || extra < 1) {
      fail("an extra copy of a hash is recorded for replica " + std::to_string(r) + " that does not hold it");
    }
    copies[r] += extra;
  }
  for (int32_t r = 0; r < num_replicas_; ++r) {
    if (blocks[r] != blocks_[r] || copies[r] != copies_[r]) {
      fail("replica " + std::to_string(r) + " counts " + std::to_string(blocks_[r]) + " blocks / " +
           std::to_string(copies_[r]) + " copies, the table holds " + std::to_string(blocks[r]) + " / " +
           std::to_string(copies[r]));
    }
  }
}

}  // namespace prefixcache
