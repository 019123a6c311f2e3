// KeyIndex implementation. See key_index.h for the layout and why.
#include "key_index.h"

#include <functional>

#include "block_pool.h"

namespace prefixcache {

namespace {
constexpr uint64_t kMinSlots = 64;
}

KeyIndex::KeyIndex(int32_t num_blocks)
    : key_(num_blocks),
      has_key_(num_blocks, 0),
      hash_(num_blocks, 0),
      hprev_(num_blocks, -1),
      hnext_(num_blocks, -1),
      table_(kMinSlots, Slot{0, -1, -1}),
      mask_(kMinSlots - 1) {}

uint64_t KeyIndex::hash_of(std::string_view key) { return std::hash<std::string_view>{}(key); }

int64_t KeyIndex::find(std::string_view key, uint64_t h) const {
  for (uint64_t i = h & mask_;; i = (i + 1) & mask_) {
    const Slot& s = table_[i];
    if (s.head < 0) return -1;
    if (s.hash == h && key_[s.head] == key) return static_cast<int64_t>(i);
  }
}

void KeyIndex::grow() {
  std::vector<Slot> old(table_.size() * 2, Slot{0, -1, -1});
  old.swap(table_);
  mask_ = table_.size() - 1;
  for (const Slot& s : old) {
    if (s.head < 0) continue;
    uint64_t i = s.hash & mask_;
    while (table_[i].head >= 0) i = (i + 1) & mask_;
    table_[i] = s;
  }
}

void KeyIndex::insert(int32_t b, std::string_view key) {
  uint64_t h = hash_of(key);
  key_[b].assign(key.data(), key.size());
  has_key_[b] = 1;
  hash_[b] = h;
  hnext_[b] = -1;
  ++size_;
  int64_t found = find(key, h);
  if (found >= 0) {
    Slot& s = table_[found];
    hprev_[b] = s.tail;
    hnext_[s.tail] = b;
    s.tail = b;
    return;
  }
  hprev_[b] = -1;
  if (static_cast<uint64_t>(num_keys_ + 1) * 2 > table_.size()) grow();
  uint64_t i = h & mask_;
  while (table_[i].head >= 0) i = (i + 1) & mask_;
  table_[i] = Slot{h, b, b};
  ++num_keys_;
}

void KeyIndex::erase(int32_t b) {
  int64_t i = find(key_[b], hash_[b]);
  Slot& s = table_[i];
  if (hprev_[b] < 0) s.head = hnext_[b]; else hnext_[hprev_[b]] = hnext_[b];
  if (hnext_[b] < 0) s.tail = hprev_[b]; else hprev_[hnext_[b]] = hprev_[b];
  hprev_[b] = hnext_[b] = -1;
  has_key_[b] = 0;
  --size_;
  if (s.head < 0) erase_slot(static_cast<uint64_t>(i));
}

void KeyIndex::erase_slot(uint64_t i) {
  // Backward-shift deletion: pull later entries of the probe run into the gap
  // unless that would move one before its home slot. No tombstones needed.
  uint64_t gap = i;
  for (uint64_t j = (i + 1) & mask_; table_[j].head >= 0; j = (j + 1) & mask_) {
    uint64_t home = table_[j].hash & mask_;
    bool stays = gap <= j ? (gap < home && home <= j) : (gap < home || home <= j);
    if (stays) continue;
    table_[gap] = table_[j];
    gap = j;
  }
  table_[gap] = Slot{0, -1, -1};
  --num_keys_;
}

int32_t KeyIndex::first(std::string_view key) const {
  int64_t i = find(key, hash_of(key));
  return i < 0 ? -1 : table_[i].head;
}

std::vector<int32_t> KeyIndex::holders(std::string_view key) const {
  std::vector<int32_t> out;
  int64_t i = find(key, hash_of(key));
  if (i < 0) return out;
  for (int32_t b = table_[i].head; b >= 0; b = hnext_[b]) out.push_back(b);
  return out;
}

void KeyIndex::clear() {
  std::fill(has_key_.begin(), has_key_.end(), 0);
  std::fill(hprev_.begin(), hprev_.end(), -1);
  std::fill(hnext_.begin(), hnext_.end(), -1);
  std::fill(table_.begin(), table_.end(), Slot{0, -1, -1});
  num_keys_ = 0;
  size_ = 0;
}

void KeyIndex::check_invariants() const {
  auto fail = [](const std::string& msg) { throw InvariantError("BlockPool key index: " + msg); };
  const int32_t n = static_cast<int32_t>(key_.size());
  int32_t keys = 0, holders = 0;
  for (uint64_t i = 0; i < table_.size(); ++i) {
    const Slot& s = table_[i];
    if (s.head < 0) continue;
    ++keys;
    for (uint64_t j = s.hash & mask_; j != i; j = (j + 1) & mask_) {
      if (table_[j].head < 0) fail("slot " + std::to_string(i) + " is unreachable from its home slot");
    }
    int32_t prev = -1;
    int32_t steps = 0;
    for (int32_t b = s.head; b >= 0; b = hnext_[b]) {
      if (b >= n || ++steps > n) fail("holder list of slot " + std::to_string(i) + " is broken");
      if (!has_key_[b]) fail("block " + std::to_string(b) + " is listed as a holder but has no key");
      if (hash_[b] != s.hash || key_[b] != key_[s.head]) fail("block " + std::to_string(b) + " is listed under another key");
      if (hprev_[b] != prev) fail("block " + std::to_string(b) + " has a stale holder back link");
      prev = b;
      ++holders;
    }
    if (s.tail != prev) fail("slot " + std::to_string(i) + " tail is stale");
  }
  int32_t keyed = 0;
  for (int32_t b = 0; b < n; ++b) keyed += has_key_[b];
  if (keys != num_keys_) fail("counts " + std::to_string(num_keys_) + " keys, table has " + std::to_string(keys));
  if (holders != size_ || keyed != size_) {
    fail("size is " + std::to_string(size_) + " but the table lists " + std::to_string(holders) + " holders and " +
         std::to_string(keyed) + " blocks hold a key");
  }
}

}  // namespace prefixcache
