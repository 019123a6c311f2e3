"""The `hash` strategy's evictors: which free cached blocks lose their hash, and when.

Owns `FreeQueueEvictor`, the evictor of `eviction: lru`: the pool's free queue already
is that order (least recently freed first), so it builds no candidates and each method
is the pool's own call or nothing. And `block_evictor(pool, block_size, policy)`, which
picks it, the native `BlockEvictor` (a policy with a native order) or the native
`CallbackBlockEvictor` (a Python `priority()`; csrc/block_evictor.h). All three answer
the same calls, so a backend makes them without asking which one it holds.

Must never: decide hits, hash, record events or hold a block reference of its own.
`FreeQueueEvictor` adds one Python call per backend call it stands for and nothing
per block: it is what the default configuration runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixcache._C import BlockEvictor, BlockPool, CallbackBlockEvictor

if TYPE_CHECKING:
    from prefixcache.eviction import EvictionPolicy

__all__ = ["FreeQueueEvictor", "block_evictor"]


class FreeQueueEvictor:
    """The pool's free queue as the evictor (`eviction: lru`): allocation reuses the
    front of the queue, so there is never room to make and nothing to rank."""

    __slots__ = ("pool", "evict")

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        #: evict(n): drop the hashes of up to n free cached blocks, least recently freed first.
        self.evict = pool.evict_front

    def make_room(self, n: int, keep: Sequence[int] = ()) -> Sequence[bytes]:
        """Nothing (no hash dropped): allocation itself evicts from the front of the free queue."""
        return ()

    def admit(self, hits: Sequence[int], tokens: int, priority: int = 0) -> None:
        """Pin the hit blocks (out of the free queue)."""
        if hits:
            self.pool.touch(hits)

    def cached(self, ids: Sequence[int], keys: bytes, key_size: int, priority: int = 0) -> None:
        """Nothing: a cached block's place in the queue is set when it is freed."""

    def free(self, ids: Sequence[int], request_tokens: int = 0) -> None:
        """pool.free(ids): cached blocks go to the queue's tail, keyless ones to its front."""
        self.pool.free(ids)

    def reset(self) -> None:
        """Nothing: the pool's `uncache_all` is the whole reset."""

    def check_invariants(self) -> None:
        """Nothing beyond the pool's own check."""


def block_evictor(
    pool: BlockPool, block_size: int, policy: EvictionPolicy
) -> FreeQueueEvictor | BlockEvictor | CallbackBlockEvictor:
    """The evictor that runs `policy` on `pool`'s free cached blocks; its ghost table holds
    `policy.history` x the pool's blocks."""
    if policy.native == "lru":
        return FreeQueueEvictor(pool)
    ghost = policy.history * pool.num_blocks
    if policy.native is not None:
        return BlockEvictor(pool, block_size, policy.native, ghost_capacity=ghost, **policy.native_params())
    return CallbackBlockEvictor(pool, block_size, policy.priority, ghost)
