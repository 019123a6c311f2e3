// BlockEvictor: eviction of free cached blocks in a policy's order, for the
// hash strategy (vLLM's free queue evicts in LRU order only).
//
// Owns: per-block policy attributes (the EvictionCandidate fields), a logical
// clock and a traffic clock, the ghost table of evicted block hashes, and a
// min-heap of candidates (free blocks that hold a key) with lazy invalidation.
// A block's key is computed ONCE, when it becomes a candidate (when free()
// drops its last reference), never per comparison and never per operation:
// for a Python policy that is one call per freed cached block. Mirrors the
// reference model PyBlockEvictor in tests/reference/block_evictor.py.
//
// Never does: decide hits, hash, or reuse a block itself. The pool still
// allocates from the front of its free queue; make_room() first evicts
// victims (uncaching them and moving them to the front), so the blocks an
// allocation takes are keyless and the policy alone chose what was lost.
// Every bad argument throws before anything changes (a Python rank that
// raises inside free(), or a comparison of its keys that fails in free() or
// evict(), leaves the pool and the evictor as they were: KeyCompare). A Python
// callback that calls back into the evictor to change it gets ReentryError
// (call_flag.h).
//
// Invariants (check_invariants): num_candidates() equals the free keyed
// blocks of the pool, and each has exactly one live heap entry. The free
// queue holds every keyless free block before every keyed one, so allocating
// at most (num_free - num_candidates) blocks takes keyless blocks only.
// Cost: O(log n) per block freed, touched or evicted; the heap is compacted
// when stale entries exceed twice the pool.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "call_flag.h"
#include "eviction_order.h"
#include "ghost_table.h"

namespace prefixcache {

template <class Key>
class BlockEvictor {
 public:
  using Rank = std::function<Key(const EvictionCandidate&)>;

  // `pool` must outlive the evictor and hold no key yet. `block_size` is in
  // TOKENS (a candidate's num_tokens); `ghost_capacity` is in blocks (0: no history).
  BlockEvictor(BlockPool& pool, int64_t block_size, Rank rank, int64_t ghost_capacity)
      : pool_(pool), block_size_(block_size), rank_(std::move(rank)), ghost_(ghost_capacity) {
    if (block_size < 1) throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
    if (pool.num_cached() != 0) throw std::invalid_argument("BlockEvictor needs a pool that holds no key yet");
    attrs_.resize(pool.num_blocks());
    version_.assign(pool.num_blocks(), 0);
    keyed_.assign(pool.num_blocks(), 0);
    kept_.assign(pool.num_blocks(), 0);
  }

  int64_t clock() const { return clock_; }
  int64_t traffic() const { return traffic_; }
  int64_t num_candidates() const { return num_candidates_; }
  const GhostTable& ghost() const { return ghost_; }

  // A request is admitted with prompt `tokens` (whole blocks, TOKENS): advance
  // the traffic clock, then pin its hit blocks (pool.touch) and count a hit
  // and a use on each; `priority` raises theirs.
  void admit(const std::vector<int64_t>& hits, int64_t tokens, int64_t priority) {
    calls_.check("BlockEvictor.admit");
    if (tokens < 0) throw std::invalid_argument("admit: tokens must be >= 0, got " + std::to_string(tokens));
    std::vector<uint8_t> was_candidate(hits.size());
    for (size_t i = 0; i < hits.size(); ++i) {
      was_candidate[i] = pool_.ref_count(hits[i]) == 0 && keyed_[hits[i]];
    }
    pool_.touch(hits);  // validates; throws before changing anything
    traffic_ += tokens;
    if (hits.empty()) return;
    int64_t now = ++clock_;
    for (size_t i = 0; i < hits.size(); ++i) {
      auto b = static_cast<int32_t>(hits[i]);
      if (was_candidate[i]) {
        --num_candidates_;
        ++version_[b];  // its heap entry is stale now
      }
      EvictionCandidate& a = attrs_[b];
      a.last_access_time = now;
      ++a.hit_count;
      ++a.use_count;
      a.priority = std::max(a.priority, priority);
    }
  }

  // Blocks `ids` (in use) were just cached under the packed keys: a fresh
  // life, whose use count continues the ghost's if the content was evicted.
  void cached(const std::vector<int64_t>& ids, std::string_view keys, int64_t key_size, int64_t priority) {
    calls_.check("BlockEvictor.cached");
    if (key_size < 1 || keys.size() != ids.size() * static_cast<size_t>(key_size)) {
      throw std::invalid_argument("cached: " + std::to_string(ids.size()) + " ids need " +
                                  std::to_string(ids.size()) + " keys of key_size bytes, got " +
                                  std::to_string(keys.size()) + " bytes");
    }
    for (int64_t id : ids) {
      if (pool_.ref_count(id) < 1) throw std::invalid_argument("cached: block " + std::to_string(id) + " is free");
    }
    int64_t now = ++clock_;
    for (size_t i = 0; i < ids.size(); ++i) {
      EvictionCandidate& a = attrs_[ids[i]];
      uint64_t ghost_key = block_ghost_key(keys.substr(i * key_size, key_size));
      a = EvictionCandidate{};
      a.id = ids[i];
      a.num_tokens = block_size_;
      a.last_access_time = a.creation_time = now;
      a.priority = priority;
      a.use_count = 1 + ghost_.take(ghost_key);
      a.last_use = traffic_;
      keyed_[ids[i]] = 1;
    }
  }

