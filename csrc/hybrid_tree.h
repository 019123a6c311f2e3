// HybridTree: the radix tree of the `radix` strategy over a hybrid layout (SGLang
// 0.5.23's UnifiedTreeCore), native. The definition is the pure-Python reference
// model, backends/hybrid_radix_tree.py (its module docstring says what each component
// does); this core must agree with it operation for operation, down to
// node ids, clocks, LRU orders and the order ids are freed in
// (tests/test_hybrid_tree_native_stateful.py).
//
// Owns: one compressed prefix tree whose nodes carry FULL pages, SWA pages or an SWA
// tombstone, and an optional MAMBA state; per-component lock refs, evictable /
// protected sizes, LRU lists (SWA, MAMBA), the evictable-leaf set, the inner-state
// set; the clocks (access times, LRU stamps, SWA lock uuids); the freed-id log and
// the event log.
//
// Never does: allocate, free, or call back into Python. What the tree lets go of is
// appended to the freed log (component, ids) in the order the reference model hands
// it to its `free` callback; the caller drains it (take_freed) after each call and
// returns the ids to its pools in that order. Store / remove events go to the event
// log the same way when recording is on. Every bad argument throws
// std::invalid_argument before anything changes; a broken invariant throws
// InvariantError (block_pool.h).
//
// Nodes live in slots that are reused once a node leaves the tree; a NodeRef names
// a slot and the node's id, and every entry point checks that the slot still holds
// that node (a stale ref is an invalid_argument, never a read of another node).
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace prefixcache {

enum HybridComponent : int { kHybridFull = 0, kHybridSwa = 1, kHybridMamba = 2 };

struct HybridNodeRef {
  int32_t slot = -1;
  int64_t id = -1;
  bool operator==(const HybridNodeRef& o) const { return slot == o.slot && id == o.id; }
};

inline constexpr int64_t kHybridNone = std::numeric_limits<int64_t>::min();  // Python's None for an int

struct HybridMatch {
  int64_t num_tokens = 0;
  HybridNodeRef node;
  int64_t full_hit = 0;
  int64_t swa_branching = kHybridNone;
  int64_t mamba_branching = kHybridNone;
  std::vector<std::pair<HybridNodeRef, int64_t>> path;  // (node, TOKENS of it covered)
  std::optional<std::pair<HybridNodeRef, int64_t>> inside;
  uint64_t version = 0;  // the tree's version the match was made on (settle checks it)
};

struct HybridReceipt {
  HybridNodeRef node;
  int64_t swa_uuid = kHybridNone;
};

struct HybridInsert {
  int64_t prefix_len = 0;
  HybridNodeRef node;
  bool mamba_exist = false;
  bool swa_branch_inserted = false;
};

struct HybridFreed {
  int component;
  std::vector<int64_t> ids;
};

// A store or remove of a component's pages [first, end) on a node (a state: its last
// page), with what an event names taken at that moment: the node may be split or gone
// by the time the caller reads the log.
struct HybridEvent {
  bool stored;  // false: removed
  int64_t node_id;
  int component;
  int64_t first, end;  // pages
  std::vector<std::string> hashes;  // the pages' chained hashes (none given: empty)
  std::optional<std::string> parent_hash;  // stores: the hash of the page before
  int64_t depth = 0;  // stores: pages before `first` on the path
  std::vector<int32_t> tokens;  // stores: the pages' tokens
  int64_t ns = 0;
};

struct HybridInsertArgs {
  std::span<const int32_t> tokens;
  int64_t ns = 0;
  std::span<const int64_t> pages;
  std::optional<std::span<const int64_t>> swa_pages;
  int64_t prev_prefix_len = 0;
  int64_t swa_evicted = 0;
  int64_t swa_branching = kHybridNone;
  int64_t mamba_value = kHybridNone;
  std::optional<std::vector<std::string>> hashes;  // every page's chained hash (events only)
};

// A node as the caller reads it (a copy: valid until the next call).
struct HybridNodeView {
  int64_t id;
  int64_t parent_id;  // -1: the root
  std::vector<int32_t> key;
  std::vector<int64_t> full;
  std::optional<std::vector<int64_t>> swa;
  int64_t mamba;  // kHybridNone: none
  std::array<int64_t, 3> locks;
  int64_t swa_uuid;
  double last_access;
  std::array<uint64_t, 3> stamps;
  int64_t ns;
  std::vector<int64_t> children;  // ids, in insertion order
};

class HybridTree {
 public:
  HybridTree(int64_t page_size, bool has_swa, bool has_mamba, int64_t window, int64_t state_grid,
             bool no_tail_cliff, bool record_events);

  void reset();

  HybridMatch match(std::span<const int32_t> tokens, int64_t ns) const;
  HybridMatch settle(const HybridMatch& out);
  std::array<int64_t, 3> lock_cost(const HybridMatch& hit) const;
  HybridReceipt lock(HybridNodeRef node);
  void unlock(const HybridReceipt& receipt);
  HybridInsert insert(const HybridInsertArgs& args);
  // want[c]: TOKENS (MAMBA: states) to free; reach[c] >= 0: the component is targeted,
  // and its walk stops once it freed that much (the caller's pool can serve then).
  std::array<int64_t, 3> evict(std::array<int64_t, 3> want, std::array<int64_t, 3> reach);
  void drop_states(const std::vector<HybridNodeRef>& nodes);

  std::vector<int64_t> path_pages(HybridNodeRef node) const;
  std::vector<int64_t> path_swa(HybridNodeRef node) const;  // -1 (NULL_BLOCK) for a tombstone's pages
  // A match's pages of FULL or SWA (-1 for a tombstone's), as far as its path covers.
  std::vector<int64_t> hit_pages(const HybridMatch& hit, int component) const;
  int64_t state(HybridNodeRef node) const { return nodes_[slot(node)].mamba; }  // kHybridNone: none
  std::vector<HybridNodeRef> path_nodes(HybridNodeRef node) const;
  std::vector<HybridNodeRef> nodes() const;  // the reference model's nodes() order
  std::vector<HybridNodeRef> children(HybridNodeRef node) const;  // in insertion order
  HybridNodeView view(HybridNodeRef node) const;
  std::vector<int64_t> lru_order(int component) const;  // ids, most recent first
  HybridNodeRef root() const { return ref(root_); }
  HybridNodeRef parent(HybridNodeRef node) const;
  void check_invariants(const std::vector<HybridReceipt>& locks) const;

  std::vector<HybridFreed> take_freed() { return std::exchange(freed_, {}); }
  std::vector<HybridEvent> take_events() { return std::exchange(events_, {}); }

  bool has(int c) const { return c == kHybridFull || (c == kHybridSwa ? has_swa_ : c == kHybridMamba && has_mamba_); }
  int64_t evictable(int c) const { return evictable_.at(c); }
  int64_t protected_size(int c) const { return protected_.at(c); }
  int64_t num_nodes() const { return num_nodes_; }
  int64_t page_size() const { return page_; }
  int64_t window() const { return window_; }
  bool no_tail_cliff() const { return no_tail_cliff_; }
  // Tests only: MAMBA's first no_tail_cliff walk asks every state of the LRU, not just
  // the inner ones (what walk_inner_states must evict the same as).
  void set_walk_every_state(bool on) { walk_every_state_ = on; }

 private:
  struct Node {
    int64_t id = -1;
    bool alive = false;
    int32_t parent = -1;
    std::vector<int32_t> children;  // insertion order: the reference model's dict order
    std::vector<int32_t> key;
    std::vector<int64_t> full;
    bool has_swa = false;
    std::vector<int64_t> swa;
    int64_t mamba = kHybridNone;
    std::array<int64_t, 3> locks{0, 0, 0};
    int64_t swa_uuid = kHybridNone;
    double last_access = 0.0;
    std::array<int32_t, 3> prev{-1, -1, -1}, next{-1, -1, -1};  // LRU links
    std::array<uint64_t, 3> stamps{0, 0, 0};
    std::array<bool, 3> in_lru{false, false, false};
    int64_t ns = 0;
    bool has_hashes = false;
    std::vector<std::string> hashes;
    int32_t leaf_pos = -1;   // index in leaves_, -1: not an evictable leaf
    int32_t inner_pos = -1;  // index in inner_states_
  };
  using Tracker = std::array<int64_t, 3>;

  // -- slots ---------------------------------------------------------------------------
  HybridNodeRef ref(int32_t s) const { return {s, nodes_[s].id}; }
  int32_t slot(HybridNodeRef r) const;  // throws for a stale or foreign ref
  bool holds(int32_t s, int64_t id) const { return s >= 0 && nodes_[s].alive && nodes_[s].id == id; }
  int32_t new_node();
  void drop_slot(int32_t s);
  double tick() { double t = clock_; clock_ += 1.0; return t; }

  // -- children --------------------------------------------------------------------------
  uint64_t child_hash(int32_t parent, int64_t ns, const int32_t* page) const;
  int32_t find_child(int32_t parent, int64_t ns, const int32_t* page) const;
  void add_child(int32_t parent, int32_t child);
  void remove_child(int32_t parent, int32_t child);
  void replace_child(int32_t parent, int32_t old_child, int32_t new_child);

  // -- sets --------------------------------------------------------------------------
  bool is_leaf(int32_t s) const;
  void refresh_leaf(int32_t s);
  void leaf_discard(int32_t s);
  void inner_add(int32_t s);
  void inner_discard(int32_t s);

  // -- LRU (SWA, MAMBA) ------------------------------------------------------------------
  int32_t head(int c) const { return c == kHybridSwa ? 0 : 2; }
  int32_t tail(int c) const { return head(c) + 1; }
  void link_after(int c, int32_t prev, int32_t s);
  void unlink(int c, int32_t s);
  void lru_insert_mru(int c, int32_t s);
  void lru_insert_after(int c, int32_t prev, int32_t s);
  void lru_remove(int c, int32_t s);
  void lru_move_to_mru(int c, int32_t s);
  void refresh_window(int32_t s, int64_t span);
  int32_t prev_unlocked(int c, int32_t s) const;  // -1: none
  int32_t lru_unlocked(int c) const { return prev_unlocked(c, tail(c)); }

  // -- values ------------------------------------------------------------------------
  bool has_value(int32_t s, int c) const;
  int64_t size(int32_t s, int c) const;
  void free_ids(int c, std::vector<int64_t> ids);
  void event(bool stored, int32_t s, int c);
  void set_swa(int32_t s, std::vector<int64_t> swa);
  void set_mamba(int32_t s, int64_t state);

  // -- structure ----------------------------------------------------------------------
  int64_t match_len(int32_t s, std::span<const int32_t> tokens, int64_t offset) const;
  int32_t split(int32_t child, int64_t split_len);
  int32_t add_leaf(int32_t parent, std::span<const int32_t> key, std::vector<int64_t> pages, int64_t ns,
                   const std::optional<std::vector<std::string>>& hashes, int64_t first_page);
  void touch_match(int32_t best);
  std::optional<std::pair<int32_t, int64_t>> swa_span(int32_t s, int64_t start, int64_t end, int64_t window_start);
  int64_t swa_overlap(int32_t s, int64_t total, int64_t m, const HybridInsertArgs& a);
  void swa_publish(int32_t leaf, int64_t start, int64_t end, const HybridInsertArgs& a);

  // -- eviction ------------------------------------------------------------------------
  void evict_component(int32_t s, int c, Tracker& tracker);
  void delete_leaf(int32_t s, Tracker& tracker);
  void cascade(int32_t s, int trigger, Tracker& tracker);
  bool done(int c, const Tracker& tracker, const std::array<int64_t, 3>& reach) const {
    return reach[c] >= 0 && tracker[c] >= reach[c];
  }
  void evict_full(int64_t quota, Tracker& tracker, const std::array<int64_t, 3>& reach);
  enum class Skip { kNone, kBranchTails, kDeepestStates };
  void walk_aux(int c, int64_t quota, Tracker& tracker, const std::array<int64_t, 3>& reach, Skip skip);
  void walk_inner_states(int64_t quota, Tracker& tracker, const std::array<int64_t, 3>& reach);
  bool viable(int32_t s) const;
  int32_t prune_dead(int32_t s, Tracker& tracker);
  std::vector<int32_t> leaves_reading(int32_t s) const;
  bool deepest_state(int32_t s) const;
  bool in_branch_tail(int32_t s) const;

  const int64_t page_;
  const bool has_swa_, has_mamba_;
  const int64_t window_, state_grid_;
  const bool no_tail_cliff_, record_events_;
  bool walk_every_state_ = false;

  std::vector<Node> nodes_;  // slots 0..3: the SWA and MAMBA LRU sentinels
  std::vector<int32_t> free_slots_;
  int32_t root_ = -1;
  std::unordered_multimap<uint64_t, int32_t> child_index_;
  std::vector<int32_t> leaves_;
  std::vector<int32_t> inner_states_;
  std::array<int64_t, 3> evictable_{0, 0, 0}, protected_{0, 0, 0};
  std::array<size_t, 3> lru_size_{0, 0, 0};
  std::array<uint64_t, 3> lru_clock_{0, 0, 0};
  int64_t num_nodes_ = 0;
  int64_t next_id_ = 0;
  int64_t next_uuid_ = 0;
  double clock_ = 1.0;
  uint64_t version_ = 0;
  std::vector<HybridFreed> freed_;
  std::vector<HybridEvent> events_;
};

}  // namespace prefixcache
