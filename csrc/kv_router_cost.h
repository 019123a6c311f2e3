// NVIDIA Dynamo's KV-router cost, over every candidate replica at once.
//
// Owns the cost of sending a prompt of P tokens, F = floor(P / B) full blocks (block size
// B), to candidate i, whose load is prefill_tokens[i] (prompt tokens not yet prefilled)
// and active_blocks[i] (distinct prompt blocks of its active requests), when overlap[i]
// of the prompt's blocks are cached there and active_overlap[i] of them are already among
// its active blocks:
//
//   cost[i] = weight * max((prefill_tokens[i] + P) / B - overlap[i], 0)
//           + active_blocks[i] + max(F - active_overlap[i], 0)
//
// (Dynamo's `DefaultWorkerSelector` logit at its defaults; lower is better), and the
// candidates tied at the lowest cost. prefixcache/cluster/routers/kv_events.py documents
// the policy and owns everything else about it (temperature, tie-breaks).
//
// Never does: look anything up (the caller passes the overlaps, from the KV index and
// the active sequences).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace prefixcache {

// One cost per candidate. Throws std::invalid_argument if the spans differ in
// length, block_size < 1, prompt_tokens < 0 or weight < 0.
std::vector<double> kv_router_costs(std::span<const int64_t> prefill_tokens, std::span<const int64_t> active_blocks,
                                    std::span<const int32_t> overlap_blocks,
                                    std::span<const int32_t> active_overlap_blocks, int64_t prompt_tokens,
                                    int64_t block_size, double weight);

// The positions of the lowest cost, ascending.
std::vector<int32_t> lowest(const std::vector<double>& costs);

}  // namespace prefixcache
