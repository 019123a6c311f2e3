// HybridTree (see hybrid_tree.h): each method follows the reference model's method of
// the same name, in the same order of effects, since frees, stamps and ticks are
// observable (block ids handed out next, LRU order, eviction order).
#include "hybrid_tree.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>

#include "block_pool.h"  // InvariantError

namespace prefixcache {
namespace {

constexpr int kComponents[3] = {kHybridFull, kHybridSwa, kHybridMamba};
constexpr int kInnerPriority[3] = {2, 1, 0};  // FULL 2 > SWA 1 > MAMBA 0: what a cascade takes
const char* const kNames[3] = {"FULL", "SWA", "MAMBA"};

int64_t len(const std::vector<int32_t>& key) { return static_cast<int64_t>(key.size()); }

}  // namespace

HybridTree::HybridTree(int64_t page_size, bool has_swa, bool has_mamba, int64_t window, int64_t state_grid,
                       bool no_tail_cliff, bool record_events)
    : page_(page_size),
      has_swa_(has_swa),
      has_mamba_(has_mamba),
      window_(has_swa ? window : 0),
      state_grid_(state_grid),
      no_tail_cliff_(no_tail_cliff),
      record_events_(record_events) {
  if (page_size < 1) throw std::invalid_argument("page_size: expected an int >= 1; got " + std::to_string(page_size));
  if (has_swa && window < 1) throw std::invalid_argument("an SWA component needs a positive window");
  if (state_grid < 1) throw std::invalid_argument("state_grid: expected an int >= 1; got " + std::to_string(state_grid));
  reset();
}

void HybridTree::reset() {
  nodes_.assign(4, Node{});  // the LRU sentinels: never alive, never in the tree
  for (int c : {kHybridSwa, kHybridMamba}) {
    nodes_[head(c)].next[c] = tail(c);
    nodes_[tail(c)].prev[c] = head(c);
  }
  free_slots_.clear();
  child_index_.clear();
  leaves_.clear();
  inner_states_.clear();
  root_ = new_node();
  Node& root = nodes_[root_];
  root.last_access = -std::numeric_limits<double>::infinity();
  for (int c : kComponents) {
    if (has(c)) root.locks[c] = 1;
  }
  evictable_ = {0, 0, 0};
  protected_ = {0, 0, 0};
  lru_size_ = {0, 0, 0};
  lru_clock_ = {0, 0, 0};
  num_nodes_ = 1;
  ++version_;
}

// -- slots ------------------------------------------------------------------------------

int32_t HybridTree::slot(HybridNodeRef r) const {
  if (r.slot < 0 || static_cast<size_t>(r.slot) >= nodes_.size() || !holds(r.slot, r.id)) {
    throw std::invalid_argument("node " + std::to_string(r.id) + " is not in the tree (stale reference)");
  }
  return r.slot;
}

int32_t HybridTree::new_node() {
  int32_t s;
  if (free_slots_.empty()) {
    s = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  } else {
    s = free_slots_.back();
    free_slots_.pop_back();
    nodes_[s] = Node{};
  }
  Node& n = nodes_[s];
  n.alive = true;
  n.id = next_id_;
  n.last_access = tick();
  tick();  // SGLang stamps a creation time too: two ticks a node
  ++next_id_;
  return s;
}

void HybridTree::drop_slot(int32_t s) {
  Node& n = nodes_[s];
  n.alive = false;
  n.children.clear();
  n.key.clear();
  n.full.clear();
  n.swa.clear();
  free_slots_.push_back(s);
}

HybridNodeRef HybridTree::parent(HybridNodeRef node) const {
  const int32_t p = nodes_[slot(node)].parent;
  return p < 0 ? HybridNodeRef{} : ref(p);
}

// -- children ---------------------------------------------------------------------------

uint64_t HybridTree::child_hash(int32_t parent, int64_t ns, const int32_t* page) const {
  // FNV-1a over (parent slot, namespace at the root, the first page): equal keys collide
  // on purpose, different ones rarely; find_child compares the keys themselves.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  mix(static_cast<uint64_t>(parent));
  if (parent == root_) mix(static_cast<uint64_t>(ns));
  for (int64_t i = 0; i < page_; ++i) mix(static_cast<uint32_t>(page[i]));
  return h;
}

int32_t HybridTree::find_child(int32_t parent, int64_t ns, const int32_t* page) const {
  auto [lo, hi] = child_index_.equal_range(child_hash(parent, ns, page));
  for (auto it = lo; it != hi; ++it) {
    const Node& c = nodes_[it->second];
    if (c.parent == parent && (parent != root_ || c.ns == ns) &&
        std::memcmp(c.key.data(), page, static_cast<size_t>(page_) * sizeof(int32_t)) == 0) {
      return it->second;
    }
  }
  return -1;
}

void HybridTree::add_child(int32_t parent, int32_t child) {
  nodes_[parent].children.push_back(child);
  child_index_.emplace(child_hash(parent, nodes_[child].ns, nodes_[child].key.data()), child);
}

void HybridTree::remove_child(int32_t parent, int32_t child) {
  auto& ch = nodes_[parent].children;
  ch.erase(std::find(ch.begin(), ch.end(), child));
  auto [lo, hi] = child_index_.equal_range(child_hash(parent, nodes_[child].ns, nodes_[child].key.data()));
  for (auto it = lo; it != hi; ++it) {
    if (it->second == child) {
      child_index_.erase(it);
      return;
    }
  }
  throw InvariantError("hybrid tree: node " + std::to_string(nodes_[child].id) + " missing from its parent's index");
}

void HybridTree::replace_child(int32_t parent, int32_t old_child, int32_t new_child) {
  // A dict's value replaced under its key keeps its place in the order.
  auto& ch = nodes_[parent].children;
  *std::find(ch.begin(), ch.end(), old_child) = new_child;
  auto [lo, hi] = child_index_.equal_range(child_hash(parent, nodes_[new_child].ns, nodes_[new_child].key.data()));
  for (auto it = lo; it != hi; ++it) {
    if (it->second == old_child) {
      it->second = new_child;
      return;
    }
  }
  throw InvariantError("hybrid tree: a split node missing from its parent's index");
}

// -- sets -------------------------------------------------------------------------------

bool HybridTree::is_leaf(int32_t s) const {
  const Node& n = nodes_[s];
  if (s == root_ || !n.alive || n.locks[0] || n.locks[1] || n.locks[2]) return false;
  return n.children.empty();
}

void HybridTree::refresh_leaf(int32_t s) {
  if (is_leaf(s)) {
    if (nodes_[s].leaf_pos < 0) {
      nodes_[s].leaf_pos = static_cast<int32_t>(leaves_.size());
      leaves_.push_back(s);
    }
  } else {
    leaf_discard(s);
  }
}

void HybridTree::leaf_discard(int32_t s) {
  const int32_t pos = nodes_[s].leaf_pos;
  if (pos < 0) return;
  leaves_[pos] = leaves_.back();
  nodes_[leaves_[pos]].leaf_pos = pos;
  leaves_.pop_back();
  nodes_[s].leaf_pos = -1;
}

void HybridTree::inner_add(int32_t s) {
  if (nodes_[s].inner_pos >= 0) return;
  nodes_[s].inner_pos = static_cast<int32_t>(inner_states_.size());
  inner_states_.push_back(s);
}

void HybridTree::inner_discard(int32_t s) {
  const int32_t pos = nodes_[s].inner_pos;
  if (pos < 0) return;
  inner_states_[pos] = inner_states_.back();
  nodes_[inner_states_[pos]].inner_pos = pos;
  inner_states_.pop_back();
  nodes_[s].inner_pos = -1;
}

// -- LRU --------------------------------------------------------------------------------

void HybridTree::link_after(int c, int32_t prev, int32_t s) {
  const int32_t nxt = nodes_[prev].next[c];
  nodes_[s].prev[c] = prev;
  nodes_[s].next[c] = nxt;
  nodes_[nxt].prev[c] = s;
  nodes_[prev].next[c] = s;
}

void HybridTree::unlink(int c, int32_t s) {
  Node& n = nodes_[s];
  nodes_[n.prev[c]].next[c] = n.next[c];
  nodes_[n.next[c]].prev[c] = n.prev[c];
  n.prev[c] = n.next[c] = -1;
}

void HybridTree::lru_insert_mru(int c, int32_t s) {
  if (nodes_[s].in_lru[c]) throw InvariantError("hybrid tree: a node entered an LRU twice");
  nodes_[s].in_lru[c] = true;
  ++lru_size_[c];
  link_after(c, head(c), s);
  nodes_[s].stamps[c] = ++lru_clock_[c];
}

void HybridTree::lru_insert_after(int c, int32_t prev, int32_t s) {
  nodes_[s].in_lru[c] = true;
  ++lru_size_[c];
  link_after(c, prev, s);
}

void HybridTree::lru_remove(int c, int32_t s) {
  nodes_[s].in_lru[c] = false;
  --lru_size_[c];
  unlink(c, s);
}

void HybridTree::lru_move_to_mru(int c, int32_t s) {
  if (!nodes_[s].in_lru[c]) throw InvariantError("hybrid tree: moving a node that is not in the LRU");
  unlink(c, s);
  link_after(c, head(c), s);
  nodes_[s].stamps[c] = ++lru_clock_[c];
}

void HybridTree::refresh_window(int32_t s, int64_t span) {
  // The node and the ancestors covering `span` TOKENS go most recent, in path order;
  // no stamp (SGLang's reset_node_and_window_ancestors_mru).
  int32_t prev = head(kHybridSwa);
  int64_t covered = 0;
  while (s != root_ && covered < span) {
    if (nodes_[s].has_swa) {
      unlink(kHybridSwa, s);
      link_after(kHybridSwa, prev, s);
      prev = s;
    }
    covered += len(nodes_[s].key);
    s = nodes_[s].parent;
  }
}

int32_t HybridTree::prev_unlocked(int c, int32_t s) const {
  int32_t x = nodes_[s].prev[c];
  while (x != head(c) && nodes_[x].locks[c] > 0) x = nodes_[x].prev[c];
  return x == head(c) ? -1 : x;
}

// -- values -----------------------------------------------------------------------------

bool HybridTree::has_value(int32_t s, int c) const {
  const Node& n = nodes_[s];
  return c == kHybridFull ? true : c == kHybridSwa ? n.has_swa : n.mamba != kHybridNone;
}

int64_t HybridTree::size(int32_t s, int c) const {
  const Node& n = nodes_[s];
  if (c == kHybridMamba) return n.mamba != kHybridNone ? 1 : 0;
  if (c == kHybridSwa) return n.has_swa ? static_cast<int64_t>(n.swa.size()) * page_ : 0;
  return static_cast<int64_t>(n.full.size()) * page_;
}

void HybridTree::free_ids(int c, std::vector<int64_t> ids) {
  if (!ids.empty()) freed_.push_back({c, std::move(ids)});
}

void HybridTree::event(bool stored, int32_t s, int c) {
  if (!record_events_) return;
  const Node& n = nodes_[s];
  const int64_t end = len(n.key) / page_;
  const int64_t first = c == kHybridMamba ? end - 1 : 0;  // a state is the one page it ends on
  HybridEvent e{stored, n.id, c, first, end, {}, std::nullopt, 0, {}, n.ns};
  if (n.has_hashes) e.hashes.assign(n.hashes.begin() + first, n.hashes.begin() + end);
  if (stored) {
    if (first > 0 && n.has_hashes) {
      e.parent_hash = n.hashes[first - 1];
    } else if (first == 0) {
      int32_t p = n.parent;
      while (p >= 0 && p != root_ && !(nodes_[p].has_hashes && !nodes_[p].hashes.empty())) p = nodes_[p].parent;
      if (p >= 0 && nodes_[p].has_hashes && !nodes_[p].hashes.empty()) e.parent_hash = nodes_[p].hashes.back();
    }
    for (int32_t p = n.parent; p >= 0 && p != root_; p = nodes_[p].parent) e.depth += len(nodes_[p].key) / page_;
    e.depth += first;
    e.tokens.assign(n.key.begin() + first * page_, n.key.begin() + end * page_);
  }
  events_.push_back(std::move(e));
}

void HybridTree::set_swa(int32_t s, std::vector<int64_t> swa) {
  Node& n = nodes_[s];
  n.swa = std::move(swa);
  n.has_swa = true;
  lru_insert_mru(kHybridSwa, s);
  (n.locks[kHybridSwa] ? protected_ : evictable_)[kHybridSwa] += size(s, kHybridSwa);
  event(true, s, kHybridSwa);
}

void HybridTree::set_mamba(int32_t s, int64_t state) {
  Node& n = nodes_[s];
  n.mamba = state;
  if (!n.children.empty()) inner_add(s);
  lru_insert_mru(kHybridMamba, s);
  (n.locks[kHybridMamba] ? protected_ : evictable_)[kHybridMamba] += 1;
  event(true, s, kHybridMamba);
}

// -- matching ---------------------------------------------------------------------------

int64_t HybridTree::match_len(int32_t s, std::span<const int32_t> tokens, int64_t offset) const {
  const auto& key = nodes_[s].key;
  const int64_t n = std::min<int64_t>(len(key), static_cast<int64_t>(tokens.size()) - offset);
  int64_t m = 0;
  while (m < n && key[m] == tokens[offset + m]) ++m;
  return m / page_ * page_;
}

HybridMatch HybridTree::match(std::span<const int32_t> tokens, int64_t ns) const {
  const int64_t n = static_cast<int64_t>(tokens.size()) / page_ * page_;
  HybridMatch out;
  out.version = version_;
  int32_t node = root_, best = root_;
  int64_t best_len = 0, full_hit = 0, offset = 0;
  int64_t swa_len = std::numeric_limits<int64_t>::max();  // Python's inf: no tombstone yet on the path
  size_t best_path = 0;
  bool partial = false;
  while (offset < n) {
    const int32_t child = find_child(node, ns, tokens.data() + offset);
    if (child < 0) break;
    const Node& c = nodes_[child];
    const int64_t m = match_len(child, tokens, offset);
    full_hit += m;
    partial = m < len(c.key);
    // Inside a node, the validators see the head a split makes: its pages, no state.
    const bool state = c.mamba != kHybridNone && !partial;
    bool ok = true;
    if (has_swa_) {
      if (c.has_swa) {
        if (swa_len != std::numeric_limits<int64_t>::max()) swa_len += m;
        ok = swa_len >= window_;
      } else {
        swa_len = 0;
        ok = false;
      }
    }
    if (has_mamba_ && !state) ok = false;
    out.path.emplace_back(ref(child), m);
    if (ok) {
      best = child;
      best_len = offset + m;
      best_path = out.path.size();
    }
    if (partial) break;
    node = child;
    offset += m;
  }
  if (partial) out.inside = out.path.back();
  out.path.resize(best_path);
  out.num_tokens = best_len;
  out.node = ref(best);
  out.full_hit = full_hit;
  if (has_swa_) {
    const int64_t aligned = full_hit / page_ * page_;
    out.swa_branching = aligned > best_len ? aligned : kHybridNone;
  }
  if (has_mamba_) {
    const int64_t aligned = full_hit / state_grid_ * state_grid_;
    out.mamba_branching = aligned > best_len ? aligned : kHybridNone;
  }
  return out;
}

HybridMatch HybridTree::settle(const HybridMatch& out) {
  if (out.version != version_) throw std::invalid_argument("settle: the tree changed since this match was made");
  HybridMatch m = out;
  m.inside.reset();
  int32_t best = slot(out.node);
  if (out.inside) {
    const int32_t child = slot(out.inside->first);
    const int32_t head = split(child, out.inside->second);
    if (best == child) best = head;
    for (auto& [node, covered] : m.path) {
      if (node.slot == child) node = ref(head);
    }
  }
  m.node = ref(best);
  touch_match(best);
  ++version_;
  return m;
}

void HybridTree::touch_match(int32_t best) {
  if (has_swa_) refresh_window(best, window_ + page_);
  if (has_mamba_ && nodes_[best].mamba != kHybridNone) lru_move_to_mru(kHybridMamba, best);
  double t = tick();
  for (int32_t s = best; s >= 0; s = nodes_[s].parent) {
    nodes_[s].last_access = t;
    t -= 0.00001;
  }
}

std::vector<int64_t> HybridTree::path_pages(HybridNodeRef node) const {
  std::vector<int32_t> chain;
  size_t total = 0;
  for (int32_t s = slot(node); s != root_; s = nodes_[s].parent) {
    chain.push_back(s);
    total += nodes_[s].full.size();
  }
  std::vector<int64_t> out;
  out.reserve(total);
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    out.insert(out.end(), nodes_[*it].full.begin(), nodes_[*it].full.end());
  }
  return out;
}

