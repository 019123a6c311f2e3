"""The log probabilities of drawn tokens, as vLLM 0.33 returns them.

Owns `TokenLogprobs` (one drawn token's logprob, its rank and the k most likely tokens)
and `token_logprobs`, which makes them for a step's rows. They are vLLM's default
`logprobs_mode`, "raw_logprobs": the log-softmax of the model's raw logits, before
temperature, top-k or top-p, so a token's logprob does not depend on how it was drawn.
A rank counts the tokens at least as likely as the drawn one (vLLM's: ties share the
worse rank), so a greedy token has rank 1 unless another token ties it.

Must never: draw tokens, or touch KV, the cache or the text (the server formats the
OpenAI fields from these: `prefixcache.serve.responses`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["TokenLogprobs", "token_logprobs"]


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's `logprob` (natural log, may be -inf), its `rank` (1 = the most
    likely) and `top`: the request's k most likely (token id, logprob), most likely first
    (ties: the lower id first)."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """For each i, the logprobs of `tokens[i]` drawn from row `rows[i]` of ``logits [n,
    vocab]`` (raw), with the `ks[i]` most likely tokens of that row. One log-softmax and
    one top-k over the rows asked for, whatever their number."""
    if not rows:
        return []
    if not len(rows) == len(tokens) == len(ks):
        raise ValueError(f"{len(rows)} rows for {len(tokens)} tokens and {len(ks)} counts")
    vocab = logits.shape[-1]
    if any(not 0 <= k <= vocab for k in ks):
        raise ValueError(f"a number of top logprobs outside [0, {vocab}]: {list(ks)}")
    lp = torch.log_softmax(logits[list(rows)].float(), dim=-1)
    drawn = torch.tensor(tokens, dtype=torch.long)
    chosen = lp.gather(1, drawn[:, None])[:, 0]
    ranks = (lp >= chosen[:, None]).sum(dim=-1)
    most = max(ks)
    if most:
        # torch.topk orders ties arbitrarily; a stable sort of the negated values puts
        # the lower id first, so the order is reproducible.
        order = torch.sort(-lp, dim=-1, stable=True).indices[:, :most]
        top_ids, top_lp = order.tolist(), lp.gather(1, order).tolist()
    out = []
    for i, (token, k) in enumerate(zip(tokens, ks)):
        top = tuple(zip(top_ids[i][:k], top_lp[i][:k])) if k else ()
        out.append(TokenLogprobs(int(token), float(chosen[i]), int(ranks[i]), top))
    return out
