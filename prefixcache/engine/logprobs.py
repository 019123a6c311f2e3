"""The log probabilities of drawn tokens, as vLLM 0.33 returns them.

Owns `TokenLogprobs` (one drawn token's logprob, its rank and the k most likely tokens,
or the logprobs of the tokens a request named: vLLM's `logprob_token_ids`) and
`token_logprobs`, which makes them for a step's rows. They are vLLM's default
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

__all__ = ["TokenLogprobs", "token_logprobs", "MAX_LOGPROB_TOKEN_IDS"]

MAX_LOGPROB_TOKEN_IDS = 128
"""The most token ids a request may name for their logprobs (vLLM 0.33's cap)."""


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's `logprob` (natural log, may be -inf), its `rank` (1 = the most
    likely) and `top`: the request's k most likely (token id, logprob), most likely first
    (ties: the lower id first), or the (token id, logprob) of each id it named, in its order."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], ks: Sequence[int],
    named: Sequence[Sequence[int] | None] | None = None,
) -> list[TokenLogprobs]:
    """For each i, the logprobs of `tokens[i]` drawn from row `rows[i]` of ``logits [n,
    vocab]`` (raw), with the `ks[i]` most likely tokens of that row, or, where `named[i]`
    is given, those ids' logprobs instead (vLLM's `logprob_token_ids`: a gather, no top-k).
    One log-softmax and one top-k over the rows asked for, whatever their number."""
    if not rows:
        return []
    named = named if named is not None else [None] * len(rows)
    if not len(rows) == len(tokens) == len(ks) == len(named):
        raise ValueError(f"{len(rows)} rows for {len(tokens)} tokens, {len(ks)} counts and {len(named)} id lists")
    vocab = logits.shape[-1]
    if any(not 0 <= k <= vocab for k in ks):
        raise ValueError(f"a number of top logprobs outside [0, {vocab}]: {list(ks)}")
    if any(ids is not None and any(not 0 <= t < vocab for t in ids) for ids in named):
        raise ValueError(f"a named token id outside [0, {vocab})")
    ks = [0 if ids is not None else k for k, ids in zip(ks, named)]
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
    for i, (token, k, ids) in enumerate(zip(tokens, ks, named)):
        if ids is not None:
            shown = tuple(zip(ids, lp[i, list(ids)].tolist()))
        else:
            shown = tuple(top[i][:k]) if k else ()
        out.append(TokenLogprobs(int(token), float(chosen[i]), int(ranks[i]), shown))
    return out