  // pool.free(ids); each block that becomes a free cached block is stamped
  // (one clock tick each, in the given order, so ranking by last_access_time
  // is exactly the pool's free-queue LRU) and ranked once.
  // `request_tokens`: whole-block prompt TOKENS of the releasing request.
  void free(const std::vector<int64_t>& ids, int64_t request_tokens) {
    CallFlag::Scope running(calls_, "BlockEvictor.free");
    if (heap_.size() > 2 * static_cast<size_t>(pool_.num_blocks()) + 64) {
      compact();  // first: it only drops stale entries, so a failed comparison changes nothing
      KeyCompare<Key>::check();
    }
    std::vector<std::pair<int32_t, EvictionCandidate>> fresh;
    for (int64_t id : ids) {
      if (pool_.ref_count(id) == 1 && keyed_[id]) {
        auto b = static_cast<int32_t>(id);
        EvictionCandidate c = attrs_[b];
        c.last_access_time = clock_ + 1 + static_cast<int64_t>(fresh.size());
        c.last_use = traffic_;
        c.request_tokens = request_tokens;
        fresh.emplace_back(b, c);
      }
    }
    std::vector<Key> keys;
    keys.reserve(fresh.size());
    for (const auto& [b, c] : fresh) keys.push_back(rank_(c));  // may throw: nothing changed yet
    // Queued before the pool frees them (an entry is live only once its block is free),
    // so a comparison that fails, or a pool that refuses, leaves nothing changed.
    const uint64_t first_seq = next_seq_;
    for (size_t i = 0; i < fresh.size(); ++i) push(fresh[i].first, std::move(keys[i]));
    try {
      KeyCompare<Key>::check();
      pool_.free(ids);  // validates: throws before changing anything
    } catch (...) {
      // Take the new entries out again (keys that failed to compare must not stay to fail
      // every later comparison), and restore the order of the others.
      heap_.erase(std::remove_if(heap_.begin(), heap_.end(), [&](const Entry& e) { return e.seq >= first_seq; }),
                  heap_.end());
      KeyCompare<Key>::unchecked([&] { std::make_heap(heap_.begin(), heap_.end(), later); });
      throw;
    }
    clock_ += static_cast<int64_t>(fresh.size());
    for (const auto& [b, c] : fresh) attrs_[b] = c;
    num_candidates_ += static_cast<int64_t>(fresh.size());
  }

  // Evict candidates, lowest key first, until at least `n` free blocks hold
  // no key (so pool.allocate(n) takes only those), never one of `keep` (the hits
  // an admission pins next: pinning one takes it out of the free blocks and the
  // candidates alike, so the count needed is the same). Returns the dropped keys.
  std::vector<std::string> make_room(int64_t n, const std::vector<int64_t>& keep = {}) {
    calls_.check("BlockEvictor.make_room");
    if (n < 0) throw std::invalid_argument("make_room: n must be >= 0, got " + std::to_string(n));
    int64_t keyless = pool_.num_free() - num_candidates_;
    return evict(std::max<int64_t>(0, n - keyless), keep);
  }

  // Evict up to `n` candidates, lowest key first, none of `keep`; returns their keys.
  std::vector<std::string> evict(int64_t n, const std::vector<int64_t>& keep = {}) {
    CallFlag::Scope running(calls_, "BlockEvictor.evict");
    if (n < 0) throw std::invalid_argument("evict: n must be >= 0, got " + std::to_string(n));
    for (int64_t b : keep) {
      if (b < 0 || b >= pool_.num_blocks()) {
        throw std::out_of_range("evict: kept block id " + std::to_string(b) + " is out of range [0, " +
                                std::to_string(pool_.num_blocks()) + ")");
      }
    }
    for (int64_t b : keep) kept_[b] = 1;
    std::vector<Entry> taken, spared;
    while (static_cast<int64_t>(taken.size()) < n && !heap_.empty()) {
      std::pop_heap(heap_.begin(), heap_.end(), later);
      Entry top = std::move(heap_.back());
      heap_.pop_back();
      if (live(top)) (kept_[top.block] ? spared : taken).push_back(std::move(top));
    }
    for (int64_t b : keep) kept_[b] = 0;
    auto put_back = [&](std::vector<Entry>& entries) {
      for (Entry& e : entries) {
        heap_.push_back(std::move(e));
        std::push_heap(heap_.begin(), heap_.end(), later);
      }
    };
    put_back(spared);
    try {
      KeyCompare<Key>::check();
    } catch (...) {  // a comparison failed: the order is unknown, so evict nothing
      KeyCompare<Key>::unchecked([&] { put_back(taken); });
      throw;
    }
    std::vector<int64_t> victims;
    for (const Entry& e : taken) {
      victims.push_back(e.block);
      ++version_[e.block];
    }
    std::vector<std::string> keys = pool_.evict_blocks(victims);
    num_candidates_ -= static_cast<int64_t>(victims.size());
    for (int64_t b : victims) keyed_[b] = 0;
    for (size_t i = 0; i < victims.size(); ++i) ghost_.put(block_ghost_key(keys[i]), attrs_[victims[i]].use_count);
    return keys;
  }

