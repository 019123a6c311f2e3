// TierManager: the memory hierarchy below the device pool (host memory, disk), one
// instance per cache, shared by every strategy.
//
// Owns: for each lower tier, its slots (a block's KV lives in one slot), the key of
// each slot (the block's chained hash, or with `lineage` its name), what travels with a block between tiers
// (BlockMeta: hit and use counts, the chain's depth, the traffic clock of its last
// use, a namespace tag; and for events or a disk tier its parent hash and token ids),
// pins (a slot a queued load reads stays put while the admission runs), with `lineage`
// an index of each slot by its link (parent key, tokens), the tier's
// eviction order, and its counters. On the device side it owns a mirror of the
// device blocks the strategy has cached (key -> blocks, plus the same BlockMeta), so
// that a block the strategy evicts can be demoted with what it held. It records,
// in order, the data movement an engine must perform (`Transfer`s: device -> tier
// stores, tier -> tier demotions, tier -> device loads) and, when asked to, the
// residency changes an event consumer needs (`TierRecord`).
//
// Never does: decide hits (the strategy and the cost model do), hold a device block
// reference, move data (the engine does, in the order recorded), or hash a key (with
// `lineage` it hashes a block's token ids, only to narrow a look-up it then compares in full).
//
// Semantics (docs/tiers.md):
//   * A block evicted from the device goes to tier 0 if tier 0 writes `on_evict`
//     and the block has at least `min_hits` hits; a block evicted from tier i goes
//     to tier i + 1 under the same rule. Otherwise it is dropped. A tier never holds
//     a block twice (an inclusive tier below may hold another copy).
//   * `write_through` tiers receive a copy of every block the device caches;
//     `selective` tiers a copy of a device block once it has `min_hits` hits
//     (SGLang's write_through_selective).
//   * A tier with `store_threshold` k >= 2 takes none of these stores until k
//     requests have used the block (computed it or hit it, each request once),
//     counted in a reuse tracker of the tier's last `reuse_slots` keys, which
//     outlives the block: a block computed again after it left every tier counts
//     its earlier use (vLLM's offloading store_threshold).
//   * A load (tier -> device block) takes a block out of an `on_evict` tier
//     (exclusive: it lives on the device now, and comes back down when evicted) and
//     refreshes it in an inclusive (`write_through` / `selective`) tier or one that
//     keeps what it loads (`keep_on_load`: a disk tier, whose file survives a restart).
//   * A tier whose policy is leaves-only evicts only slots no other slot of the
//     tier extends (a chain's tail), so a tier never holds a block whose prefix it
//     dropped first.
// Transfers are recorded in the order they must run: a slot's old content is moved
// down before the store that overwrites it, and a load before any store that reuses
// its slot (the slot is pinned until the load is recorded).
//
// Keys. By default a key is the block's chained hash (content-addressed: a block is
// found by hashing its prefix). With `lineage` a key is a name the manager gives
// (`new_name`, `device_cached_named`: a counter, never reused), and a block is found
// from its parent's key and its own token ids, compared in full (`follow`): no hash
// decides a hit, so nothing needs to be collision resistant, and a strategy that
// already knows its prefix (a tree) hashes nothing. A block is then found only through
// its parent: one whose parent left every tier and the device is unreachable until
// evicted.
//
// Invariants (check_invariants): a key is held by at most one slot per tier; a
// slot's child count equals the slots of its tier whose parent it is; every
// unpinned keyed slot that may leave has exactly one live entry in its queues; free slots
// hold no key; the device mirror holds only what the strategy says is cached.
// Every bad argument throws before anything changes; nothing here aborts. A tier's
// `rank` runs Python code part-way through a call: a call that would change the
// manager from there gets ReentryError (call_flag.h).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "call_flag.h"
#include "eviction_order.h"
#include "ghost_table.h"
#include "key_index.h"
#include "token_pages.h"

