"""The log probabilities of drawn tokens, as vLLM 0.33 returns them.

Owns `TokenLogprobs` (one drawn token's logprob, its rank and the k most likely tokens)
and `token_logprobs`, which makes them for a step's rows. They are vLLM's default
`logprobs_mode`, "raw_logprobs": the log-softmax of the model's raw logits, before the
logits processors (bias, penalties), temperature and the filters, so a token's logprob does
not depend on how it was drawn.
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
        # The most-th largest value bounds each row's top; the tokens at or above it (most,
        # or more where values tie) are few, and a stable sort of them by value puts the
        # lower id first among equals: reproducible, where torch.topk orders ties as it
        # likes, and O(vocab) where sorting the row is O(vocab log vocab).
        bound = torch.topk(lp, most, dim=-1).values[:, -1:]
        top = []
        for i in range(len(rows)):
            ids = torch.nonzero(lp[i] >= bound[i], as_tuple=True)[0]
            values = lp[i, ids]
            order = torch.sort(-values, stable=True).indices[:most]
            top.append(list(zip(ids[order].tolist(), values[order].tolist())))
    out = []
    for i, (token, k) in enumerate(zip(tokens, ks)):
        out.append(TokenLogprobs(int(token), float(chosen[i]), int(ranks[i]), tuple(top[i][:k]) if k else ()))
    return out
