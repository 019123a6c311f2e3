// BlockContents implementation. See block_contents.h for what it owns and the proof.
#include "block_contents.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

namespace prefixcache {

namespace {
bool fits_int32(int64_t v) {
  return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
}
}  // namespace

BlockContents::BlockContents(const BlockPool& pool, int64_t block_size)
    : pool_(pool), block_size_(block_size), num_blocks_(pool.num_blocks()) {
  if (block_size < 1 || block_size > kMaxBlockSize) {
    throw std::invalid_argument("block_size must be in [1, " + std::to_string(kMaxBlockSize) + "], got " +
                                std::to_string(block_size));
  }
  block_node_.assign(num_blocks_, kNone);
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
  is_wide_ = true;
}

bool BlockContents::same_tokens(int32_t node, const int64_t* block_tokens, int64_t count) const {
  // Branch-free over the block (the compiler vectorizes it): a block is short, and
  // a mismatch is the rare case.
  const size_t base = static_cast<size_t>(node) * static_cast<size_t>(block_size_);
  uint64_t differ = 0;
  if (!is_wide_) {
    const int32_t* stored = narrow_.data() + base;
    for (int64_t j = 0; j < count; ++j) differ |= static_cast<uint64_t>(stored[j] ^ block_tokens[j]);
  } else {
    const int64_t* stored = wide_.data() + base;
    for (int64_t j = 0; j < count; ++j) differ |= static_cast<uint64_t>(stored[j] ^ block_tokens[j]);
  }
  return differ == 0;
}

int32_t BlockContents::new_node(int32_t parent, const int64_t* block_tokens, std::string_view ns) {
  int32_t n = free_slots_;
  if (n != kNone) {
    free_slots_ = parent_[n];
  } else {
    n = static_cast<int32_t>(parent_.size());
    if (n == std::numeric_limits<int32_t>::max()) throw std::length_error("BlockContents: too many content nodes");
    parent_.push_back(kNone);
    references_.push_back(0);
    namespace_.emplace_back();
    const size_t cells = parent_.size() * static_cast<size_t>(block_size_);
    is_wide_ ? wide_.resize(cells) : narrow_.resize(cells);
  }
  parent_[n] = parent;
  references_[n] = 1;  // the block's
  if (parent != kNone) {
    ++references_[parent];
    namespace_[n].clear();
  } else {
    namespace_[n].assign(ns.data(), ns.size());
  }
  const size_t base = static_cast<size_t>(n) * static_cast<size_t>(block_size_);
  for (int64_t j = 0; j < block_size_; ++j) {
    if (is_wide_) {
      wide_[base + j] = block_tokens[j];
    } else {
      narrow_[base + j] = static_cast<int32_t>(block_tokens[j]);
    }
  }
  ++num_nodes_;
  return n;
}

void BlockContents::release(int32_t node) {
  while (node != kNone && --references_[node] == 0) {
    const int32_t up = parent_[node];
    parent_[node] = free_slots_;
    free_slots_ = node;
    --num_nodes_;
    node = up;
  }
}

void BlockContents::record(int64_t parent, std::span<const int32_t> blocks, std::span<const int64_t> tokens,
                           std::string_view ns, int64_t provable) {
  if (parent != -1) check_id(parent, "record: parent");
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
  // A chain that follows a block without a node (never recorded, or holding an id
  // beyond int64) cannot be proved: its blocks get no node.
  int32_t prev = parent == -1 ? kNone : block_node_[parent];
  if (parent != -1 && prev == kNone) provable = 0;
  if (!is_wide_) {
    for (int64_t t : tokens.first(static_cast<size_t>(provable) * block_size_)) {
      if (!fits_int32(t)) {
        widen();
        break;
      }
    }
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int32_t b = blocks[i];
    const int32_t old = block_node_[b];
    // The new node is made before the old one is released: a block recorded after
    // itself keeps its old content alive as the new node's parent.
    block_node_[b] = static_cast<int64_t>(i) < provable ? new_node(prev, tokens.data() + i * block_size_, ns) : kNone;
    release(old);
    prev = block_node_[b];
  }
}

bool BlockContents::proves(int32_t h, int64_t i, std::span<const int32_t> proved, std::span<const int64_t> tokens,
                           std::string_view ns, int64_t head) const {
  const int32_t n = block_node_[h];
  if (n == kNone || !same_tokens(n, tokens.data() + i * block_size_, head)) return false;
  if (i == 0) return parent_[n] == kNone && namespace_[n] == ns;
  // Down the node's ancestry: done at a node already proved at the same position
  // (in the usual case the very first step), or at the chain start.
  int32_t p = parent_[n];
  for (int64_t j = i - 1;; --j) {
    if (p == kNone) return false;
    if (p == block_node_[proved[j]]) return true;
    if (!same_tokens(p, tokens.data() + j * block_size_, block_size_)) return false;
    if (j == 0) return parent_[p] == kNone && namespace_[p] == ns;
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
  out.blocks.reserve(num_keys);
  for (size_t i = 0; i < num_keys; ++i) {
    std::string_view key = keys.substr(i * key_size, key_size);
    std::optional<int32_t> first = pool_.lookup(key);
    if (!first) break;
    if (proves(*first, static_cast<int64_t>(i), out.blocks, tokens, ns, block_size_)) {
      out.blocks.push_back(*first);
      continue;
    }
    int32_t found = -1;
    for (int32_t h : pool_.blocks_for(key)) {
      if (h != *first && proves(h, static_cast<int64_t>(i), out.blocks, tokens, ns, block_size_)) {
        found = h;
        break;
      }
    }
    if (found < 0) {
      out.failed = true;
      break;
    }
    out.blocks.push_back(found);
  }
  return out;
}

int64_t BlockContents::verify_table(std::span<const int32_t> table, std::span<const int64_t> tokens,
                                    std::string_view ns) const {
  for (int32_t b : table) check_id(b, "verify_table");
  const size_t n = std::min(table.size(), tokens.size() / static_cast<size_t>(block_size_));
  for (size_t i = 0; i < n; ++i) {
    if (!proves(table[i], static_cast<int64_t>(i), table.first(i), tokens, ns, block_size_)) {
      return static_cast<int64_t>(i);
    }
  }
  return static_cast<int64_t>(n);
}

bool BlockContents::verify_head(int64_t block, std::span<const int32_t> proved, std::span<const int64_t> tokens,
                                int64_t n, std::string_view ns) const {
  const int32_t h = check_id(block, "verify_head");
  for (int32_t b : proved) check_id(b, "verify_head: proved");
  if (n < 1 || n > block_size_) {
    throw std::invalid_argument("verify_head: n must be in [1, " + std::to_string(block_size_) + "], got " +
                                std::to_string(n));
  }
  const int64_t i = static_cast<int64_t>(proved.size());
  if (static_cast<int64_t>(tokens.size()) < i * block_size_ + n) return false;  // not all representable
  return proves(h, i, proved, tokens, ns, n);
}

std::vector<int64_t> BlockContents::tokens(int64_t id) const {
  const int32_t n = block_node_[check_id(id, "tokens")];
  std::vector<int64_t> out;
  if (n == kNone) return out;
  for (int64_t j = 0; j < block_size_; ++j) out.push_back(token(n, j));
  return out;
}

int64_t BlockContents::depth(int64_t id) const {
  int64_t d = 0;
  for (int32_t n = block_node_[check_id(id, "depth")]; n != kNone; n = parent_[n]) ++d;
  return d;
}

void BlockContents::check_invariants() const {
  auto fail = [](const std::string& msg) { throw InvariantError("BlockContents: " + msg); };
  const size_t slots = parent_.size();
  if (is_wide_ ? !narrow_.empty() : !wide_.empty()) fail("token storage is both narrow and wide");
  if ((is_wide_ ? wide_.size() : narrow_.size()) != slots * static_cast<size_t>(block_size_)) {
    fail("token storage does not match the node slots");
  }
  std::vector<uint8_t> is_free(slots, 0);
  int64_t num_free = 0;
  for (int32_t n = free_slots_; n != kNone; n = parent_[n]) {
    if (n < 0 || static_cast<size_t>(n) >= slots || is_free[n]) fail("the free list of node slots is broken");
    if (references_[n] != 0) fail("free node slot " + std::to_string(n) + " has references");
    is_free[n] = 1;
    ++num_free;
  }
  if (num_nodes_ + num_free != static_cast<int64_t>(slots)) fail("live and free node slots do not add up");
  std::vector<uint32_t> counted(slots, 0);
  for (int32_t b = 0; b < num_blocks_; ++b) {
    const int32_t n = block_node_[b];
    if (n == kNone) continue;
    if (n < 0 || static_cast<size_t>(n) >= slots || is_free[n]) {
      fail("block " + std::to_string(b) + " points at a dead node");
    }
    ++counted[n];
  }
  for (size_t n = 0; n < slots; ++n) {
    if (is_free[n]) continue;
    const int32_t p = parent_[n];
    if (p != kNone && (p < 0 || static_cast<size_t>(p) >= slots || is_free[p])) {
      fail("node " + std::to_string(n) + " has a dead parent");
    }
    if (p != kNone) ++counted[p];
  }
  for (size_t n = 0; n < slots; ++n) {
    if (!is_free[n] && counted[n] != references_[n]) {
      fail("node " + std::to_string(n) + " has " + std::to_string(references_[n]) + " references, " +
           std::to_string(counted[n]) + " found");
    }
    if (!is_free[n] && counted[n] == 0) fail("node " + std::to_string(n) + " is alive but unreferenced");
  }
}

}  // namespace prefixcache
