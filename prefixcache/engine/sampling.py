"""Drawing the next token from logits: greedy, or temperature / top-k / top-p with a
request's own seeded generator.

Owns `SamplingParams` (per request), `processed_logits` (vLLM's logits processors:
allowed token ids, bad words (`bad_word_tokens`), min_tokens' stop-token mask, logit
bias, then the presence, frequency and repetition penalties over a request's tokens) and
`sample`. A request with a seed owns a
`torch.Generator`, so its tokens do not depend on which other requests share its steps
or on preemption (a preempted request keeps its generator and never redraws a token).

A row that cannot be sampled (its logits hold nan or +inf, or its filtered distribution
has no finite mass) gets a `SamplingError` in place of a token: that request ends alone,
and the other rows of the step are drawn as usual.

Must never: touch KV or the cache, draw from torch's global generator when a seed is
given, or let one row's failure fail another row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

import torch

from prefixcache.engine.config import SamplingConfig
from prefixcache.errors import ConfigError

__all__ = ["SamplingParams", "SamplingError", "sample", "filter_logits", "child_params", "processed_logits",
           "bad_word_tokens"]

SamplingParams = SamplingConfig
"""A request's sampling settings: the same fields as the config's `sampling:` section."""


def _penalize(out: torch.Tensor, rows: Sequence[int], params: Sequence[SamplingParams],
              prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
    """Row i of `out` (in `rows`) penalized in place as vLLM's sampler does it: repetition
    first (a token seen in the prompt or the output: a positive logit divided by it, another
    multiplied), then frequency (times each output token's count) and presence (once per
    output token) subtracted."""
    vocab = out.shape[-1]
    for i in rows:
        p = params[i]
        counts = torch.bincount(torch.as_tensor(list(outputs[i]), dtype=torch.long), minlength=vocab)[:vocab]
        in_output = counts > 0
        row = out[i]
        if p.repetition_penalty != 1.0:
            seen = in_output | (torch.bincount(torch.as_tensor(list(prompts[i]), dtype=torch.long),
                                               minlength=vocab)[:vocab] > 0)
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, scaled, row)
        out[i] = row - p.frequency_penalty * counts - p.presence_penalty * in_output


def bad_word_tokens(words: Sequence[str], encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], ...]:
    """The token sequences `bad_words` ban (vLLM's `update_from_tokenizer`): each word
    without its leading spaces, and again after one space where that starts with another
    token and is as long (a word met mid-text); `encode` adds no special tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise ConfigError("bad_words", f"each bad word must be a non-blank str, got {word!r}")
        bare = tuple(encode(word.lstrip()))
        spaced = tuple(encode(" " + word.lstrip()))
        out.append(bare)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def _ban_bad_words(row: torch.Tensor, words: Sequence[Sequence[int]], output: Sequence[int]) -> None:
    """vLLM's bad words: a word's last token is banned where the output ends with the rest."""
    for word in words:
        if len(word) > len(output) + 1:
            continue
        head = len(word) - 1
        if head == 0 or list(output[len(output) - head :]) == list(word[:head]):
            row[word[-1]] = float("-inf")


def processed_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]], banned: Sequence[Collection[int]],
    bad_words: Sequence[Sequence[Sequence[int]]] = (),
) -> torch.Tensor:
    """The logits row i's token is drawn from, vLLM's logits processors in vLLM's order:
    tokens outside `allowed_token_ids`, then `bad_words[i]`'s (`bad_word_tokens`), then
    those in `banned[i]` (a request's stop tokens while it is short of its `min_tokens`)
    set to -inf, `logit_bias` added, then the penalties (`_penalize`). `logits` itself
    when no row has any (the raw logits give the logprobs either way), else a float copy."""
    rows = [i for i, p in enumerate(params) if p.processed or banned[i] or (bad_words and bad_words[i])]
    if not rows:
        return logits
    out = logits.float().clone()
    vocab = out.shape[-1]
    for i in rows:
        p = params[i]
        if p.allowed_token_ids is not None:
            keep = torch.zeros(vocab, dtype=torch.bool)
            keep[list(p.allowed_token_ids)] = True
            out[i] = out[i].masked_fill(~keep, float("-inf"))
        if bad_words and bad_words[i]:
            _ban_bad_words(out[i], bad_words[i], outputs[i])
        if banned[i]:
            out[i, [t for t in banned[i] if t < vocab]] = float("-inf")
        for token, bias in p.logit_bias:
            out[i, token] += bias
    _penalize(out, [i for i in rows if params[i].penalized], params, prompts, outputs)
    return out


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of a request with n > 1 (vLLM's `ParentRequest`): the
    parent's, with seed + index when it has a seed, wrapped to int64 as torch takes a seed
    (two's complement). vLLM sets the child's seed after its params are checked, so a
    child seed of -1 is a seed there, not "none": it is set the same way here."""
    if params.seed is None or index == 0:
        return params
    child = replace(params, seed=None)
    object.__setattr__(child, "seed", (params.seed + index + 2**63) % 2**64 - 2**63)
    return child


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  min_p: float = 0.0) -> torch.Tensor:
    """``logits [vocab]`` divided by `temperature`, with tokens less than `min_p` times as
    likely as the most likely one, then those outside the top-k and the top-p nucleus,
    set to -inf (vLLM's order; the most likely token always survives)."""
    x = logits.float() / temperature
    if min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens strictly more likely already reach top_p.
        drop = (probs.cumsum(-1) - probs) >= top_p
        x = x.scatter(0, order[drop], float("-inf"))
    return x


class SamplingError(ValueError):
    """One request's row of logits could not be sampled (a model or parameter fault)."""


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[int | SamplingError]:
    """One token per row of ``logits [n, vocab]``: argmax for greedy rows, otherwise a draw
    from row i's filtered distribution with `generators[i]` (None: torch's global one).
    A row that cannot be sampled gets a `SamplingError` instead (see the module docstring)."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(params)} params and {len(generators)} generators")
    # -inf is a masked token; nan or +inf is a broken row, and so is a row with no finite logit.
    broken = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
    out: list[int | SamplingError] = list(logits.argmax(dim=-1).tolist())
    for i, (p, g) in enumerate(zip(params, generators)):
        if broken[i]:
            out[i] = SamplingError("the model's logits for this request are not finite (nan or inf)")
            continue
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p.temperature, p.top_k, p.top_p, p.min_p), dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            out[i] = SamplingError(f"no token can be drawn at temperature {p.temperature}, top_k {p.top_k}, "
                                   f"top_p {p.top_p}: the distribution is not finite")
            continue
        out[i] = int(torch.multinomial(probs, 1, generator=g))
    return out
