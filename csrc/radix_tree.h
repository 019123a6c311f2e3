// RadixTree: SGLang's RadixAttention prefix tree (mem_cache/radix_cache.py,
// v0.5.23) over the shared BlockPool.
//
// Owns: the compressed prefix tree of cached token runs, one pool reference per
// block it holds, the lock refs that protect the paths of live requests, the
// exact evictable / protected sizes, a logical clock for recency, and eviction
// of unlocked leaves by policy priority. Mirrors the pure-Python reference
// model in tests/reference/radix_tree.py; the two must agree operation for
// operation (tests/test_radix_tree_stateful.py).
//
// Never does: allocate blocks, hash, record events, or know about requests.
// The caller (backends/radix.py) allocates a request's blocks, hands them to
// the tree with insert() and frees the duplicates insert() gives back.
// Every bad argument throws (std::invalid_argument -> ValueError,
// std::out_of_range -> IndexError) before anything changes.
//
// Shape. Each namespace (SGLang's extra_key; nullopt is a namespace of its
// own) has its own root, so equal tokens in two namespaces never share a node.
// A root exists only while it has children or locks: insert() creates it, and it
// is dropped when its last child is evicted and no lock is held through it
// (match_prefix never creates one: an empty match names node 0, "no node", which
// lock and unlock take as a no-op). So the tree's memory follows what it caches,
// however many namespaces come and go. Every node knows its root, so node(id) is
// O(1).
// A non-root node holds a run of tokens whose length is a positive multiple
// of the page size (SGLang's page_size, our block_size) and one block per
// page. Children are keyed by their first page; pages compare whole, so a
// difference anywhere in a page is a miss for that page.
//
// Invariants (checked by check_invariants):
//   * lock_ref(parent) >= lock_ref(child): a request locks root -> node (a
//     root's lock_ref counts the locks held in its namespace; it holds no tokens).
//   * Every root has a child or a lock.
//   * evictable_size = tokens in nodes with lock_ref 0, protected_size = the
//     rest; a node's split keeps its lock_ref on both halves, so a split moves
//     neither size.
//   * The evictable leaves are exactly the non-root nodes with lock_ref 0 and
//     no children; every unlocked node is reachable by evicting leaves, so
//     evictable_size is what evicting everything would free.
//   * Every block in the tree appears once and holds a pool reference.
//
// Eviction order. Unlocked leaves sit in a persistent ordered set keyed by
// (policy key, node id): O(log n) per evicted leaf, however many leaves there are
// (SGLang rebuilds a heap over every evictable leaf on each eviction; same victims,
// same order). A leaf whose policy inputs change (a walk touches it) is marked
// dirty and re-keyed when the next eviction starts, so a touch costs O(1). The key
// is the native order's (native_key), or a LeafRanker's (a Python policy: asked once
// when a leaf becomes a candidate or changes, never per eviction call). evict_by,
// a ranking passed per call, is asked once per candidate per call over a heap built
// per call: it may differ from call to call, so nothing can be kept.
//
// hit_count (SGLang 0.5.23): counted at insert, not at match_prefix. An insert walk
// counts a hit on each node ending past `inserted` (the tokens this caller inserted
// before: SGLang's cache_inserted_len) and on the node it creates, so a request counts
// each node once; a split's upper half copies the count.
//
// Clock. A counter, not wall time, so replays are reproducible. Each match
// or insert takes one tick for the nodes it walks; each node it creates takes
// a tick of its own (SGLang stamps new nodes with time.monotonic() after the
// walk's timestamp, so they sort as more recent; the order is the same).
//
// Extending a locked path (extend). A request that inserts again re-walks its
// whole path in SGLang, re-stamping every node from the root. extend() walks
// only the new tokens below the caller's node and leaves the path above as a
// PathStamp on that node: what the re-walk would have written there (its tick,
// traffic clock, request length, priority, and the depth of any leaf it created,
// for tlru's history_len). The stamp is folded into the path when the node's
// lock is dropped (unlock walks the path anyway), so a commit costs O(new pages),
// not O(path). Nothing can read the difference meanwhile: only unlocked leaves
// are ranked, a locked node and its ancestors are never one, every fold is a max
// (or "the latest tick's values"), and node() reports the folded values.
#pragma once

#include <algorithm>
#include <cstddef>
#include <climits>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "block_pool.h"
#include "call_flag.h"
#include "eviction_order.h"
#include "ghost_table.h"
#include "repeat_finder.h"

