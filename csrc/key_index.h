// KeyIndex: which blocks hold which key, for BlockPool.
//
// Owns: each block's key bytes, and a key -> holders map. Several blocks may hold
// the same key (vLLM keeps every copy of a block computed twice); holders are
// kept in caching order, so first(key) is the earliest-cached one.
//
// Layout, chosen so the steady state allocates nothing: keys live in one
// std::string per block whose capacity survives reuse; the map is a flat
// open-addressing table (linear probing, backward-shift deletion) of
// {hash, head, tail}; holders of one key form an intrusive doubly linked list
// through per-block int32 arrays, so insert and erase are O(1) expected.
//
// Never does: reference counting or the free queue (BlockPool owns those), and
// it does not validate block ids; the pool does that before calling in.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace prefixcache {

class KeyIndex {
 public:
  explicit KeyIndex(int32_t num_blocks);

  bool has_key(int32_t b) const { return has_key_[b] != 0; }
  const std::string& key(int32_t b) const { return key_[b]; }
  // Blocks holding a key.
  int32_t size() const { return size_; }

  // Block b (keyless) now holds `key`; it becomes the key's newest holder.
  void insert(int32_t b, std::string_view key);
  // Block b (keyed) no longer holds its key.
  void erase(int32_t b);
  // Earliest-cached block holding `key`, or -1.
  int32_t first(std::string_view key) const;
  // Every block holding `key`, earliest first.
  std::vector<int32_t> holders(std::string_view key) const;
  void clear();

  // Throws InvariantError (block_pool.h) naming the first inconsistency.
  void check_invariants() const;

 private:
  struct Slot {
    uint64_t hash;
    int32_t head;  // -1: empty slot
    int32_t tail;
  };

  static uint64_t hash_of(std::string_view key);
  // Slot of `key` (with hash h), or -1.
  int64_t find(std::string_view key, uint64_t h) const;
  void erase_slot(uint64_t i);
  void grow();

  std::vector<std::string> key_;
  std::vector<uint8_t> has_key_;
  std::vector<uint64_t> hash_;  // hash_of(key_[b]), kept to find b's slot without rehashing
  std::vector<int32_t> hprev_;  // previous / next holder of the same key, -1 at the ends
  std::vector<int32_t> hnext_;
  std::vector<Slot> table_;  // size is a power of two, at most half full
  uint64_t mask_ = 0;
  int32_t num_keys_ = 0;  // occupied slots (distinct keys)
  int32_t size_ = 0;
};

}  // namespace prefixcache
