// RadixTree implementation. See radix_tree.h for what it owns and its invariants.
#include "radix_tree.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

namespace prefixcache {

namespace {

std::string node_str(const RadixNode& n) { return "node " + std::to_string(n.id); }

}  // namespace

// XXH3 over the page's bytes: a child look-up hashes a whole page (512 ids is 2 KiB),
// and a serial multiply per id cost more than the rest of a match at large pages.
size_t PageKeyHash::operator()(const PageKey& k) const noexcept {
  return static_cast<size_t>(XXH3_64bits(k.data, k.len * sizeof(int32_t)));
}

bool PageKeyEq::operator()(const PageKey& a, const PageKey& b) const noexcept {
  return a.len == b.len && std::memcmp(a.data, b.data, a.len * sizeof(int32_t)) == 0;
}

// The path a key takes through one namespace's subtree, found without
// changing anything: `path` holds the nodes matched whole; a match that ends
// inside a node names it in `partial` with the tokens it matched there.
struct RadixTree::Walk {
  RadixNode* root = nullptr;
  std::vector<RadixNode*> path;
  RadixNode* partial = nullptr;
  size_t partial_len = 0;
  size_t matched = 0;

  RadixNode* last() const {
    if (partial != nullptr) return partial;
    return path.empty() ? root : path.back();
  }
};

RadixTree::RadixTree(BlockPool& pool, int64_t page_size, std::optional<EvictionOrder> order, OrderParams params,
                     int64_t ghost_capacity, std::unique_ptr<LeafRanker> ranker)
    : pool_(pool),
      page_(static_cast<size_t>(page_size)),
      order_(order),
      params_(params),
      ghost_(ghost_capacity),
      ranker_(std::move(ranker)),
      ranked_set_(RankedLess{ranker_.get()}) {
  if (order_ && ranker_) throw std::invalid_argument("a tree orders its leaves natively or by a ranker, not both");
  if (ghost_capacity < 0) throw std::invalid_argument("ghost_capacity must be >= 0, got " + std::to_string(ghost_capacity));
  if (page_size < 1) throw std::invalid_argument("page_size must be >= 1, got " + std::to_string(page_size));
  in_tree_.assign(pool.num_blocks(), 0);
  repeats_ = RepeatFinder(static_cast<size_t>(pool.num_blocks()));
}

// ---------------------------------------------------------------- look-up

size_t RadixTree::mismatch(const RadixNode& node, TokenSpan key, size_t at) const {
  const size_t n = std::min(node.tokens.size(), key.size() - at);
  const int32_t* mine = node.tokens.data();
  const size_t same = static_cast<size_t>(std::mismatch(mine, mine + n, key.data() + at).first - mine);
  if (same == node.tokens.size()) return same;
  return same / page_ * page_;  // a page that differs anywhere is a miss
}

RadixTree::Walk RadixTree::walk(TokenSpan key, RadixNode* root) const {
  Walk w;
  w.root = root;
  if (root == nullptr) return w;
  RadixNode* node = root;
  size_t at = 0;
  while (at < key.size()) {
    auto it = node->children.find(PageKey{key.data() + at, page_});
    if (it == node->children.end()) break;
    RadixNode* child = it->second;
    size_t same = mismatch(*child, key, at);
    at += same;
    if (same < child->tokens.size()) {
      w.partial = child;
      w.partial_len = same;
      break;
    }
    w.path.push_back(child);
    node = child;
  }
  w.matched = at;
  return w;
}

MatchResult RadixTree::collect(const Walk& w) const {
  MatchResult out;
  out.num_tokens = static_cast<int64_t>(w.matched);
  out.blocks.reserve(w.matched / page_);
  for (RadixNode* n : w.path) {
    out.blocks.insert(out.blocks.end(), n->blocks.begin(), n->blocks.end());
    if (n->lock_ref == 0) out.unlocked_tokens += static_cast<int64_t>(n->tokens.size());
  }
  if (w.partial != nullptr) {
    auto pages = static_cast<ptrdiff_t>(w.partial_len / page_);
    out.blocks.insert(out.blocks.end(), w.partial->blocks.begin(), w.partial->blocks.begin() + pages);
    if (w.partial->lock_ref == 0) out.unlocked_tokens += static_cast<int64_t>(w.partial_len);
  }
  RadixNode* last = w.last();
  out.node = last != nullptr ? last->id : 0;
  return out;
}

TokenSpan RadixTree::whole_pages(TokenSpan tokens) const {
  return tokens.first(tokens.size() / page_ * page_);
}

MatchResult RadixTree::match(TokenSpan tokens, const Namespace& ns) const {
  return collect(walk(whole_pages(tokens), root_of(ns)));
}

MatchResult RadixTree::match_prefix(TokenSpan tokens, const Namespace& ns) {
  calls_.check("RadixTree.match_prefix");
  RadixNode* root = root_of(ns);
  TokenSpan key = whole_pages(tokens);
  Walk w = walk(key, root);
  MatchResult out = collect(w);
  int64_t now = ++clock_;
  traffic_ += static_cast<int64_t>(key.size());
  if (root != nullptr) root->last_access_time = now;
  for (RadixNode* n : w.path) {
    n->last_access_time = now;
    ++n->use_count;
    touched(n);
  }
  if (w.partial != nullptr) {
    // SGLang refreshes the node it is about to split, then splits it.
    w.partial->last_access_time = now;
    touched(w.partial);
    RadixNode* mid = split(w.partial, w.partial_len, ++clock_);
    ++mid->use_count;
    out.node = mid->id;
  }
  return out;
}

// ---------------------------------------------------------------- insert

InsertResult RadixTree::insert(TokenSpan tokens, std::span<int32_t> blocks, const Namespace& ns, int64_t priority,
                              int64_t start, int64_t inserted) {
  calls_.check("RadixTree.insert");
  if (inserted < 0) inserted = start;
  if (tokens.size() % page_ != 0) {
    throw std::invalid_argument("insert: tokens has " + std::to_string(tokens.size()) +
                                " tokens, not a multiple of page_size " + std::to_string(page_));
  }
  if (start < 0 || static_cast<size_t>(start) > tokens.size() || static_cast<size_t>(start) % page_ != 0) {
    throw std::invalid_argument("insert: start=" + std::to_string(start) + " must be a multiple of page_size " +
                                std::to_string(page_) + " in [0, " + std::to_string(tokens.size()) + "]");
  }
  const size_t first = static_cast<size_t>(start) / page_;  // page of blocks[0]
  if (blocks.size() != tokens.size() / page_ - first) {
    throw std::invalid_argument("insert: blocks has " + std::to_string(blocks.size()) + " ids but tokens[" +
                                std::to_string(start) + ":" + std::to_string(tokens.size()) + "] need " +
                                std::to_string(tokens.size() / page_ - first) + " (one per page)");
  }
  Walk w = walk(tokens, root_of(ns));
  if (w.matched < static_cast<size_t>(start)) {
    throw std::invalid_argument("insert: start=" + std::to_string(start) + " but only the first " +
                                std::to_string(w.matched) + " tokens are in the tree");
  }
  MatchResult present = collect(w);
  check_insert(w, present, blocks, first, "insert");

  RadixNode* root = w.root;
  if (root == nullptr) {
    if (tokens.empty()) {  // no root, nothing to hold: node 0
      ++clock_;
      return InsertResult{};
    }
    root = w.root = root_or_create(ns);  // only to hold a leaf
  }
  int64_t now = ++clock_;
  root->last_access_time = now;
  const auto request_tokens = static_cast<int64_t>(tokens.size());
  int64_t deepest = 0;
  InsertResult out = apply_insert(root, w, present, tokens, blocks, first, start, inserted, priority, now,
                                  request_tokens, &deepest);
  root->history_len = std::max(root->history_len, deepest);
  return out;
}

InsertResult RadixTree::extend(int64_t node, TokenSpan tokens, std::span<int32_t> blocks, int64_t priority) {
  calls_.check("RadixTree.extend");
  RadixNode* from = node_ptr(node, "extend");
  if (tokens.size() % page_ != 0) {
    throw std::invalid_argument("extend: tokens has " + std::to_string(tokens.size()) +
                                " tokens, not a multiple of page_size " + std::to_string(page_));
  }
  if (blocks.size() != tokens.size() / page_) {
    throw std::invalid_argument("extend: blocks has " + std::to_string(blocks.size()) + " ids but " +
                                std::to_string(tokens.size()) + " tokens need " +
                                std::to_string(tokens.size() / page_) + " (one per page)");
  }
  Walk w = walk(tokens, from);
  MatchResult present = collect(w);
  check_insert(w, present, blocks, 0, "extend");

  const int64_t base = from->cached_prefix_len;
  int64_t now = ++clock_;
  const int64_t request_tokens = base + static_cast<int64_t>(tokens.size());
  int64_t deepest = 0;
  InsertResult out = apply_insert(from, w, present, tokens, blocks, 0, base, base, priority, now, request_tokens,
                                  &deepest);
  out.prefix_len += base;
  // What re-walking root -> from would have written there (insert's path stamps).
  stamp_path(from, PathStamp{now, traffic_, request_tokens, priority, deepest});
  return out;
}

void RadixTree::check_insert(const Walk& w, const MatchResult& present, std::span<int32_t> blocks, size_t first,
                             const char* what) const {
  const size_t dup_pages = w.matched / page_;
  std::vector<int32_t> adopted;  // caller-owned blocks named in this call
  for (size_t i = 0; i < blocks.size(); ++i) {
    int32_t b = blocks[i];
    size_t p = first + i;
    if (b < 0 || b >= pool_.num_blocks()) {
      throw std::out_of_range(std::string(what) + ": block id " + std::to_string(b) + " is out of range [0, " +
                              std::to_string(pool_.num_blocks()) + ")");
    }
    if (p < dup_pages && b == present.blocks[p]) continue;
    // A caller's block that is not the tree's: a duplicate to hand back, or
    // a new page to adopt. Either way the caller must own it.
    if (in_tree_[b]) {
      throw std::invalid_argument(std::string(what) + ": block " + std::to_string(b) + " (page " +
                                  std::to_string(p) + ") already belongs to the tree at another position");
    }
    if (pool_.ref_count(b) < 1) {
      throw std::invalid_argument(std::string(what) + ": block " + std::to_string(b) + " is free in the pool");
    }
    adopted.push_back(b);
  }
  if (std::optional<int64_t> repeated = repeats_.first_repeat(adopted)) {
    throw std::invalid_argument(std::string(what) + ": block " + std::to_string(*repeated) + " appears more than once");
  }
}

// The walk below `from` (offsets are absolute: `from` ends at from->cached_prefix_len).
// `from` itself is stamped by the caller. Sets *deepest to the depth of the leaf
// created (0: none), whose history the caller raises above `from`.
InsertResult RadixTree::apply_insert(RadixNode* from, const Walk& w, const MatchResult& present, TokenSpan key,
                                     std::span<int32_t> blocks, size_t first, int64_t start, int64_t inserted,
                                     int64_t priority, int64_t now, int64_t request_tokens, int64_t* deepest) {
  const size_t dup_pages = w.matched / page_;
  InsertResult out;
  out.prefix_len = static_cast<int64_t>(w.matched);
  // Tokens before the node: the caller's own prefix counted its use already.
  auto offset = static_cast<size_t>(from->cached_prefix_len);
  const auto begin = static_cast<size_t>(start);
  for (RadixNode* n : w.path) {
    n->last_access_time = now;
    n->priority = std::max(n->priority, priority);
    stamp_use(n, offset >= begin, request_tokens, now);
    offset += n->tokens.size();
    if (static_cast<int64_t>(offset) > inserted) ++n->hit_count;  // ends past what the caller inserted
    touched(n);
  }
  RadixNode* node = w.last() != nullptr ? w.last() : from;
  if (w.partial != nullptr) {
    w.partial->last_access_time = now;
    touched(w.partial);
    node = split(w.partial, w.partial_len, ++clock_);
    node->priority = std::max(node->priority, priority);
    stamp_use(node, offset >= begin, request_tokens, now);
    if (static_cast<int64_t>(offset + w.partial_len) > inserted) ++node->hit_count;
  }
  for (size_t p = first; p < dup_pages; ++p) {
    int32_t& mine = blocks[p - first];
    if (mine != present.blocks[p]) {
      out.displaced.push_back(mine);
      mine = present.blocks[p];
    }
  }
  *deepest = 0;
  if (w.matched < key.size()) {
    RadixNode* leaf = new_node(node, ++clock_);
    leaf->tokens.assign(key.begin() + static_cast<ptrdiff_t>(w.matched), key.end());
    leaf->blocks.assign(blocks.begin() + static_cast<ptrdiff_t>(dup_pages - first), blocks.end());
    leaf->priority = priority;
    leaf->last_use = traffic_;
    leaf->request_tokens = request_tokens;
    leaf->use_time = now;
    int64_t history = 0;
    if (ghost_.enabled()) {
      uint64_t k = node->tail_key;
      for (size_t p = 0; p < leaf->blocks.size(); ++p) {
        k = page_key_after(k, *leaf, p);
        history = std::max(history, ghost_.take(k));
      }
      leaf->tail_key = k;
    }
    leaf->use_count = 1 + history;
    if (from->cached_prefix_len + static_cast<int64_t>(key.size()) > inserted) leaf->hit_count = 1;
    leaf->cached_prefix_len = node->cached_prefix_len + static_cast<int64_t>(leaf->tokens.size());
    raise_history(leaf, from);
    *deepest = leaf->cached_prefix_len;
    node->children.emplace(PageKey{leaf->tokens.data(), page_}, leaf);
    for (int32_t b : leaf->blocks) in_tree_[b] = 1;
    evictable_size_ += static_cast<int64_t>(leaf->tokens.size());
    update_leaf_status(node);
    update_leaf_status(leaf);
    node = leaf;
  }
  out.node = node != nullptr ? node->id : 0;
  return out;
}

// ---------------------------------------------------------------- path stamps

void RadixTree::apply_stamp(RadixNode* n, const PathStamp& s) {
  n->last_access_time = std::max(n->last_access_time, s.time);
  n->history_len = std::max(n->history_len, s.history);
  if (n->is_root()) return;  // insert stamps a root's time only
  n->priority = std::max(n->priority, s.priority);
  if (s.time > n->use_time) {
    n->use_time = s.time;
    n->last_use = s.last_use;
    n->request_tokens = s.request_tokens;
  }
}

void RadixTree::stamp_path(RadixNode* from, const PathStamp& s) {
  if (!from->is_root() && from->lock_ref > 0) {  // owed until its lock is dropped
    from->pending.merge(s);
    pending_.insert(from);
    return;
  }
  for (RadixNode* n = from; n != nullptr; n = n->parent) {
    apply_stamp(n, s);
    touched(n);
  }
}

PathStamp RadixTree::owed(const RadixNode* n) const {
  PathStamp out;
  for (const RadixNode* holder : pending_) {
    for (const RadixNode* up = holder; up != nullptr; up = up->parent) {
      if (up == n) {
        out.merge(holder->pending);
        break;
      }
    }
  }
  return out;
}

void RadixTree::stamp_use(RadixNode* n, bool counts, int64_t request_tokens, int64_t now) {
  n->last_use = traffic_;
  n->request_tokens = request_tokens;
  n->use_time = now;
  if (counts) ++n->use_count;
}

uint64_t RadixTree::page_key_after(uint64_t parent_key, const RadixNode& n, size_t page) const {
  return chain_page_key(parent_key, n.tokens.data() + page * page_, page_);
}

uint64_t RadixTree::namespace_key(const Namespace& ns) const {
  if (!ns) return mix64(0x9E3779B97F4A7C15ULL);
  uint64_t h = mix64(0x51afd7ed558ccdULL ^ ns->size());
  for (unsigned char c : *ns) h = mix64(h ^ c);
  return h;
}

RadixNode* RadixTree::new_node(RadixNode* parent, int64_t stamp) {
  auto owned = std::make_unique<RadixNode>();
  RadixNode* n = owned.get();
  n->id = next_id_++;
  n->parent = parent;
  n->root = parent != nullptr ? parent->root : n;
  n->creation_time = n->last_access_time = stamp;
  nodes_.emplace(n->id, std::move(owned));
  return n;
}

// child = [0, split_len) + [split_len, end) becomes mid -> child. mid inherits
// lock_ref (so neither size moves), priority and hit_count, and is stamped as
// a new node, as SGLang's _split_node does.
RadixNode* RadixTree::split(RadixNode* child, size_t split_len, int64_t stamp) {
  RadixNode* parent = child->parent;
  RadixNode* mid = new_node(parent, stamp);
  auto cut = static_cast<ptrdiff_t>(split_len);
  auto cut_pages = static_cast<ptrdiff_t>(split_len / page_);
  mid->tokens.assign(child->tokens.begin(), child->tokens.begin() + cut);
  mid->blocks.assign(child->blocks.begin(), child->blocks.begin() + cut_pages);
  mid->lock_ref = child->lock_ref;
  mid->priority = child->priority;
  mid->hit_count = child->hit_count;
  mid->use_count = child->use_count;
  mid->last_use = child->last_use;
  mid->request_tokens = child->request_tokens;
  mid->use_time = child->use_time;
  mid->cached_prefix_len = parent->cached_prefix_len + static_cast<int64_t>(split_len);
  mid->history_len = child->history_len;
  if (ghost_.enabled()) {
    uint64_t key = parent->tail_key;
    for (size_t p = 0; p < mid->blocks.size(); ++p) key = page_key_after(key, *mid, p);
    mid->tail_key = key;
  }
  // Re-key while the child's first page is still intact: the map's key views it.
  parent->children.erase(PageKey{child->tokens.data(), page_});
  parent->children.emplace(PageKey{mid->tokens.data(), page_}, mid);
  child->tokens.erase(child->tokens.begin(), child->tokens.begin() + cut);
  child->blocks.erase(child->blocks.begin(), child->blocks.begin() + cut_pages);
  child->parent = mid;
  mid->children.emplace(PageKey{child->tokens.data(), page_}, child);
  return mid;
}

// ---------------------------------------------------------------- locks

void RadixTree::lock(int64_t id) {
  calls_.check("RadixTree.lock");
  if (id == 0) return;  // no node
  RadixNode* n = node_ptr(id, "lock");
  for (; !n->is_root(); n = n->parent) {
    if (n->lock_ref++ == 0) {
      auto len = static_cast<int64_t>(n->tokens.size());
      evictable_size_ -= len;
      protected_size_ += len;
      update_leaf_status(n);
    }
  }
  ++n->lock_ref;  // the root: it stays while a lock is held in its namespace
}

void RadixTree::unlock(int64_t id) {
  calls_.check("RadixTree.unlock");
  if (id == 0) return;  // no node
  RadixNode* start = node_ptr(id, "unlock");
  if (start->lock_ref == 0) throw std::invalid_argument("unlock: " + node_str(*start) + " is not locked");
  // Fold the path stamps owed on the way up: the walk reaches the root, so every
  // node above a stamp's holder gets it (see "Extending a locked path").
  PathStamp owed;
  RadixNode* n = start;
  for (; !n->is_root(); n = n->parent) {
    if (n->pending.time != 0) {
      owed.merge(n->pending);
      n->pending = PathStamp{};
      pending_.erase(n);
    }
    if (owed.time != 0) apply_stamp(n, owed);
    if (--n->lock_ref == 0) {
      auto len = static_cast<int64_t>(n->tokens.size());
      evictable_size_ += len;
      protected_size_ -= len;
      update_leaf_status(n);
    }
  }
  if (owed.time != 0) apply_stamp(n, owed);
  --n->lock_ref;
  drop_root_if_empty(n);
}

void RadixTree::relock(int64_t from_id, int64_t to_id) {
  calls_.check("RadixTree.relock");
  RadixNode* to = node_ptr(to_id, "relock");
  if (from_id == 0) {  // nothing was locked (no root then): a plain lock
    lock(to_id);
    return;
  }
  RadixNode* from = node_ptr(from_id, "relock");
  if (from->lock_ref == 0) throw std::invalid_argument("relock: " + node_str(*from) + " is not locked");
  // The nodes strictly between: lock(to) + unlock(from) changes only them.
  std::vector<RadixNode*> below;
  RadixNode* up = to;
  for (; up != from && !up->is_root(); up = up->parent) below.push_back(up);
  if (up != from) {  // not below `from`: the long way
    lock(to_id);
    unlock(from_id);
    return;
  }
  for (auto it = below.rbegin(); it != below.rend(); ++it) {  // top down, so parent >= child holds
    RadixNode* b = *it;
    if (b->lock_ref++ == 0) {
      auto len = static_cast<int64_t>(b->tokens.size());
      evictable_size_ -= len;
      protected_size_ += len;
      update_leaf_status(b);
    }
  }
}

// ---------------------------------------------------------------- eviction

int64_t RadixTree::evict(int64_t num_tokens) {
  calls_.check("RadixTree.evict");
  last_evicted_.clear();
  if (!order_ && !ranker_) {
    throw std::invalid_argument("evict: this tree has no native eviction order (nor a ranker); rank candidates with a priority function");
  }
  if (num_tokens < 0) throw std::invalid_argument("evict: num_tokens must be >= 0, got " + std::to_string(num_tokens));
  refresh_order();
  int64_t evicted = 0;
  while (evicted < num_tokens) {
    if (order_ ? order_set_.empty() : ranked_set_.empty()) break;
    RadixNode* leaf = nodes_.at(order_ ? order_set_.begin()->id : ranked_set_.begin()->id).get();
    RadixNode* parent = leaf->parent;
    const bool parent_is_root = parent->is_root();  // a root left empty is dropped with the leaf
    evicted += static_cast<int64_t>(leaf->tokens.size());
    delete_leaf(leaf);  // takes it out of the order; its parent may come in, dirty
    // It just became a leaf: rank it now, it may be next (a ranker that throws leaves
    // it dirty, for the next eviction). A root left empty went with the leaf.
    if (!parent_is_root && parent->dirty) rekey(parent);
  }
  return evicted;
}

void RadixTree::touched(RadixNode* n) {
  if (n->leaf_slot < 0 || n->dirty || (!order_ && !ranker_)) return;  // only evictable leaves are ordered
  n->dirty = true;
  dirty_.push_back(n->id);
}

void RadixTree::refresh_order() {
  size_t done = 0;
  try {
    for (; done < dirty_.size(); ++done) {
      auto found = nodes_.find(dirty_[done]);
      if (found == nodes_.end()) continue;  // evicted since
      RadixNode* n = found->second.get();
      if (!n->dirty) continue;
      if (n->leaf_slot >= 0) {
        rekey(n);
      } else {
        n->dirty = false;
      }
    }
  } catch (...) {  // a ranker threw: what was re-keyed is done, the rest stays dirty
    dirty_.erase(dirty_.begin(), dirty_.begin() + static_cast<ptrdiff_t>(done));
    throw;
  }
  dirty_.clear();
}

void RadixTree::rekey(RadixNode* n) {
  if (order_) {
    unorder(n);
    order_of_[n->id] = order_set_.insert(OrderEntry{native_key(*order_, params_, candidate(*n)), n->id}).first;
    n->dirty = false;
    return;
  }
  // The new key goes in before the old one comes out, so a throw leaves n as it was.
  const uint64_t key = ranker_->rank(candidate(*n));
  std::pair<RankedSet::iterator, bool> placed;
  try {
    placed = ranked_set_.insert(RankedEntry{key, n->id});
  } catch (...) {
    ranker_->release(key);
    // Keys that do not compare with this one are already in the order (a policy that
    // returned a str, then an int): none of them can be trusted to place the next, so
    // every leaf is ranked again before the next eviction.
    unrank_all();
    throw;
  }
  if (!placed.second) {
    ranker_->release(key);  // its old entry has an equal key: it stays
  } else {
    auto at = ranked_of_.find(n->id);
    if (at != ranked_of_.end()) {
      ranker_->release(at->second->key);
      ranked_set_.erase(at->second);
      at->second = placed.first;
    } else {
      ranked_of_.emplace(n->id, placed.first);
    }
  }
  n->dirty = false;
}

void RadixTree::unrank_all() {
  for (const auto& [id, at] : ranked_of_) {
    ranker_->release(at->key);
    RadixNode* leaf = nodes_.at(id).get();
    if (!leaf->dirty) {
      leaf->dirty = true;
      dirty_.push_back(id);
    }
  }
  ranked_set_.clear();
  ranked_of_.clear();
}

void RadixTree::unorder(RadixNode* n) {
  if (auto at = order_of_.find(n->id); at != order_of_.end()) {
    order_set_.erase(at->second);
    order_of_.erase(at);
  }
  if (auto at = ranked_of_.find(n->id); at != ranked_of_.end()) {
    ranker_->release(at->second->key);
    ranked_set_.erase(at->second);
    ranked_of_.erase(at);
  }
}

// Raises the branch's high-water depth up to (not including) `stop`, whose path
// the caller stamps with the depth itself.
void RadixTree::raise_history(RadixNode* n, const RadixNode* stop) {
  n->history_len = std::max(n->history_len, n->cached_prefix_len);
  for (RadixNode* up = n->parent; up != stop && up != nullptr && up->history_len < n->cached_prefix_len;
       up = up->parent) {
    up->history_len = n->cached_prefix_len;
    touched(up);
  }
}

void RadixTree::update_leaf_status(RadixNode* n) {
  set_evictable_leaf(n, !n->is_root() && n->lock_ref == 0 && n->children.empty());
}

void RadixTree::set_evictable_leaf(RadixNode* n, bool evictable) {
  if (evictable && n->leaf_slot < 0) {
    n->leaf_slot = static_cast<int64_t>(evictable_leaves_.size());
    evictable_leaves_.push_back(n);
    touched(n);
  } else if (!evictable && n->leaf_slot >= 0) {
    unorder(n);
    n->dirty = false;
    RadixNode* moved = evictable_leaves_.back();
    evictable_leaves_[n->leaf_slot] = moved;
    moved->leaf_slot = n->leaf_slot;
    evictable_leaves_.pop_back();
    n->leaf_slot = -1;
  }
}

void RadixTree::delete_leaf(RadixNode* leaf) {
  // Free first: if the pool refuses, the tree has not changed.
  pool_.free(std::vector<int64_t>(leaf->blocks.begin(), leaf->blocks.end()));
  for (int32_t b : leaf->blocks) {
    in_tree_[b] = 0;
    last_evicted_.push_back(b);
  }
  evictable_size_ -= static_cast<int64_t>(leaf->tokens.size());
  RadixNode* parent = leaf->parent;
  if (ghost_.enabled()) {
    uint64_t key = parent->tail_key;
    for (size_t p = 0; p < leaf->blocks.size(); ++p) {
      key = page_key_after(key, *leaf, p);
      ghost_.put(key, leaf->use_count);
    }
  }
  set_evictable_leaf(leaf, false);
  parent->children.erase(PageKey{leaf->tokens.data(), page_});
  nodes_.erase(leaf->id);
  if (parent->is_root()) {
    drop_root_if_empty(parent);
  } else {
    update_leaf_status(parent);
  }
}

void RadixTree::drop_root_if_empty(RadixNode* root) {
  if (!root->children.empty() || root->lock_ref != 0) return;
  if (root->ns_name != nullptr) {
    named_roots_.erase(named_roots_.find(*root->ns_name));  // by iterator: ns_name views the key erased
  } else {
    none_root_ = nullptr;
  }
  nodes_.erase(root->id);
}

void RadixTree::reset() {
  calls_.check("RadixTree.reset");
  if (protected_size_ > 0) {
    throw std::invalid_argument("reset: " + std::to_string(protected_size_) + " tokens are locked");
  }
  for (RadixNode* root : roots()) {
    if (root->lock_ref > 0) {
      throw std::invalid_argument("reset: namespace root " + node_str(*root) + " is locked " +
                                  std::to_string(root->lock_ref) + " times");
    }
  }
  // Oldest node first, each in token order: the pool's free queue (and so
  // every later allocation) does not depend on hash-map order.
  std::vector<const RadixNode*> by_age;
  for (const auto& [id, n] : nodes_) by_age.push_back(n.get());
  std::sort(by_age.begin(), by_age.end(), [](const RadixNode* a, const RadixNode* b) { return a->id < b->id; });
  std::vector<int64_t> all;
  for (const RadixNode* n : by_age) all.insert(all.end(), n->blocks.begin(), n->blocks.end());
  pool_.free(all);
  nodes_.clear();
  none_root_ = nullptr;
  named_roots_.clear();
  evictable_leaves_.clear();
  order_set_.clear();
  order_of_.clear();
  for (const RankedEntry& e : ranked_set_) ranker_->release(e.key);
  ranked_set_.clear();
  ranked_of_.clear();
  dirty_.clear();
  pending_.clear();  // nothing is locked, so nothing is owed
  std::fill(in_tree_.begin(), in_tree_.end(), 0);
  evictable_size_ = protected_size_ = 0;
  last_evicted_.clear();
  ghost_.clear();
}

// ---------------------------------------------------------------- roots and inspection

RadixNode* RadixTree::root_of(const Namespace& ns) const {
  if (!ns) return none_root_;
  auto it = named_roots_.find(*ns);
  return it == named_roots_.end() ? nullptr : it->second;
}

RadixNode* RadixTree::root_or_create(const Namespace& ns) {
  RadixNode* root = root_of(ns);
  if (root != nullptr) return root;
  root = new_node(nullptr, clock_);
  if (ghost_.enabled()) root->tail_key = namespace_key(ns);
  if (ns) {
    root->ns_name = &named_roots_.emplace(*ns, root).first->first;  // node-based map: the key stays put
  } else {
    none_root_ = root;
  }
  return root;
}

std::vector<RadixNode*> RadixTree::roots() const {
  std::vector<RadixNode*> out;
  out.reserve(named_roots_.size() + 1);
  if (none_root_ != nullptr) out.push_back(none_root_);
  for (const auto& [name, r] : named_roots_) out.push_back(r);
  return out;
}

std::optional<int64_t> RadixTree::root(const Namespace& ns) const {
  RadixNode* r = root_of(ns);
  if (r == nullptr) return std::nullopt;
  return r->id;
}

std::vector<Namespace> RadixTree::namespaces() const {
  std::vector<Namespace> out;
  if (none_root_ != nullptr) out.emplace_back(std::nullopt);
  std::vector<std::string> named;
  for (const auto& [name, root] : named_roots_) named.push_back(name);
  std::sort(named.begin(), named.end());
  for (auto& name : named) out.emplace_back(std::move(name));
  return out;
}

RadixNode* RadixTree::node_ptr(int64_t id, const char* what) const {
  auto it = nodes_.find(id);
  if (it == nodes_.end()) {
    throw std::invalid_argument(std::string(what) + ": node " + std::to_string(id) + " does not exist (evicted, or never created)");
  }
  return it->second.get();
}

EvictionCandidate RadixTree::candidate(const RadixNode& n) const {
  EvictionCandidate c;
  c.id = n.id;
  c.num_tokens = static_cast<int64_t>(n.tokens.size());
#define PREFIXCACHE_NODE_FIELD(name, doc) c.name = n.name;
  PREFIXCACHE_CANDIDATE_STAMPS(PREFIXCACHE_NODE_FIELD)
#undef PREFIXCACHE_NODE_FIELD
  return c;
}

NodeInfo RadixTree::node(int64_t id) const {
  RadixNode copy;  // the node's stamps with the stamps owed to it folded in
  const RadixNode* n = node_ptr(id, "node");
  copy.parent = n->parent;
  copy.use_time = n->use_time;
#define PREFIXCACHE_COPY_STAMP(name, doc) copy.name = n->name;
  PREFIXCACHE_CANDIDATE_STAMPS(PREFIXCACHE_COPY_STAMP)
#undef PREFIXCACHE_COPY_STAMP
  if (!pending_.empty()) apply_stamp(&copy, owed(n));
  NodeInfo info;
  info.id = n->id;
  info.tokens = n->tokens;
  info.blocks = n->blocks;
  info.lock_ref = n->lock_ref;
#define PREFIXCACHE_INFO_STAMP(name, doc) info.name = copy.name;
  PREFIXCACHE_CANDIDATE_STAMPS(PREFIXCACHE_INFO_STAMP)
#undef PREFIXCACHE_INFO_STAMP
  if (!n->is_root()) info.parent = n->parent->id;
  if (n->root->ns_name != nullptr) info.ns = *n->root->ns_name;
  for (const auto& [key, child] : n->children) {
    info.children.emplace_back(std::vector<int32_t>(key.data, key.data + key.len), child->id);
  }
  std::sort(info.children.begin(), info.children.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  return info;
}

void RadixTree::check_invariants(const std::optional<std::vector<int64_t>>& locked_nodes) const {
  auto fail = [](const std::string& msg) { throw InvariantError("RadixTree: " + msg); };
  std::unordered_map<const RadixNode*, int64_t> expected_locks;
  if (locked_nodes) {
    for (int64_t id : *locked_nodes) {
      if (id == 0) continue;  // no node: nothing locked
      auto it = nodes_.find(id);
      if (it == nodes_.end()) fail("a live lock names node " + std::to_string(id) + ", which does not exist");
      for (const RadixNode* n = it->second.get(); n != nullptr; n = n->parent) ++expected_locks[n];
    }
  }

  std::vector<uint8_t> seen_block(in_tree_.size(), 0);
  int64_t num_nodes = 0, evictable = 0, protect = 0, num_blocks = 0, num_leaves = 0, num_pending = 0;
  std::vector<const RadixNode*> stack;
  for (const RadixNode* root : roots()) {
    if (!root->tokens.empty() || !root->blocks.empty()) fail("namespace root " + node_str(*root) + " holds tokens or blocks");
    if (root->children.empty() && root->lock_ref == 0) fail("namespace root " + node_str(*root) + " is kept with no child and no lock");
    if (root->root != root) fail("namespace root " + node_str(*root) + " does not name itself as its root");
    if (root->ns_name != nullptr && named_roots_.find(*root->ns_name) == named_roots_.end()) fail("namespace root " + node_str(*root) + " names a namespace without a root");
    if (locked_nodes) {
      auto it = expected_locks.find(root);
      int64_t want = it == expected_locks.end() ? 0 : it->second;
      if (root->lock_ref != want) fail("namespace root " + node_str(*root) + " has lock_ref " + std::to_string(root->lock_ref) + " but live requests hold " + std::to_string(want));
    }
    stack.push_back(root);
    while (!stack.empty()) {
      const RadixNode* n = stack.back();
      stack.pop_back();
      ++num_nodes;
      auto found = nodes_.find(n->id);
      if (found == nodes_.end() || found->second.get() != n) fail(node_str(*n) + " is not registered under its id");
      if (n->last_access_time > clock_ || n->creation_time > clock_ || n->pending.time > clock_) {
        fail(node_str(*n) + " is stamped after the clock");
      }
      if (n->pending.time != 0) {
        ++num_pending;
        if (!pending_.count(const_cast<RadixNode*>(n))) fail(node_str(*n) + " owes a path stamp that is not registered");
        if (n->is_root() || n->lock_ref == 0) fail(node_str(*n) + " owes a path stamp but is not locked");
      }
      for (const auto& [key, child] : n->children) {
        if (child->parent != n) fail(node_str(*child) + " parent link does not point to " + node_str(*n));
        if (child->root != root) fail(node_str(*child) + " does not name its namespace's root");
        if (key.data != child->tokens.data() || key.len != page_) fail(node_str(*child) + " is keyed by a stale page view");
        stack.push_back(child);
      }
      if (n->is_root()) continue;
      const auto len = static_cast<int64_t>(n->tokens.size());
      if (len == 0) fail(node_str(*n) + " is an empty non-root node");
      if (n->tokens.size() % page_ != 0) fail(node_str(*n) + " holds " + std::to_string(len) + " tokens, not whole pages");
      if (n->blocks.size() != n->tokens.size() / page_) fail(node_str(*n) + " holds " + std::to_string(n->blocks.size()) + " blocks for " + std::to_string(len) + " tokens");
      if (n->lock_ref < 0) fail(node_str(*n) + " has negative lock_ref");
      if (n->parent->lock_ref < n->lock_ref) fail(node_str(*n) + " is locked more than its parent");
      if (locked_nodes) {
        auto it = expected_locks.find(n);
        int64_t want = it == expected_locks.end() ? 0 : it->second;
        if (n->lock_ref != want) fail(node_str(*n) + " has lock_ref " + std::to_string(n->lock_ref) + " but live requests hold " + std::to_string(want));
      }
      (n->lock_ref == 0 ? evictable : protect) += len;
      bool leaf = n->lock_ref == 0 && n->children.empty();
      if (leaf != (n->leaf_slot >= 0)) fail(node_str(*n) + " evictable-leaf flag is wrong");
      if (leaf) {
        ++num_leaves;
        if (n->leaf_slot >= static_cast<int64_t>(evictable_leaves_.size()) || evictable_leaves_[n->leaf_slot] != n) fail(node_str(*n) + " leaf slot is stale");
      }
      for (int32_t b : n->blocks) {
        if (b < 0 || static_cast<size_t>(b) >= in_tree_.size()) fail(node_str(*n) + " holds out-of-range block " + std::to_string(b));
        if (seen_block[b]) fail("block " + std::to_string(b) + " is held twice");
        seen_block[b] = 1;
        if (!in_tree_[b]) fail("block " + std::to_string(b) + " is not flagged as the tree's");
        if (pool_.ref_count(b) < 1) fail("block " + std::to_string(b) + " is in the tree but free in the pool");
        ++num_blocks;
      }
    }
  }
  if (num_nodes != static_cast<int64_t>(nodes_.size())) fail(std::to_string(nodes_.size()) + " nodes registered but " + std::to_string(num_nodes) + " reachable");
  if (num_leaves != static_cast<int64_t>(evictable_leaves_.size())) fail("evictable leaf list has stale entries");
  if (num_pending != static_cast<int64_t>(pending_.size())) fail("the owed path stamps list nodes that owe none");
  if (order_) {
    if (order_set_.size() != order_of_.size()) fail("leaf order index and its id map disagree");
    for (const OrderEntry& e : order_set_) {
      auto it = nodes_.find(e.id);
      if (it == nodes_.end() || it->second->leaf_slot < 0) fail("leaf order holds node " + std::to_string(e.id) + ", not an evictable leaf");
      if (!it->second->dirty && e.key != native_key(*order_, params_, candidate(*it->second))) fail("leaf order key of node " + std::to_string(e.id) + " is stale but the node is not marked dirty");
    }
    for (const RadixNode* leaf : evictable_leaves_) {
      if (!leaf->dirty && order_of_.find(leaf->id) == order_of_.end()) fail("evictable leaf node " + std::to_string(leaf->id) + " is missing from the leaf order");
    }
  }
  if (ranker_) {  // a ranker's keys are the caller's: membership is checked, not the keys
    if (ranked_set_.size() != ranked_of_.size()) fail("ranked leaf order and its id map disagree");
    for (const RankedEntry& e : ranked_set_) {
      auto it = nodes_.find(e.id);
      if (it == nodes_.end() || it->second->leaf_slot < 0) fail("ranked leaf order holds node " + std::to_string(e.id) + ", not an evictable leaf");
    }
    for (const RadixNode* leaf : evictable_leaves_) {
      if (!leaf->dirty && ranked_of_.find(leaf->id) == ranked_of_.end()) fail("evictable leaf node " + std::to_string(leaf->id) + " is missing from the ranked leaf order");
    }
  } else if (!ranked_set_.empty()) {
    fail("a tree without a ranker holds ranked keys");
  }
  if (evictable != evictable_size_) fail("evictable_size is " + std::to_string(evictable_size_) + ", nodes hold " + std::to_string(evictable));
  if (protect != protected_size_) fail("protected_size is " + std::to_string(protected_size_) + ", nodes hold " + std::to_string(protect));
  int64_t flagged = std::count(in_tree_.begin(), in_tree_.end(), static_cast<uint8_t>(1));
  if (flagged != num_blocks) fail(std::to_string(flagged) + " blocks flagged as the tree's but nodes hold " + std::to_string(num_blocks));
}

}  // namespace prefixcache