namespace prefixcache {

using Namespace = std::optional<std::string>;
using TokenSpan = std::span<const int32_t>;

// The built-in eviction orders (eviction_order.h) are evaluated natively: a
// priority is a pair compared lexicographically; the smallest is evicted
// first, ties go to the older node (smaller id).
//
// Use history (for orders that count reuse, gslru). Each node also keeps
// use_count (requests that used it: each match_prefix that hits it, each
// insert that walks it beyond the inserting request's own prefix, the one
// that creates it), last_use (the traffic clock, TOKENS admitted by
// match_prefix, at the latest insert that walked it) and request_tokens (that
// insert's length). With a ghost table (ghost_capacity > 0), a node's pages
// have 64-bit content keys chained from the namespace root (chain_page_key);
// an evicted leaf leaves its use count under each page's key, and a new leaf
// continues the largest count its pages left, so content that comes back is
// known to be reused. Without one, none of this hashing happens.
struct RadixNode;

// What an insert walk writes on each node of a path above where it starts
// (see "Extending a locked path"); time == 0: nothing owed.
struct PathStamp {
  int64_t time = 0;            // the walk's tick: last_access_time and use_time
  int64_t last_use = 0;        // the traffic clock then
  int64_t request_tokens = 0;  // the walk's key length, TOKENS
  int64_t priority = INT64_MIN;
  int64_t history = 0;         // deepest cached_prefix_len created below (tlru)

  // Both walks' effect, as if both had run (the later tick's values win).
  void merge(const PathStamp& o) {
    if (o.time > time) {
      time = o.time;
      last_use = o.last_use;
      request_tokens = o.request_tokens;
    }
    priority = std::max(priority, o.priority);
    history = std::max(history, o.history);
  }
};

// A view of a page of tokens: a child's key, or a look-up into a query.
struct PageKey {
  const int32_t* data;
  size_t len;
};
struct PageKeyHash {
  size_t operator()(const PageKey& k) const noexcept;
};
struct PageKeyEq {
  bool operator()(const PageKey& a, const PageKey& b) const noexcept;
};
// The key views the child's own first page, so the child's tokens must be
// re-keyed whenever they change (only a split changes them).
using ChildMap = std::unordered_map<PageKey, RadixNode*, PageKeyHash, PageKeyEq>;

struct RadixNode {
  int64_t id = 0;
  RadixNode* parent = nullptr;  // nullptr for a namespace root
  std::vector<int32_t> tokens;  // the run this edge adds; empty for a root
  std::vector<int32_t> blocks;  // one per page of `tokens`
  ChildMap children;
  int64_t lock_ref = 0;
  int64_t last_access_time = 0;
  int64_t creation_time = 0;
  int64_t hit_count = 0;
  int64_t priority = 0;
  int64_t use_count = 0;       // see "Use history" above
  int64_t last_use = 0;        // traffic clock at the latest insert through it
  int64_t request_tokens = 0;  // that insert's length, TOKENS
  uint64_t tail_key = 0;       // content key of its last page (a root: of its namespace); ghost only
  int64_t cached_prefix_len = 0;  // TOKENS root -> end of this node (tlru)
  int64_t history_len = 0;        // deepest cached_prefix_len its branch reached (tlru; never shrinks)
  int64_t use_time = 0;           // clock of the insert that set last_use / request_tokens
  int64_t leaf_slot = -1;  // index in RadixTree::evictable_leaves_, or -1
  bool dirty = false;      // policy inputs changed since its key in the leaf order was computed
  PathStamp pending;       // stamps owed to root -> this node (see "Extending a locked path")
  RadixNode* root = nullptr;             // its namespace's root (itself for a root)
  const std::string* ns_name = nullptr;  // a named root: its namespace (the key in named_roots_)