std::vector<int64_t> HybridTree::path_swa(HybridNodeRef node) const {
  std::vector<int32_t> chain;
  for (int32_t s = slot(node); s != root_; s = nodes_[s].parent) chain.push_back(s);
  std::vector<int64_t> out;
  for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
    const Node& n = nodes_[*it];
    if (n.has_swa) {
      out.insert(out.end(), n.swa.begin(), n.swa.end());
    } else {
      out.insert(out.end(), n.full.size(), -1);
    }
  }
  return out;
}

std::vector<int64_t> HybridTree::hit_pages(const HybridMatch& hit, int c) const {
  if (c != kHybridFull && c != kHybridSwa) throw std::invalid_argument("component: FULL or SWA hold pages");
  std::vector<int64_t> out;
  for (const auto& [r, covered] : hit.path) {
    const Node& n = nodes_[slot(r)];
    const size_t k = static_cast<size_t>(covered / page_);
    if (c == kHybridFull) {
      out.insert(out.end(), n.full.begin(), n.full.begin() + k);
    } else if (n.has_swa) {
      out.insert(out.end(), n.swa.begin(), n.swa.begin() + k);
    } else {
      out.insert(out.end(), k, -1);
    }
  }
  return out;
}

std::vector<HybridNodeRef> HybridTree::path_nodes(HybridNodeRef node) const {
  std::vector<HybridNodeRef> out;
  for (int32_t s = slot(node); s != root_; s = nodes_[s].parent) out.push_back(ref(s));
  std::reverse(out.begin(), out.end());
  return out;
}

