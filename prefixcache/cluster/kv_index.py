"""The cluster KV index: which replicas hold which blocks, built from their KV events.

Owns `KVIndex`, the cluster-wide map from block hash to the replicas holding it, over the
native `prefixcache._C.KvIndex` (csrc/kv_index.h: one flat table, a replica bitmask per
hash). It is fed by each replica's KV events, `apply(replica, events)`, a plain function
of (replica id, events) that an event subscriber, a simulation draining
`PrefixCache.drain_events()`, or a test calls alike; and it answers, for a request's
block hashes, how long a prefix each replica holds (`longest_prefix`), in one call.

Semantics (as vLLM publishes events, docs/serving.md "KV events on the wire"):
- a block hash is an int (vLLM's default wire form: the low 64 bits of the digest) or a
  digest (bytes; its low 64 bits, big-endian, are taken), so our events and vLLM's index
  the same way;
- a `BlockStored` of a hash a replica holds already is another copy (the `hash` backend
  caches a block computed twice twice); a `BlockRemoved` drops one copy, and the
  replica holds the block until its last copy goes; a removal of a hash the replica
  does not hold (an event lost upstream) is counted in `counters["unknown_removed"]`;
- `AllBlocksCleared` drops the replica's blocks; `remove_replica` drops them and the
  replica;
- only events of `medium` (default "GPU"; an event's medium None counts as any) are
  applied, the others counted in `counters["skipped"]`;
- per-tier residency (`lower_media`, e.g. ("CPU", "STORAGE") for replicas with
  `cache.tiers`): the index also keeps, per lower medium, which replicas hold each block
  there, and a union of every medium, so `tiered_prefix` says how long a prefix each
  replica holds on ANY medium and how many of its blocks are on the device and on each
  lower medium (a router weighs a lower-tier block by what loading it costs).

Replicas are any hashable ids (ints in a simulation, Ray Serve replica ids in a
deployment); the index numbers them densely for the native table and reuses the number
of a removed replica. Must never: hold routing policy (costs, loads, thresholds), talk
to the network, or guess: events of a replica it was not told about raise KeyError.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from prefixcache._C import KvIndex as _NativeKvIndex
from prefixcache._C import block_hash_int
from prefixcache.cluster.prompt_hashes import PromptHashes
from prefixcache.events import MEDIUM_GPU, KVEvent

__all__ = ["KVIndex", "ReplicaId", "block_hash_int"]

ReplicaId = Hashable
BlockHashes = Sequence[int | bytes] | PromptHashes
"""A chain of block hashes: ints or digests, or a prompt's packed digests."""