namespace prefixcache {

enum class TierWrite : int32_t { kOnEvict = 0, kWriteThrough = 1, kSelective = 2 };

// One lower tier as configured (prefixcache.tier_config.TierConfig, resolved).
struct TierSpec {
  int64_t num_slots = 0;
  TierWrite write = TierWrite::kOnEvict;
  int64_t min_hits = 0;            // hits a block needs to enter the tier
  EvictionOrder order = EvictionOrder::kLru;
  OrderParams params;
  // A policy without a native order (a Python priority()): the key of each candidate,
  // called once when it becomes one, instead of `order`. Must not throw (the binding
  // ranks a slot whose policy failed first and reports the failure).
  std::function<NativeKey(const EvictionCandidate&)> rank;
  bool leaves_only = false;        // only chain tails leave (the `chain` policy)
  bool keep_on_load = false;       // a load leaves the block here too (a disk tier: its file
                                   // outlives the process, so a restart finds the block)
  int64_t store_threshold = 0;     // requests that must have used a block before it enters (<= 1: any)
  int64_t reuse_slots = 0;         // keys the reuse tracker remembers (store_threshold >= 2)
};

// What travels with a block from tier to tier.
struct BlockMeta {
  int64_t hits = 0;            // admissions that hit it
  int64_t uses = 0;            // requests that used it (hits + the one that computed it)
  int64_t depth = 0;           // requests before it in its chain that continued the chain
  int64_t last_use = 0;        // traffic clock (TOKENS admitted) at its last use
  int64_t request_tokens = 0;  // whole-block prompt TOKENS of the request that last used it
  int32_t tag = 0;             // namespace tag (the Python side's table; events only)
  uint64_t token_hash = 0;     // lineage: XXH3-64 of its token ids (the link's second half)
};

// Copy one block's KV from (src_tier, src) to (dst_tier, dst); tier -1 is the device pool.
struct Transfer {
  int32_t src_tier, src, dst_tier, dst;
};

// A residency change an event consumer needs: block `key` was stored in or removed
// from `tier` (-1: the device, for loads recorded here).
struct TierRecord {
  bool stored;
  int32_t tier;
  std::string key;
  std::string parent;  // empty: the start of a chain (stored only)
  bool has_parent;
  std::vector<int64_t> tokens;  // stored only, when tokens are kept
  int32_t tag;
};

struct TierCounters {
  int64_t hits = 0;        // blocks of admissions found in this tier (loaded or not)
  int64_t loads = 0;       // blocks loaded from it to the device
  int64_t stores = 0;      // blocks written into it
  int64_t evictions = 0;   // blocks it dropped or moved down to make room
  int64_t demotions = 0;   // of those, moved down to the next tier
  int64_t refused = 0;     // stores refused: no unpinned slot, or a failed write
  int64_t errors = 0;      // blocks found bad when loaded (checksum, truncation)
  int64_t filtered = 0;    // blocks its admission filter kept out (store_threshold; min_hits on on_evict)
};

class TierManager {
 public:
  static constexpr int32_t kDevice = -1;
  static constexpr int32_t kNowhere = -2;

  // `num_device_blocks`: the device pool's size; `block_size` TOKENS; `key_size`
  // bytes per chained hash; `keep_tokens`: remember each block's parent and
  // tokens (for events and a disk file's headers); `record_events`: log TierRecords;
  // `lineage`: keys are names, blocks are found by `follow` (needs keep_tokens, and every
  // block cached with a parent: a chain's first block names its root); `token_bytes`:
  // how wide the strategy's token ids are (4 or 8), so how they are passed (packed,
  // little-endian as the machine) and kept.
  TierManager(int64_t num_device_blocks, int64_t block_size, int64_t key_size, std::vector<TierSpec> tiers,
              bool keep_tokens, bool record_events, bool lineage = false, int64_t token_bytes = 8);

  int32_t num_tiers() const { return static_cast<int32_t>(tiers_.size()); }
  int64_t block_size() const { return block_size_; }
  int64_t key_size() const { return key_size_; }
  bool keep_tokens() const { return keep_tokens_; }
  bool lineage() const { return lineage_; }
  int64_t token_bytes() const { return token_bytes_; }
  int64_t traffic() const { return traffic_; }
  int64_t num_slots(int32_t tier) const { return tier_at(tier).spec.num_slots; }
  int64_t num_used(int32_t tier) const { return tier_at(tier).index.size(); }
  const TierCounters& counters(int32_t tier) const { return tier_at(tier).counters; }
  int64_t num_device_cached() const { return device_.index.size(); }