  bool is_root() const { return parent == nullptr; }
};

// A caller's ranking of eviction candidates (a Python policy), for a tree without a
// native order. The tree keeps each leaf's key, made by rank() when the leaf becomes a
// candidate or its inputs change, orders keys by less(), and releases a key it drops;
// it never looks inside one. rank() and less() may throw: the tree stays consistent,
// and a leaf whose key could not be made or placed is ranked again at the next eviction.
class LeafRanker {
 public:
  virtual ~LeafRanker() = default;
  virtual uint64_t rank(const EvictionCandidate& candidate) = 0;  // a handle to the key made
  virtual bool less(uint64_t a, uint64_t b) const = 0;
  virtual void release(uint64_t key) noexcept = 0;
};

struct MatchResult {
  int64_t num_tokens = 0;          // matched tokens, whole pages
  std::vector<int32_t> blocks;     // the blocks holding them
  int64_t node = 0;                // last node of the match (see match / match_prefix)
  int64_t unlocked_tokens = 0;     // matched tokens in nodes with lock_ref 0
};

struct InsertResult {
  int64_t prefix_len = 0;          // leading tokens that were already in the tree
  int64_t node = 0;                // the node that ends at the inserted key's end
  std::vector<int32_t> displaced;  // caller's blocks replaced by the tree's (duplicates)
};

// A copy of one node, for inspection and tests: its shape, then what a policy reads
// about it (eviction_order.h's stamps, with the stamps owed to it folded in).
struct NodeInfo {
  int64_t id = 0;
  std::optional<int64_t> parent;
  Namespace ns;
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;
  int64_t lock_ref = 0;
  std::vector<std::pair<std::vector<int32_t>, int64_t>> children;  // (first page, id), by id
#define PREFIXCACHE_NODE_INFO_STAMP(name, doc) int64_t name = 0;
  PREFIXCACHE_CANDIDATE_STAMPS(PREFIXCACHE_NODE_INFO_STAMP)
#undef PREFIXCACHE_NODE_INFO_STAMP
};

class RadixTree {
 public:
  // `pool` must outlive the tree. page_size is in tokens (1 = token level).
  // The leaf order is the native `order` or the `ranker`'s (not both); with
  // neither, only evict_by() can evict (a policy the caller ranks per call).
  // `params` go to the order (gslru); ghost_capacity is in pages (0: no history).
  RadixTree(BlockPool& pool, int64_t page_size, std::optional<EvictionOrder> order, OrderParams params = {},
            int64_t ghost_capacity = 0, std::unique_ptr<LeafRanker> ranker = nullptr);
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  int64_t page_size() const { return static_cast<int64_t>(page_); }
  std::optional<EvictionOrder> order() const { return order_; }

  // Pure look-up: the longest cached whole-page prefix of `tokens` (cut to
  // whole pages first). Splits nothing and touches no clock. `node` is the
  // deepest node the match reaches, which may extend past num_tokens.
  MatchResult match(TokenSpan tokens, const Namespace& ns) const;

  // SGLang's match_prefix: the same look-up, but a match that ends inside a
  // node splits it so `node` ends exactly at num_tokens, every node walked
  // gets a fresh last_access_time, and each node of the matched path counts a
  // use. A namespace without a root gets none: `node` is 0 (no node).
  MatchResult match_prefix(TokenSpan tokens, const Namespace& ns);

  // SGLang's insert: adds `tokens` (a whole number of pages) whose pages from
  // token `start` on are stored in `blocks` (one per page). The caller already
  // holds the first `start` tokens from the tree (SGLang's cache_protected_len),
  // so they must be present. Pages already present keep the tree's blocks: on
  // return the entries of `blocks` for them hold the tree's ids, and every
  // caller id replaced is listed in `displaced` (still the caller's to free).
  // The remaining blocks now belong to the tree (it owns their pool reference).
  // Walked nodes get a fresh last_access_time and priority = max(priority, p).
  // `inserted` (TOKENS) is what this caller inserted before, for hit counting (see
  // the top of this file); -1 means `start`.
  InsertResult insert(TokenSpan tokens, std::span<int32_t> blocks, const Namespace& ns, int64_t priority,
                      int64_t start = 0, int64_t inserted = -1);

  // insert() continued from `node`: the same as inserting the tokens of root ->
  // node followed by `tokens` with start = inserted = the node's depth, i.e. a
  // caller that holds the path to `node` (and inserted it) adds the pages after
  // it, stored in `blocks` (one per page of `tokens`; re-pointed in place as
  // insert() does). prefix_len counts from the root. Costs O(tokens) when
  // `node` is locked (the path above is stamped lazily), O(path) otherwise.
  InsertResult extend(int64_t node, TokenSpan tokens, std::span<int32_t> blocks, int64_t priority);

  // Moves one lock from `from` to `to`: lock(to) then unlock(from), in
  // O(nodes between them) when `to` is `from` or below it (a commit's new end).
  // `from` must be locked (0, no node: a plain lock(to)); nothing changes if an
  // argument is bad.
  void relock(int64_t from, int64_t to);

  // Lock / unlock the path root -> node; the root counts the lock, so it stays
  // while the lock is held. Node 0 (no node) is a no-op. unlock of an unlocked
  // node throws; an unlock that leaves a root without children or locks drops it.
  void lock(int64_t node);
  void unlock(int64_t node);

