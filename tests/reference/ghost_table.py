"""The ghost table in plain Python: the readable twin of csrc/ghost_table.h.

Owns the bounded memory of content use that outlives the content (key -> use count:
at eviction, for the history-aware policies; so far, for a tier's reuse filter), the
block-hash key (`ghost_key`), and the 64-bit content keys the radix tree chains its
pages under. Entry for entry what the native table keeps; the twins of the tree, the
block evictor and the tier manager use it, and the tests compare their answers with
the native ones.

Must never: rank candidates or touch a pool; it only remembers.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["GhostTable", "ghost_key", "mix64", "chain_page_key", "namespace_key"]

_M64 = (1 << 64) - 1


def ghost_key(block_hash: bytes) -> int:
    """A block hash's key in the ghost table: its first 8 bytes, little-endian."""
    return int.from_bytes(block_hash[:8].ljust(8, b"\0"), "little")


class GhostTable:
    """Bounded memory of evicted content: key -> use count at eviction, for at most
    `capacity` keys, the oldest put forgotten first (re-putting moves a key to the
    back)."""

    def __init__(self, capacity: int = 0) -> None:
        self.capacity = max(0, capacity)
        self._uses: OrderedDict[int, int] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._uses)

    def put(self, key: int, uses: int) -> None:
        if not self.capacity:
            return
        self._uses.pop(key, None)
        self._uses[key] = uses
        while len(self._uses) > self.capacity:
            self._uses.popitem(last=False)

    def peek(self, key: int) -> int:
        return self._uses.get(key, 0)

    def take(self, key: int) -> int:
        return self._uses.pop(key, 0)

    def clear(self) -> None:
        self._uses.clear()


def mix64(x: int) -> int:
    """splitmix64's finalizer."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def chain_page_key(parent: int, tokens: list[int]) -> int:
    """A radix page's 64-bit content key: FNV-1a over its 32-bit tokens from the parent's key."""
    h = parent ^ 0xCBF29CE484222325
    for t in tokens:
        h = ((h ^ (t & 0xFFFFFFFF)) * 0x100000001B3) & _M64
    return mix64(h)


def namespace_key(namespace: str | None) -> int:
    """The content key a namespace's pages chain from."""
    if namespace is None:
        return mix64(0x9E3779B97F4A7C15)
    data = namespace.encode()
    h = mix64(0x51AFD7ED558CCD ^ len(data))
    for c in data:
        h = mix64(h ^ c)
    return h
