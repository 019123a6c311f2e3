// BlockContents: exactly what each cached block's KV was computed from, so that a
// hit found through a non-cryptographic hash is proved before it is used.
//
// Owns, per block of a BlockPool: its tokens (block_size ids, int32 while every id
// fits, widened once to int64 when one does not), its parent (the block before it in
// the table of the request that computed it, -1 at the start of a chain), the
// parent's generation at that moment, the namespace of a chain's first block, and its
// own generation (a stamp taken each time the block is recorded, so a reused parent
// is noticed). The KV of a block depends on the namespace and on every token up to
// its last one, so "exactly the same content" means: same tokens, and a parent with
// exactly the same content (same namespace at the first block).
//
// Never does: reference counting, the free queue or the key index (BlockPool owns
// them; this reads the index), hashing, or deciding what is cached. It stores no
// hash of anything: every comparison is of token ids and namespace bytes.
//
// Verification of a chain hit (lookup_chain): key i's holders are tried earliest
// first; holder h proves position i if its tokens equal the request's block i and
//   * i == 0: h starts a chain in the request's namespace;
//   * else: h's parent is the block proved at i - 1 with an unchanged generation
//     (O(1), the usual case), or h's recorded ancestry spells the request's first
//     i blocks in its namespace, every ancestor still holding the generation h saw
//     (a copy of the same prefix computed by another request; O(i)).
// A key with holders but none that proves its position is a verification failure:
// the hit stops there and the caller counts it. An ancestor re-recorded since (its
// block was reused) breaks the proof: that is a miss, never a wrong hit. So that
// the copies a request actually uses together stay provable, adopt() re-points a
// block proved through its ancestry at the proved block before it (its content is
// the same; only the record of where it came from moves).
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
  bool walked = false;          // some hit was proved through its ancestry (see adopt)
};

class BlockContents {
 public:
  // `pool` must outlive this object. block_size is in tokens.
  BlockContents(const BlockPool& pool, int64_t block_size);

  int64_t block_size() const { return block_size_; }
  int32_t num_blocks() const { return num_blocks_; }
  // Whether token storage was widened to int64 (an id outside int32 was recorded).
  bool wide() const { return !wide_.empty(); }

  // `blocks` (consecutive blocks of one request's table) now hold `tokens`,
  // block_size each. blocks[0]'s parent is `parent`, the block before it in the
  // table (-1: blocks[0] starts a chain in namespace `ns`); each later block's is
  // the one before it. `parent` must be recorded already. Only the first
  // `provable` blocks can ever be proved (the caller could not represent a token
  // of the rest); the others are recorded as unprovable. Validated first: all or
  // nothing. Stamps each block with a new generation.
  void record(int64_t parent, std::span<const int32_t> blocks, std::span<const int64_t> tokens, std::string_view ns,
              int64_t provable);
  // The longest run of keys (packed, key_size bytes each) whose holders prove the
  // request's blocks, where `tokens` are its leading tokens and `ns` its namespace.
  // Keys past tokens.size() / block_size cannot be proved.
  VerifiedChain lookup_chain(std::string_view keys, int64_t key_size, std::span<const int64_t> tokens,
                             std::string_view ns) const;
  // How many leading blocks of `table` prove the request's first blocks (the same
  // proof as lookup_chain, with table[i - 1] as the parent at position i).
  int64_t verify_table(std::span<const int32_t> table, std::span<const int64_t> tokens, std::string_view ns) const;
  // Re-points each block of `chain` that proves position i at chain[i - 1], its
  // parent in the table of the request now using it; stops at the first block that
  // does not prove its position (nothing is trusted that is not proved again).
  // Returns the number of blocks proved.
  int64_t adopt(std::span<const int32_t> chain, std::span<const int64_t> tokens, std::string_view ns);

  // Inspection, for tests: the recorded descriptor of block `id`.
  int32_t parent(int64_t id) const;
  uint64_t generation(int64_t id) const;
  std::vector<int64_t> tokens(int64_t id) const;

  void check_invariants() const;

 private:
  int32_t check_id(int64_t id, const char* what) const;
  int64_t token(int32_t b, int64_t j) const { return wide_.empty() ? narrow_[b * block_size_ + j] : wide_[b * block_size_ + j]; }
  bool same_tokens(int32_t b, const int64_t* block_tokens) const;
  // Whether h's descriptor proves that h holds the request's block i, given the
  // blocks already proved at positions [0, i).
  bool proves(int32_t h, int64_t i, std::span<const int32_t> proved, std::span<const int64_t> tokens,
              std::string_view ns) const;
  void widen();

  const BlockPool& pool_;
  int64_t block_size_;
  int32_t num_blocks_;
  std::vector<int32_t> narrow_;  // num_blocks * block_size ids, while all fit in int32
  std::vector<int64_t> wide_;    // the same, once one does not (then narrow_ is empty)
  std::vector<int32_t> parent_;  // -1: starts a chain
  std::vector<uint64_t> parent_generation_;
  std::vector<uint64_t> generation_;  // 0: never recorded
  std::vector<uint8_t> provable_;
  std::vector<std::string> namespace_;  // of a chain's first block
  uint64_t clock_ = 0;
};

}  // namespace prefixcache
