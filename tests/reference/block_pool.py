"""The block pool: the readable reference for `prefixcache._C.BlockPool`.

Owns the fixed set of KV blocks every strategy shares: per-block reference counts,
the free queue, and the key -> blocks index of cached blocks. The native `BlockPool`
is what backends use; `PyBlockPool` is the same semantics in plain Python, written the
way vLLM's `FreeKVCacheBlockQueue` is (block objects linked by prev/next pointers). Tests drive both with the same operations and require identical
results; the pool benchmark measures one against the other.

Must never: hash, match or choose what to evict. A pool does not know what a key means
or which request holds a block. Every bad argument raises (`IndexError` for ids out of
range, `ValueError` otherwise) before anything changes.

Free-queue invariant: the front is reused first. A block whose last reference is dropped
goes to the FRONT if it holds no key (its content is worthless, reuse it first) and to the
TAIL if it does (it stays hittable, and the queue is an LRU of cached content). Callers
free a request's blocks in reverse order so that, among blocks freed together, the one
holding the longest prefix is evicted first. All queue operations are O(1) per block.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache._C import InvariantError

__all__ = ["PyBlockPool"]


class _Block:
    """One block: its id, reference count, key and free-queue links."""

    __slots__ = ("block_id", "ref_cnt", "key", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: bytes | None = None
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _FreeQueue:
    """Doubly linked list of free blocks between two sentinels; O(1) everywhere."""

    def __init__(self, blocks: list[_Block]) -> None:
        self.head = _Block(-1)
        self.tail = _Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for block in blocks:
            self.insert_before(block, self.tail)

    def popleft(self) -> _Block:
        block = self.head.next
        assert block is not None and block is not self.tail
        self.remove(block)
        return block

    def remove(self, block: _Block) -> None:
        assert block.prev is not None and block.next is not None
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.size -= 1

    def insert_before(self, block: _Block, successor: _Block) -> None:
        predecessor = successor.prev
        assert predecessor is not None
        predecessor.next = block
        block.prev = predecessor
        block.next = successor
        successor.prev = block
        self.size += 1

    def ids(self) -> list[int]:
        out = []
        node = self.head.next
        while node is not self.tail:
            assert node is not None
            out.append(node.block_id)
            node = node.next
        return out


def _split_packed(keys: bytes | bytearray, key_size: int, what: str) -> list[bytes]:
    # A request grows its packed digests in a bytearray; both are accepted, as natively.
    if not isinstance(keys, (bytes, bytearray)):
        raise TypeError(f"keys must be bytes or bytearray, got {type(keys).__name__}")
    keys = bytes(keys)
    if key_size < 1 or len(keys) % key_size:
        raise ValueError(
            f"{what}: key_size must be >= 1 and divide the {len(keys)} key bytes, got {key_size}"
        )
    return [keys[at : at + key_size] for at in range(0, len(keys), key_size)]


def _suffix(suffix: bytes) -> bytes:
    if not isinstance(suffix, bytes):
        raise TypeError(f"suffix must be bytes, got {type(suffix).__name__}")
    return suffix


class PyBlockPool:
    """Pure-Python model of `BlockPool`, same API and errors. For tests and benchmarks."""

    def __init__(self, num_blocks: int) -> None:
        if not 1 <= num_blocks <= 1 << 30:
            raise ValueError(f"num_blocks must be in [1, {1 << 30}], got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._queue = _FreeQueue(self._blocks)
        # key -> blocks holding it, in caching order (dicts keep insertion order).
        self._index: dict[bytes, dict[int, _Block]] = {}
        self._last_removed: list[bytes] = []
        self.num_cached = 0
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return self._queue.size

    @property
    def num_pinned(self) -> int:
        return self.num_blocks - self._queue.size

    def _block(self, block_id: int, what: str) -> _Block:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"{what}: block id {block_id} is out of range [0, {self.num_blocks})")
        return self._blocks[block_id]

    def _unique(self, ids: Sequence[int], what: str) -> list[_Block]:
        blocks = [self._block(i, what) for i in ids]
        seen: set[int] = set()
        for block in blocks:
            if block.block_id in seen:
                raise ValueError(f"{what}: block {block.block_id} appears more than once in one call")
            seen.add(block.block_id)
        return blocks

    def _drop_key(self, block: _Block) -> None:
        assert block.key is not None
        holders = self._index[block.key]
        del holders[block.block_id]
        if not holders:
            del self._index[block.key]
        block.key = None
        self.num_cached -= 1

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks (ref 1) from the front; None, changing nothing, if fewer are free."""
        if not 0 <= n <= self.num_blocks:
            raise ValueError(f"allocate: n must be in [0, num_blocks={self.num_blocks}], got {n}")
        if n > self._queue.size:
            return None
        self._last_removed = []
        out = []
        for _ in range(n):
            block = self._queue.popleft()
            if block.key is not None:
                self._last_removed.append(block.key)
                self._drop_key(block)
                self.num_evicted += 1
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference each; at zero keyless blocks go to the front, keyed to the tail."""
        blocks = self._unique(ids, "free")
        for block in blocks:
            if block.ref_cnt == 0:
                raise ValueError(f"free: block {block.block_id} is already free")
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        # Pushing at the front one by one reverses, so push the keyless ones backwards.
        for block in reversed(released):
            if block.key is None:
                front = self._queue.head.next
                assert front is not None
                self._queue.insert_before(block, front)
        for block in released:
            if block.key is not None:
                self._queue.insert_before(block, self._queue.tail)

    def touch(self, ids: Sequence[int]) -> None:
        """Add one reference each; a free block leaves the queue."""
        for block in self._unique(ids, "touch"):
            if block.ref_cnt == 0:
                self._queue.remove(block)
            block.ref_cnt += 1

    def count_free(self, ids: Sequence[int]) -> int:
        """How many of `ids` are free (ref 0): what `touch(ids)` takes from the queue."""
        return sum(self._block(i, "count_free").ref_cnt == 0 for i in ids)

    @staticmethod
    def _check_cacheable(block: _Block, key: bytes) -> None:
        if not key:
            raise ValueError("cache: key must be non-empty bytes")
        if block.ref_cnt == 0:
            raise ValueError(f"cache: block {block.block_id} is free; only blocks in use can be cached")
        if block.key is not None:
            raise ValueError(f"cache: block {block.block_id} already holds a key")

    def _insert_key(self, block: _Block, key: bytes) -> None:
        block.key = key
        self._index.setdefault(key, {})[block.block_id] = block
        self.num_cached += 1

    def cache(self, block_id: int, key: bytes) -> None:
        """Record that in-use, keyless block `block_id` holds `key`."""
        block = self._block(block_id, "cache")
        self._check_cacheable(block, key)
        self._insert_key(block, key)

    def cache_many(self, ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """cache(ids[i], keys[i]) for each i, validated first: all or nothing."""
        if len(ids) != len(keys):
            raise ValueError(f"cache_many: {len(ids)} ids but {len(keys)} keys")
        blocks = self._unique(ids, "cache")
        for block, key in zip(blocks, keys):
            self._check_cacheable(block, key)
        for block, key in zip(blocks, keys):
            self._insert_key(block, key)

    def cache_many_packed(self, ids: Sequence[int], keys: bytes, key_size: int, suffix: bytes = b"") -> None:
        """cache_many with the keys packed back to back in `keys`, key_size bytes each,
        each followed by `suffix`."""
        suffix = _suffix(suffix)
        self.cache_many(ids, [k + suffix for k in _split_packed(keys, key_size, "cache_many_packed")])

    def uncache(self, block_id: int) -> bytes | None:
        block = self._block(block_id, "uncache")
        key = block.key
        if key is not None:
            self._drop_key(block)
        return key

    def uncache_all(self) -> int:
        n = self.num_cached
        for block in self._blocks:
            block.key = None
        self._index.clear()
        self.num_cached = 0
        return n

    def lookup(self, key: bytes) -> int | None:
        holders = self._index.get(key)
        return next(iter(holders)) if holders else None

    def lookup_chain(self, keys: Sequence[bytes]) -> list[int]:
        out = []
        for key in keys:
            block_id = self.lookup(key)
            if block_id is None:
                break
            out.append(block_id)
        return out

    def evict_front(self, n: int) -> list[bytes]:
        """Drop the keys of the first n keyed free blocks (queue order); return them.

        The blocks keep their place: everything ahead of them is keyless."""
        if n < 0:
            raise ValueError(f"evict_front: n must be >= 0, got {n}")
        keys: list[bytes] = []
        node = self._queue.head.next
        while node is not self._queue.tail and len(keys) < n:
            assert node is not None
            if node.key is not None:
                keys.append(node.key)
                self._drop_key(node)
                self.num_evicted += 1
            node = node.next
        return keys

    def evict_blocks(self, ids: Sequence[int]) -> list[bytes]:
        """Drop the keys of these free, keyed blocks and move them to the front of the
        free queue in the given order (reused next); return their keys. All or nothing."""
        blocks = self._unique(ids, "evict_blocks")
        for block in blocks:
            if block.ref_cnt:
                raise ValueError(f"evict_blocks: block {block.block_id} is in use")
            if block.key is None:
                raise ValueError(f"evict_blocks: block {block.block_id} holds no key")
        keys = []
        for block in blocks:
            keys.append(block.key)
            self._drop_key(block)
            self.num_evicted += 1
        for block in reversed(blocks):
            self._queue.remove(block)
            front = self._queue.head.next
            assert front is not None
            self._queue.insert_before(block, front)
        return keys

    def lookup_chain_packed(self, keys: bytes, key_size: int, suffix: bytes = b"") -> list[int]:
        """lookup_chain over keys packed back to back in `keys`, key_size bytes each,
        each followed by `suffix`."""
        suffix = _suffix(suffix)
        return self.lookup_chain([k + suffix for k in _split_packed(keys, key_size, "lookup_chain_packed")])

    def last_removed(self) -> list[bytes]:
        return list(self._last_removed)

    def ref_count(self, block_id: int) -> int:
        return self._block(block_id, "ref_count").ref_cnt

    def key(self, block_id: int) -> bytes | None:
        return self._block(block_id, "key").key

    def free_queue(self) -> list[int]:
        return self._queue.ids()

    def blocks_for(self, key: bytes) -> list[int]:
        return list(self._index.get(key, {}))

    def check_invariants(self) -> None:
        queued = self._queue.ids()
        if len(queued) != self._queue.size:
            raise InvariantError("PyBlockPool: queue size is stale")
        queued_set = set(queued)
        for block in self._blocks:
            if (block.ref_cnt == 0) != (block.block_id in queued_set):
                raise InvariantError(f"PyBlockPool: block {block.block_id} ref {block.ref_cnt} vs queue")
        held = sum(1 for b in self._blocks if b.key is not None)
        listed = sum(len(h) for h in self._index.values())
        if not held == listed == self.num_cached:
            raise InvariantError("PyBlockPool: key index out of step with blocks")
