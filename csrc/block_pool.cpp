// BlockPool implementation. See block_pool.h for what it owns and its invariants.
#include "block_pool.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace prefixcache {

namespace {
std::string block_str(int64_t id) { return "block " + std::to_string(id); }

int32_t checked_size(int64_t num_blocks) {
  if (num_blocks < 1 || num_blocks > kMaxBlocks) {
    throw std::invalid_argument("num_blocks must be in [1, " + std::to_string(kMaxBlocks) +
                                "], got " + std::to_string(num_blocks));
  }
  return static_cast<int32_t>(num_blocks);
}

std::vector<std::string_view> split_packed(std::string_view keys, int64_t key_size, const char* what) {
  if (key_size < 1 || keys.size() % static_cast<size_t>(key_size) != 0) {
    throw std::invalid_argument(std::string(what) + ": key_size must be >= 1 and divide the " +
                                std::to_string(keys.size()) + " key bytes, got " + std::to_string(key_size));
  }
  std::vector<std::string_view> views;
  views.reserve(keys.size() / key_size);
  for (size_t at = 0; at < keys.size(); at += key_size) views.push_back(keys.substr(at, key_size));
  return views;
}
}  // namespace

BlockPool::BlockPool(int64_t num_blocks) : num_blocks_(checked_size(num_blocks)), index_(num_blocks_) {
  head_ = num_blocks_;
  tail_ = num_blocks_ + 1;
  ref_.assign(num_blocks_, 0);
  prev_.assign(num_blocks_ + 2, -1);
  next_.assign(num_blocks_ + 2, -1);
  repeats_ = RepeatFinder(static_cast<size_t>(num_blocks_));
  // The queue starts in id order: block 0 is reused first.
  int32_t prev = head_;
  for (int32_t b = 0; b < num_blocks_; ++b) {
    next_[prev] = b;
    prev_[b] = prev;
    prev = b;
  }
  next_[prev] = tail_;
  prev_[tail_] = prev;
  num_free_ = num_blocks_;
}

int32_t BlockPool::check_id(int64_t id, const char* what) const {
  if (id < 0 || id >= num_blocks_) {
    throw std::out_of_range(std::string(what) + ": block id " + std::to_string(id) +
                            " is out of range [0, " + std::to_string(num_blocks_) + ")");
  }
  return static_cast<int32_t>(id);
}

void BlockPool::check_unique(const std::vector<int64_t>& ids, const char* what) const {
  for (int64_t id : ids) check_id(id, what);
  if (std::optional<int64_t> dup = repeats_.first_repeat(ids)) {
    throw std::invalid_argument(std::string(what) + ": " + block_str(*dup) +
                                " appears more than once in one call");
  }
}

void BlockPool::unlink(int32_t b) {
  next_[prev_[b]] = next_[b];
  prev_[next_[b]] = prev_[b];
  prev_[b] = next_[b] = -1;
}

void BlockPool::link_before(int32_t b, int32_t next) {
  int32_t prev = prev_[next];
  next_[prev] = b;
  prev_[b] = prev;
  next_[b] = next;
  prev_[next] = b;
}


std::optional<std::vector<int32_t>> BlockPool::allocate(int64_t n) {
  if (n < 0 || n > num_blocks_) {
    throw std::invalid_argument("allocate: n must be in [0, num_blocks=" +
                                std::to_string(num_blocks_) + "], got " + std::to_string(n));
  }
  if (n > num_free_) return std::nullopt;
  num_last_removed_ = 0;
  std::vector<int32_t> out;
  out.reserve(n);
  for (int64_t i = 0; i < n; ++i) out.push_back(take_front());
  return out;
}

int32_t BlockPool::allocate_one() {
  if (num_free_ == 0) return -1;
  num_last_removed_ = 0;
  return take_front();
}

int32_t BlockPool::take_front() {
  int32_t b = next_[head_];
  unlink(b);
  if (index_.has_key(b)) {
    // Lazy eviction: a freed block keeps its key until it is reused here.
    if (num_last_removed_ == last_removed_.size()) last_removed_.emplace_back();
    last_removed_[num_last_removed_++].assign(index_.key(b));
    index_.erase(b);
    ++num_evicted_;
  }
  ref_[b] = 1;
  --num_free_;
  return b;
}