class KVIndex:
    """Block hash -> replicas holding it, fed by KV events (see the module docstring)."""

    def __init__(self, *, medium: str | None = MEDIUM_GPU, lower_media: Sequence[str] = ()) -> None:
        self.medium = medium
        self.lower_media = tuple(lower_media)
        self._native = _NativeKvIndex()
        # Per-tier residency: one index per lower medium, and one of every medium.
        self._lower = {m: _NativeKvIndex() for m in self.lower_media}
        self._any = _NativeKvIndex() if self.lower_media else None
        self._slot: dict[ReplicaId, int] = {}
        self._keys: list[ReplicaId | None] = []  # slot -> replica (None: free)
        self._free: list[int] = []  # free slots, the last freed reused first

    # -- replicas ------------------------------------------------------------------
    @property
    def replicas(self) -> tuple[ReplicaId, ...]:
        """The replicas in the index, in the order they were added."""
        return tuple(self._slot)

    def __contains__(self, replica: object) -> bool:
        return replica in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def add_replica(self, replica: ReplicaId) -> None:
        """Start tracking `replica` (holding nothing). ValueError if it is tracked."""
        if replica in self._slot:
            raise ValueError(f"replica {replica!r} is already in the index")
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._keys)
            if slot >= _NativeKvIndex.max_replicas:
                raise ValueError(f"the index tracks at most {_NativeKvIndex.max_replicas} replicas")
            for native in self._natives():
                native.add_replica(slot)
            self._keys.append(None)
        self._slot[replica] = slot
        self._keys[slot] = replica

    def remove_replica(self, replica: ReplicaId) -> int:
        """Forget `replica` and every block it held (a dead or removed replica); returns
        the BLOCKS it held. KeyError if it is not tracked."""
        slot = self._slot_of(replica)
        blocks = self._native.blocks(slot)
        for native in self._natives():
            native.clear(slot)
        del self._slot[replica]
        self._keys[slot] = None
        self._free.append(slot)
        return blocks

    def _slot_of(self, replica: ReplicaId) -> int:
        try:
            return self._slot[replica]
        except (KeyError, TypeError):
            known = ", ".join(map(repr, self._slot)) or "none"
            raise KeyError(f"replica {replica!r} is not in the index (replicas: {known}); add_replica first") from None

    # -- ingest --------------------------------------------------------------------
    def apply(self, replica: ReplicaId, events: Iterable[KVEvent]) -> None:
        """Apply `replica`'s KV events, oldest first. A bad event (not a KV event, a
        block hash that is neither int nor bytes) raises TypeError and applies nothing."""
        if not isinstance(events, (list, tuple)):
            events = list(events)
        slot = self._slot_of(replica)
        self._native.apply(slot, events, self.medium)
        for medium, native in self._lower.items():
            native.apply(slot, events, medium)
        if self._any is not None:
            self._any.apply(slot, events, None)

    def store(self, replica: ReplicaId, hashes: Sequence[int | bytes]) -> None:
        """`replica` holds one more copy of each hash on `medium` (a BlockStored without an event)."""
        slot = self._slot_of(replica)
        self._native.store(slot, hashes)
        if self._any is not None:
            self._any.store(slot, hashes)

    def remove(self, replica: ReplicaId, hashes: Sequence[int | bytes]) -> None:
        """`replica` dropped one copy of each hash on `medium` (a BlockRemoved without an event)."""
        slot = self._slot_of(replica)
        self._native.remove(slot, hashes)
        if self._any is not None:
            self._any.remove(slot, hashes)

    def clear(self, replica: ReplicaId) -> None:
        """`replica` holds nothing (an AllBlocksCleared without an event)."""
        slot = self._slot_of(replica)
        for native in self._natives():
            native.clear(slot)

    def _natives(self) -> list[_NativeKvIndex]:
        out = [self._native, *self._lower.values()]
        return out + [self._any] if self._any is not None else out

    # -- queries -------------------------------------------------------------------
    def longest_prefix(self, hashes: BlockHashes) -> dict[ReplicaId, int]:
        """{replica: BLOCKS} for every replica holding at least the first block of the
        chain: how many leading blocks of `hashes` it holds (the others hold 0)."""
        if isinstance(hashes, PromptHashes):
            depths = self._native.longest_prefix_packed(hashes.packed, hashes.digest_size)
        else:
            depths = self._native.longest_prefix(hashes)
        keys = self._keys
        return {keys[slot]: depth for slot, depth in depths.items()}

    def tiered_prefix(self, hashes: BlockHashes) -> dict[ReplicaId, tuple[int, ...]]:
        """{replica: BLOCKS per medium} for every replica holding the chain's first block
        on some medium: of the longest leading run of `hashes` it holds on ANY medium,
        how many blocks are on `medium` (the device) first, then on each of `lower_media`
        in order. A block held on several media counts on the first of them. Without
        `lower_media`, the device's `longest_prefix` as 1-tuples."""
        if self._any is None:
            return {r: (d,) for r, d in self.longest_prefix(hashes).items()}
        depths, hashes = self._any_runs(hashes)
        keys, out = self._keys, {}
        lower = list(self._lower.values())
        for slot, depth in depths.items():
            counts = [0] * (1 + len(lower))
            for h in hashes[:depth]:
                if self._native.copies_of(h, slot):
                    counts[0] += 1
                    continue
                for k, native in enumerate(lower, 1):
                    if native.copies_of(h, slot):
                        counts[k] += 1
                        break
            out[keys[slot]] = tuple(counts)
        return out

    def weighted_prefix(self, hashes: BlockHashes, weights: Mapping[str, float],
                        default: float = 1.0) -> dict[ReplicaId, float]:  # fmt: skip
        """{replica: weight} for every replica holding the chain's first block on some
        medium: over the longest leading run of `hashes` it holds on ANY medium, each
        block weighs the most of `weights` (by medium name; `default` for a medium it
        does not name) among the media holding it there (llm-d's LongestPrefixScorer)."""
        own = weights.get(self.medium, default) if self.medium is not None else default
        if self._any is None:
            return {r: d * own for r, d in self.longest_prefix(hashes).items()}
        depths, hashes = self._any_runs(hashes)
        keys, out = self._keys, {}
        lower = [(native, weights.get(m, default)) for m, native in self._lower.items()]
        for slot, depth in depths.items():
            total = 0.0
            for h in hashes[:depth]:
                best = own if self._native.copies_of(h, slot) else 0.0
                for native, w in lower:
                    if w > best and native.copies_of(h, slot):
                        best = w
                total += best
            out[keys[slot]] = total
        return out

    def _any_runs(self, hashes: BlockHashes) -> tuple[dict[int, int], Sequence[int | bytes]]:
        """({slot: BLOCKS} of the longest leading run each slot holds on ANY medium, the
        chain as a sequence of hashes); only with `lower_media`."""
        assert self._any is not None
        if isinstance(hashes, PromptHashes):
            return self._any.longest_prefix_packed(hashes.packed, hashes.digest_size), hashes.digests()
        return self._any.longest_prefix(hashes), hashes

    def held_on(self, medium: str, replica: ReplicaId) -> tuple[int, int]:
        """(distinct BLOCKS, copies) `replica` holds on one of `lower_media`, or on the
        index's own `medium`."""
        native = self._native if medium == self.medium else self._lower[medium]
        slot = self._slot_of(replica)
        return native.blocks(slot), native.copies(slot)

    def holds_on(self, medium: str, block_hash: int | bytes, replica: ReplicaId) -> int:
        """Copies of one block hash `replica` holds on `medium` (the index's own, or a lower one)."""
        native = self._native if medium == self.medium else self._lower[medium]
        return native.copies_of(block_hash, self._slot_of(replica))

    def blocks(self, replica: ReplicaId) -> int:
        """Distinct BLOCKS `replica` holds."""
        return self._native.blocks(self._slot_of(replica))

    def copies(self, replica: ReplicaId) -> int:
        """Copies `replica` holds (a block computed twice counts twice)."""
        return self._native.copies(self._slot_of(replica))

    def copies_of(self, block_hash: int | bytes, replica: ReplicaId) -> int:
        """Copies of one block hash `replica` holds."""
        return self._native.copies_of(block_hash, self._slot_of(replica))

    @property
    def num_hashes(self) -> int:
        """Distinct block hashes held by any replica."""
        return self._native.num_hashes

    @property
    def num_pairs(self) -> int:
        """(block, replica) pairs held."""
        return self._native.num_pairs

    @property
    def memory_bytes(self) -> int:
        """Heap BYTES of the native index."""
        return self._native.memory_bytes

    @property
    def counters(self) -> dict[str, int]:
        """Ingest counters: stored, removed, unknown_removed, cleared, skipped."""
        return self._native.counters()

    def check_invariants(self) -> None:
        """Raise InvariantError naming the first inconsistency of the native index."""
        self._native.check_invariants()
