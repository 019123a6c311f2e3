// KvIndex: the cluster-wide map from block hash to the replicas holding it.
//
// Owns: for every cached block hash (the low 64 bits of the chained digest, as vLLM
// publishes it), the set of replicas holding it and, where a replica holds more than
// one copy, how many; per replica the number of distinct blocks and copies it holds;
// and ingest counters. It answers, in one call, the longest cached prefix of a chain
// of block hashes on every replica.
//
// Layout, chosen for the per-request query: one flat open-addressing table (linear
// probing, backward-shift deletion, at most 3/4 full) whose slot is the key and a
// replica bitmask of `words_` 64-bit words, back to back in one vector, so a probe
// and the mask it leads to share a cache line. A slot is empty iff its mask is zero
// (no held block has an empty mask). Copies beyond the first of a (block, replica)
// pair (the `hash` backend caches a block computed twice twice) live in a side map
// that is empty in the common case. Costs: store/remove O(1) expected; the prefix
// query O(matched depth x words_); clearing or removing a replica O(table), which is
// rare (a reset, a dead replica).
//
// Chained hashes make a flat map enough: block i's hash covers every token before it,
// so "replica r holds h[0..k)" is k look-ups, with no tree of parents to keep.
//
// Never does: decide anything about routing (cost, load, thresholds), read Python
// objects, or validate a replica id; the binding converts events and checks ids.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace prefixcache {

// A batch of KV events of one replica, flattened: event i is `kinds[i]` over the
// hashes [ends[i-1], ends[i]) (a Cleared event has none).
struct KvEventBatch {
  enum Kind : uint8_t { kStored = 0, kRemoved = 1, kCleared = 2 };
  std::vector<uint8_t> kinds;
  std::vector<uint32_t> ends;
  std::vector<uint64_t> hashes;
  int64_t skipped = 0;  // events left out by the caller (another medium), counted only
};

// Zeroed heap words for the table. A table of 2 MiB or more is 2 MiB-aligned and asks
// for transparent huge pages (Linux madvise): the prefix query's look-ups land on random
// slots, and on 4 KiB pages each one is a TLB miss whose page walk costs more than the
// cache miss itself (measured: about 1 us a look-up in a 2 GiB table inside a VM).
class TableWords {
 public:
  TableWords() = default;
  explicit TableWords(size_t n);
  TableWords(TableWords&& other) noexcept { swap(other); }
  TableWords& operator=(TableWords&& other) noexcept {
    swap(other);
    return *this;
  }
  TableWords(const TableWords&) = delete;
  TableWords& operator=(const TableWords&) = delete;
  ~TableWords();

  uint64_t* data() { return data_; }
  const uint64_t* data() const { return data_; }
  size_t size() const { return size_; }
  size_t bytes() const { return bytes_; }  // allocated, rounded up to the alignment
  void swap(TableWords& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(bytes_, other.bytes_);
  }

 private:
  uint64_t* data_ = nullptr;
  size_t size_ = 0;
  size_t bytes_ = 0;
};

struct KvIndexCounters {
  int64_t stored = 0;            // block hashes stored (every copy)
  int64_t removed = 0;           // block hashes removed that the replica held
  int64_t unknown_removed = 0;   // removals of a hash the replica did not hold (a gap upstream)
  int64_t cleared = 0;           // AllBlocksCleared applied
  int64_t skipped = 0;           // events of another medium, not applied
};

class KvIndex {
 public:
  // Replicas an index can track: a slot's mask is kMaxReplicas / 64 words at most.
  static constexpr int32_t kMaxReplicas = 4096;

  KvIndex();

  // Replica ids are dense: [0, num_replicas()). Adding id r makes every id below it
  // valid too (as replicas without blocks).
  int32_t num_replicas() const { return num_replicas_; }
  void add_replica(int32_t r);
  // Drops every block of replica r (its slot stays valid, with nothing held).
  void clear(int32_t r);

  void store(int32_t r, std::span<const uint64_t> hashes);
  void remove(int32_t r, std::span<const uint64_t> hashes);
  void apply(int32_t r, const KvEventBatch& batch);

  // out[r] = the number of leading hashes replica r holds, for every replica.
  void longest_prefix(std::span<const uint64_t> hashes, std::vector<int32_t>& out) const;

  // Copies of `hash` replica r holds (0 if none).
  int64_t copies_of(uint64_t hash, int32_t r) const;
  int64_t blocks(int32_t r) const { return blocks_[r]; }  // distinct blocks of r
  int64_t copies(int32_t r) const { return copies_[r]; }  // every copy of r
  int64_t num_hashes() const { return size_; }            // distinct hashes held anywhere
  int64_t num_pairs() const;                              // (hash, replica) pairs held
  const KvIndexCounters& counters() const { return counters_; }
  // Bytes the index holds on the heap (table, side map, per-replica arrays).
  int64_t memory_bytes() const;

  // Throws InvariantError (block_pool.h) naming the first inconsistency.
  void check_invariants() const;

 private:
  struct PairHash {
    size_t operator()(const std::pair<uint64_t, int32_t>& p) const {
      return static_cast<size_t>(p.first ^ (static_cast<uint64_t>(p.second) * 0x9e3779b97f4a7c15ULL));
    }
  };

  uint64_t* slot(uint64_t i) { return table_.data() + i * stride(); }
  const uint64_t* slot(uint64_t i) const { return table_.data() + i * stride(); }
  uint64_t stride() const { return 1 + static_cast<uint64_t>(words_); }
  uint64_t capacity() const { return mask_ + 1; }
  bool empty_slot(const uint64_t* s) const;
  int64_t find(uint64_t hash) const;        // slot index, or -1
  uint64_t find_or_insert(uint64_t hash);  // slot index; a new entry has an empty mask
  void prefetch(uint64_t hash) const;      // hint: `hash`'s home slot is read soon
  void erase_slot(uint64_t i);
  void rebuild(uint64_t capacity, int32_t words);  // rehash every held entry

  void store_one(int32_t r, uint64_t hash);
  void remove_one(int32_t r, uint64_t hash);

  TableWords table_;  // capacity() slots of stride() words: key, mask[words_]
  uint64_t mask_ = 0;            // capacity() - 1, a power of two minus one
  int32_t words_ = 1;            // mask words per slot: replicas < 64 * words_
  int64_t size_ = 0;             // occupied slots
  int32_t num_replicas_ = 0;
  std::vector<int64_t> blocks_, copies_;
  std::unordered_map<std::pair<uint64_t, int32_t>, int64_t, PairHash> extra_;  // copies beyond the first
  KvIndexCounters counters_;
};

}  // namespace prefixcache
