"""What the two caches of the `hash` strategy share: maintenance over the pool's index, and vLLM's events.

Owns `HashCacheBase`, the base of `hash.HashCache` (one group) and
`hybrid_hash.HybridHashCache` (a hybrid layout): both keep their cached content as keys
in the shared `BlockPool`'s index, evict through an evictor (`prefixcache.evictors`),
count in a `StatsCounter` and log to an event log, so `evict`, `reset`, `stats` and
`drain_events` are one code for both. And the event builders both record with:
`stored_event` (vLLM's `BlockStored` for a run of one request's blocks, all of them or
the ones a group keeps) and `removed_events` (a `BlockRemoved` per dropped key, with the
group its key names).

A subclass sets, in its `__init__`: `_evictor`, `_stats` (`StatsCounter`), `_events`
(`event_log(...)`), `_evicted_at_reset` (`pool.num_evicted` then), `_digest_size` (bytes per
block hash), `_algorithm` and `_none_hash` (the chain's algorithm and root); and `tiers` when it keeps lower tiers (`prefixcache.tiers.Tiers`): what `evict`
drops then goes down, `reset` clears them and `stats` counts them.

Must never: decide hits, allocate, or know a request's lifecycle (the subclasses do).
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.events import (
    FULL_ATTENTION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    event_extra_keys,
    event_lora,
)
from prefixcache.hashing import chain_digests, namespace_extra_keys
from prefixcache.protocol import Namespace, PrefixCache, guarded
from prefixcache.requests import check_count
from prefixcache.stats import CacheStats
from prefixcache.tiers import Tiers

__all__ = ["HashCacheBase", "stored_event", "removed_events"]


def removed_events(keys: Sequence[bytes], digest_size: int) -> list[BlockRemoved]:
    """One BlockRemoved per dropped key, as vLLM records them: the block hash and the
    group its key names (a key longer than the hash ends in the group index, 4
    big-endian bytes; a bare hash is group 0)."""
    ds = digest_size
    return [
        BlockRemoved((bytes(k[:ds]),), group_idx=int.from_bytes(k[ds:], "big") if len(k) > ds else 0) for k in keys
    ]


def stored_event(
    digests: bytes | bytearray,
    digest_size: int,
    tokens: Sequence[int],
    namespace: Namespace,
    block_size: int,
    start: int,
    stop: int,
    keyed: Sequence[int] | None = None,
    *,
    group_idx: int = 0,
    kind: str = FULL_ATTENTION,
    sliding_window: int | None = None,
) -> BlockStored:
    """vLLM's BlockStored for blocks [start, stop) of one request whose packed block
    hashes are `digests`: the hashes of the blocks `keyed` (all of them when None), the
    parent hash of block `start`, the tokens of the whole range, the namespace's extra
    keys per keyed block and its adapter, and the group's fields."""
    ds, bs = digest_size, block_size
    keyed = range(start, stop) if keyed is None else keyed
    first = event_extra_keys(namespace_extra_keys(namespace))
    later = event_extra_keys(namespace_extra_keys(namespace, first_block=False))
    lora_id, lora_name = event_lora(namespace)
    return BlockStored(
        block_hashes=tuple(bytes(digests[i * ds : (i + 1) * ds]) for i in keyed),
        parent_block_hash=bytes(digests[(start - 1) * ds : start * ds]) if start else None,
        token_ids=tuple(tokens[start * bs : stop * bs]),
        block_size=bs,
        lora_id=lora_id,
        lora_name=lora_name,
        extra_keys=tuple(first if i == 0 else later for i in keyed) or None,
        group_idx=group_idx,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=sliding_window,
    )


class HashCacheBase(PrefixCache):
    """The maintenance calls of a cache whose content is the pool's index (module
    docstring); the request lifecycle is the subclass's."""

    tiers: Tiers | None = None

    def _prompt_digests(self, tokens: Sequence[int], namespace: Namespace) -> bytes:
        """Packed hashes of the full blocks of `tokens`, the first salted with the namespace."""
        return chain_digests(
            tokens,
            self.block_size,
            self._algorithm,
            self._none_hash,
            namespace_extra_keys(namespace),
            namespace_extra_keys(namespace, first_block=False),
        )

    def _extend_chain(self, digests: bytearray, tokens: Sequence[int], num_full: int, namespace: Namespace) -> bytes:
        """Hash a request's full blocks past the `digests` it has (blocks completed by
        append), up to block `num_full`, appending their hashes to `digests`; those hashes
        (empty when none was missing)."""
        bs, ds = self.block_size, self._digest_size
        num_hashed = len(digests) // ds
        if num_hashed >= num_full:
            return b""
        later = namespace_extra_keys(namespace, first_block=False)
        new = chain_digests(
            tokens[num_hashed * bs : num_full * bs],
            bs,
            self._algorithm,
            bytes(digests[-ds:]) if num_hashed else self._none_hash,
            later if num_hashed else namespace_extra_keys(namespace),
            later,
        )
        digests += new
        return new

    def _removed_events(self, keys: Sequence[bytes]) -> list[BlockRemoved]:
        return removed_events(keys, self._digest_size)

    def _record_removed(self, keys: Sequence[bytes]) -> None:
        """Record the BlockRemoved of these dropped keys."""
        self._events.record_from(self._removed_events, keys)

    @guarded
    def evict(self, num_blocks: int) -> int:
        """Drop the keys of up to `num_blocks` free cached blocks, in the policy's
        order (LRU: least recently freed first). They were already free; now they can
        no longer be hit."""
        num_blocks = check_count(num_blocks, "num_blocks")
        removed = self._evictor.evict(num_blocks)
        self._record_removed(removed)
        if self.tiers is not None and removed:
            self.tiers.evicted_keys(removed, self.pool)  # their KV is intact: demote it
        return len(removed)

    @guarded
    def reset(self) -> bool:
        if self.pool.num_pinned:
            return False
        self.pool.uncache_all()
        self._evictor.reset()
        if self.tiers is not None:
            self.tiers.reset()
        self._stats.reset()
        self._evicted_at_reset = self.pool.num_evicted
        self._events.record(AllBlocksCleared())
        return True

    @guarded
    def stats(self) -> CacheStats:
        self._stats.evictions = self.pool.num_evicted - self._evicted_at_reset
        self._stats.events_dropped = self._events.dropped
        return self._stats.snapshot(self.tiers.stats() if self.tiers is not None else ())

    @guarded
    def drain_events(self) -> list[KVEvent]:
        return self._events.drain()
