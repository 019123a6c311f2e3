// BlockContents implementation. See block_contents.h for what it owns and the proof.
#include "block_contents.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

namespace prefixcache {

namespace {
bool fits_int32(int64_t v) { return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max(); }
}  // namespace

BlockContents::BlockContents(const BlockPool& pool, int64_t block_size)
    : pool_(pool), block_size_(block_size), num_blocks_(pool.num_blocks()) {
  // Token storage is num_blocks * block_size ids; refuse a size that cannot be indexed.
  if (block_size < 1 || block_size > (int64_t{1} << 24)) {
    throw std::invalid_argument("block_size must be in [1, 16777216], got " + std::to_string(block_size));
  }
  narrow_.assign(static_cast<size_t>(num_blocks_) * static_cast<size_t>(block_size_), 0);
  parent_.assign(num_blocks_, -1);
  parent_generation_.assign(num_blocks_, 0);
  generation_.assign(num_blocks_, 0);
  provable_.assign(num_blocks_, 0);
  namespace_.resize(num_blocks_);
}

int32_t BlockContents::check_id(int64_t id, const char* what) const {
  if (id < 0 || id >= num_blocks_) {
    throw std::out_of_range(std::string(what) + ": block id " + std::to_string(id) + " is out of range [0, " +
                            std::to_string(num_blocks_) + ")");
  }
  return static_cast<int32_t>(id);
}

void BlockContents::widen() {
  wide_.assign(narrow_.begin(), narrow_.end());
  std::vector<int32_t>().swap(narrow_);
}

bool BlockContents::same_tokens(int32_t b, const int64_t* block_tokens) const {
  const size_t base = static_cast<size_t>(b) * static_cast<size_t>(block_size_);
  if (wide_.empty()) {
    const int32_t* stored = narrow_.data() + base;
    for (int64_t j = 0; j < block_size_; ++j) {
      if (stored[j] != block_tokens[j]) return false;
    }
    return true;
  }
  const int64_t* stored = wide_.data() + base;
  for (int64_t j = 0; j < block_size_; ++j) {
    if (stored[j] != block_tokens[j]) return false;
  }
  return true;
}

void BlockContents::record(int64_t parent, std::span<const int32_t> blocks, std::span<const int64_t> tokens,
                           std::string_view ns, int64_t provable) {
  if (parent != -1) {
    check_id(parent, "record: parent");
    if (generation_[parent] == 0) {
      throw std::invalid_argument("record: parent block " + std::to_string(parent) + " was never recorded");
    }
  }
  for (int32_t b : blocks) check_id(b, "record");
  if (tokens.size() != blocks.size() * static_cast<size_t>(block_size_)) {
    throw std::invalid_argument("record: " + std::to_string(blocks.size()) + " blocks need " +
                                std::to_string(blocks.size() * block_size_) + " tokens, got " +
                                std::to_string(tokens.size()));
  }
  if (provable < 0 || provable > static_cast<int64_t>(blocks.size())) {
    throw std::invalid_argument("record: provable must be in [0, " + std::to_string(blocks.size()) + "], got " +
                                std::to_string(provable));
  }
  if (wide_.empty()) {
    for (int64_t t : tokens) {
      if (!fits_int32(t)) {
        widen();
        break;
      }
    }
  }
  int64_t prev = parent;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int32_t b = blocks[i];
    // The parent's generation is read before b is stamped: a block recorded as its
    // own parent then proves nothing, instead of proving itself.
    parent_[b] = static_cast<int32_t>(prev);
    parent_generation_[b] = prev < 0 ? 0 : generation_[prev];
    if (prev < 0) namespace_[b].assign(ns.data(), ns.size());
    generation_[b] = ++clock_;
    provable_[b] = static_cast<int64_t>(i) < provable;
    const size_t base = static_cast<size_t>(b) * static_cast<size_t>(block_size_);
    const int64_t* src = tokens.data() + i * block_size_;
    if (wide_.empty()) {
      for (int64_t j = 0; j < block_size_; ++j) narrow_[base + j] = static_cast<int32_t>(src[j]);
    } else {
      for (int64_t j = 0; j < block_size_; ++j) wide_[base + j] = src[j];
    }
    prev = b;
  }
}

bool BlockContents::proves(int32_t h, int64_t i, std::span<const int32_t> proved, std::span<const int64_t> tokens,
                           std::string_view ns) const {
  if (generation_[h] == 0 || !provable_[h] || !same_tokens(h, tokens.data() + i * block_size_)) return false;
  if (i == 0) return parent_[h] < 0 && namespace_[h] == ns;
  if (parent_[h] == proved[i - 1] && parent_generation_[h] == generation_[proved[i - 1]]) return true;
  // Another copy of the prefix: walk h's recorded ancestry down to the chain start,
  // or to a block already proved at the same position.
  int32_t p = parent_[h];
  uint64_t seen = parent_generation_[h];
  for (int64_t j = i - 1;; --j) {
    if (p < 0 || generation_[p] != seen || !provable_[p]) return false;
    if (p == proved[j]) return true;
    if (!same_tokens(p, tokens.data() + j * block_size_)) return false;
    if (j == 0) return parent_[p] < 0 && namespace_[p] == ns;
    seen = parent_generation_[p];
    p = parent_[p];
  }
}

