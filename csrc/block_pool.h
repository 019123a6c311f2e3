// BlockPool: the fixed set of KV blocks that every prefix-cache strategy shares.
//
// Owns: per-block reference counts, the free queue (an intrusive doubly linked
// list over int32 prev/next arrays with two sentinels), and the key -> blocks
// index of cached blocks. Mirrors the pure-Python reference model in
// tests/reference/block_pool.py; the two must agree operation for operation.
//
// Never does: hashing, matching, policy. It does not know what a key means,
// which request holds a block, or why a block is cached. Every bad argument
// throws (std::out_of_range -> IndexError, std::invalid_argument ->
// ValueError); nothing here aborts the process, and a call that throws has
// changed nothing.
//
// Invariants (checked by check_invariants):
//   * ref[b] == 0  <=>  b is linked in the free queue.
//   * The queue's front is reused first. Blocks freed without a key are pushed
//     to the front (their content is worthless); blocks freed with a key are
//     appended to the tail, so the queue is an LRU of cached content.
//   * A block holds at most one key; index[key] lists the blocks holding it in
//     the order they were cached, and lookup(key) returns the first of them.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "key_index.h"
#include "repeat_finder.h"

namespace prefixcache {

// The most blocks a pool may hold: ids and the two sentinels fit in int32. Bound to
// Python as prefixcache._C.MAX_NUM_BLOCKS, which config validation reads.
inline constexpr int32_t kMaxBlocks = (1 << 30);

// Raised by check_invariants(); bound to Python as AssertionError subclass.
struct InvariantError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks);

  int32_t num_blocks() const { return num_blocks_; }
  int32_t num_free() const { return num_free_; }
  int32_t num_pinned() const { return num_blocks_ - num_free_; }
  int32_t num_cached() const { return index_.size(); }
  // Cached blocks whose key allocate(), evict_front() or evict_blocks() dropped, since construction.
  int64_t num_evicted() const { return num_evicted_; }

  // Takes n blocks from the front of the free queue, each with ref 1. A taken
  // block that still held a key loses it (the key is listed by
  // last_removed()). Returns nullopt, changing nothing, if fewer than n are free.
  std::optional<std::vector<int32_t>> allocate(int64_t n);
  // allocate(1) without a vector (a decode step's block): the block, or -1 if none is free.
  int32_t allocate_one();
  // Drops one reference from each block. Blocks that reach zero go back to the
  // queue: keyless ones to the FRONT (keeping the given order), keyed ones to
  // the TAIL (in the given order). Callers free a request's blocks in reverse
  // so its tail is evicted before the prefix it shares with others.
  void free(const std::vector<int64_t>& ids);
  // Adds one reference to each block; a block at zero leaves the queue (O(1)).
  void touch(const std::vector<int64_t>& ids);
  // How many of `ids` are free (ref 0): the blocks touch(ids) would take out
  // of the free queue. Lets a caller check room before pinning anything.
  int64_t count_free(const std::vector<int64_t>& ids) const;

  // Records that block `id` (which must be in use and keyless) holds `key`.
  void cache(int64_t id, std::string_view key);
  // cache(ids[i], keys[i]) for each i; validated first, so all or nothing.
  void cache_many(const std::vector<int64_t>& ids, const std::vector<std::string_view>& keys);
  // cache_many with the keys packed back to back in `keys`, `key_size` bytes
  // each (a request's chain of digests as one buffer, no object per key), each
  // key followed by `suffix` (a layer group's mark; empty: none).
  void cache_many_packed(const std::vector<int64_t>& ids, std::string_view keys, int64_t key_size,
                         std::string_view suffix = {});
  // Drops block `id`'s key if it has one; returns the key it held.
  std::optional<std::string> uncache(int64_t id);
  // Drops every key (used by reset); returns how many blocks lost one.
  int64_t uncache_all();
  // The earliest-cached block still holding `key`.
  std::optional<int32_t> lookup(std::string_view key) const;
  // Block for each key in order, stopping at the first key not cached.
  std::vector<int32_t> lookup_chain(const std::vector<std::string_view>& keys) const;
  // lookup_chain over keys packed back to back, `key_size` bytes each, each
  // followed by `suffix` (empty: none).
  std::vector<int32_t> lookup_chain_packed(std::string_view keys, int64_t key_size,
                                           std::string_view suffix = {}) const;
  // Drops the keys of the first n keyed blocks of the free queue (front =
  // least recently freed) and returns them in queue order; fewer if fewer are
  // free and keyed. The blocks stay where they are: every block ahead of them
  // is keyless, so the queue still reuses keyless blocks first. Counts toward
  // num_evicted. O(k + n), k = keyless free blocks ahead of them.
  std::vector<std::string> evict_front(int64_t n);
  // Drops the keys of the given free, keyed blocks and moves them to the FRONT
  // of the free queue in the given order (reused next), returning their keys:
  // eviction in an order a policy chose rather than the queue's. Validated
  // first (each id once, free and keyed), so all or nothing. Counts toward
  // num_evicted. O(len(ids)).
  std::vector<std::string> evict_blocks(const std::vector<int64_t>& ids);

  // Keys dropped by the most recent allocate() call, in allocation order.
  std::vector<std::string_view> last_removed() const {
    return {last_removed_.begin(), last_removed_.begin() + num_last_removed_};
  }

  int32_t ref_count(int64_t id) const;
  std::optional<std::string> key(int64_t id) const;
  // Free queue from front (reused first) to tail. O(num_free); for tests.
  std::vector<int32_t> free_queue() const;
  // Blocks holding `key`, in caching order. For tests and collision checks.
  std::vector<int32_t> blocks_for(std::string_view key) const;

  void check_invariants() const;

 private:
  int32_t check_id(int64_t id, const char* what) const;
  void check_unique(const std::vector<int64_t>& ids, const char* what) const;
  void unlink(int32_t b);
  // The front of the free queue, taken with ref 1 (its key dropped); one must be free.
  int32_t take_front();
  void link_before(int32_t b, int32_t next);
  void drop_key(int32_t b);
  void check_cacheable(int32_t b, std::string_view key) const;

  int32_t num_blocks_;
  int32_t head_;  // sentinel: next_[head_] is the front
  int32_t tail_;  // sentinel: prev_[tail_] is the back
  std::vector<int32_t> ref_;
  std::vector<int32_t> prev_;
  std::vector<int32_t> next_;
  KeyIndex index_;
  int32_t num_free_ = 0;
  int64_t num_evicted_ = 0;
  // The first num_last_removed_ entries are the keys dropped by the last
  // allocate(); the strings are reused so steady-state allocation is free.
  std::vector<std::string> last_removed_;
  size_t num_last_removed_ = 0;
  RepeatFinder repeats_;  // check_unique()'s scratch, one flag per block
};

}  // namespace prefixcache
