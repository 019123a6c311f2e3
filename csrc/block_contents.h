// BlockContents: exactly what each cached block's KV was computed from, so that a
// hit found through a non-cryptographic hash is proved before it is used.
//
// The KV of a block depends on its namespace and on every token up to its last one.
// Each recorded block points at an immutable CONTENT NODE: its block_size token ids,
// the node of the block before it in the table of the request that computed it (none
// at the start of a chain), and, at a chain's start, the namespace. A node describes
// one computation forever; when its block is reused and recorded again the block gets
// a new node, and the old one lives on while a child node still refers to it (nodes
// are reference counted: one reference per block pointing at it and per child node).
// Token ids are stored as int32 while every id fits, widened once to int64 when one
// does not.
//
// Never does: reference counting of blocks, the free queue or the key index
// (BlockPool owns them; this reads the index), hashing, or deciding what is cached.
// It stores no hash of anything: every comparison is of token ids and namespace bytes.
//
// Proof (lookup_chain). Key i's holders are tried earliest first; holder h proves
// position i of a request when h's node holds the request's block-i tokens and
//   * i == 0: the node starts a chain in the request's namespace;
//   * else: the node's parent is the node of the block proved at i - 1 (O(1), the
//     usual case), or the parent's ancestry spells the request's first i blocks in its
//     namespace, down to the start or to a node already proved (another request's copy
//     of the same prefix, computed on other blocks; O(i)).
// A key with holders but none that proves its position is a verification failure:
// the hit stops there and the caller counts it. Nodes never change, so a proof never
// depends on what a reused block holds now. A partial hit's source (verify_head) is
// proved the same way at the position after the full hits, on its first n tokens.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "block_pool.h"

namespace prefixcache {

struct VerifiedChain {
  std::vector<int32_t> blocks;  // proved hits, one per leading key
  bool failed = false;          // stopped at a key whose holders all failed to prove it
};

class BlockContents {
 public:
  // The largest block size it records (TOKENS); bound as prefixcache._C.MAX_VERIFIED_BLOCK_SIZE.
  static constexpr int64_t kMaxBlockSize = int64_t{1} << 24;

  // `pool` must outlive this object. block_size is in tokens.
  BlockContents(const BlockPool& pool, int64_t block_size);

  int64_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return num_blocks_; }
  // Content nodes alive (referenced by a block or by a child node).
  int64_t num_nodes() const { return num_nodes_; }
  // Whether token storage was widened to int64 (an id outside int32 was recorded).
  bool wide() const { return is_wide_; }

  // `blocks` (consecutive blocks of one request's table) now hold `tokens`,
  // block_size each. blocks[0] follows `parent`, the block before it in the table
  // (-1: blocks[0] starts a chain in namespace `ns`); each later block follows the
  // one before it. `parent` must hold a node. Only the first `provable` blocks can
  // ever be proved (the caller could not represent a token of the rest): the others
  // get no node. Validated first: all or nothing.
  void record(int64_t parent, std::span<const int32_t> blocks, std::span<const int64_t> tokens, std::string_view ns,
              int64_t provable);
  // The longest run of keys (packed, key_size bytes each) whose holders prove the
  // request's blocks, where `tokens` are its leading tokens and `ns` its namespace.
  // Keys past tokens.size() / block_size cannot be proved.
  VerifiedChain lookup_chain(std::string_view keys, int64_t key_size, std::span<const int64_t> tokens,
                             std::string_view ns) const;
  // How many leading blocks of `table` prove the request's first blocks (the same
  // proof as lookup_chain, with table[0:i] as the blocks proved before position i).
  int64_t verify_table(std::span<const int32_t> table, std::span<const int64_t> tokens, std::string_view ns) const;
  // Whether `block` may be the source of a partial hit (a copy of its first n tokens,
  // 1 <= n <= block_size) after the request's proved hits `proved` (its first
  // proved.size() blocks, as lookup_chain returned them): the same proof as a full
  // hit at position proved.size(), comparing only the block's first n tokens.
  // `tokens` are the request's leading tokens; fewer than the proof reads: false.
  bool verify_head(int64_t block, std::span<const int32_t> proved, std::span<const int64_t> tokens, int64_t n,
                   std::string_view ns) const;

  // Inspection, for tests: the tokens of block `id`'s node (empty without one), and
  // its number of nodes from the chain start through it (0 without one).
  std::vector<int64_t> tokens(int64_t id) const;
  int64_t depth(int64_t id) const;

  void check_invariants() const;

 private:
  static constexpr int32_t kNone = -1;

  int32_t check_id(int64_t id, const char* what) const;
  int64_t token(int32_t node, int64_t j) const {
    const size_t at = static_cast<size_t>(node) * static_cast<size_t>(block_size_) + static_cast<size_t>(j);
    return is_wide_ ? wide_[at] : narrow_[at];
  }
  // Whether the node's first `count` token ids are block_tokens[0:count].
  bool same_tokens(int32_t node, const int64_t* block_tokens, int64_t count) const;
  // Whether h's node proves that h holds the request's block i (its first `head`
  // tokens: block_size for a full hit), given the blocks already proved at [0, i).
  bool proves(int32_t h, int64_t i, std::span<const int32_t> proved, std::span<const int64_t> tokens,
              std::string_view ns, int64_t head) const;
  int32_t new_node(int32_t parent, const int64_t* block_tokens, std::string_view ns);
  void release(int32_t node);  // drops one reference; frees nodes that reach zero
  void widen();

  const BlockPool& pool_;
  int64_t block_size_;
  int32_t num_blocks_;
  std::vector<int32_t> block_node_;  // per block: its node, or kNone
  // Per node slot. A free slot has references 0 and is on the free list (via parent_).
  std::vector<int32_t> parent_;
  std::vector<uint32_t> references_;
  std::vector<std::string> namespace_;  // of a chain's first node
  std::vector<int32_t> narrow_;         // block_size ids per slot, while all fit in int32
  std::vector<int64_t> wide_;           // the same, once one does not (then narrow_ is empty)
  bool is_wide_ = false;
  int32_t free_slots_ = kNone;          // head of the free list
  int64_t num_nodes_ = 0;
};

}  // namespace prefixcache