VerifiedChain BlockContents::lookup_chain(std::string_view keys, int64_t key_size, std::span<const int64_t> tokens,
                                          std::string_view ns) const {
  if (key_size < 1 || keys.size() % static_cast<size_t>(key_size) != 0) {
    throw std::invalid_argument("lookup_chain: key_size must be >= 1 and divide the " + std::to_string(keys.size()) +
                                " key bytes, got " + std::to_string(key_size));
  }
  const size_t num_keys = std::min(keys.size() / key_size, tokens.size() / static_cast<size_t>(block_size_));
  VerifiedChain out;
  for (size_t i = 0; i < num_keys; ++i) {
    std::string_view key = keys.substr(i * key_size, key_size);
    std::optional<int32_t> first = pool_.lookup(key);
    if (!first) break;
    if (proves(*first, static_cast<int64_t>(i), out.blocks, tokens, ns)) {
      out.walked |= i > 0 && parent_[*first] != out.blocks[i - 1];
      out.blocks.push_back(*first);
      continue;
    }
    int32_t found = -1;
    for (int32_t h : pool_.blocks_for(key)) {
      if (h != *first && proves(h, static_cast<int64_t>(i), out.blocks, tokens, ns)) {
        found = h;
        break;
      }
    }
    if (found < 0) {
      out.failed = true;
      break;
    }
    out.walked |= i > 0 && parent_[found] != out.blocks[i - 1];
    out.blocks.push_back(found);
  }
  return out;
}

int64_t BlockContents::verify_table(std::span<const int32_t> table, std::span<const int64_t> tokens,
                                    std::string_view ns) const {
  for (int32_t b : table) check_id(b, "verify_table");
  const size_t n = std::min(table.size(), tokens.size() / static_cast<size_t>(block_size_));
  for (size_t i = 0; i < n; ++i) {
    if (!proves(table[i], static_cast<int64_t>(i), table.first(i), tokens, ns)) return static_cast<int64_t>(i);
  }
  return static_cast<int64_t>(n);
}

int64_t BlockContents::adopt(std::span<const int32_t> chain, std::span<const int64_t> tokens, std::string_view ns) {
  for (int32_t b : chain) check_id(b, "adopt");
  const size_t n = std::min(chain.size(), tokens.size() / static_cast<size_t>(block_size_));
  for (size_t i = 0; i < n; ++i) {
    if (!proves(chain[i], static_cast<int64_t>(i), chain.first(i), tokens, ns)) return static_cast<int64_t>(i);
    if (i > 0 && parent_[chain[i]] != chain[i - 1]) {
      parent_[chain[i]] = chain[i - 1];
      parent_generation_[chain[i]] = generation_[chain[i - 1]];
    }
  }
  return static_cast<int64_t>(n);
}

int32_t BlockContents::parent(int64_t id) const { return parent_[check_id(id, "parent")]; }

uint64_t BlockContents::generation(int64_t id) const { return generation_[check_id(id, "generation")]; }

std::vector<int64_t> BlockContents::tokens(int64_t id) const {
  const int32_t b = check_id(id, "tokens");
  std::vector<int64_t> out(static_cast<size_t>(block_size_));
  for (int64_t j = 0; j < block_size_; ++j) out[j] = token(b, j);
  return out;
}

void BlockContents::check_invariants() const {
  auto fail = [](const std::string& msg) { throw InvariantError("BlockContents: " + msg); };
  if (!wide_.empty() && !narrow_.empty()) fail("token storage is both narrow and wide");
  const size_t cells = static_cast<size_t>(num_blocks_) * static_cast<size_t>(block_size_);
  if ((wide_.empty() ? narrow_.size() : wide_.size()) != cells) fail("token storage has the wrong size");
  for (int32_t b = 0; b < num_blocks_; ++b) {
    const std::string who = "block " + std::to_string(b);
    if (generation_[b] > clock_) fail(who + " has a generation from the future");
    if (generation_[b] == 0) {
      if (provable_[b]) fail(who + " was never recorded but is provable");
      continue;
    }
    const int32_t p = parent_[b];
    if (p < -1 || p >= num_blocks_) fail(who + " has parent " + std::to_string(p));
    // A child records (or adopts) a parent that was recorded already.
    if (p >= 0 && (parent_generation_[b] == 0 || parent_generation_[b] > clock_)) {
      fail(who + " saw parent generation " + std::to_string(parent_generation_[b]) + " (clock " +
           std::to_string(clock_) + ")");
    }
  }
}

}  // namespace prefixcache