// -- structure --------------------------------------------------------------------------

int32_t HybridTree::split(int32_t child, int64_t split_len) {
  // The new node takes the head; locks copied, the SWA uuid moves to it, the state
  // stays on the tail, the head sits just behind the tail in the SWA LRU.
  const size_t p = static_cast<size_t>(split_len / page_);
  const int32_t head = new_node();
  const int32_t parent = nodes_[child].parent;
  Node& c = nodes_[child];
  Node& h = nodes_[head];
  h.parent = parent;
  h.ns = c.ns;
  h.key.assign(c.key.begin(), c.key.begin() + split_len);
  replace_child(parent, child, head);  // keyed by the head's first page, the child's before
  c.key.erase(c.key.begin(), c.key.begin() + split_len);
  c.parent = head;
  add_child(head, child);
  h.full.assign(c.full.begin(), c.full.begin() + p);
  c.full.erase(c.full.begin(), c.full.begin() + p);
  h.locks[kHybridFull] = c.locks[kHybridFull];
  if (has_swa_) {
    h.locks[kHybridSwa] = c.locks[kHybridSwa];
    if (c.has_swa) {
      h.swa.assign(c.swa.begin(), c.swa.begin() + p);
      c.swa.erase(c.swa.begin(), c.swa.begin() + p);
      h.has_swa = true;
    }
    h.swa_uuid = std::exchange(c.swa_uuid, kHybridNone);
  }
  if (c.has_hashes) {
    h.has_hashes = true;
    h.hashes.assign(c.hashes.begin(), c.hashes.begin() + p);
    c.hashes.erase(c.hashes.begin(), c.hashes.begin() + p);
  }
  if (has_swa_ && h.has_swa) lru_insert_after(kHybridSwa, child, head);
  c.last_access = tick();
  ++num_nodes_;
  refresh_leaf(head);
  refresh_leaf(child);
  return head;
}

