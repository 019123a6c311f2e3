"""What a router predicts each replica caches, from the requests it routed there.

Owns `RoutedPrefixes`: per replica, the block hashes of the prompts routed to it, in
least-recently-routed order, trimmed to a size. It is the approximate radix tree of
SGLang's cache-aware router and the prefix tree of Ray Serve LLM's
`PrefixCacheAffinityRouter`, at block granularity: a set of chained block hashes is a
radix tree over blocks (a chain holds its prefix), so "longest match" is the same
question the event-fed KV index answers, and it is answered by a `KVIndex` of its own.

Recency: a routed prompt touches its blocks from the last to the first, so a block is
never older than the blocks after it in a chain and trimming the least recent drops
leaves before their parents, as both trees evict (leaves first, LRU).

Must never: read KV events or loads; it knows only what the router told it.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixcache.cluster.kv_index import KVIndex, ReplicaId
from prefixcache.cluster.prompt_hashes import PromptHashes

__all__ = ["RoutedPrefixes"]


class RoutedPrefixes:
    """Block hashes routed to each replica, LRU-ordered. Sizes in TOKENS unless blocks."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.index = KVIndex(medium=None)
        self._lru: dict[ReplicaId, OrderedDict[bytes, None]] = {}

    def add_replica(self, replica: ReplicaId) -> None:
        self.index.add_replica(replica)
        self._lru[replica] = OrderedDict()

    def remove_replica(self, replica: ReplicaId) -> None:
        """Forget `replica` (nothing happens if it was never added)."""
        if replica in self._lru:
            self.index.remove_replica(replica)
            del self._lru[replica]

    def __contains__(self, replica: object) -> bool:
        return replica in self._lru

    @property
    def replicas(self) -> tuple[ReplicaId, ...]:
        return tuple(self._lru)

    def insert(self, replica: ReplicaId, hashes: PromptHashes) -> None:
        """`replica` was sent a prompt with these block hashes: they become its most
        recent (a replica seen for the first time is added)."""
        if replica not in self._lru:
            self.add_replica(replica)
        lru = self._lru[replica]
        new = []
        for digest in reversed(hashes.digests()):
            if digest in lru:
                lru.move_to_end(digest)
            else:
                lru[digest] = None
                new.append(digest)
        if new:
            self.index.store(replica, new)

    def longest_prefix(self, hashes: PromptHashes) -> dict[ReplicaId, int]:
        """{replica: BLOCKS of `hashes` predicted cached there}, replicas with at least one."""
        return self.index.longest_prefix(hashes)

    def tokens(self, replica: ReplicaId) -> int:
        """TOKENS predicted cached on `replica` (its tree's size; 0 if never routed to)."""
        lru = self._lru.get(replica)
        return 0 if lru is None else len(lru) * self.block_size

    def tokens_of(self, replicas: list[ReplicaId]) -> list[int]:
        """`tokens(r)` for each replica, in one pass (a router weighs every candidate)."""
        get, bs = self._lru.get, self.block_size
        return [len(get(r, ())) * bs for r in replicas]

    def evict_to(self, replica: ReplicaId, max_tokens: int) -> int:
        """Drop `replica`'s least recently routed blocks until it holds at most
        `max_tokens` TOKENS; returns the BLOCKS dropped."""
        lru = self._lru[replica]
        excess = len(lru) - max(max_tokens, 0) // self.block_size
        if excess <= 0:
            return 0
        gone = [lru.popitem(last=False)[0] for _ in range(excess)]
        self.index.remove(replica, gone)
        return excess
