"""Multi-turn chat workload: turn k's prompt is everything said before plus a new question.

`num_conversations` conversations of `turns` turns. Every conversation starts with a
system prompt of `system_prompt_len` tokens shared by ALL conversations (0 for none).
Turn k's prompt = system prompt + q1 + a1 + ... + q(k-1) + a(k-1) + qk, where each
question is `question_len` fresh tokens and each answer a(k) is turn k's OUTPUT,
`answer_len` fresh tokens, so a replay that commits turn k's output makes turn k+1 hit it.
Conversations are interleaved at random (seeded), each keeping its own turn order.

Must never: share content across conversations other than the system prompt.

Analytic infinite-cache token hit ratio at block size B, exact for every seed. With
S, Q, A the lengths, C conversations and T turns: after turn k the cache holds the whole
blocks of S + k*(Q+A) tokens (prompt and answer), so turn k+1 hits B*floor((S+k(Q+A))/B);
turn 1 hits the system prompt, B*floor(S/B), except for the very first request. So

    hits   = (C-1)*B*floor(S/B) + C * sum_{k=1}^{T-1} B*floor((S + k(Q+A))/B)
    prompt = C * sum_{k=1}^{T} (S + k*Q + (k-1)*A)

(A replay must commit every output token for this to hold; a real engine never writes the
KV of the last sampled token, which would cost one token per turn at B = 1.)
Defaults (64 x 8 turns, 256 + 60 + 200 tokens): 0.9507 at B = 1, 0.9458 at B = 16.
"""

from __future__ import annotations

import random
from functools import partial

from prefixcache.workloads.build import Item, assemble, interleave, whole_blocks
from prefixcache.workloads.checks import NonNegative, Positive, Rate, checked_params
from prefixcache.workloads.tokens import TokenSource
from prefixcache.workloads.workload import Workload

__all__ = ["multi_turn", "multi_turn_hit_ratio"]


@checked_params
def multi_turn(
    num_conversations: Positive = 64,
    turns: Positive = 8,
    system_prompt_len: NonNegative = 256,
    question_len: Positive = 60,
    answer_len: NonNegative = 200,
    *,
    seed: int = 0,
    request_rate: Rate = None,
) -> Workload:
    """Multi-turn chat. Lengths in TOKENS; `request_rate` in requests/s."""
    rng, src = random.Random(seed), TokenSource()
    system = src.fresh(system_prompt_len)
    conversations: list[list[Item]] = []
    for c in range(num_conversations):
        history, turn_items = system, []
        for k in range(1, turns + 1):
            prompt, answer = history + src.fresh(question_len), src.fresh(answer_len)
            turn_items.append((prompt, answer, f"conv{c}/turn{k}"))
            history = prompt + answer
        conversations.append(turn_items)
    shape = dict(num_conversations=num_conversations, turns=turns, system_prompt_len=system_prompt_len,
                 question_len=question_len, answer_len=answer_len)
    return assemble("multi_turn", {**shape, "seed": seed}, interleave(rng, conversations), rng=rng,
                    request_rate=request_rate, analytic=partial(multi_turn_hit_ratio, **shape))


def multi_turn_hit_ratio(
    num_conversations: int = 64, turns: int = 8, system_prompt_len: int = 256, question_len: int = 60,
    answer_len: int = 200, *, block_size: int,
) -> float:
    """Infinite-cache token hit ratio of `multi_turn` at `block_size` TOKENS."""
    c, t, s, q, a, b = num_conversations, turns, system_prompt_len, question_len, answer_len, block_size
    hits = (c - 1) * whole_blocks(s, b) + c * sum(whole_blocks(s + k * (q + a), b) for k in range(1, t))
    prompt = c * sum(s + k * q + (k - 1) * a for k in range(1, t + 1))
    return hits / prompt