int32_t HybridTree::add_leaf(int32_t parent, std::span<const int32_t> key, std::vector<int64_t> pages, int64_t ns,
                             const std::optional<std::vector<std::string>>& hashes, int64_t first_page) {
  const int32_t s = new_node();
  Node& n = nodes_[s];
  n.parent = parent;
  if (hashes) {
    n.has_hashes = true;
    n.hashes.assign(hashes->begin() + first_page, hashes->begin() + first_page + static_cast<int64_t>(pages.size()));
  }
  n.key.assign(key.begin(), key.end());
  n.full = std::move(pages);
  n.ns = ns;
  if (nodes_[parent].mamba != kHybridNone) inner_add(parent);
  add_child(parent, s);
  evictable_[kHybridFull] += len(n.key);
  ++num_nodes_;
  refresh_leaf(s);
  refresh_leaf(parent);
  event(true, s, kHybridFull);
  return s;
}

// -- locks ------------------------------------------------------------------------------

HybridReceipt HybridTree::lock(HybridNodeRef ref_) {
  const int32_t node = slot(ref_);
  HybridReceipt receipt{ref_, kHybridNone};
  for (int32_t cur = node; cur != root_; cur = nodes_[cur].parent) {
    Node& n = nodes_[cur];
    if (n.locks[kHybridFull] == 0) {
      evictable_[kHybridFull] -= len(n.key);
      protected_[kHybridFull] += len(n.key);
    }
    ++n.locks[kHybridFull];
    leaf_discard(cur);
  }
  if (has_swa_) {
    int64_t covered = 0;
    for (int32_t cur = node; cur != root_ && covered < window_; cur = nodes_[cur].parent) {
      Node& n = nodes_[cur];
      if (n.locks[kHybridSwa] == 0 && n.has_swa) {
        evictable_[kHybridSwa] -= len(n.key);
        protected_[kHybridSwa] += len(n.key);
      }
      ++n.locks[kHybridSwa];
      covered += len(n.key);
      if (covered >= window_) {
        if (n.swa_uuid == kHybridNone) n.swa_uuid = ++next_uuid_;
        receipt.swa_uuid = n.swa_uuid;
      }
    }
  }
  if (has_mamba_ && node != root_) {
    Node& n = nodes_[node];
    if (n.locks[kHybridMamba] == 0 && n.mamba != kHybridNone) {
      evictable_[kHybridMamba] -= 1;
      protected_[kHybridMamba] += 1;
    }
    ++n.locks[kHybridMamba];
  }
  refresh_leaf(node);
  ++version_;
  return receipt;
}

std::array<int64_t, 3> HybridTree::lock_cost(const HybridMatch& hit) const {
  std::array<int64_t, 3> cost{0, 0, 0};
  for (const auto& [r, covered] : hit.path) {
    if (nodes_[slot(r)].locks[kHybridFull] == 0) cost[kHybridFull] += covered;
  }
  if (has_swa_) {
    int64_t covered_swa = 0;
    for (auto it = hit.path.rbegin(); it != hit.path.rend() && covered_swa < window_; ++it) {
      const Node& n = nodes_[it->first.slot];
      if (n.locks[kHybridSwa] == 0 && n.has_swa) cost[kHybridSwa] += it->second;
      covered_swa += it->second;
    }
  }
  if (has_mamba_ && !hit.path.empty()) {
    const auto& [r, covered] = hit.path.back();
    const Node& n = nodes_[r.slot];
    if (covered == len(n.key) && n.mamba != kHybridNone && n.locks[kHybridMamba] == 0) cost[kHybridMamba] = 1;
  }
  return cost;
}