  // -- the device side (the strategy reports what it caches, hits and evicts) --
  // Blocks `blocks` (device ids) now hold the packed `keys` (key_size bytes each),
  // a chain whose first block's parent is `parent` (nullopt: a chain start);
  // `tokens` (n * block_size packed ids, or empty) are theirs. `depth`, `request_tokens`
  // and `tag` describe the request that computed them. A block that already holds
  // its key is left as it is. Feeds write_through tiers.
  void device_cached(const std::vector<int64_t>& blocks, std::string_view keys, std::optional<std::string_view> parent,
                     std::string_view tokens, int64_t depth, int64_t request_tokens, int32_t tag);
  // Lineage only: device_cached, the blocks' names chosen here. A block that already
  // holds a name keeps it (a loaded block); one the tiers hold after the same parent with
  // the same tokens takes that copy's name (so its children stay reachable, as hashing
  // would give it its copy's key); any other a fresh name. `parent` names the block
  // before the first (a chain's root name at the start).
  void device_cached_named(const std::vector<int64_t>& blocks, std::string_view parent, std::string_view tokens,
                           int64_t depth, int64_t request_tokens, int32_t tag);
  // Lineage only: a name never given before (the manager counts them: key_size bytes,
  // the count little-endian, zero-padded).
  std::string new_name();
  // The key (name) the device mirror holds for `block`, or nullopt.
  std::optional<std::string> device_key(int64_t block) const;
  // An admission of `tokens` TOKENS (whole blocks) hit the device blocks `blocks`:
  // the traffic clock advances, each block counts a hit; feeds selective tiers.
  // Returns the request's chain depth: 1 + the depth of its last hit block when that
  // block was used by its computer alone (the request continues a chain's tail), else 0.
  int64_t admitted(int64_t tokens, const std::vector<int64_t>& blocks, int64_t request_tokens);
  // Device blocks the strategy no longer caches while their KV is still intact
  // (it lasts until the pool hands the block out and the new owner computes into
  // it, which the engine does after running the transfers recorded here): each is
  // demoted by the rules above. Blocks the mirror does not hold are ignored.
  void device_evicted(const std::vector<int64_t>& blocks);
  // Device blocks forgotten without demotion (a duplicate freed; a reset).
  void device_dropped(const std::vector<int64_t>& blocks);
  // Device blocks the mirror holds under `key` (several, for a block computed twice).
  std::vector<int32_t> device_holders(std::string_view key) const;
  bool device_has(int64_t block) const;
  const BlockMeta& device_meta(int64_t block) const;

  // -- look-up --
  // The tier holding `key` (the highest), and its slot; {kNowhere, -1} if none.
  std::pair<int32_t, int32_t> locate(std::string_view key) const;
  // Where each block of a chain is, from key `start` to `stop` (packed keys), until
  // the first block held nowhere: {kDevice, block} when `pool` caches it (the
  // earliest holder), else {tier, slot}. `pool` may be null (tiers only).
  std::vector<std::pair<int32_t, int32_t>> chain(const BlockPool* pool, std::string_view keys, int64_t start,
                                                 int64_t stop) const;

  // Lineage only: where each block of `tokens` (whole blocks) after the block keyed
  // `parent` is in the tiers, up to the first held nowhere: the slot whose parent is
  // the previous block's key and whose token ids equal the block's (the highest tier
  // first; in a tier, the earliest stored of such slots). Appends the found
  // slots' keys, packed, to `keys`.
  std::vector<std::pair<int32_t, int32_t>> follow(std::string_view parent, std::string_view tokens,
                                                  std::string* keys) const;

  // -- an admission's loads --
  // Pin slots so nothing this admission does evicts them; unpin() undoes it.
  void pin(const std::vector<std::pair<int32_t, int32_t>>& slots);
  void unpin(const std::vector<std::pair<int32_t, int32_t>>& slots);
  // Record a load of each (pinned) source into the device block `dst[i]`, unpin it,
  // promote it (out of an on_evict tier; refreshed in an inclusive one), and give
  // the device block the source's key, parent, tokens and meta (one hit more).
  // With `promote` false the sources stay pinned and in their tiers until
  // finish_loads(sources): a strategy whose device copy is not hittable until later (a
  // radix request's loaded pages, until its commit inserts them) keeps the block
  // findable, and announced, where it was.
  void load(const std::vector<std::pair<int32_t, int32_t>>& sources, const std::vector<int64_t>& dst,
            bool promote = true);
  // Unpin and promote sources a load(..., false) kept.
  void finish_loads(const std::vector<std::pair<int32_t, int32_t>>& sources);
  // Count blocks an admission found in lower tiers but chose not to load.
  void count_hits(int32_t tier, int64_t n);

