"""The `PrefixCache` protocol: the one interface every caching strategy implements.

Owns the abstract class the engine, the A/B runner and the conformance kit talk to,
and its value types (`Match`, `Admission`; `CacheStats` and the `KVEvent` family are
defined in `stats` and `events` and re-exported here). Counts are in TOKENS unless a
name says blocks.

Must never: import a backend, the engine or the experiment layer. Data flows down.

Rules every implementation obeys (the conformance kit tests each one):

1. `admit` returns `Admission(block_table, num_cached_tokens)`. The hit is the longest
   cached prefix, capped at `len(tokens) - 1` (the last prompt token is always
   computed, so its logits exist), and is a whole number of blocks. Hit blocks are
   pinned; blocks for the rest of the prompt are allocated.
2. `admit` and `append` are atomic: when there is no room even after evicting
   everything evictable they return `None` and change nothing.
3. Nothing pinned by a live request is ever evicted or reused.
4. `commit` makes the request's full, computed blocks available to later
   `match`/`admit` calls. A block computed twice (same content) is handled as the
   reference system does: `hash` indexes both copies (vLLM), `radix` frees the
   request's copy (SGLang).
5. `release` caches the request's full computed blocks, unpins everything, and frees
   what is not cached (partial tail blocks, duplicates). Releasing twice, or an unknown
   id, raises `KeyError`.
6. The KV of a cached prefix is bit-identical to recomputing it: caching never changes
   model output.
7. After every request is released no block is pinned, and every block is free or
   cached; `check_invariants` verifies this and the backend's own structure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixcache.isolation import Isolation, LoRA, Namespace
from prefixcache.stats import CacheStats

if TYPE_CHECKING:
    from prefixcache._C import BlockPool
    from prefixcache.config import CacheConfig

__all__ = [
    "PrefixCache",
    "Match",
    "Admission",
    "CacheStats",
    "KVEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "Namespace",
    "Isolation",
    "LoRA",
    "as_tokens",
]



@dataclass(frozen=True)
class Match:
    """A look-up result: the first `num_tokens` tokens are cached in `block_ids`."""

    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Admission:
    """An admitted request: its block table (blocks for the whole prompt, in order) and
    how many leading prompt tokens are already computed (a multiple of the block size)."""

    block_table: tuple[int, ...]
    num_cached_tokens: int


def as_tokens(tokens: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints (accepts lists, tuples, numpy int arrays)."""
    if isinstance(tokens, list):
        return tokens
    tolist = getattr(tokens, "tolist", None)
    if tolist is not None:
        out = tolist()
        if not isinstance(out, list):
            raise ValueError("tokens must be one-dimensional")
        return out
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    return list(tokens)


class PrefixCache(ABC):
    """A prefix-caching strategy over a shared `BlockPool` (see the module docstring).

    Lifecycle of a request: `admit` -> (`commit` / `append` ...) -> `release`.
    A request's tokens are its prompt followed by everything appended; `commit(n)`
    says the KV of `tokens[:n]` is written. Not thread-safe.
    """

    #: Name under which the class is registered (set by `register_backend`).
    name: ClassVar[str] = ""

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        if pool.num_blocks != config.num_blocks:
            raise ValueError(
                f"pool has {pool.num_blocks} blocks but config.num_blocks is {config.num_blocks}"
            )
        self.pool = pool
        self.config = config
        self.block_size = config.block_size

    # -- look-up (pure: pins nothing, changes no recency, counts no stats) ----------
    @abstractmethod
    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        """Longest cached prefix of `tokens` (whole blocks; NOT capped at len - 1)."""

    # -- request lifecycle -------------------------------------------------------------
    @abstractmethod
    def admit(
        self, request_id: Hashable, tokens: Sequence[int], *, namespace: Namespace = None
    ) -> Admission | None:
        """Start a request: pin its cached prefix, allocate blocks for the rest of the
        prompt. None (nothing changed) if the pool cannot make room. `ValueError` for an
        empty prompt or a request id already live."""

    @abstractmethod
    def append(self, request_id: Hashable, tokens: Sequence[int]) -> list[int] | None:
        """Add tokens (decode output, the next chunk); returns the block ids newly added
        to the block table (possibly empty), or None (nothing changed) if no room."""

    @abstractmethod
    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        """The KV of `tokens[:num_computed_tokens]` is written; its full blocks become
        hittable. `num_computed_tokens` never decreases and is at most the token count."""

    @abstractmethod
    def release(self, request_id: Hashable) -> None:
        """The request finished or was aborted: cache its full computed blocks, unpin
        everything, free the rest. `KeyError` for an unknown or released id."""

    @abstractmethod
    def block_table(self, request_id: Hashable) -> Sequence[int]:
        """Block ids of a live request, in token order. `KeyError` if not live."""

    # -- maintenance ---------------------------------------------------------------------
    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` unpinned cached blocks if there are that many;
        returns the number of blocks actually freed (may exceed the request)."""

    @abstractmethod
    def reset(self) -> bool:
        """Drop every cached block. False (nothing changed) if any block is pinned."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Counters since construction or the last successful `reset`."""

    @abstractmethod
    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise `InvariantError` (an `AssertionError`) naming the first broken invariant
        of the backend's structure or of the pool."""