void HybridTree::unlock(const HybridReceipt& receipt) {
  const int32_t node = slot(receipt.node);
  // Check the whole release before changing anything: an unlock of a lock never taken
  // must leave the tree as it was.
  for (int32_t cur = node; cur != root_; cur = nodes_[cur].parent) {
    if (nodes_[cur].locks[kHybridFull] <= 0) {
      throw std::invalid_argument("node " + std::to_string(nodes_[cur].id) + ": FULL unlocked more than locked");
    }
  }
  if (has_mamba_ && node != root_ && nodes_[node].locks[kHybridMamba] <= 0) {
    throw std::invalid_argument("node " + std::to_string(nodes_[node].id) + ": MAMBA unlocked more than locked");
  }
  if (has_swa_ && node != root_) {
    for (int32_t cur = node; cur != root_; cur = nodes_[cur].parent) {
      if (nodes_[cur].locks[kHybridSwa] <= 0) {
        throw std::invalid_argument("node " + std::to_string(nodes_[cur].id) + ": SWA unlocked more than locked");
      }
      if (receipt.swa_uuid != kHybridNone && nodes_[cur].swa_uuid == receipt.swa_uuid) break;
    }
  }
  if (has_mamba_ && node != root_) {
    Node& n = nodes_[node];
    if (n.locks[kHybridMamba] == 1 && n.mamba != kHybridNone) {
      evictable_[kHybridMamba] += 1;
      protected_[kHybridMamba] -= 1;
    }
    if (--n.locks[kHybridMamba] == 0) refresh_leaf(node);
  }
  if (has_swa_ && node != root_) {
    for (int32_t cur = node; cur != root_; cur = nodes_[cur].parent) {
      Node& n = nodes_[cur];
      const int64_t was = n.locks[kHybridSwa];
      if (was == 1 && n.has_swa) {
        evictable_[kHybridSwa] += len(n.key);
        protected_[kHybridSwa] -= len(n.key);
      }
      n.locks[kHybridSwa] = was - 1;
      if (was == 1) refresh_leaf(cur);
      if (receipt.swa_uuid != kHybridNone && n.swa_uuid == receipt.swa_uuid) break;
    }
  }
  for (int32_t cur = node; cur != root_; cur = nodes_[cur].parent) {
    Node& n = nodes_[cur];
    if (n.locks[kHybridFull] == 1) {
      evictable_[kHybridFull] += len(n.key);
      protected_[kHybridFull] -= len(n.key);
    }
    if (--n.locks[kHybridFull] == 0) refresh_leaf(cur);
  }
  refresh_leaf(node);
  ++version_;
}

// -- insertion --------------------------------------------------------------------------

HybridInsert HybridTree::insert(const HybridInsertArgs& a) {
  const int64_t page = page_;
  const int64_t n = static_cast<int64_t>(a.tokens.size()) / page * page;
  if (static_cast<int64_t>(a.pages.size()) < n / page) {
    throw std::invalid_argument("pages: " + std::to_string(a.pages.size()) + " pages for " + std::to_string(n) +
                                " tokens");
  }
  if (has_swa_ && a.swa_pages && static_cast<int64_t>(a.swa_pages->size()) < n / page) {
    throw std::invalid_argument("swa_pages: " + std::to_string(a.swa_pages->size()) + " pages for " +
                                std::to_string(n) + " tokens");
  }
  if (has_swa_ && n > 0 && !a.swa_pages) throw std::invalid_argument("swa_pages: a tree with SWA inserts SWA pages");
  if (a.hashes && static_cast<int64_t>(a.hashes->size()) < n / page) {
    throw std::invalid_argument("hashes: " + std::to_string(a.hashes->size()) + " for " + std::to_string(n) + " tokens");
  }
  if (has_mamba_ && n > 0 && a.mamba_value == kHybridNone) {
    throw std::invalid_argument("mamba_value: a tree with MAMBA inserts a state with every key");
  }
  ++version_;
  nodes_[root_].last_access = tick();
  if (n == 0) return {0, ref(root_), true, false};
  int32_t node = root_;
  int64_t total = 0;
  while (total < n) {
    int32_t child = find_child(node, a.ns, a.tokens.data() + total);
    if (child < 0) break;
    nodes_[child].last_access = tick();
    const int64_t m = match_len(child, a.tokens, total);
    if (m < len(nodes_[child].key)) child = split(child, m);
    int64_t consumed = m;
    if (has_swa_) consumed = swa_overlap(child, total, m, a);
    const int64_t dup_start = std::max<int64_t>(0, a.prev_prefix_len - total);
    if (dup_start < consumed) {
      const int64_t lo = (total + dup_start) / page, hi = (total + consumed) / page;
      free_ids(kHybridFull, {a.pages.begin() + lo, a.pages.begin() + hi});
      if (has_swa_ && a.swa_pages) {
        // Below the request's SWA eviction floor only FULL is still its own.
        std::vector<int64_t> live;
        for (int64_t i = lo; i < hi; ++i) {
          if (i * page >= a.swa_evicted) {
            if ((*a.swa_pages)[i] < 0) throw InvariantError("the request's SWA pages above its eviction floor are live");
            live.push_back((*a.swa_pages)[i]);
          }
        }
        free_ids(kHybridSwa, std::move(live));
      }
    }
    node = child;
    total += m;
  }
  HybridInsert out{total, ref(node), false, false};
  int32_t target = node;
  bool new_leaf = false;
  if (total < n) {
    target = add_leaf(node, a.tokens.subspan(total, n - total),
                      {a.pages.begin() + total / page, a.pages.begin() + n / page}, a.ns, a.hashes, total / page);
    new_leaf = true;
  }
  out.node = ref(target);
  if (has_swa_) {
    if (a.swa_branching != kHybridNone) out.swa_branch_inserted = n >= a.swa_branching;
    if (new_leaf) swa_publish(target, total, total + len(nodes_[target].key), a);
  }
  if (has_mamba_) {
    Node& t = nodes_[target];
    if (new_leaf) {
      t.mamba = a.mamba_value;
      lru_insert_mru(kHybridMamba, target);
      evictable_[kHybridMamba] += 1;
      event(true, target, kHybridMamba);
    } else if (t.mamba == kHybridNone) {
      set_mamba(target, a.mamba_value);
      nodes_[target].last_access = tick();
    } else {
      lru_move_to_mru(kHybridMamba, target);
      t.last_access = tick();
      out.mamba_exist = true;
    }
  }
  if (target != root_ && has_swa_) refresh_window(target, window_ + page);
  out.node = ref(target);
  return out;
}

std::optional<std::pair<int32_t, int64_t>> HybridTree::swa_span(int32_t s, int64_t start, int64_t end,
                                                                int64_t window_start) {
  // The part of a tombstone at or past the request's window start: split there, the
  // older part stays a tombstone (SGLang's _clip_to_window).
  if (nodes_[s].has_swa) return std::nullopt;
  if (window_start % page_) throw std::invalid_argument("swa_evicted: expected whole pages");
  const int64_t live = std::max(start, window_start);
  if (live >= end) return std::nullopt;
  if (live > start) split(s, live - start);
  return std::make_pair(s, live);
}