  // -- the engine's side --
  // A slot whose data is bad (a checksum or a length that does not match) or whose
  // write failed: it leaves its tier, counted in errors (bad) or refused (failed).
  void drop(int32_t tier, int32_t slot, bool failed_write);
  // Copy into tier `t` (one that keeps what it loads: a disk tier) every block the device
  // mirror or a tier above `t` holds and `t` does not, device blocks first, at most
  // num_slots(t) of them (so a pass never evicts its own copies under LRU): what a
  // graceful shutdown writes so that a restart on the file finds every chain whole,
  // heads included. Stores are recorded (transfers, records, counters) like any other;
  // nothing leaves the tiers above. Returns the blocks stored.
  int64_t persist(int32_t t);
  // Put back a block a disk file holds (a restart): `slot` must be free.
  void restore(int32_t tier, int32_t slot, std::string_view key, std::optional<std::string_view> parent,
               std::string_view tokens, int64_t hits);
  std::string slot_key(int32_t tier, int32_t slot) const;
  std::optional<std::string> slot_parent(int32_t tier, int32_t slot) const;
  std::vector<int64_t> slot_tokens(int32_t tier, int32_t slot) const;
  int64_t slot_hits(int32_t tier, int32_t slot) const;
  // Slots of a tier that hold a block, ascending.
  std::vector<int32_t> used_slots(int32_t tier) const;

  // -- logs --
  std::vector<Transfer> drain_transfers();
  size_t num_transfers() const { return transfers_.size(); }
  // Whether a transfer recorded since the last drain writes into slot `slot` of `tier`
  // (its data is not there until the engine runs it).
  bool pending(int32_t tier, int32_t slot) const;
  std::vector<TierRecord> drain_records();

  // -- what the Python side's per-namespace tables may forget --
  // The namespace tags that a keyed device block, a tier's slot or an undrained record
  // carries, ascending; any other tag names nothing here and may be given out again.
  std::vector<int32_t> tags_in_use() const;
  // For each name in `names` (packed, key_size bytes each): whether a keyed device block
  // or a tier's slot follows it (names it as its parent). A chain root's name that
  // nothing follows can be forgotten: no look-up can pass through it.
  std::vector<bool> parents_in_use(std::string_view names) const;

  // Every tier emptied, the device mirror too, counters zeroed (a cache reset).
  void reset();
  // `pool`: the device pool (null: skip the device cross-check).
  void check_invariants(const BlockPool* pool) const;
  // Slots of a tier in eviction order (first out first); for tests.
  std::vector<int32_t> order(int32_t tier) const;

 private:
  struct Slots {
    explicit Slots(const TierSpec& s, int64_t key_size);
    TierSpec spec;
    KeyIndex index;                   // slot -> key; key -> its slot
    KeyIndex children_of;             // slot -> its parent's key; parent key -> child slots
    KeyIndex by_link;                 // lineage: slot -> its link (parent key, token hash)
    std::vector<std::string> parent;  // parent key (when has_parent)
    std::vector<uint8_t> has_parent;
    std::vector<BlockMeta> meta;
    std::vector<int32_t> pins;
    std::vector<int32_t> children;    // slots of this tier whose parent this slot holds
    std::vector<int64_t> stamp;       // tier clock at store / last touch
    std::vector<int64_t> created;
    std::vector<uint32_t> version;
    std::vector<int32_t> page;        // keep_tokens: the slot's TokenPages page (left in place when it empties)
    std::vector<int32_t> free_slots;  // keyless slots, the last pushed reused first
    std::vector<int32_t> free_pos;    // a slot's index in free_slots, or -1
    struct Entry {
      NativeKey key;
      uint64_t seq;
      int32_t slot;
      uint32_t version;
    };
    // Candidates in leaving order, lazily deleted (an entry whose version is stale is
    // skipped): those pushed after one leaving no later go to `run`, a queue already in
    // order (an LRU tier's every store and touch), the rest to `heap`; the next to leave
    // is the earlier of the two fronts.
    std::deque<Entry> run;
    std::vector<Entry> heap;
    size_t queued() const { return run.size() + heap.size(); }
    // Requests that used each of the last reuse_slots keys (store_threshold >= 2 only):
    // a GhostTable whose count is put back one higher at every use.
    GhostTable reuse;
    uint64_t next_seq = 0;
    int64_t clock = 0;
    TierCounters counters;
  };

  Slots& tier_at(int32_t t);
  const Slots& tier_at(int32_t t) const;
  int32_t check_slot(const Slots& s, int32_t t, int64_t slot, const char* what) const;
  int32_t check_block(int64_t block, const char* what) const;