  // Evicts unlocked leaves, lowest priority first, until at least num_tokens
  // are freed or nothing is evictable; a parent whose last child goes (and
  // that is unlocked) becomes a candidate. Frees the blocks to the pool and
  // returns the tokens evicted (may exceed num_tokens: leaves go whole).
  // Uses the tree's leaf order (native or ranker); throws if it has neither. If
  // the ranker throws, what was evicted stays evicted and last_evicted() lists it.
  int64_t evict(int64_t num_tokens);

  // evict() ordered by a caller's priority. `rank` is called once per
  // candidate (each initial leaf, then each parent as it becomes one), never
  // per comparison. If rank or a comparison fails (KeyCompare), what was evicted
  // stays evicted and consistent, and last_evicted() lists it; a failure while
  // the first candidates are ranked and ordered evicts nothing. While it runs,
  // a call that would change the tree (from rank, say) throws ReentryError.
  template <class Key, class Rank>
  int64_t evict_by(int64_t num_tokens, Rank&& rank);

  // Blocks freed by the latest evict call, in eviction order (leaf by leaf,
  // each leaf's in token order).
  const std::vector<int32_t>& last_evicted() const { return last_evicted_; }

  // Frees every block and drops every node; throws if anything is locked (a
  // root included).
  // Ids and the clock keep counting.
  void reset();

  int64_t total_size() const { return evictable_size_ + protected_size_; }
  int64_t evictable_size() const { return evictable_size_; }
  int64_t protected_size() const { return protected_size_; }
  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size()); }  // roots included
  int64_t clock() const { return clock_; }
  // Whether the tree's leaves are ranked by a LeafRanker (a Python policy in the
  // binding): then dropping a key may run the caller's code in the middle of any call.
  bool has_ranker() const { return ranker_ != nullptr; }
  int64_t traffic() const { return traffic_; }
  const GhostTable& ghost() const { return ghost_; }
  std::optional<int64_t> root(const Namespace& ns) const;
  std::vector<Namespace> namespaces() const;  // those with a root, sorted (None first)
  NodeInfo node(int64_t id) const;  // O(1)
  EvictionCandidate candidate(const RadixNode& node) const;

  // Throws InvariantError naming the first broken invariant (see the top of
  // this file). With `locked_nodes` (one entry per live lock), also requires
  // every lock_ref to equal the number of those nodes in its subtree.
  void check_invariants(const std::optional<std::vector<int64_t>>& locked_nodes) const;

 private:
  struct Walk;  // a look-up's path, computed before anything changes

  Walk walk(TokenSpan key, RadixNode* root) const;
  // insert() below `from` (depth `base`): validates (throws before any change),
  // then `apply_insert` changes the tree. Offsets (start, inserted) are absolute.
  void check_insert(const Walk& w, const MatchResult& present, std::span<int32_t> blocks, size_t first,
                    const char* what) const;
  InsertResult apply_insert(RadixNode* from, const Walk& w, const MatchResult& present, TokenSpan key,
                            std::span<int32_t> blocks, size_t first, int64_t start, int64_t inserted,
                            int64_t priority, int64_t now, int64_t request_tokens, int64_t* deepest);
  static void apply_stamp(RadixNode* n, const PathStamp& s);
  void stamp_path(RadixNode* from, const PathStamp& s);
  PathStamp owed(const RadixNode* n) const;  // stamps not yet folded into n
  MatchResult collect(const Walk& w) const;
  TokenSpan whole_pages(TokenSpan tokens) const;
  RadixNode* root_of(const Namespace& ns) const;
  RadixNode* root_or_create(const Namespace& ns);
  std::vector<RadixNode*> roots() const;  // None's first, then the named ones in map order
  RadixNode* node_ptr(int64_t id, const char* what) const;
  RadixNode* new_node(RadixNode* parent, int64_t stamp);
  RadixNode* split(RadixNode* child, size_t split_len, int64_t stamp);
  void touch_path(const Walk& w, int64_t access_time, std::optional<int64_t> priority);
  void update_leaf_status(RadixNode* node);
  void set_evictable_leaf(RadixNode* node, bool evictable);
  void touched(RadixNode* node);  // its policy inputs changed: re-key it before the next eviction
  void refresh_order();
  void rekey(RadixNode* leaf);    // (re)place an evictable leaf in the leaf order; clears dirty
  void unorder(RadixNode* node);  // take it out of the leaf order
  void unrank_all();              // empty a ranker's order: every ranked leaf is ranked again
  void raise_history(RadixNode* node, const RadixNode* stop = nullptr);
  void delete_leaf(RadixNode* leaf);  // may drop its parent, if that is a root left empty
  void drop_root_if_empty(RadixNode* root);
  void stamp_use(RadixNode* n, bool counts, int64_t request_tokens, int64_t now);
  uint64_t page_key_after(uint64_t parent_key, const RadixNode& n, size_t page) const;
  uint64_t namespace_key(const Namespace& ns) const;
  size_t mismatch(const RadixNode& node, TokenSpan key, size_t at) const;

  BlockPool& pool_;
  size_t page_;  // tokens per page
  std::optional<EvictionOrder> order_;
  OrderParams params_;
  GhostTable ghost_;
  std::unordered_map<int64_t, std::unique_ptr<RadixNode>> nodes_;
  RadixNode* none_root_ = nullptr;
  std::unordered_map<std::string, RadixNode*> named_roots_;
  std::vector<RadixNode*> evictable_leaves_;
  // The native order's persistent leaf order (see "Eviction order"), and the ids of
  // nodes to re-key (some may be gone, or clean again: skipped).
  struct OrderEntry {
    NativeKey key;
    int64_t id;
    bool operator<(const OrderEntry& o) const { return key != o.key ? key < o.key : id < o.id; }
  };
  std::set<OrderEntry> order_set_;
  std::unordered_map<int64_t, std::set<OrderEntry>::iterator> order_of_;
  // The ranker's leaf order: (key handle, id), keys compared by the ranker.
  struct RankedEntry {
    uint64_t key;
    int64_t id;
  };
  struct RankedLess {
    const LeafRanker* ranker;
    bool operator()(const RankedEntry& a, const RankedEntry& b) const {
      if (ranker->less(a.key, b.key)) return true;
      if (ranker->less(b.key, a.key)) return false;
      return a.id < b.id;
    }
  };
  using RankedSet = std::set<RankedEntry, RankedLess>;
  std::unique_ptr<LeafRanker> ranker_;
  RankedSet ranked_set_{RankedLess{nullptr}};
  std::unordered_map<int64_t, RankedSet::iterator> ranked_of_;
  std::vector<int64_t> dirty_;
  std::unordered_set<RadixNode*> pending_;  // nodes holding a PathStamp (all locked)
  std::vector<uint8_t> in_tree_;  // per pool block: 1 if a node holds it
  RepeatFinder repeats_;  // insert's duplicate check, one flag per pool block
  int64_t evictable_size_ = 0;
  int64_t protected_size_ = 0;
  int64_t clock_ = 0;
  int64_t traffic_ = 0;  // TOKENS (whole pages) match_prefix was asked for
  int64_t next_id_ = 1;
  std::vector<int32_t> last_evicted_;
  CallFlag calls_;  // set while evict_by runs the caller's ranking (call_flag.h)
};

