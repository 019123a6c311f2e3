// The estimated-TTFT router's cost, over every candidate replica at once.
//
// Owns the estimate of how long a prompt of P tokens (block size B) would wait for its
// first token on candidate i, and the charge for the work it adds there, from the load
// columns and the KV index's overlap, in SECONDS. With o = overlap[i] cached blocks, the
// cache's hit h = min(o B, floor((P - 1) / B) B) (the last prompt token is always
// computed) and n = P - h tokens to prefill from position h; with b = num_requests[i] -
// queued_requests[i] requests running there (each takes a token of every step) and
// X = prefill_tokens[i] + n prompt tokens ahead of and in this request's first token:
//
//   chunk   = max(budget - b, 1)                        prompt tokens a step can take
//   steps   = X / chunk
//   ttft[i] = steps x overhead_s + max(token_s (X + b steps) + pair_s pairs(n, h), steps x weights_s)
//   own[i]  = token_s n + pair_s pairs(n, h)             its own prefill, alone
//   cost[i] = ttft[i] + load_weight x own[i] + decode_weight x b x min(own[i], decode_cap_s)
//
// where pairs(n, h) = n h + n (n + 1) / 2 query-key pairs of its own prefill. token_s,
// pair_s, weights_s, overhead_s and budget are the replicas' service model's
// (prefixcache/cluster/service_model.py: the same roofline, in closed form). The charges
// are the delay its own prefill adds for others there: everyone queued behind it
// (load_weight), and each of the b requests decoding there, whose steps its chunks
// lengthen (decode_weight): a cache miss costs the cluster more than its own TTFT, and a
// long one most where many decode, up to decode_cap_s of it (past that, a long prompt
// would be sent to wait behind a queue it cannot afford). Lower is better.
//
// The choice (estimated_ttft_choice): the lowest cost, unless the candidate holding the
// longest cached run of the prompt costs at most stick_s more and its ttft is at most
// stick_ttft_s: then that one (affinity, SGLang's cache-aware router's rule in seconds: a
// move is a miss now and the prefix cached twice in caches that churn; the bound keeps
// affinity from making a request wait longer than its first token can afford).
// prefixcache/cluster/routers/estimated_ttft.py owns the policy around it.
//
// Never does: look anything up (the caller passes the overlaps, from the KV index).
#pragma once

#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace prefixcache {

// The replicas' service model, as the estimate reads it (SECONDS and TOKENS).
struct TtftModel {
  double token_s;     // compute per token processed
  double pair_s;      // compute per query-key pair
  double weights_s;   // reading the weights once: a step's floor
  double overhead_s;  // a step's fixed cost
  int64_t budget;     // tokens a step processes at most
  double load_weight;    // the charge for those queued behind it
  double decode_weight;  // the charge for each request decoding there
  double decode_cap_s = std::numeric_limits<double>::infinity();  // own prefill the decode charge counts at most
};

// One cost per candidate; with `ttfts`, each candidate's ttft (the cost less its charges)
// there too. Throws std::invalid_argument if the columns differ in length, block_size < 1,
// prompt_tokens < 1, or a model field is negative, not finite or (budget) < 1.
std::vector<double> estimated_ttft_costs(std::span<const int64_t> prefill_tokens,
                                         std::span<const int64_t> num_requests,
                                         std::span<const int64_t> queued_requests,
                                         std::span<const int32_t> overlap_blocks, int64_t prompt_tokens,
                                         int64_t block_size, const TtftModel& model,
                                         std::vector<double>* ttfts = nullptr);

// The positions chosen from `costs` (ascending; several when tied, for the caller to pick
// at random): the lowest cost, unless the candidates that would hit the most of the
// prompt (their overlap_blocks, up to the prompt's last whole block before its last token;
// at least one) include one within stick_s SECONDS of it: then those of them at their
// lowest cost whose ttft (`ttfts`, one per candidate; needed only where stick_ttft_s is
// finite) is at most stick_ttft_s SECONDS, if any is. Throws std::invalid_argument if the
// spans differ in length, stick_s or stick_ttft_s is negative or NaN, or prompt_tokens or
// block_size < 1.
std::vector<int32_t> estimated_ttft_choice(std::span<const double> costs, std::span<const int32_t> overlap_blocks,
                                           int64_t prompt_tokens, int64_t block_size, double stick_s,
                                           std::span<const double> ttfts = {},
                                           double stick_ttft_s = std::numeric_limits<double>::infinity());

// The SECONDS part of one candidate's cost (ttft[i] above), for a caller that reports it.
double estimated_ttft(int64_t backlog_tokens, int64_t running, int64_t cached_tokens, int64_t prompt_tokens,
                      const TtftModel& model);

}  // namespace prefixcache
