"""The per-path state cap of a hybrid layout: which cached recurrent states a path keeps.

Owns `replay_victims`, the rule both strategies' `state_cap` option applies when a
request is released: a state's worth is the replay it saves (a hit at its position
computes nothing before it; without it, the hit falls back to the previous state on the
path and recomputes the tokens between), so the states with the least of it go first,
and the deepest, the one the path's next turn reads, never.

Must never: touch a pool or a tree, or decide when the cap applies (the backends do).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

__all__ = ["replay_victims"]

S = TypeVar("S", bound=Hashable)


def replay_victims(states: Sequence[tuple[int, S]], cap: int) -> list[S]:
    """The states to evict so that `cap` of a path's cached `states` ((position in
    TOKENS, state), by position) remain: repeatedly the one whose replay length (its
    position minus the previous remaining state's, or 0's) is least, never the
    deepest."""
    kept = list(states)
    out = []
    while len(kept) > max(cap, 1):
        k = min(range(len(kept) - 1), key=lambda j: kept[j][0] - (kept[j - 1][0] if j else 0))
        out.append(kept.pop(k)[1])
    return out