void BlockPool::free(const std::vector<int64_t>& ids) {
  check_unique(ids, "free");
  for (int64_t id : ids) {
    if (ref_[id] == 0) throw std::invalid_argument("free: " + block_str(id) + " is already free");
  }
  // Keyless blocks are pushed at the front one by one, so walk them in
  // reverse to leave them in the given order; keyed ones go to the tail.
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    int32_t b = static_cast<int32_t>(*it);
    if (ref_[b] == 1 && !index_.has_key(b)) link_before(b, next_[head_]);
  }
  for (int64_t id : ids) {
    int32_t b = static_cast<int32_t>(id);
    if (--ref_[b] > 0) continue;
    ++num_free_;
    if (index_.has_key(b)) link_before(b, tail_);
  }
}

void BlockPool::touch(const std::vector<int64_t>& ids) {
  check_unique(ids, "touch");
  for (int64_t id : ids) {
    int32_t b = static_cast<int32_t>(id);
    if (ref_[b]++ == 0) {
      unlink(b);
      --num_free_;
    }
  }
}

void BlockPool::check_cacheable(int32_t b, std::string_view key) const {
  if (key.empty()) throw std::invalid_argument("cache: key must be non-empty bytes");
  if (ref_[b] == 0) {
    throw std::invalid_argument("cache: " + block_str(b) + " is free; only blocks in use can be cached");
  }
  if (index_.has_key(b)) throw std::invalid_argument("cache: " + block_str(b) + " already holds a key");
}

int64_t BlockPool::count_free(const std::vector<int64_t>& ids) const {
  for (int64_t id : ids) check_id(id, "count_free");
  int64_t n = 0;
  for (int64_t id : ids) n += ref_[id] == 0;
  return n;
}

void BlockPool::cache(int64_t id, std::string_view key) {
  int32_t b = check_id(id, "cache");
  check_cacheable(b, key);
  index_.insert(b, key);
}

void BlockPool::cache_many(const std::vector<int64_t>& ids, const std::vector<std::string_view>& keys) {
  if (ids.size() != keys.size()) {
    throw std::invalid_argument("cache_many: " + std::to_string(ids.size()) + " ids but " +
                                std::to_string(keys.size()) + " keys");
  }
  check_unique(ids, "cache");
  for (size_t i = 0; i < ids.size(); ++i) check_cacheable(static_cast<int32_t>(ids[i]), keys[i]);
  for (size_t i = 0; i < ids.size(); ++i) index_.insert(static_cast<int32_t>(ids[i]), keys[i]);
}

void BlockPool::cache_many_packed(const std::vector<int64_t>& ids, std::string_view keys, int64_t key_size,
                                  std::string_view suffix) {
  auto views = split_packed(keys, key_size, "cache_many_packed");
  if (suffix.empty()) return cache_many(ids, views);
  std::vector<std::string> owned;
  owned.reserve(views.size());
  for (auto v : views) owned.emplace_back(std::string(v).append(suffix));
  cache_many(ids, std::vector<std::string_view>(owned.begin(), owned.end()));
}

std::optional<std::string> BlockPool::uncache(int64_t id) {
  int32_t b = check_id(id, "uncache");
  if (!index_.has_key(b)) return std::nullopt;
  std::string key = index_.key(b);
  index_.erase(b);
  return key;
}

int64_t BlockPool::uncache_all() {
  int64_t n = index_.size();
  index_.clear();
  return n;
}

std::optional<int32_t> BlockPool::lookup(std::string_view key) const {
  int32_t b = index_.first(key);
  if (b < 0) return std::nullopt;
  return b;
}

std::vector<int32_t> BlockPool::lookup_chain(const std::vector<std::string_view>& keys) const {
  std::vector<int32_t> out;
  for (const auto& key : keys) {
    int32_t b = index_.first(key);
    if (b < 0) break;
    out.push_back(b);
  }
  return out;
}

