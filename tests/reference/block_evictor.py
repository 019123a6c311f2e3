"""Policy-ordered eviction for the `hash` strategy: the readable reference for
`prefixcache._C.BlockEvictor`.

vLLM's free queue evicts free cached blocks in one order, least recently freed first.
A `BlockEvictor` lets any `EvictionPolicy` choose instead. It owns, per block, the
attributes a policy reads (`prefixcache.eviction.Candidate`: clocks, hit and use counts,
priority, the traffic clock at its last use, the size of the request that last used
it), a ghost table of evicted block hashes (use counts survive an eviction), and a
min-heap of candidates with lazy invalidation. A candidate is a FREE block that still
holds its hash. Its key is computed ONCE, when it becomes a candidate (when `free`
drops its last reference): one `priority()` call per freed cached block for a Python
policy, none for a native one. Before an allocation of n blocks, `make_room(n)` evicts
victims by key until n free blocks hold no hash; the pool's `evict_blocks` uncaches
them and moves them to the front of the free queue, which then allocates exactly them.

The native classes are `BlockEvictor` (native order) and `CallbackBlockEvictor` (a
Python priority function); `PyBlockEvictor` is the same semantics in plain Python, and
tests drive both with the same operations and require identical results.

Must never: decide hits, hash, or reuse a block itself; change anything when a call
raises (a Python policy that raises inside `free` leaves pool and evictor unchanged).
Clocks: `clock` ticks once per `admit` with hits, once per `cached` call, and once per
block that `free` makes a candidate (in the order given, so ranking by
`last_access_time` is exactly the pool's free-queue LRU); `traffic` counts the TOKENS
`admit` was given (whole blocks of prompts).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from prefixcache._C import InvariantError

from .candidate import CandidateRecord
from .ghost_table import GhostTable, ghost_key

__all__ = ["PyBlockEvictor", "ghost_key"]


class PyBlockEvictor:
    """Pure-Python model of `BlockEvictor` / `CallbackBlockEvictor`: same API and results."""

    def __init__(self, pool: Any, block_size: int, priority: Callable[[Any], Any], ghost_capacity: int = 0) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if pool.num_cached:
            raise ValueError("BlockEvictor needs a pool that holds no key yet")
        self.pool = pool
        self.block_size = block_size
        self._rank = priority
        self._ghost = GhostTable(ghost_capacity)
        self._attrs = [CandidateRecord(b, block_size) for b in range(pool.num_blocks)]
        self._version = [0] * pool.num_blocks
        self._keyed = [False] * pool.num_blocks
        self._heap: list[tuple[Any, int, int, int]] = []  # (key, seq, block, version)
        self._seq = 0
        self.clock = 0
        self.traffic = 0
        self.num_candidates = 0

    @property
    def ghost_size(self) -> int:
        return len(self._ghost)

    def admit(self, hits: Sequence[int], tokens: int, priority: int = 0) -> None:
        if tokens < 0:
            raise ValueError(f"admit: tokens must be >= 0, got {tokens}")
        was_candidate = [self.pool.ref_count(b) == 0 and self._keyed[b] for b in hits]
        self.pool.touch(hits)
        self.traffic += tokens
        if not hits:
            return
        self.clock += 1
        for b, candidate in zip(hits, was_candidate):
            if candidate:
                self.num_candidates -= 1
                self._version[b] += 1
            a = self._attrs[b]
            self._attrs[b] = replace(
                a,
                last_access_time=self.clock,
                hit_count=a.hit_count + 1,
                use_count=a.use_count + 1,
                priority=max(a.priority, priority),
            )

    def cached(self, ids: Sequence[int], keys: bytes, key_size: int, priority: int = 0) -> None:
        if key_size < 1 or len(keys) != len(ids) * key_size:
            raise ValueError(
                f"cached: {len(ids)} ids need {len(ids)} keys of key_size bytes, got {len(keys)} bytes"
            )
        for b in ids:
            if self.pool.ref_count(b) < 1:
                raise ValueError(f"cached: block {b} is free")
        self.clock += 1
        for i, b in enumerate(ids):
            uses = 1 + self._ghost.take(ghost_key(keys[i * key_size : (i + 1) * key_size]))
            self._attrs[b] = CandidateRecord(
                b, self.block_size, self.clock, self.clock, 0, priority, uses, self.traffic, 0
            )
            self._keyed[b] = True

    def free(self, ids: Sequence[int], request_tokens: int = 0) -> None:
        fresh = []
        for b in ids:
            if self.pool.ref_count(b) == 1 and self._keyed[b]:
                stamp = self.clock + 1 + len(fresh)
                fresh.append(
                    replace(self._attrs[b], last_access_time=stamp, last_use=self.traffic, request_tokens=request_tokens)
                )
        keys = [self._rank(c) for c in fresh]  # may raise: nothing changed yet
        self.pool.free(ids)
        self.clock += len(fresh)
        for c, key in zip(fresh, keys):
            self._attrs[c.id] = c
            self._version[c.id] += 1
            heapq.heappush(self._heap, (key, self._seq, c.id, self._version[c.id]))
            self._seq += 1
        self.num_candidates += len(fresh)
        if len(self._heap) > 2 * self.pool.num_blocks + 64:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def make_room(self, n: int, keep: Sequence[int] = ()) -> list[bytes]:
        if n < 0:
            raise ValueError(f"make_room: n must be >= 0, got {n}")
        keyless = self.pool.num_free - self.num_candidates
        return self.evict(max(0, n - keyless), keep)

    def evict(self, n: int, keep: Sequence[int] = ()) -> list[bytes]:
        if n < 0:
            raise ValueError(f"evict: n must be >= 0, got {n}")
        for b in keep:
            if not 0 <= b < self.pool.num_blocks:
                raise IndexError(f"evict: kept block id {b} is out of range [0, {self.pool.num_blocks})")
        kept, victims, spared = set(keep), [], []
        while len(victims) < n and self._heap:
            entry = heapq.heappop(self._heap)
            if self._live(entry):
                if entry[2] in kept:
                    spared.append(entry)
                    continue
                victims.append(entry[2])
                self._version[entry[2]] += 1
        for entry in spared:
            heapq.heappush(self._heap, entry)
        keys = self.pool.evict_blocks(victims)
        self.num_candidates -= len(victims)
        for b, key in zip(victims, keys):
            self._keyed[b] = False
            self._ghost.put(ghost_key(key), self._attrs[b].use_count)
        return keys

    def reset(self) -> None:
        self._heap.clear()
        self._version = [v + 1 for v in self._version]
        self._keyed = [False] * self.pool.num_blocks
        self.num_candidates = 0
        self._ghost.clear()

    def candidate(self, id: int) -> CandidateRecord:
        if not 0 <= id < self.pool.num_blocks:
            raise IndexError(f"candidate: block id {id} is out of range [0, {self.pool.num_blocks})")
        return self._attrs[id]

    def order(self) -> list[int]:
        return [e[2] for e in sorted(e for e in self._heap if self._live(e))]

    def _live(self, entry: tuple[Any, int, int, int]) -> bool:
        _, _, b, version = entry
        return self._version[b] == version and self._keyed[b] and self.pool.ref_count(b) == 0

    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise InvariantError(f"BlockEvictor: {msg}")

        live: dict[int, int] = {}
        for e in self._heap:
            if self._live(e):
                live[e[2]] = live.get(e[2], 0) + 1
        free_keyed = 0
        for b in range(self.pool.num_blocks):
            if self._keyed[b] != (self.pool.key(b) is not None):
                fail(f"block {b} " + ("lost its key behind the evictor's back" if self._keyed[b]
                                      else "was cached behind the evictor's back"))
            if self.pool.ref_count(b) == 0 and self._keyed[b]:
                free_keyed += 1
                if live.get(b, 0) != 1:
                    fail(f"free cached block {b} has {live.get(b, 0)} live heap entries")
        if free_keyed != self.num_candidates:
            fail(f"{self.num_candidates} candidates counted, the pool has {free_keyed} free cached blocks")
        seen_keyed = False
        for b in self.pool.free_queue():
            keyed = self.pool.key(b) is not None
            if seen_keyed and not keyed:
                fail(f"keyless free block {b} sits behind a cached one")
            seen_keyed = seen_keyed or keyed