int64_t HybridTree::swa_overlap(int32_t s, int64_t total, int64_t m, const HybridInsertArgs& a) {
  // A tombstone the request's key covers inside its window takes the request's pages
  // back ("recovery"); returns where its own pages stop being duplicates.
  if (a.prev_prefix_len >= total + m) return m;
  const auto span = swa_span(s, total, total + m, a.swa_evicted);
  if (!span) return m;
  const auto [node, live] = *span;
  const int64_t lo = live / page_, hi = (total + m) / page_;
  std::vector<int64_t> incoming;
  if (a.swa_pages) incoming.assign(a.swa_pages->begin() + lo, a.swa_pages->begin() + hi);
  for (int64_t id : incoming) {
    if (id < 0) throw InvariantError("an SWA recovery takes live pages");
  }
  std::vector<int64_t> own(a.pages.begin() + lo, a.pages.begin() + hi);
  if (nodes_[node].locks[kHybridFull] > 0) {
    // The node keeps its pages and takes the request's SWA; the request's FULL goes.
    free_ids(kHybridFull, std::move(own));
  } else {
    // The node takes the request's FULL pages; its old ones go (their SWA went before).
    std::vector<int64_t> old = std::exchange(nodes_[node].full, std::move(own));
    free_ids(kHybridFull, std::move(old));
  }
  set_swa(node, std::move(incoming));
  return live - total;
}

void HybridTree::swa_publish(int32_t leaf, int64_t start, int64_t end, const HybridInsertArgs& a) {
  // A new leaf's SWA from the request's window start on, a node at most one window.
  const auto span = swa_span(leaf, start, end, a.swa_evicted);
  if (!span) return;
  const int32_t node = span->first;
  int32_t head = -1;
  if (nodes_[node].locks[kHybridSwa] == 0) {
    const int64_t tail = (window_ + page_ - 1) / page_ * page_;
    if (len(nodes_[node].key) > tail) head = split(node, len(nodes_[node].key) - tail);
  }
  const int64_t end_page = end / page_;
  const auto& swa = *a.swa_pages;
  if (head >= 0) {
    const int64_t hp = len(nodes_[head].key) / page_;
    const int64_t lo = end_page - len(nodes_[node].key) / page_ - hp;
    set_swa(head, {swa.begin() + lo, swa.begin() + lo + hp});
  }
  const int64_t lo = end_page - len(nodes_[node].key) / page_;
  set_swa(node, {swa.begin() + lo, swa.begin() + end_page});
}

// -- eviction ---------------------------------------------------------------------------

void HybridTree::evict_component(int32_t s, int c, Tracker& tracker) {
  if (!has_value(s, c)) return;
  const int64_t sz = size(s, c);
  evictable_[c] -= sz;
  tracker[c] += sz;
  event(false, s, c);
  Node& n = nodes_[s];
  if (c == kHybridFull) {
    free_ids(kHybridFull, n.full);
  } else if (c == kHybridSwa) {
    free_ids(kHybridSwa, std::exchange(n.swa, {}));
    n.has_swa = false;
  } else {
    free_ids(kHybridMamba, {std::exchange(n.mamba, kHybridNone)});
    inner_discard(s);
  }
  if (c != kHybridFull && n.in_lru[c]) lru_remove(c, s);
}

void HybridTree::drop_states(const std::vector<HybridNodeRef>& refs) {
  std::vector<int32_t> slots;
  for (const auto& r : refs) {
    const int32_t s = slot(r);
    if (nodes_[s].locks[kHybridMamba] != 0) {
      throw std::invalid_argument("node " + std::to_string(r.id) + ": dropping a locked state");
    }
    slots.push_back(s);
  }
  Tracker tracker{0, 0, 0};
  for (int32_t s : slots) evict_component(s, kHybridMamba, tracker);
  ++version_;
}

void HybridTree::delete_leaf(int32_t s, Tracker& tracker) {
  for (int c : kComponents) {
    if (has(c)) evict_component(s, c, tracker);
  }
  leaf_discard(s);
  const int32_t parent = nodes_[s].parent;
  remove_child(parent, s);
  if (nodes_[parent].children.empty()) inner_discard(parent);
  --num_nodes_;
  drop_slot(s);
  refresh_leaf(parent);
}

void HybridTree::cascade(int32_t s, int trigger, Tracker& tracker) {
  for (int c : kComponents) {
    if (!has(c) || c == trigger || kInnerPriority[c] >= kInnerPriority[trigger] || !has_value(s, c)) continue;
    if (nodes_[s].locks[c] != 0) {
      throw InvariantError("node " + std::to_string(nodes_[s].id) + ": cascading into a locked " + kNames[c]);
    }
    evict_component(s, c, tracker);
  }
  refresh_leaf(s);
}

std::array<int64_t, 3> HybridTree::evict(std::array<int64_t, 3> want, std::array<int64_t, 3> reach) {
  for (int c : kComponents) {
    if (!has(c)) want[c] = 0, reach[c] = -1;
  }
  ++version_;
  Tracker tracker{0, 0, 0};
  for (int c : kComponents) {
    if (!has(c)) continue;
    const bool to_target = c == kHybridFull && want[c] > 0 && reach[c] >= 0;
    if (done(c, tracker, reach) || (!to_target && tracker[c] >= want[c])) continue;
    const int64_t quota = to_target ? std::max(want[c], tracker[c] + evictable_[kHybridFull]) : want[c];
    if (c == kHybridFull) {
      evict_full(quota, tracker, reach);
    } else {
      if (no_tail_cliff_ && c == kHybridSwa) {
        walk_aux(c, quota, tracker, reach, Skip::kBranchTails);
      } else if (no_tail_cliff_ && walk_every_state_) {
        walk_aux(c, quota, tracker, reach, Skip::kDeepestStates);
      } else if (no_tail_cliff_ && !inner_states_.empty()) {
        walk_inner_states(quota, tracker, reach);
      }
      walk_aux(c, quota, tracker, reach, Skip::kNone);
    }
  }
  return tracker;
}

