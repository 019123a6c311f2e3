"""The cluster KV index in plain Python: the readable twin of `prefixcache.cluster.KVIndex`
(the native `prefixcache._C.KvIndex` under its replica-id mapping).

A dict from block hash (the index's int form) to a Counter of replica -> copies. Every
operation says in a line or two what the native index must do; the stateful test drives
both with the same random operations and compares every answer and every error type.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

from prefixcache.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

MASK64 = (1 << 64) - 1


def block_hash_int(h: int | bytes) -> int:
    """An int's low 64 bits; a digest's low 64 bits read big-endian (vLLM's int form)."""
    if isinstance(h, bool) or not isinstance(h, (int, bytes)):
        raise TypeError(f"expected a block hash (an int, or a digest as bytes); got {type(h).__name__}")
    return (int.from_bytes(h, "big") if isinstance(h, bytes) else h) & MASK64


class ReferenceKVIndex:
    def __init__(self, *, medium: str | None = MEDIUM_GPU) -> None:
        self.medium = medium
        self.holders: dict[int, Counter[Hashable]] = {}
        self.replicas: dict[Hashable, None] = {}
        self.counters = Counter(stored=0, removed=0, unknown_removed=0, cleared=0, skipped=0)

    def _known(self, r: Hashable) -> None:
        if r not in self.replicas:
            raise KeyError(r)

    def add_replica(self, r: Hashable) -> None:
        if r in self.replicas:
            raise ValueError(r)
        self.replicas[r] = None

    def remove_replica(self, r: Hashable) -> int:
        """Forget r and its blocks; the blocks it held."""
        self._known(r)
        blocks = self.blocks(r)
        self.clear(r)
        del self.replicas[r]
        return blocks

    def store(self, r: Hashable, hashes: Iterable[int | bytes]) -> None:
        self._known(r)
        keys = [block_hash_int(h) for h in hashes]  # all converted before any is stored
        for h in keys:
            self.holders.setdefault(h, Counter())[r] += 1
            self.counters["stored"] += 1

    def remove(self, r: Hashable, hashes: Iterable[int | bytes]) -> None:
        self._known(r)
        for h in [block_hash_int(h) for h in hashes]:
            copies = self.holders.get(h)
            if not copies or copies[r] == 0:
                self.counters["unknown_removed"] += 1  # never stored here: counted, ignored
                continue
            self.counters["removed"] += 1
            copies[r] -= 1
            if copies[r] == 0:
                del copies[r]
            if not copies:
                del self.holders[h]

    def clear(self, r: Hashable) -> None:
        """Drop every block of r (counts nothing: a clear is not a removal)."""
        self._known(r)
        for h in [h for h, copies in self.holders.items() if r in copies]:
            del self.holders[h][r]
            if not self.holders[h]:
                del self.holders[h]

    def apply(self, r: Hashable, events: Sequence[KVEvent]) -> None:
        self._known(r)
        for e in events:  # validated first: a bad event applies nothing
            if not isinstance(e, (BlockStored, BlockRemoved, AllBlocksCleared)):
                raise TypeError(e)
            if not isinstance(e, AllBlocksCleared):
                [block_hash_int(h) for h in e.block_hashes]
        for e in events:
            if self.medium is not None and e.medium is not None and e.medium != self.medium:
                self.counters["skipped"] += 1
            elif isinstance(e, BlockStored):
                self.store(r, e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.remove(r, e.block_hashes)
            else:
                self.clear(r)
                self.counters["cleared"] += 1

    def longest_prefix(self, hashes: Sequence[int | bytes]) -> dict[Hashable, int]:
        """{replica: how many leading hashes it holds}, replicas holding at least one."""
        keys = [block_hash_int(h) for h in hashes]
        out = {}
        for r in self.replicas:
            depth = 0
            while depth < len(keys) and self.holders.get(keys[depth], Counter())[r] > 0:
                depth += 1
            if depth:
                out[r] = depth
        return out

    def copies_of(self, h: int | bytes, r: Hashable) -> int:
        self._known(r)
        return self.holders.get(block_hash_int(h), Counter())[r]

    def blocks(self, r: Hashable) -> int:
        self._known(r)
        return sum(1 for copies in self.holders.values() if r in copies)

    def copies(self, r: Hashable) -> int:
        self._known(r)
        return sum(copies[r] for copies in self.holders.values())

    @property
    def num_hashes(self) -> int:
        return len(self.holders)

    @property
    def num_pairs(self) -> int:
        return sum(len(copies) for copies in self.holders.values())