  bool evictable(const Slots& s, int32_t slot) const;
  bool live(const Slots& s, const Slots::Entry& e) const;
  void push(Slots& s, int32_t slot);
  NativeKey key_of(const Slots& s, int32_t slot) const;
  // A free slot of tier t, moving a victim down (or dropping it) if need be; -1 if
  // every slot is pinned or nothing may leave.
  int32_t take_slot(int32_t t);
  // Store a block (from the device block `src` or slot `src` of tier `src_tier`) into
  // tier t; returns the slot, or -1 (refused). The caller checked t does not hold it.
  int32_t store(int32_t t, int32_t src_tier, int32_t src, std::string_view key, const std::string* parent,
                int32_t page, const BlockMeta& meta);
  void remove_slot(int32_t t, int32_t slot);
  // A request used the block `key` (computed or hit it): every reuse tracker counts it.
  void count_use(std::string_view key);
  // Whether tier s's store_threshold lets `key` in.
  static bool reused_enough(const Slots& s, std::string_view key);
  // A leaves-only tier's child counts, once `slot` holds its key and parent.
  void link_children(Slots& s, int32_t slot);
  // Unpin a loaded slot, and take it out of an on_evict tier (or refresh it in an inclusive one).
  void promote_slot(int32_t t, int32_t slot);
  // Where a block leaving tier t (-1: the device) goes, by the rules above.
  void demote(int32_t from, int32_t src, std::string_view key, const std::string* parent, int32_t page,
              const BlockMeta& meta);
  void record(bool stored, int32_t tier, std::string_view key, const std::string* parent, const char* tokens,
              int32_t tag);
  void compact(Slots& s);
  // fn(meta, parent or nullptr) for every keyed device block and tier slot.
  template <class Fn>
  void for_each_held(Fn&& fn) const {
    for (int32_t b = 0; b < num_device_blocks_; ++b) {
      if (device_.index.has_key(b)) fn(device_.meta[b], device_.has_parent[b] ? &device_.parent[b] : nullptr);
    }
    for (const Slots& s : tiers_) {
      for (int32_t i = 0; i < s.spec.num_slots; ++i) {
        if (s.index.has_key(i)) fn(s.meta[i], s.has_parent[i] ? &s.parent[i] : nullptr);
      }
    }
  }
  // The next candidate to leave (live or not), taken out; nullopt when none is queued.
  std::optional<Slots::Entry> pop(Slots& s);
  // device_cached's per-block work once keys are known (checked by the caller).
  void cache_one(int32_t b, std::string_view key, std::optional<std::string_view> up, const char* tokens,
                 int64_t depth, int64_t request_tokens, int32_t tag, uint64_t token_hash);
  // Lineage: the slot (tier, slot) holding the block after `up` with these tokens, or {kNowhere, -1}.
  std::pair<int32_t, int32_t> find_link(std::string_view up, const char* page, uint64_t token_hash) const;
  // The link index's key of a block: its parent's key, then its token hash. The view is
  // of a buffer the next call overwrites (one link is in use at a time; no allocation).
  std::string_view link_of(std::string_view parent, uint64_t token_hash) const;
  uint64_t hash_tokens(const char* page) const;
  // A page's ids as int64s.
  std::vector<int64_t> widened(const char* page) const;
  // Throws unless `key` is key_size bytes (what: the call's name; name: the argument's).
  void check_key_size(std::string_view key, const char* what, const char* name) const;
  // Throws unless `tokens` is `blocks` whole blocks of packed ids (what: the call's name).
  void check_token_bytes(std::string_view tokens, size_t blocks, const char* what) const;

  int64_t num_device_blocks_;
  int64_t block_size_;
  int64_t key_size_;
  bool keep_tokens_;
  bool record_events_;
  bool lineage_;
  int64_t token_bytes_;
  size_t page_bytes_;  // block_size x token_bytes: one block's packed ids
  uint64_t names_ = 0;  // lineage: names given so far
  mutable std::string link_;  // link_of's buffer
  int64_t traffic_ = 0;
  std::vector<Slots> tiers_;
  struct Device {
    explicit Device(int64_t n)
        : index(static_cast<int32_t>(n)), parent(n), has_parent(n, 0), meta(n), page(n, TokenPages::kNone) {}
    KeyIndex index;
    std::vector<std::string> parent;
    std::vector<uint8_t> has_parent;
    std::vector<BlockMeta> meta;
    std::vector<int32_t> page;  // keep_tokens: the block's page (left in place when it is evicted)
  } device_;
  // keep_tokens: every block's token ids, shared by the device mirror and the tiers (a
  // demotion or a load passes a page along, it copies nothing); one page per holder.
  TokenPages pages_;
  int64_t pages_capacity() const;
  std::vector<Transfer> transfers_;
  std::vector<TierRecord> records_;
  CallFlag calls_;
};

}  // namespace prefixcache