void HybridTree::evict_full(int64_t quota, Tracker& tracker, const std::array<int64_t, 3>& reach) {
  // Unlocked leaves, least recently accessed first; a parent that becomes a leaf joins.
  using Entry = std::tuple<double, int64_t, int32_t>;  // (access time, id, slot)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int32_t s : leaves_) heap.emplace(nodes_[s].last_access, nodes_[s].id, s);
  int32_t parent = -1;
  while (true) {
    if (parent >= 0 && nodes_[parent].leaf_pos >= 0) heap.emplace(nodes_[parent].last_access, nodes_[parent].id, parent);
    parent = -1;
    int32_t victim = -1;
    while (tracker[kHybridFull] < quota && !heap.empty()) {
      const auto [t, id, s] = heap.top();
      heap.pop();
      if (holds(s, id) && nodes_[s].leaf_pos >= 0) {
        victim = s;
        break;
      }
    }
    if (victim < 0) return;
    parent = nodes_[victim].parent;
    delete_leaf(victim, tracker);
    if (no_tail_cliff_) parent = prune_dead(parent, tracker);
    if (done(kHybridFull, tracker, reach)) return;
  }
}

void HybridTree::walk_aux(int c, int64_t quota, Tracker& tracker, const std::array<int64_t, 3>& reach,
                          Skip skip) {
  // Least recent unlocked first: a leaf goes whole, an inner node is tombstoned for c
  // (and what ranks below c on it). `skip`: what no_tail_cliff's first walk passes over.
  std::unordered_set<int64_t> passed;  // ids the skip kept, not asked again
  auto in_lru = [&](int32_t s) { return s >= 0 && nodes_[s].alive && nodes_[s].in_lru[c]; };
  int32_t cursor = lru_unlocked(c);
  while (true) {
    if (cursor >= 0 && !in_lru(cursor)) cursor = lru_unlocked(c);
    if (tracker[c] >= quota || done(c, tracker, reach) || cursor < 0 || !in_lru(cursor)) return;
    const int32_t x = cursor;
    cursor = prev_unlocked(c, x);
    if (skip != Skip::kNone) {
      const int64_t id = nodes_[x].id;
      if (passed.count(id) || (skip == Skip::kBranchTails ? in_branch_tail(x) : deepest_state(x))) {
        passed.insert(id);
        continue;
      }
    }
    if (nodes_[x].leaf_pos >= 0) {
      const int32_t parent = nodes_[x].parent;
      delete_leaf(x, tracker);
      if (no_tail_cliff_) prune_dead(parent, tracker);
    } else {
      evict_component(x, c, tracker);
      cascade(x, c, tracker);
      if (no_tail_cliff_ && c == kHybridSwa) {
        std::vector<std::pair<int32_t, int64_t>> reading;
        for (int32_t leaf : leaves_reading(x)) reading.emplace_back(leaf, nodes_[leaf].id);
        for (const auto& [leaf, id] : reading) {
          if (holds(leaf, id)) prune_dead(leaf, tracker);
        }
      }
    }
  }
}

void HybridTree::walk_inner_states(int64_t quota, Tracker& tracker, const std::array<int64_t, 3>& reach) {
  // MAMBA's first walk over the only states it would not skip at sight: those on inner
  // nodes, least recent first (the LRU's order is its stamps').
  std::vector<std::pair<uint64_t, std::pair<int32_t, int64_t>>> order;
  for (int32_t s : inner_states_) order.push_back({nodes_[s].stamps[kHybridMamba], {s, nodes_[s].id}});
  std::sort(order.begin(), order.end());
  for (const auto& [stamp, entry] : order) {
    const auto [x, id] = entry;
    if (tracker[kHybridMamba] >= quota || done(kHybridMamba, tracker, reach)) return;
    if (holds(x, id) && nodes_[x].inner_pos >= 0 && !nodes_[x].locks[kHybridMamba] && !deepest_state(x)) {
      evict_component(x, kHybridMamba, tracker);
      cascade(x, kHybridMamba, tracker);
    }
  }
}

bool HybridTree::viable(int32_t s) const {
  if (has_mamba_ && nodes_[s].mamba == kHybridNone) return false;
  int64_t live = 0;
  for (int32_t x = s; has_swa_ && x != root_ && live < window_; x = nodes_[x].parent) {
    if (!nodes_[x].has_swa) return false;
    live += len(nodes_[x].key);
  }
  return true;
}

int32_t HybridTree::prune_dead(int32_t s, Tracker& tracker) {
  while (nodes_[s].alive && nodes_[s].leaf_pos >= 0 && !viable(s)) {
    const int32_t parent = nodes_[s].parent;
    delete_leaf(s, tracker);
    s = parent;
  }
  return s;
}

std::vector<int32_t> HybridTree::leaves_reading(int32_t s) const {
  std::vector<int32_t> out;
  std::vector<std::pair<int32_t, int64_t>> stack;
  for (int32_t ch : nodes_[s].children) stack.emplace_back(ch, len(nodes_[ch].key));
  while (!stack.empty()) {
    const auto [x, dist] = stack.back();
    stack.pop_back();
    if (dist >= window_) continue;
    if (nodes_[x].children.empty()) out.push_back(x);
    for (int32_t ch : nodes_[x].children) stack.emplace_back(ch, dist + len(nodes_[ch].key));
  }
  return out;
}

bool HybridTree::deepest_state(int32_t s) const {
  std::vector<int32_t> stack(nodes_[s].children.begin(), nodes_[s].children.end());
  if (stack.empty()) return true;
  while (!stack.empty()) {
    const int32_t x = stack.back();
    stack.pop_back();
    if (nodes_[x].mamba == kHybridNone) {
      if (nodes_[x].children.empty()) return true;
      stack.insert(stack.end(), nodes_[x].children.begin(), nodes_[x].children.end());
    }
  }
  return false;
}

bool HybridTree::in_branch_tail(int32_t s) const {
  if (nodes_[s].children.empty()) return viable(s);
  for (int32_t leaf : leaves_reading(s)) {
    if (viable(leaf)) return true;
  }
  return false;
}

// -- inspection -------------------------------------------------------------------------

std::vector<HybridNodeRef> HybridTree::nodes() const {
  std::vector<HybridNodeRef> out;
  std::vector<int32_t> stack{root_};
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    out.push_back(ref(s));
    stack.insert(stack.end(), nodes_[s].children.begin(), nodes_[s].children.end());
  }
  return out;
}

std::vector<HybridNodeRef> HybridTree::children(HybridNodeRef node) const {
  std::vector<HybridNodeRef> out;
  for (int32_t ch : nodes_[slot(node)].children) out.push_back(ref(ch));
  return out;
}