// ---------------------------------------------------------------------------
// Template definition (here so the Python binding can rank with Python keys).

template <class Key, class Rank>
int64_t RadixTree::evict_by(int64_t num_tokens, Rank&& rank) {
  CallFlag::Scope running(calls_, "RadixTree.evict");
  last_evicted_.clear();  // first: a call that throws has evicted nothing
  if (num_tokens < 0) throw std::invalid_argument("evict: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  struct Entry {
    Key key;
    int64_t id;
    RadixNode* node;
  };
  // std heaps are max-heaps: "a goes below b" when a should be evicted later.
  auto later = [](const Entry& a, const Entry& b) {
    if (b.key < a.key) return true;
    if (a.key < b.key) return false;
    return a.id > b.id;
  };
  std::vector<Entry> heap;
  heap.reserve(evictable_leaves_.size());
  for (RadixNode* leaf : evictable_leaves_) heap.push_back(Entry{rank(*leaf), leaf->id, leaf});
  std::make_heap(heap.begin(), heap.end(), later);
  KeyCompare<Key>::check();

  int64_t evicted = 0;
  while (evicted < num_tokens && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    KeyCompare<Key>::check();
    Entry top = std::move(heap.back());
    heap.pop_back();
    RadixNode* leaf = top.node;
    RadixNode* parent = leaf->parent;
    // Rank the parent before changing anything, so a throwing rank leaves
    // this step undone.
    std::optional<Key> parent_key;
    if (!parent->is_root() && parent->children.size() == 1 && parent->lock_ref == 0) {
      parent_key.emplace(rank(*parent));
    }
    evicted += static_cast<int64_t>(leaf->tokens.size());
    delete_leaf(leaf);
    if (parent_key) {
      heap.push_back(Entry{std::move(*parent_key), parent->id, parent});
      std::push_heap(heap.begin(), heap.end(), later);
      KeyCompare<Key>::check();
    }
  }
  return evicted;
}

}  // namespace prefixcache
