// Eviction orders shared by the radix tree (leaves) and the block evictor
// (free cached blocks of the hash strategy): what a candidate looks like and
// the native priority of each built-in policy.
//
// Owns: EvictionCandidate and its field list (what a policy may read,
// prefixcache.eviction.Candidate),
// the EvictionOrder enum and its parser, the parameters of the orders that have
// some, and native_key(): the sortable key of a candidate, smallest evicted
// first. Mirrors the priority() methods of prefixcache/eviction.py exactly.
//
// Never does: keep state, walk a structure or touch the pool. A structure
// computes a candidate's key once, when it becomes a candidate, and orders by it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace prefixcache {

// lru, lfu, fifo, mru, filo, priority, slru, tlru are SGLang 0.5.23's
// (mem_cache/evict_policy.py); gslru and chain are ours (eviction.py).
enum class EvictionOrder { kLru, kLfu, kFifo, kMru, kFilo, kPriority, kGslru, kSlru, kTlru, kChain };

// Parses a policy's `native` name; std::invalid_argument names the allowed values.
inline EvictionOrder parse_eviction_order(const std::string& name) {
  if (name == "lru") return EvictionOrder::kLru;
  if (name == "lfu") return EvictionOrder::kLfu;
  if (name == "fifo") return EvictionOrder::kFifo;
  if (name == "mru") return EvictionOrder::kMru;
  if (name == "filo") return EvictionOrder::kFilo;
  if (name == "priority") return EvictionOrder::kPriority;
  if (name == "gslru") return EvictionOrder::kGslru;
  if (name == "slru") return EvictionOrder::kSlru;
  if (name == "tlru") return EvictionOrder::kTlru;
  if (name == "chain") return EvictionOrder::kChain;
  throw std::invalid_argument("eviction order '" + name +
                              "' is not native; allowed values: lru, lfu, fifo, mru, filo, priority, gslru, slru, tlru, "
                              "chain");
}

// Parameters of the orders that take some. TOKENS unless said.
struct OrderParams {
  int64_t protect_tokens = 0;        // gslru: how much later a reused candidate goes
  int64_t size_weight = 0;           // gslru: how much earlier a fresh one goes, per token of its request
  int64_t protected_threshold = 2;   // slru: hits (a count) that move a candidate to the protected segment
  int64_t tlru_threshold = 0;        // tlru: SGLang's `threshold`
  int64_t next_prompt_estimate = 0;  // tlru: SGLang's `next_prompt_estimate`
};

// What a policy may read about a candidate (a radix leaf, or a free cached
// block), besides its id: X(name, doc) per field, all int64. The one definition:
// EvictionCandidate's members, their Python properties and `_C.CANDIDATE_FIELDS`
// (which prefixcache.eviction.Candidate is tested against and the Python twins'
// records are built from) all expand this list. Times are logical clocks;
// `last_use` is the traffic clock (TOKENS of prompts admitted so far) at the
// candidate's last use.
#define PREFIXCACHE_CANDIDATE_FIELDS(X)                            \
  X(num_tokens, "Tokens it holds (a leaf's run, a block's size).") \
  PREFIXCACHE_CANDIDATE_STAMPS(X)

// The fields after num_tokens (a candidate's size, which a structure knows from its
// shape): what a structure stamps on a candidate, under these names in a radix node.
#define PREFIXCACHE_CANDIDATE_STAMPS(X)                                                                        \
  X(last_access_time, "Logical clock of its last access.")                                                     \
  X(creation_time, "Logical clock when it was created (radix) or cached (hash).")                              \
  X(hit_count, "Times it was part of a hit.")                                                                  \
  X(priority, "Highest request priority that touched it.")                                                     \
  X(use_count, "Requests that used it (hit or computed it), history included.")                                \
  X(last_use, "Traffic clock (TOKENS admitted) at its last use.")                                              \
  X(request_tokens, "Whole-block prompt TOKENS of the request that last used it.")                             \
  X(cached_prefix_len, "TOKENS from the root to the end of the node (radix; 0 for a hash block).")             \
  X(history_len, "Deepest cached_prefix_len the node's branch reached, never shrinking (radix; 0 for a hash block).")

struct EvictionCandidate {
  int64_t id = 0;  // node id (radix) or block id (hash)
#define PREFIXCACHE_CANDIDATE_MEMBER(name, doc) int64_t name = 0;
  PREFIXCACHE_CANDIDATE_FIELDS(PREFIXCACHE_CANDIDATE_MEMBER)
#undef PREFIXCACHE_CANDIDATE_MEMBER
};

using NativeKey = std::pair<int64_t, int64_t>;

// How a heap of keys learns that a comparison failed. A key type whose comparison can
// fail (a Python policy's priorities, bind_py_key.h) must not throw from inside the std
// heap algorithms, which would leave a moved-from key in the heap: its operator<
// answers "not less" and keeps the failure, and the structure calls check() once the
// heap operation is over, which throws it with every key still in place. unchecked(f)
// runs f (putting keys back after a failure) as if no comparison had failed, then
// keeps the first failure. Native keys never fail: both are free.
template <class Key>
struct KeyCompare {
  static void check() {}
  template <class F>
  static void unchecked(F&& f) {
    f();
  }
};

// The key of `c` under `order`: compared lexicographically, smallest evicted first.
inline NativeKey native_key(EvictionOrder order, const OrderParams& params, const EvictionCandidate& c) {
  switch (order) {
    case EvictionOrder::kLru: return {c.last_access_time, 0};
    case EvictionOrder::kLfu: return {c.hit_count, c.last_access_time};
    case EvictionOrder::kFifo: return {c.creation_time, 0};
    case EvictionOrder::kMru: return {-c.last_access_time, 0};
    case EvictionOrder::kFilo: return {-c.creation_time, 0};
    case EvictionOrder::kPriority: return {c.priority, c.last_access_time};
    case EvictionOrder::kGslru:
    case EvictionOrder::kChain:  // gslru's key; a tier makes it leaves-only and counts uses per chain
      if (c.use_count >= 2) return {c.last_use + params.protect_tokens, 0};
      return {c.last_use - params.size_weight * c.request_tokens, 0};
    case EvictionOrder::kSlru: return {c.hit_count >= params.protected_threshold ? 1 : 0, c.last_access_time};
    case EvictionOrder::kTlru: {
      // Tokens past the branch's budget cannot help its next prefill: "TEL-safe", first out.
      const int64_t budget = std::max<int64_t>(c.history_len + params.next_prompt_estimate - params.tlru_threshold, 0);
      const bool tel_safe = c.cached_prefix_len - c.num_tokens >= budget;
      return {tel_safe ? -1 : 0, c.last_access_time};
    }
  }
  return {0, 0};
}

}  // namespace prefixcache