HybridNodeView HybridTree::view(HybridNodeRef r) const {
  const Node& n = nodes_[slot(r)];
  HybridNodeView v{n.id, n.parent < 0 ? -1 : nodes_[n.parent].id, n.key, n.full, std::nullopt, n.mamba, n.locks,
                   n.swa_uuid, n.last_access, n.stamps, n.ns, {}};
  if (n.has_swa) v.swa = n.swa;
  for (int32_t ch : n.children) v.children.push_back(nodes_[ch].id);
  return v;
}

std::vector<int64_t> HybridTree::lru_order(int c) const {
  if (c != kHybridSwa && c != kHybridMamba) throw std::invalid_argument("component: SWA or MAMBA have an LRU");
  std::vector<int64_t> out;
  for (int32_t x = nodes_[head(c)].next[c]; x != tail(c); x = nodes_[x].next[c]) out.push_back(nodes_[x].id);
  return out;
}

void HybridTree::check_invariants(const std::vector<HybridReceipt>& receipts) const {
  auto fail = [](const std::string& msg) { throw InvariantError(msg); };
  std::unordered_map<int64_t, std::array<int64_t, 3>> want;
  for (const auto& r : receipts) {
    if (!holds(r.node.slot, r.node.id)) fail("a live lock names node " + std::to_string(r.node.id) + ", gone");
    for (int32_t cur = r.node.slot; cur != root_; cur = nodes_[cur].parent) ++want[nodes_[cur].id][kHybridFull];
    if (has_swa_) {
      for (int32_t cur = r.node.slot; cur != root_; cur = nodes_[cur].parent) {
        ++want[nodes_[cur].id][kHybridSwa];
        if (r.swa_uuid != kHybridNone && nodes_[cur].swa_uuid == r.swa_uuid) break;
      }
    }
    if (has_mamba_ && r.node.slot != root_) ++want[r.node.id][kHybridMamba];
  }
  std::array<int64_t, 3> evictable{0, 0, 0}, prot{0, 0, 0};
  int64_t count = 0;
  size_t leaves = 0, inner = 0;
  for (const auto& r : nodes()) {
    ++count;
    const int32_t s = r.slot;
    if (s == root_) continue;
    const Node& n = nodes_[s];
    const std::string nid = "node " + std::to_string(n.id);
    if (n.key.empty() || len(n.key) % page_) fail(nid + ": key of " + std::to_string(n.key.size()) + " tokens is not whole pages");
    if (static_cast<int64_t>(n.full.size()) != len(n.key) / page_) fail(nid + ": FULL holds " + std::to_string(n.full.size()) + " pages for " + std::to_string(n.key.size()) + " tokens");
    if (n.has_swa && n.swa.size() != n.full.size()) fail(nid + ": SWA holds " + std::to_string(n.swa.size()) + " pages for " + std::to_string(n.full.size()));
    if ((!has_swa_ && n.has_swa) || (!has_mamba_ && n.mamba != kHybridNone)) fail(nid + ": a value for a component the tree does not have");
    for (int32_t ch : n.children) {
      if (nodes_[ch].parent != s || find_child(s, nodes_[ch].ns, nodes_[ch].key.data()) != ch) fail(nid + ": child " + std::to_string(nodes_[ch].id) + " is linked wrong");
    }
    const auto it = want.find(n.id);
    const std::array<int64_t, 3> exp = it == want.end() ? std::array<int64_t, 3>{0, 0, 0} : it->second;
    for (int c : kComponents) {
      if (!has(c)) continue;
      if (n.locks[c] != exp[c]) fail(nid + ": " + kNames[c] + " lock " + std::to_string(n.locks[c]) + ", live requests hold " + std::to_string(exp[c]));
      (n.locks[c] ? prot : evictable)[c] += size(s, c);
      if (c != kHybridFull && has_value(s, c) != n.in_lru[c]) fail(nid + ": " + kNames[c] + " value and LRU membership disagree");
    }
    if (is_leaf(s) != (n.leaf_pos >= 0)) fail(nid + ": the evictable-leaf set is wrong about it");
    if (n.leaf_pos >= 0) ++leaves;
    if (no_tail_cliff_ && n.leaf_pos >= 0 && !viable(s)) fail(nid + ": an evictable leaf no match can end in (no_tail_cliff prunes those)");
    const bool inner_state = n.mamba != kHybridNone && !n.children.empty();
    if (inner_state != (n.inner_pos >= 0)) fail(nid + ": the inner-state set is wrong about it");
    if (inner_state) ++inner;
  }
  for (int32_t ch : nodes_[root_].children) {
    if (find_child(root_, nodes_[ch].ns, nodes_[ch].key.data()) != ch) fail("root child " + std::to_string(nodes_[ch].id) + " is keyed wrong");
  }
  if (count != num_nodes_) fail(std::to_string(count) + " nodes reachable, " + std::to_string(num_nodes_) + " counted");
  if (leaves != leaves_.size()) fail("the evictable-leaf set holds nodes outside the tree");
  if (inner != inner_states_.size()) fail(std::to_string(inner) + " nodes hold a state and a child, " + std::to_string(inner_states_.size()) + " listed");
  if (has_mamba_) {
    uint64_t last = std::numeric_limits<uint64_t>::max();
    for (int32_t x = nodes_[head(kHybridMamba)].next[kHybridMamba]; x != tail(kHybridMamba); x = nodes_[x].next[kHybridMamba]) {
      if (nodes_[x].stamps[kHybridMamba] > last) fail("MAMBA's LRU order is not its stamps' order");
      last = nodes_[x].stamps[kHybridMamba];
    }
  }
  for (int c : kComponents) {
    if (!has(c)) continue;
    if (evictable[c] != evictable_[c] || prot[c] != protected_[c]) {
      fail(std::string(kNames[c]) + " sizes: evictable " + std::to_string(evictable_[c]) + " / protected " + std::to_string(protected_[c]) + ", nodes say " + std::to_string(evictable[c]) + " / " + std::to_string(prot[c]));
    }
    if (c != kHybridFull && lru_order(c).size() != lru_size_[c]) fail(std::string(kNames[c]) + " LRU list and membership disagree");
  }
}

}  // namespace prefixcache
