"""A small model of a hybrid `radix` cache: what its KV events say it holds, and the hit
SGLang 0.5.23's UnifiedRadixCache makes of that.

`HybridRadixModel` keeps, per layout group, the block hashes the cache announced
(`BlockStored`) and has not withdrawn (`BlockRemoved`, `AllBlocksCleared`), and predicts
the hit of a prompt from them alone, page by page, with SGLang's validators: a hit of L
tokens needs every full-attention page before L, the sliding window's pages live in a
run ending at L that is at least a window long (`window - 1` tokens before the query;
any run from the start if no page before L is a tombstone), and a state on the page L
ends. A tree decides only at node ends; the page-by-page answer is the same, because a
node's components are all-or-nothing and a state sits only at its node's end.

Used by the hypothesis state machine (tests/test_hybrid_radix_stateful.py), which checks
every admission's hit and every `match` against it, and so the events too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.hashing import block_hashes
from prefixcache.layout import MAMBA, SLIDING_WINDOW, LayerGroup


class HybridRadixModel:
    def __init__(self, layout: Sequence[LayerGroup], block_size: int, algorithm: str = "sha256_cbor",
                 seed: str | None = None) -> None:  # fmt: skip
        self.layout = tuple(layout)
        self.bs = block_size
        self.algorithm, self.seed = algorithm, seed
        self.held: list[Counter[Any]] = [Counter() for _ in self.layout]
        kinds = [g.kind for g in self.layout]
        self.full = kinds.index("full_attention")
        self.swa = kinds.index(SLIDING_WINDOW) if SLIDING_WINDOW in kinds else None
        self.state = kinds.index(MAMBA) if MAMBA in kinds else None
        self.window = self.layout[self.swa].window - 1 if self.swa is not None else 0  # type: ignore[operator]

    def consume(self, events: Iterable[Any]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.held[event.group_idx].update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.held[event.group_idx]
                for h in event.block_hashes:
                    assert held[h] > 0, f"group {event.group_idx}: BlockRemoved of a hash no BlockStored holds"
                    held[h] -= 1
                    if not held[h]:
                        del held[h]
            elif isinstance(event, AllBlocksCleared):
                for held in self.held:
                    held.clear()

    def hit(self, tokens: Sequence[int], namespace: Any = None) -> int:
        """The hit (TOKENS) of a look-up of `tokens` (not capped)."""
        hashes = block_hashes(list(tokens), self.bs, self.algorithm, namespace=namespace, seed=self.seed)
        best = 0
        run = float("inf")  # live window TOKENS since the last tombstone
        for k, h in enumerate(hashes, 1):
            if h not in self.held[self.full]:
                break
            ok = True
            if self.swa is not None:
                if h in self.held[self.swa]:
                    run += self.bs
                    ok = run >= self.window
                else:
                    run, ok = 0, False
            if self.state is not None and h not in self.held[self.state]:
                ok = False
            if ok:
                best = k * self.bs
        return best
