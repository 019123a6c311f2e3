// TierManager implementation. See tier_manager.h for the semantics and invariants.
#include "tier_manager.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <unordered_map>

#define XXH_INLINE_ALL
#include "third_party/xxhash/xxhash.h"

namespace prefixcache {

TierManager::Slots::Slots(const TierSpec& s, int64_t /*key_size*/)
    : spec(s),
      index(static_cast<int32_t>(s.num_slots)),
      children_of(static_cast<int32_t>(s.num_slots)),
      by_link(static_cast<int32_t>(s.num_slots)),
      parent(s.num_slots),
      has_parent(s.num_slots, 0),
      meta(s.num_slots),
      pins(s.num_slots, 0),
      children(s.num_slots, 0),
      stamp(s.num_slots, 0),
      created(s.num_slots, 0),
      version(s.num_slots, 0),
      page(s.num_slots, TokenPages::kNone),
      free_pos(s.num_slots, -1),
      reuse(s.store_threshold >= 2 ? s.reuse_slots : 0) {
  free_slots.reserve(s.num_slots);
  for (int64_t i = s.num_slots - 1; i >= 0; --i) {  // slot 0 is taken first
    free_pos[i] = static_cast<int32_t>(free_slots.size());
    free_slots.push_back(static_cast<int32_t>(i));
  }
}

TierManager::TierManager(int64_t num_device_blocks, int64_t block_size, int64_t key_size, std::vector<TierSpec> tiers,
                         bool keep_tokens, bool record_events, bool lineage, int64_t token_bytes)
    : num_device_blocks_(num_device_blocks),
      block_size_(block_size),
      key_size_(key_size),
      keep_tokens_(keep_tokens),
      record_events_(record_events),
      lineage_(lineage),
      token_bytes_(token_bytes),
      page_bytes_(token_bytes == 4 || token_bytes == 8 ? static_cast<size_t>(block_size * token_bytes) : 0),
      device_(num_device_blocks < 1 || num_device_blocks > kMaxBlocks ? 1 : num_device_blocks),
      pages_(1, 0) {
  if (num_device_blocks < 1 || num_device_blocks > kMaxBlocks) {
    throw std::invalid_argument("num_device_blocks must be in [1, " + std::to_string(kMaxBlocks) + "], got " +
                                std::to_string(num_device_blocks));
  }
  if (block_size < 1) throw std::invalid_argument("block_size must be >= 1, got " + std::to_string(block_size));
  if (key_size < 1) throw std::invalid_argument("key_size must be >= 1, got " + std::to_string(key_size));
  if (token_bytes != 4 && token_bytes != 8) {
    throw std::invalid_argument("token_bytes must be 4 or 8, got " + std::to_string(token_bytes));
  }
  if (lineage && !keep_tokens) {
    throw std::invalid_argument("lineage needs keep_tokens: a block is found by comparing its token ids");
  }
  if (keep_tokens && block_size > (int64_t{1} << 20)) {
    throw std::invalid_argument("block_size " + std::to_string(block_size) + " is too large to keep tokens per slot");
  }
  for (size_t t = 0; t < tiers.size(); ++t) {
    const TierSpec& s = tiers[t];
    if (s.num_slots < 1 || s.num_slots > kMaxBlocks) {
      throw std::invalid_argument("tiers[" + std::to_string(t) + "].num_blocks must be in [1, " +
                                  std::to_string(kMaxBlocks) + "], got " + std::to_string(s.num_slots));
    }
    if (s.min_hits < 0) {
      throw std::invalid_argument("tiers[" + std::to_string(t) + "].min_hits must be >= 0, got " +
                                  std::to_string(s.min_hits));
    }
    if (s.store_threshold < 0) {
      throw std::invalid_argument("tiers[" + std::to_string(t) + "].store_threshold must be >= 0, got " +
                                  std::to_string(s.store_threshold));
    }
    if (s.store_threshold >= 2 && (s.reuse_slots < 1 || s.reuse_slots > kMaxBlocks)) {
      throw std::invalid_argument("tiers[" + std::to_string(t) + "].reuse_tracker_size must be in [1, " +
                                  std::to_string(kMaxBlocks) + "] with store_threshold >= 2, got " +
                                  std::to_string(s.reuse_slots));
    }
  }
  tiers_.reserve(tiers.size());
  for (const TierSpec& s : tiers) tiers_.emplace_back(s, key_size);
  pages_ = TokenPages(static_cast<int64_t>(page_bytes_), pages_capacity());
}

int64_t TierManager::pages_capacity() const {
  if (!keep_tokens_) return 0;
  int64_t holders = num_device_blocks_;
  for (const Slots& s : tiers_) holders += s.spec.num_slots;
  return holders + 1;
}

TierManager::Slots& TierManager::tier_at(int32_t t) {
  if (t < 0 || t >= num_tiers()) {
    throw std::out_of_range("tier " + std::to_string(t) + " is out of range [0, " + std::to_string(num_tiers()) + ")");
  }
  return tiers_[t];
}

const TierManager::Slots& TierManager::tier_at(int32_t t) const {
  return const_cast<TierManager*>(this)->tier_at(t);
}

int32_t TierManager::check_slot(const Slots& s, int32_t t, int64_t slot, const char* what) const {
  if (slot < 0 || slot >= s.spec.num_slots) {
    throw std::out_of_range(std::string(what) + ": slot " + std::to_string(slot) + " of tier " + std::to_string(t) +
                            " is out of range [0, " + std::to_string(s.spec.num_slots) + ")");
  }
  return static_cast<int32_t>(slot);
}

int32_t TierManager::check_block(int64_t block, const char* what) const {
  if (block < 0 || block >= num_device_blocks_) {
    throw std::out_of_range(std::string(what) + ": block id " + std::to_string(block) + " is out of range [0, " +
                            std::to_string(num_device_blocks_) + ")");
  }
  return static_cast<int32_t>(block);
}

// ------------------------------------------------------------------ eviction order

bool TierManager::evictable(const Slots& s, int32_t slot) const {
  return s.index.has_key(slot) && s.pins[slot] == 0 && !(s.spec.leaves_only && s.children[slot] > 0);
}

bool TierManager::live(const Slots& s, const Slots::Entry& e) const {
  return s.version[e.slot] == e.version && evictable(s, e.slot);
}

NativeKey TierManager::key_of(const Slots& s, int32_t slot) const {
  EvictionCandidate c;
  const BlockMeta& m = s.meta[slot];
  c.id = slot;
  c.num_tokens = block_size_;
  c.last_access_time = s.stamp[slot];
  c.creation_time = s.created[slot];
  c.hit_count = m.hits;
  c.use_count = s.spec.order == EvictionOrder::kChain ? std::max(m.uses, m.depth + 1) : m.uses;
  c.last_use = m.last_use;
  c.request_tokens = m.request_tokens;
  return s.spec.rank ? s.spec.rank(c) : native_key(s.spec.order, s.spec.params, c);
}

namespace {
// std heaps are max-heaps: "a goes below b" when a leaves later.
template <class Entry>
bool later(const Entry& a, const Entry& b) {
  if (b.key < a.key) return true;
  if (a.key < b.key) return false;
  return a.seq > b.seq;
}
}  // namespace

void TierManager::push(Slots& s, int32_t slot) {
  if (!evictable(s, slot)) return;
  if (s.queued() > 2 * static_cast<size_t>(s.spec.num_slots) + 64) compact(s);
  const Slots::Entry e{key_of(s, slot), s.next_seq++, slot, ++s.version[slot]};
  if (s.run.empty() || !later(s.run.back(), e)) {
    s.run.push_back(e);  // leaves no earlier than the run's last: O(1)
  } else {
    s.heap.push_back(e);
    std::push_heap(s.heap.begin(), s.heap.end(), later<Slots::Entry>);
  }
}

std::optional<TierManager::Slots::Entry> TierManager::pop(Slots& s) {
  if (s.run.empty() && s.heap.empty()) return std::nullopt;
  if (s.run.empty() || (!s.heap.empty() && later(s.run.front(), s.heap.front()))) {
    std::pop_heap(s.heap.begin(), s.heap.end(), later<Slots::Entry>);
    const Slots::Entry top = s.heap.back();
    s.heap.pop_back();
    return top;
  }
  const Slots::Entry top = s.run.front();
  s.run.pop_front();
  return top;
}

void TierManager::compact(Slots& s) {
  std::vector<Slots::Entry> kept;
  for (const Slots::Entry& e : s.heap) {
    if (live(s, e)) kept.push_back(e);
  }
  s.heap.swap(kept);
  std::make_heap(s.heap.begin(), s.heap.end(), later<Slots::Entry>);
  std::deque<Slots::Entry> run;  // (a subsequence of an ordered run is in order)
  for (const Slots::Entry& e : s.run) {
    if (live(s, e)) run.push_back(e);
  }
  s.run.swap(run);
}

// ------------------------------------------------------------------ movement

void TierManager::record(bool stored, int32_t tier, std::string_view key, const std::string* parent,
                         const char* tokens, int32_t tag) {
  if (!record_events_) return;
  TierRecord r{stored, tier, std::string(key), parent ? *parent : std::string(), parent != nullptr, {}, tag};
  if (stored && tokens != nullptr) r.tokens = widened(tokens);
  records_.push_back(std::move(r));
}

void TierManager::remove_slot(int32_t t, int32_t slot) {
  Slots& s = tiers_[t];
  const std::string& key = s.index.key(slot);
  record(false, t, key, nullptr, nullptr, s.meta[slot].tag);
  if (s.has_parent[slot] && s.spec.leaves_only) {
    int32_t p = s.index.first(s.parent[slot]);
    if (p >= 0) {
      --s.children[p];
      if (s.children[p] == 0) push(s, p);  // a chain tail again
    }
    s.children_of.erase(slot);
  }
  if (s.by_link.has_key(slot)) s.by_link.erase(slot);
  s.has_parent[slot] = 0;
  s.index.erase(slot);
  s.children[slot] = 0;
  ++s.version[slot];
}

void TierManager::link_children(Slots& s, int32_t slot) {
  // Only a leaves-only tier needs to know which of its slots extend which.
  if (!s.spec.leaves_only) return;
  if (s.has_parent[slot]) {
    s.children_of.insert(slot, s.parent[slot]);
    int32_t p = s.index.first(s.parent[slot]);
    if (p >= 0) {
      if (s.children[p] == 0) ++s.version[p];  // no longer a candidate
      ++s.children[p];
    }
  }
  int32_t kids = 0;
  for (int32_t c : s.children_of.holders(s.index.key(slot))) kids += s.index.has_key(c) ? 1 : 0;
  s.children[slot] = kids;
}

std::string_view TierManager::link_of(std::string_view parent, uint64_t token_hash) const {
  link_.assign(parent.data(), parent.size());
  link_.append(reinterpret_cast<const char*>(&token_hash), sizeof token_hash);
  return link_;
}

uint64_t TierManager::hash_tokens(const char* page) const { return XXH3_64bits(page, page_bytes_); }

std::vector<int64_t> TierManager::widened(const char* page) const {
  std::vector<int64_t> out(static_cast<size_t>(block_size_));
  if (token_bytes_ == 8) {
    std::memcpy(out.data(), page, page_bytes_);
    return out;
  }
  for (size_t i = 0; i < out.size(); ++i) {
    int32_t v;
    std::memcpy(&v, page + i * sizeof v, sizeof v);
    out[i] = v;
  }
  return out;
}

void TierManager::check_key_size(std::string_view key, const char* what, const char* name) const {
  if (key.size() != static_cast<size_t>(key_size_)) {
    throw std::invalid_argument(std::string(what) + ": " + name + " must be " + std::to_string(key_size_) +
                                " bytes, got " + std::to_string(key.size()));
  }
}

void TierManager::check_token_bytes(std::string_view tokens, size_t blocks, const char* what) const {
  if (tokens.size() != blocks * page_bytes_) {
    throw std::invalid_argument(std::string(what) + ": " + std::to_string(blocks) + " blocks need " +
                                std::to_string(blocks * block_size_) + " token ids, got " +
                                std::to_string(tokens.size() / token_bytes_));
  }
}

void TierManager::demote(int32_t from, int32_t src, std::string_view key, const std::string* parent, int32_t page,
                         const BlockMeta& meta) {
  const int32_t next = from + 1;
  // The next tier only: an inclusive tier further down may hold a copy (written through),
  // which does not make this one hold it.
  if (next >= num_tiers() || tiers_[next].index.first(key) >= 0) return;
  Slots& s = tiers_[next];
  if (s.spec.write != TierWrite::kOnEvict) return;  // dropped: an inclusive tier copies on its own terms
  if (meta.hits < s.spec.min_hits || !reused_enough(s, key)) {
    ++s.counters.filtered;  // dropped by the filter
    return;
  }
  store(next, from, src, key, parent, page, meta);
}

void TierManager::count_use(std::string_view key) {
  const uint64_t k = block_ghost_key(key);
  for (Slots& s : tiers_) {
    if (s.reuse.enabled()) s.reuse.put(k, s.reuse.peek(k) + 1);
  }
}

bool TierManager::reused_enough(const Slots& s, std::string_view key) {
  return s.spec.store_threshold < 2 || s.reuse.peek(block_ghost_key(key)) >= s.spec.store_threshold;
}

int32_t TierManager::take_slot(int32_t t) {
  Slots& s = tiers_[t];
  if (!s.free_slots.empty()) {
    int32_t slot = s.free_slots.back();
    s.free_slots.pop_back();
    s.free_pos[slot] = -1;
    return slot;
  }
  while (const std::optional<Slots::Entry> next = pop(s)) {
    const Slots::Entry top = *next;
    if (!live(s, top)) continue;
    const int32_t victim = top.slot;
    // remove_slot drops the key from the index but leaves the slot's key, parent and
    // tokens in place until the slot is written again (by the caller, after this), so
    // demote() reads them where they are.
    const bool has_parent = s.has_parent[victim] != 0;
    const BlockMeta meta = s.meta[victim];
    remove_slot(t, victim);
    ++s.counters.evictions;
    const int64_t stores_below = t + 1 < num_tiers() ? tiers_[t + 1].counters.stores : 0;
    // The victim's data moves down before the caller's store overwrites its slot.
    demote(t, victim, s.index.key(victim), has_parent ? &s.parent[victim] : nullptr, s.page[victim], meta);
    if (t + 1 < num_tiers() && tiers_[t + 1].counters.stores > stores_below) ++s.counters.demotions;
    return victim;
  }
  return -1;
}

int32_t TierManager::store(int32_t t, int32_t src_tier, int32_t src, std::string_view key, const std::string* parent,
                           int32_t page, const BlockMeta& meta) {
  const int32_t slot = take_slot(t);
  Slots& s = tiers_[t];
  if (slot < 0) {
    ++s.counters.refused;
    return -1;
  }
  s.index.insert(slot, key);
  if (parent != nullptr) {
    s.parent[slot].assign(parent->data(), parent->size());
    s.has_parent[slot] = 1;
    if (lineage_) s.by_link.insert(slot, link_of(*parent, meta.token_hash));
  }
  link_children(s, slot);
  s.meta[slot] = meta;
  s.stamp[slot] = s.created[slot] = ++s.clock;
  s.pins[slot] = 0;
  if (keep_tokens_) pages_.hold(s.page[slot], page);  // the block's ids, by reference
  transfers_.push_back(Transfer{src_tier, src, t, slot});
  ++s.counters.stores;
  record(true, t, key, parent, pages_.data(s.page[slot]), meta.tag);
  push(s, slot);
  return slot;
}

// ------------------------------------------------------------------ device side

void TierManager::device_cached(const std::vector<int64_t>& blocks, std::string_view keys,
                                std::optional<std::string_view> parent, std::string_view tokens, int64_t depth,
                                int64_t request_tokens, int32_t tag) {
  CallFlag::Scope running(calls_, "TierManager.device_cached");
  const size_t n = blocks.size();
  if (keys.size() != n * static_cast<size_t>(key_size_)) {
    throw std::invalid_argument("device_cached: " + std::to_string(n) + " blocks need " + std::to_string(n) +
                                " keys of " + std::to_string(key_size_) + " bytes, got " +
                                std::to_string(keys.size()) + " bytes");
  }
  if (parent) check_key_size(*parent, "device_cached", "parent");
  if (lineage_ && n > 0 && !parent) {
    throw std::invalid_argument("device_cached: with lineage every chain names its parent (a root key at the start)");
  }
  if (keep_tokens_) check_token_bytes(tokens, n, "device_cached");
  for (size_t i = 0; i < n; ++i) {
    int32_t b = check_block(blocks[i], "device_cached");
    if (device_.index.has_key(b) && device_.index.key(b) != keys.substr(i * key_size_, key_size_)) {
      throw std::invalid_argument("device_cached: block " + std::to_string(b) +
                                  " still holds another key (report its eviction first)");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const int32_t b = static_cast<int32_t>(blocks[i]);
    std::optional<std::string_view> up = i ? std::optional<std::string_view>(keys.substr((i - 1) * key_size_, key_size_))
                                           : parent;
    if (device_.index.has_key(b)) continue;  // holds this key already (a loaded block)
    const char* toks = keep_tokens_ ? tokens.data() + i * page_bytes_ : nullptr;
    cache_one(b, keys.substr(i * key_size_, key_size_), up, toks, depth, request_tokens, tag,
              lineage_ ? hash_tokens(toks) : 0);
  }
}

void TierManager::cache_one(int32_t b, std::string_view key, std::optional<std::string_view> up, const char* tokens,
                            int64_t depth, int64_t request_tokens, int32_t tag, uint64_t token_hash) {
  device_.index.insert(b, key);
  count_use(key);
  device_.has_parent[b] = up.has_value();
  if (up) device_.parent[b].assign(up->data(), up->size());
  device_.meta[b] = BlockMeta{0, 1, depth, traffic_, request_tokens, tag, token_hash};
  if (keep_tokens_) pages_.fill(device_.page[b], tokens);
  const std::string* par = up ? &device_.parent[b] : nullptr;
  for (int32_t t = 0; t < num_tiers(); ++t) {
    if (tiers_[t].spec.write == TierWrite::kWriteThrough && tiers_[t].index.first(key) < 0) {
      if (reused_enough(tiers_[t], key)) {
        store(t, kDevice, b, key, par, device_.page[b], device_.meta[b]);
      } else {
        ++tiers_[t].counters.filtered;
      }
    }
  }
}

void TierManager::device_cached_named(const std::vector<int64_t>& blocks, std::string_view parent,
                                      std::string_view tokens, int64_t depth, int64_t request_tokens, int32_t tag) {
  CallFlag::Scope running(calls_, "TierManager.device_cached_named");
  if (!lineage_) throw std::invalid_argument("device_cached_named: this manager is keyed by hash (built without lineage)");
  const size_t n = blocks.size();
  check_key_size(parent, "device_cached_named", "parent");
  check_token_bytes(tokens, n, "device_cached_named");
  for (size_t i = 0; i < n; ++i) check_block(blocks[i], "device_cached_named");
  std::string up(parent);
  for (size_t i = 0; i < n; ++i) {
    const int32_t b = static_cast<int32_t>(blocks[i]);
    if (device_.index.has_key(b)) {  // a loaded block: named already
      up = device_.index.key(b);
      continue;
    }
    const char* page = tokens.data() + i * page_bytes_;
    const uint64_t h = hash_tokens(page);
    const auto [t, slot] = find_link(up, page, h);
    const std::string name = t == kNowhere ? new_name() : tiers_[t].index.key(slot);
    cache_one(b, name, up, page, depth, request_tokens, tag, h);
    up = name;
  }
}

std::string TierManager::new_name() {
  if (!lineage_) throw std::invalid_argument("new_name: this manager is keyed by hash (built without lineage)");
  const uint64_t n = ++names_;
  std::string name(static_cast<size_t>(key_size_), '\0');
  std::memcpy(name.data(), &n, std::min<size_t>(sizeof n, name.size()));
  return name;
}

std::optional<std::string> TierManager::device_key(int64_t block) const {
  const int32_t b = check_block(block, "device_key");
  if (!device_.index.has_key(b)) return std::nullopt;
  return device_.index.key(b);
}

int64_t TierManager::admitted(int64_t tokens, const std::vector<int64_t>& blocks, int64_t request_tokens) {
  CallFlag::Scope running(calls_, "TierManager.admitted");
  if (tokens < 0) throw std::invalid_argument("admitted: tokens must be >= 0, got " + std::to_string(tokens));
  for (int64_t b : blocks) check_block(b, "admitted");
  traffic_ += tokens;
  // The request continues a chain when its hit ends at a block only its computer used:
  // the chain's tail, not a prefix many requests branch from.
  int64_t depth = 0;
  if (!blocks.empty() && device_.index.has_key(static_cast<int32_t>(blocks.back()))) {
    const BlockMeta& last = device_.meta[blocks.back()];
    if (last.uses == 1) depth = last.depth + 1;
  }
  for (int64_t id : blocks) {
    const int32_t b = static_cast<int32_t>(id);
    if (!device_.index.has_key(b)) continue;
    BlockMeta& m = device_.meta[b];
    ++m.hits;
    ++m.uses;
    m.last_use = traffic_;
    m.request_tokens = request_tokens;
    m.depth = std::max(m.depth, depth);
    std::string_view key = device_.index.key(b);
    count_use(key);
    const std::string* par = device_.has_parent[b] ? &device_.parent[b] : nullptr;
    for (int32_t t = 0; t < num_tiers(); ++t) {
      Slots& s = tiers_[t];
      if (s.spec.write == TierWrite::kSelective && m.hits >= s.spec.min_hits && s.index.first(key) < 0) {
        if (reused_enough(s, key)) {
          store(t, kDevice, b, key, par, device_.page[b], m);
        } else {
          ++s.counters.filtered;
        }
      }
    }
  }
  return depth;
}

void TierManager::device_evicted(const std::vector<int64_t>& blocks) {
  CallFlag::Scope running(calls_, "TierManager.device_evicted");
  for (int64_t b : blocks) check_block(b, "device_evicted");
  for (int64_t id : blocks) {
    const int32_t b = static_cast<int32_t>(id);
    if (!device_.index.has_key(b)) continue;
    // erase() leaves the block's key, parent and tokens in place until the block is cached
    // again, which cannot happen during this call: demote() reads them there.
    device_.index.erase(b);
    std::string_view key = device_.index.key(b);
    if (device_.index.first(key) >= 0) continue;  // another copy is still on the device
    demote(kDevice, b, key, device_.has_parent[b] ? &device_.parent[b] : nullptr, device_.page[b], device_.meta[b]);
  }
}

void TierManager::device_dropped(const std::vector<int64_t>& blocks) {
  CallFlag::Scope running(calls_, "TierManager.device_dropped");
  for (int64_t b : blocks) check_block(b, "device_dropped");
  for (int64_t b : blocks) {
    if (device_.index.has_key(static_cast<int32_t>(b))) device_.index.erase(static_cast<int32_t>(b));
  }
}

std::vector<int32_t> TierManager::device_holders(std::string_view key) const { return device_.index.holders(key); }

bool TierManager::device_has(int64_t block) const {
  return device_.index.has_key(check_block(block, "device_has"));
}

const BlockMeta& TierManager::device_meta(int64_t block) const { return device_.meta[check_block(block, "device_meta")]; }

int64_t TierManager::persist(int32_t t) {
  CallFlag::Scope running(calls_, "TierManager.persist");
  Slots& dst = tier_at(t);
  if (!dst.spec.keep_on_load) {
    throw std::invalid_argument("persist: tier " + std::to_string(t) +
                                " does not keep what it loads (only a disk tier persists blocks)");
  }
  const int64_t most = dst.spec.num_slots;
  int64_t stored = 0;
  // A source the tier already holds is skipped, so a key held twice above is copied once.
  auto copy = [&](int32_t src_tier, int32_t src, std::string_view key, const std::string* parent, int32_t page,
                  const BlockMeta& meta) {
    if (stored >= most || dst.index.first(key) >= 0) return;
    if (store(t, src_tier, src, key, parent, page, meta) >= 0) ++stored;
  };
  for (int32_t b = 0; b < static_cast<int32_t>(num_device_blocks_); ++b) {
    if (!device_.index.has_key(b)) continue;
    copy(kDevice, b, device_.index.key(b), device_.has_parent[b] ? &device_.parent[b] : nullptr, device_.page[b],
         device_.meta[b]);
  }
  for (int32_t u = 0; u < t; ++u) {
    Slots& s = tiers_[u];
    for (int32_t slot = 0; slot < static_cast<int32_t>(s.spec.num_slots); ++slot) {
      if (!s.index.has_key(slot)) continue;
      copy(u, slot, s.index.key(slot), s.has_parent[slot] ? &s.parent[slot] : nullptr, s.page[slot], s.meta[slot]);
    }
  }
  return stored;
}

// ------------------------------------------------------------------ look-up

std::pair<int32_t, int32_t> TierManager::locate(std::string_view key) const {
  for (int32_t t = 0; t < num_tiers(); ++t) {
    int32_t slot = tiers_[t].index.first(key);
    if (slot >= 0) return {t, slot};
  }
  return {kNowhere, -1};
}

std::vector<std::pair<int32_t, int32_t>> TierManager::chain(const BlockPool* pool, std::string_view keys,
                                                            int64_t start, int64_t stop) const {
  if (keys.size() % key_size_) {
    throw std::invalid_argument("chain: keys must be a multiple of " + std::to_string(key_size_) + " bytes, got " +
                                std::to_string(keys.size()));
  }
  const int64_t num_keys = static_cast<int64_t>(keys.size()) / key_size_;
  if (start < 0 || stop > num_keys || start > stop) {
    throw std::out_of_range("chain: [" + std::to_string(start) + ", " + std::to_string(stop) +
                            ") is not a range of the " + std::to_string(num_keys) + " keys");
  }
  std::vector<std::pair<int32_t, int32_t>> out;
  for (int64_t i = start; i < stop; ++i) {
    std::string_view key = keys.substr(i * key_size_, key_size_);
    if (pool != nullptr) {
      std::optional<int32_t> b = pool->lookup(key);
      if (b) {
        out.emplace_back(kDevice, *b);
        continue;
      }
    }
    auto where = locate(key);
    if (where.first == kNowhere) break;
    out.push_back(where);
  }
  return out;
}

std::vector<std::pair<int32_t, int32_t>> TierManager::follow(std::string_view parent, std::string_view tokens,
                                                             std::string* keys) const {
  if (!lineage_) throw std::invalid_argument("follow: this manager finds blocks by key (built without lineage)");
  check_key_size(parent, "follow", "parent");
  if (tokens.size() % page_bytes_) {
    throw std::invalid_argument("follow: " + std::to_string(tokens.size() / token_bytes_) +
                                " token ids are not whole blocks of " + std::to_string(block_size_));
  }
  std::vector<std::pair<int32_t, int32_t>> out;
  std::string up(parent);
  for (size_t at = 0; at < tokens.size(); at += page_bytes_) {
    const char* page = tokens.data() + at;
    const auto found = find_link(up, page, hash_tokens(page));
    if (found.first == kNowhere) break;
    out.push_back(found);
    up = tiers_[found.first].index.key(found.second);
    if (keys != nullptr) keys->append(up);
  }
  return out;
}

std::pair<int32_t, int32_t> TierManager::find_link(std::string_view up, const char* page,
                                                    uint64_t token_hash) const {
  const std::string_view link = link_of(up, token_hash);
  for (int32_t t = 0; t < num_tiers(); ++t) {
    const Slots& s = tiers_[t];
    // Holders share the link's bytes; the parent and every token id decide (a hash
    // collision, or a block computed twice, is only a second holder).
    for (int32_t slot : s.by_link.holders(link)) {
      const char* held = pages_.data(s.page[slot]);  // (never null for a linked slot; checked all the same)
      if (held != nullptr && s.parent[slot] == up && std::memcmp(held, page, page_bytes_) == 0) {
        return {t, slot};
      }
    }
  }
  return {kNowhere, -1};
}

// ------------------------------------------------------------------ loads

void TierManager::pin(const std::vector<std::pair<int32_t, int32_t>>& slots) {
  CallFlag::Scope running(calls_, "TierManager.pin");
  for (const auto& [t, slot] : slots) {
    const Slots& s = tier_at(t);
    check_slot(s, t, slot, "pin");
    if (!s.index.has_key(slot)) throw std::invalid_argument("pin: slot " + std::to_string(slot) + " of tier " +
                                                            std::to_string(t) + " holds no block");
  }
  for (const auto& [t, slot] : slots) {
    ++tiers_[t].pins[slot];
    ++tiers_[t].version[slot];
  }
}

void TierManager::unpin(const std::vector<std::pair<int32_t, int32_t>>& slots) {
  CallFlag::Scope running(calls_, "TierManager.unpin");
  for (const auto& [t, slot] : slots) {
    const Slots& s = tier_at(t);
    check_slot(s, t, slot, "unpin");
    if (s.pins[slot] < 1) throw std::invalid_argument("unpin: slot " + std::to_string(slot) + " of tier " +
                                                      std::to_string(t) + " is not pinned");
  }
  for (const auto& [t, slot] : slots) {
    --tiers_[t].pins[slot];
    push(tiers_[t], slot);
  }
}

void TierManager::promote_slot(int32_t t, int32_t slot) {
  Slots& s = tiers_[t];
  --s.pins[slot];
  if (s.spec.write == TierWrite::kOnEvict && !s.spec.keep_on_load) {
    if (s.pins[slot] > 0) return;  // another admission loads it too: the last one takes it out
    remove_slot(t, slot);  // exclusive: the block lives on the device now
    s.free_pos[slot] = static_cast<int32_t>(s.free_slots.size());
    s.free_slots.push_back(slot);
  } else {
    s.stamp[slot] = ++s.clock;
    push(s, slot);
  }
}

void TierManager::finish_loads(const std::vector<std::pair<int32_t, int32_t>>& sources) {
  CallFlag::Scope running(calls_, "TierManager.finish_loads");
  for (const auto& [t, slot] : sources) {
    const Slots& s = tier_at(t);
    check_slot(s, t, slot, "finish_loads");
    if (!s.index.has_key(slot) || s.pins[slot] < 1) {
      throw std::invalid_argument("finish_loads: slot " + std::to_string(slot) + " of tier " + std::to_string(t) +
                                  " must hold a block and be pinned");
    }
  }
  for (const auto& [t, slot] : sources) promote_slot(t, slot);
}

void TierManager::load(const std::vector<std::pair<int32_t, int32_t>>& sources, const std::vector<int64_t>& dst,
                       bool promote) {
  CallFlag::Scope running(calls_, "TierManager.load");
  if (sources.size() != dst.size()) {
    throw std::invalid_argument("load: " + std::to_string(sources.size()) + " sources for " +
                                std::to_string(dst.size()) + " device blocks");
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto& [t, slot] = sources[i];
    const Slots& s = tier_at(t);
    check_slot(s, t, slot, "load");
    if (!s.index.has_key(slot) || s.pins[slot] < 1) {
      throw std::invalid_argument("load: slot " + std::to_string(slot) + " of tier " + std::to_string(t) +
                                  " must hold a block and be pinned");
    }
    int32_t b = check_block(dst[i], "load");
    if (device_.index.has_key(b)) {
      throw std::invalid_argument("load: device block " + std::to_string(b) + " still holds a key");
    }
  }
  for (size_t i = 0; i < sources.size(); ++i) {
    const auto [t, slot] = sources[i];
    Slots& s = tiers_[t];
    const int32_t b = static_cast<int32_t>(dst[i]);
    transfers_.push_back(Transfer{t, slot, kDevice, b});
    ++s.counters.loads;
    std::string_view key = s.index.key(slot);
    device_.index.insert(b, key);
    device_.has_parent[b] = s.has_parent[slot];
    if (s.has_parent[slot]) device_.parent[b] = s.parent[slot];
    device_.meta[b] = s.meta[slot];
    if (keep_tokens_) pages_.hold(device_.page[b], s.page[slot]);
    if (promote) promote_slot(t, slot);
  }
}

void TierManager::count_hits(int32_t tier, int64_t n) {
  CallFlag::Scope running(calls_, "TierManager.count_hits");
  Slots& s = tier_at(tier);
  if (n < 0) throw std::invalid_argument("count_hits: n must be >= 0, got " + std::to_string(n));
  s.counters.hits += n;
}

// ------------------------------------------------------------------ the engine's side

void TierManager::drop(int32_t tier, int32_t slot, bool failed_write) {
  CallFlag::Scope running(calls_, "TierManager.drop");
  Slots& s = tier_at(tier);
  check_slot(s, tier, slot, "drop");
  if (!s.index.has_key(slot)) return;  // gone already (a later eviction)
  if (s.pins[slot] > 0) {
    throw std::invalid_argument("drop: slot " + std::to_string(slot) + " of tier " + std::to_string(tier) +
                                " is pinned by an admission in progress");
  }
  remove_slot(tier, slot);
  s.free_pos[slot] = static_cast<int32_t>(s.free_slots.size());
  s.free_slots.push_back(slot);
  ++(failed_write ? s.counters.refused : s.counters.errors);
}

void TierManager::restore(int32_t tier, int32_t slot, std::string_view key, std::optional<std::string_view> parent,
                          std::string_view tokens, int64_t hits) {
  CallFlag::Scope running(calls_, "TierManager.restore");
  Slots& s = tier_at(tier);
  check_slot(s, tier, slot, "restore");
  if (s.index.has_key(slot)) {
    throw std::invalid_argument("restore: slot " + std::to_string(slot) + " of tier " + std::to_string(tier) +
                                " already holds a block");
  }
  check_key_size(key, "restore", "key");
  if (parent) check_key_size(*parent, "restore", "parent");
  if (s.index.first(key) >= 0) {
    throw std::invalid_argument("restore: tier " + std::to_string(tier) + " already holds that key");
  }
  if (keep_tokens_) check_token_bytes(tokens, 1, "restore");
  // Out of the free list (swap with its last entry).
  const int32_t at = s.free_pos[slot];
  const int32_t last = s.free_slots.back();
  s.free_slots[at] = last;
  s.free_pos[last] = at;
  s.free_slots.pop_back();
  s.free_pos[slot] = -1;
  std::string par = parent ? std::string(*parent) : std::string();
  BlockMeta meta{std::max<int64_t>(hits, 0), std::max<int64_t>(hits, 0) + 1, 0, traffic_, 0, 0};
  // store() without taking a slot or recording a transfer: the data is already there.
  s.index.insert(slot, key);
  if (lineage_) meta.token_hash = hash_tokens(tokens.data());  // (lineage keeps tokens: checked above)
  if (parent) {
    s.parent[slot] = par;
    s.has_parent[slot] = 1;
    if (lineage_) s.by_link.insert(slot, link_of(par, meta.token_hash));
  }
  link_children(s, slot);
  s.meta[slot] = meta;
  s.stamp[slot] = s.created[slot] = ++s.clock;
  if (keep_tokens_) pages_.fill(s.page[slot], tokens.data());
  record(true, tier, key, parent ? &par : nullptr, pages_.data(s.page[slot]), 0);
  push(s, slot);
}

std::string TierManager::slot_key(int32_t tier, int32_t slot) const {
  const Slots& s = tier_at(tier);
  check_slot(s, tier, slot, "slot_key");
  if (!s.index.has_key(slot)) throw std::invalid_argument("slot " + std::to_string(slot) + " of tier " +
                                                          std::to_string(tier) + " holds no block");
  return s.index.key(slot);
}

std::optional<std::string> TierManager::slot_parent(int32_t tier, int32_t slot) const {
  const Slots& s = tier_at(tier);
  slot_key(tier, slot);
  if (!s.has_parent[slot]) return std::nullopt;
  return s.parent[slot];
}

std::vector<int64_t> TierManager::slot_tokens(int32_t tier, int32_t slot) const {
  slot_key(tier, slot);
  if (!keep_tokens_) return {};
  return widened(pages_.data(tiers_[tier].page[slot]));
}

int64_t TierManager::slot_hits(int32_t tier, int32_t slot) const {
  slot_key(tier, slot);
  return tiers_[tier].meta[slot].hits;
}

std::vector<int32_t> TierManager::used_slots(int32_t tier) const {
  const Slots& s = tier_at(tier);
  std::vector<int32_t> out;
  for (int32_t i = 0; i < s.spec.num_slots; ++i) {
    if (s.index.has_key(i)) out.push_back(i);
  }
  return out;
}

// ------------------------------------------------------------------ logs, reset, checks

std::vector<Transfer> TierManager::drain_transfers() {
  CallFlag::Scope running(calls_, "TierManager.drain_transfers");
  std::vector<Transfer> out;
  out.swap(transfers_);
  return out;
}

bool TierManager::pending(int32_t tier, int32_t slot) const {
  check_slot(tier_at(tier), tier, slot, "pending");
  for (auto it = transfers_.rbegin(); it != transfers_.rend(); ++it) {
    if (it->dst_tier == tier && it->dst == slot) return true;
  }
  return false;
}

std::vector<TierRecord> TierManager::drain_records() {
  CallFlag::Scope running(calls_, "TierManager.drain_records");
  std::vector<TierRecord> out;
  out.swap(records_);
  return out;
}

std::vector<int32_t> TierManager::tags_in_use() const {
  std::vector<int32_t> out;
  for_each_held([&](const BlockMeta& meta, const std::string*) { out.push_back(meta.tag); });
  for (const TierRecord& r : records_) out.push_back(r.tag);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<bool> TierManager::parents_in_use(std::string_view names) const {
  if (names.size() % static_cast<size_t>(key_size_)) {
    throw std::invalid_argument("parents_in_use: names must be whole keys of " + std::to_string(key_size_) +
                                " bytes, got " + std::to_string(names.size()) + " bytes");
  }
  const size_t n = names.size() / static_cast<size_t>(key_size_);
  auto name = [&](size_t i) { return names.substr(i * key_size_, key_size_); };
  std::unordered_map<std::string_view, bool> followed;  // a name given twice is looked up once
  followed.reserve(n);
  for (size_t i = 0; i < n; ++i) followed.emplace(name(i), false);
  for_each_held([&](const BlockMeta&, const std::string* parent) {
    if (parent == nullptr) return;
    const auto it = followed.find(*parent);
    if (it != followed.end()) it->second = true;
  });
  std::vector<bool> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = followed.at(name(i));
  return out;
}

void TierManager::reset() {
  CallFlag::Scope running(calls_, "TierManager.reset");
  for (Slots& s : tiers_) {
    for (int32_t pin : s.pins) {
      if (pin) throw std::invalid_argument("reset: a slot is pinned by an admission in progress");
    }
  }
  for (size_t t = 0; t < tiers_.size(); ++t) {
    Slots fresh(tiers_[t].spec, key_size_);
    tiers_[t] = std::move(fresh);
  }
  device_ = Device(num_device_blocks_);
  pages_ = TokenPages(static_cast<int64_t>(page_bytes_), pages_capacity());
  traffic_ = 0;
  transfers_.clear();
  records_.clear();
}

std::vector<int32_t> TierManager::order(int32_t tier) const {
  const Slots& s = tier_at(tier);
  std::vector<Slots::Entry> entries;
  for (const Slots::Entry& e : s.heap) {
    if (live(s, e)) entries.push_back(e);
  }
  for (const Slots::Entry& e : s.run) {
    if (live(s, e)) entries.push_back(e);
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return later(b, a); });
  std::vector<int32_t> out;
  for (const auto& e : entries) out.push_back(e.slot);
  return out;
}

void TierManager::check_invariants(const BlockPool* pool) const {
  auto fail = [](const std::string& msg) { throw InvariantError("TierManager: " + msg); };
  for (int32_t t = 0; t < num_tiers(); ++t) {
    const Slots& s = tiers_[t];
    s.index.check_invariants();
    s.children_of.check_invariants();
    s.by_link.check_invariants();
    std::vector<int32_t> entries(s.spec.num_slots, 0);
    for (const Slots::Entry& e : s.heap) {
      if (live(s, e)) ++entries[e.slot];
    }
    for (size_t i = 0; i < s.run.size(); ++i) {
      if (i > 0 && later(s.run[i - 1], s.run[i])) fail("tier " + std::to_string(t) + ": its ordered run is out of order");
      if (live(s, s.run[i])) ++entries[s.run[i].slot];
    }
    int64_t num_free = 0;
    for (int32_t i = 0; i < s.spec.num_slots; ++i) {
      const std::string where = "tier " + std::to_string(t) + " slot " + std::to_string(i);
      if (s.pins[i] < 0) fail(where + " has a negative pin count");
      if (!s.index.has_key(i)) {
        ++num_free;
        if (s.free_pos[i] < 0 || s.free_pos[i] >= static_cast<int32_t>(s.free_slots.size()) ||
            s.free_slots[s.free_pos[i]] != i) {
          fail(where + " holds no block but is not in the free list");
        }
        if (s.pins[i]) fail(where + " is pinned but holds no block");
        if (s.by_link.has_key(i)) fail(where + " holds no block but is linked");
        continue;
      }
      if (s.free_pos[i] >= 0) fail(where + " holds a block but is in the free list");
      if (keep_tokens_ && s.page[i] == TokenPages::kNone) fail(where + " holds a block without its token ids");
      if (s.index.first(s.index.key(i)) != i) fail(where + ": its key is held by another slot of the tier");
      if (s.spec.leaves_only) {
        int32_t kids = 0;
        for (int32_t c : s.children_of.holders(s.index.key(i))) kids += s.index.has_key(c) ? 1 : 0;
        if (kids != s.children[i]) {
          fail(where + " counts " + std::to_string(s.children[i]) + " children, the tier holds " +
               std::to_string(kids));
        }
        if (s.has_parent[i] != (s.children_of.has_key(i) ? 1 : 0)) fail(where + ": parent index out of step");
      }
      if (lineage_) {
        const bool linked = s.by_link.has_key(i);
        if (linked != (s.has_parent[i] != 0)) fail(where + ": link index out of step");
        const uint64_t h = hash_tokens(pages_.data(s.page[i]));
        if (h != s.meta[i].token_hash || (linked && s.by_link.key(i) != link_of(s.parent[i], h))) {
          fail(where + ": its link does not name its parent and tokens");
        }
      }
      if (evictable(s, i) && entries[i] != 1) {
        fail(where + " may leave but has " + std::to_string(entries[i]) + " live queue entries");
      }
    }
    if (s.reuse.size() > s.reuse.capacity()) {
      fail("tier " + std::to_string(t) + ": the reuse tracker holds " + std::to_string(s.reuse.size()) +
           " keys, more than its " + std::to_string(s.reuse.capacity()));
    }
    if (num_free != static_cast<int64_t>(s.free_slots.size())) {
      fail("tier " + std::to_string(t) + ": " + std::to_string(num_free) + " free slots, the free list holds " +
           std::to_string(s.free_slots.size()));
    }
  }
  device_.index.check_invariants();
  if (keep_tokens_) {  // a page's references are its holders, kept or left in place
    std::vector<int64_t> held(static_cast<size_t>(pages_.capacity()), 0);
    auto count = [&](int32_t p) {
      if (p != TokenPages::kNone) ++held[p];
    };
    for (const Slots& s : tiers_) std::for_each(s.page.begin(), s.page.end(), count);
    std::for_each(device_.page.begin(), device_.page.end(), count);
    int64_t unheld = 0;
    for (int32_t p = 0; p < pages_.capacity(); ++p) {
      if (held[p] != pages_.refs(p)) {
        fail("token page " + std::to_string(p) + " has " + std::to_string(pages_.refs(p)) + " references and " +
             std::to_string(held[p]) + " holders");
      }
      unheld += held[p] == 0;
    }
    if (unheld != pages_.num_free()) fail("the token pages' free list is out of step");
    for (int32_t b = 0; b < num_device_blocks_; ++b) {
      if (device_.index.has_key(b) && device_.page[b] == TokenPages::kNone) {
        fail("device block " + std::to_string(b) + " is cached without its token ids");
      }
    }
  }
  if (pool != nullptr) {
    for (int32_t b = 0; b < num_device_blocks_; ++b) {
      if (!device_.index.has_key(b)) continue;
      std::optional<std::string> held = pool->key(b);
      if (!held || *held != device_.index.key(b)) {
        fail("device block " + std::to_string(b) + " is in the mirror but the pool does not cache it under that key");
      }
    }
  }
}

}  // namespace prefixcache