  // After pool.uncache_all(): no candidates, no history.
  void reset() {
    calls_.check("BlockEvictor.reset");
    heap_.clear();
    for (auto& v : version_) ++v;
    std::fill(keyed_.begin(), keyed_.end(), 0);
    num_candidates_ = 0;
    ghost_.clear();
  }

  EvictionCandidate candidate(int64_t id) const {
    if (id < 0 || id >= pool_.num_blocks()) {
      throw std::out_of_range("candidate: block id " + std::to_string(id) + " is out of range [0, " +
                              std::to_string(pool_.num_blocks()) + ")");
    }
    EvictionCandidate c = attrs_[id];
    c.id = id;
    c.num_tokens = block_size_;
    return c;
  }

  // Candidates in eviction order (what evict() would take, first to last). For tests.
  std::vector<int32_t> order() const {
    std::vector<Entry> entries;
    for (const Entry& e : heap_) {
      if (live(e)) entries.push_back(e);
    }
    std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return later(b, a); });
    KeyCompare<Key>::check();
    std::vector<int32_t> out;
    for (const Entry& e : entries) out.push_back(e.block);
    return out;
  }

  void check_invariants() const {
    auto fail = [](const std::string& msg) { throw InvariantError("BlockEvictor: " + msg); };
    int64_t free_keyed = 0;
    std::vector<int32_t> entries(pool_.num_blocks(), 0);
    for (const Entry& e : heap_) {
      if (live(e)) ++entries[e.block];
    }
    for (int32_t b = 0; b < pool_.num_blocks(); ++b) {
      if (static_cast<bool>(keyed_[b]) != pool_.key(b).has_value()) {
        fail("block " + std::to_string(b) + (keyed_[b] ? " lost its key behind the evictor's back" : " was cached behind the evictor's back"));
      }
      bool candidate = pool_.ref_count(b) == 0 && keyed_[b];
      free_keyed += candidate;
      if (candidate && entries[b] != 1) {
        fail("free cached block " + std::to_string(b) + " has " + std::to_string(entries[b]) + " live heap entries");
      }
    }
    if (free_keyed != num_candidates_) {
      fail(std::to_string(num_candidates_) + " candidates counted, the pool has " + std::to_string(free_keyed) +
           " free cached blocks");
    }
    // Keyless free blocks come first in the queue, so allocation never takes a keyed one.
    bool seen_keyed = false;
    for (int32_t b : pool_.free_queue()) {
      bool keyed = pool_.key(b).has_value();
      if (seen_keyed && !keyed) fail("keyless free block " + std::to_string(b) + " sits behind a cached one");
      seen_keyed = seen_keyed || keyed;
    }
  }

 private:
  struct Entry {
    Key key;
    uint64_t seq;
    int32_t block;
    uint32_t version;
  };

  // std heaps are max-heaps: "a goes below b" when a is evicted later.
  static bool later(const Entry& a, const Entry& b) {
    if (b.key < a.key) return true;
    if (a.key < b.key) return false;
    return a.seq > b.seq;
  }

  bool live(const Entry& e) const {
    return version_[e.block] == e.version && keyed_[e.block] && pool_.ref_count(e.block) == 0;
  }

  void push(int32_t b, Key key) {
    heap_.push_back(Entry{std::move(key), next_seq_++, b, ++version_[b]});
    std::push_heap(heap_.begin(), heap_.end(), later);
  }

  void compact() {
    std::vector<Entry> kept;
    kept.reserve(num_candidates_ + 1);
    for (Entry& e : heap_) {
      if (live(e)) kept.push_back(std::move(e));
    }
    heap_.swap(kept);
    std::make_heap(heap_.begin(), heap_.end(), later);
  }

  BlockPool& pool_;
  int64_t block_size_;
  Rank rank_;
  GhostTable ghost_;
  std::vector<EvictionCandidate> attrs_;
  std::vector<uint32_t> version_;
  std::vector<uint8_t> keyed_;  // per block: holds a key (set by cached, cleared by evict / reset)
  std::vector<uint8_t> kept_;   // scratch for evict's `keep`, left all-zero
  std::vector<Entry> heap_;
  uint64_t next_seq_ = 0;
  int64_t clock_ = 0;
  int64_t traffic_ = 0;
  int64_t num_candidates_ = 0;
  CallFlag calls_;
};

}  // namespace prefixcache