std::vector<int32_t> BlockPool::lookup_chain_packed(std::string_view keys, int64_t key_size,
                                                    std::string_view suffix) const {
  auto views = split_packed(keys, key_size, "lookup_chain_packed");
  if (suffix.empty()) return lookup_chain(views);
  std::vector<int32_t> out;
  std::string key;
  for (auto v : views) {
    key.assign(v).append(suffix);
    int32_t b = index_.first(key);
    if (b < 0) break;
    out.push_back(b);
  }
  return out;
}

std::vector<std::string> BlockPool::evict_front(int64_t n) {
  if (n < 0) throw std::invalid_argument("evict_front: n must be >= 0, got " + std::to_string(n));
  std::vector<std::string> keys;
  for (int32_t b = next_[head_]; b != tail_ && static_cast<int64_t>(keys.size()) < n; b = next_[b]) {
    if (!index_.has_key(b)) continue;
    keys.push_back(index_.key(b));
    index_.erase(b);
    ++num_evicted_;
  }
  return keys;
}

std::vector<std::string> BlockPool::evict_blocks(const std::vector<int64_t>& ids) {
  check_unique(ids, "evict_blocks");
  for (int64_t id : ids) {
    if (ref_[id] != 0) throw std::invalid_argument("evict_blocks: " + block_str(id) + " is in use");
    if (!index_.has_key(static_cast<int32_t>(id))) throw std::invalid_argument("evict_blocks: " + block_str(id) + " holds no key");
  }
  std::vector<std::string> keys;
  keys.reserve(ids.size());
  for (int64_t id : ids) {
    int32_t b = static_cast<int32_t>(id);
    keys.push_back(index_.key(b));
    index_.erase(b);
    ++num_evicted_;
  }
  // Pushing at the front one by one reverses, so push them backwards.
  for (auto it = ids.rbegin(); it != ids.rend(); ++it) {
    int32_t b = static_cast<int32_t>(*it);
    unlink(b);
    link_before(b, next_[head_]);
  }
  return keys;
}

int32_t BlockPool::ref_count(int64_t id) const { return ref_[check_id(id, "ref_count")]; }

std::optional<std::string> BlockPool::key(int64_t id) const {
  int32_t b = check_id(id, "key");
  if (!index_.has_key(b)) return std::nullopt;
  return index_.key(b);
}

std::vector<int32_t> BlockPool::free_queue() const {
  std::vector<int32_t> out;
  out.reserve(num_free_);
  for (int32_t b = next_[head_]; b != tail_ && static_cast<int32_t>(out.size()) <= num_blocks_; b = next_[b]) {
    out.push_back(b);
  }
  return out;
}

std::vector<int32_t> BlockPool::blocks_for(std::string_view key) const {
  return index_.holders(key);
}

void BlockPool::check_invariants() const {
  auto fail = [](const std::string& msg) { throw InvariantError("BlockPool: " + msg); };
  std::vector<uint8_t> queued(num_blocks_, 0);
  int32_t count = 0;
  int32_t prev = head_;
  for (int32_t b = next_[head_]; b != tail_; b = next_[b]) {
    if (b < 0 || b >= num_blocks_) fail("free queue links to " + std::to_string(b) + " after " + std::to_string(prev));
    if (queued[b]) fail("free queue visits " + block_str(b) + " twice (cycle)");
    if (prev_[b] != prev) fail(block_str(b) + " prev link is " + std::to_string(prev_[b]) + ", expected " + std::to_string(prev));
    if (ref_[b] != 0) fail(block_str(b) + " is in the free queue with ref " + std::to_string(ref_[b]));
    queued[b] = 1;
    prev = b;
    ++count;
  }
  if (prev_[tail_] != prev) fail("tail sentinel prev link is stale");
  if (count != num_free_) fail("free queue holds " + std::to_string(count) + " blocks, num_free is " + std::to_string(num_free_));
  for (int32_t b = 0; b < num_blocks_; ++b) {
    if (ref_[b] < 0) fail(block_str(b) + " has negative ref " + std::to_string(ref_[b]));
    if (ref_[b] == 0 && !queued[b]) fail(block_str(b) + " has ref 0 but is not in the free queue");
  }
  index_.check_invariants();
}

}  // namespace prefixcache
