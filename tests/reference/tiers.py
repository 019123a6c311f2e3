"""Reference model of the memory hierarchy below the device pool, in plain Python.

`PyTierManager` has the semantics of the native `prefixcache._C.TierManager`
(csrc/tier_manager.h) operation for operation: per tier, slots keyed by a block's
chained hash with what travels with it (hits, uses, chain depth, last use, parent,
tokens; with lineage the tokens find a block: `follow`), pins, an eviction order ranked by the policy's `priority()` (eviction.py; the
native order mirrors it), ties broken by the order candidates were ranked in,
leaves-only eviction for a policy that asks for it; the device mirror; the write
policies (on_evict moves a block down when it leaves the tier above, write_through
copies at caching, selective after `min_hits` hits), each gated by the tier's
`store_threshold` over its reuse tracker (a ghost table of uses per block hash, bumped
once per request that computes or hits the block); loads that promote; and the
ordered transfer log. tests/test_tiers_stateful.py drives both with the same random
operations and requires the same answers, transfers and counters after every step.

It is the readable statement of the rules, not a fast one: every eviction scans the
tier for its lowest-ranked candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.eviction import EvictionPolicy
from .candidate import CandidateRecord
from .ghost_table import GhostTable, ghost_key

DEVICE = -1


@dataclass
class Meta:
    hits: int = 0
    uses: int = 0
    depth: int = 0
    last_use: int = 0
    request_tokens: int = 0


@dataclass
class Slot:
    key: bytes
    parent: bytes | None
    meta: Meta
    stamp: int
    created: int
    tokens: tuple[int, ...] = ()
    pins: int = 0
    rank: tuple = ()  # (priority, seq) when it was last ranked


@dataclass
class Tier:
    num_slots: int
    write: str
    min_hits: int
    policy: EvictionPolicy
    leaves_only: bool
    keep_on_load: bool = False
    store_threshold: int = 0
    reuse_slots: int = 0
    slots: dict[int, Slot] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    clock: int = 0
    seq: int = 0
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("hits", "loads", "stores", "evictions", "demotions", "refused", "errors", "filtered"), 0)
    )

    def __post_init__(self) -> None:
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.reuse = GhostTable(self.reuse_slots if self.store_threshold >= 2 else 0)

    def reused_enough(self, key: bytes) -> bool:
        return self.store_threshold < 2 or self.reuse.peek(ghost_key(key)) >= self.store_threshold

    def slot_of(self, key: bytes) -> int | None:
        return next((i for i, s in self.slots.items() if s.key == key), None)

    def children(self, key: bytes) -> int:
        return sum(1 for s in self.slots.values() if s.parent == key)

    def evictable(self, i: int) -> bool:
        s = self.slots[i]
        return s.pins == 0 and not (self.leaves_only and self.children(s.key) > 0)

    def rank(self, i: int, block_size: int) -> None:
        s = self.slots[i]
        m = s.meta
        uses = max(m.uses, m.depth + 1) if self.policy.native == "chain" else m.uses
        c = CandidateRecord(i, block_size, s.stamp, s.created, m.hits, 0, uses, m.last_use, m.request_tokens, 0, 0)
        self.seq += 1
        s.rank = (self.policy.priority(c), self.seq)


class PyTierManager:
    def __init__(self, num_device_blocks: int, block_size: int, tiers: list[tuple], keep_tokens: bool = True,
                 key_size: int = 4) -> None:  # fmt: skip
        self.block_size = block_size
        self.key_size = key_size
        self.names = 0  # lineage: names given so far
        self.keep_tokens = keep_tokens
        # (num_slots, write, min_hits, policy, leaves_only, keep_on_load, store_threshold, reuse_slots)
        self.tiers = [Tier(*tier) for tier in tiers]
        self.device: dict[int, tuple[bytes, bytes | None, Meta, tuple[int, ...]]] = {}
        self.traffic = 0
        self.transfers: list[tuple[int, int, int, int]] = []

    # -- helpers -----------------------------------------------------------------------
    def _push(self, t: int, i: int) -> None:
        tier = self.tiers[t]
        if tier.evictable(i):
            tier.rank(i, self.block_size)

    def _remove(self, t: int, i: int) -> Slot:
        tier = self.tiers[t]
        s = tier.slots.pop(i)
        if s.parent is not None and tier.leaves_only:
            p = tier.slot_of(s.parent)
            if p is not None and tier.children(s.parent) == 0:
                self._push(t, p)
        return s

    def _take(self, t: int) -> int | None:
        tier = self.tiers[t]
        if tier.free:
            return tier.free.pop()
        candidates = [i for i in tier.slots if tier.evictable(i)]
        if not candidates:
            return None
        victim = min(candidates, key=lambda i: tier.slots[i].rank)
        s = self._remove(t, victim)
        tier.counters["evictions"] += 1
        below = self.tiers[t + 1].counters["stores"] if t + 1 < len(self.tiers) else 0
        self._demote(t, victim, s.key, s.parent, s.tokens, s.meta)
        if t + 1 < len(self.tiers) and self.tiers[t + 1].counters["stores"] > below:
            tier.counters["demotions"] += 1
        return victim

    def _demote(self, t: int, src: int, key: bytes, parent: bytes | None, tokens: tuple, meta: Meta) -> None:
        nxt = t + 1
        if nxt >= len(self.tiers) or self.tiers[nxt].slot_of(key) is not None:
            return
        tier = self.tiers[nxt]
        if tier.write != "on_evict":
            return
        if meta.hits < tier.min_hits or not tier.reused_enough(key):
            tier.counters["filtered"] += 1
            return
        self._store(nxt, t, src, key, parent, tokens, meta)

    def _store(self, t: int, src_tier: int, src: int, key: bytes, parent: bytes | None, tokens: tuple, meta: Meta) -> None:
        i = self._take(t)
        tier = self.tiers[t]
        if i is None:
            tier.counters["refused"] += 1
            return
        tier.clock += 1
        tier.slots[i] = Slot(key, parent, Meta(**vars(meta)), tier.clock, tier.clock, tokens if self.keep_tokens else ())
        self.transfers.append((src_tier, src, t, i))
        tier.counters["stores"] += 1
        self._push(t, i)

    def _count_use(self, key: bytes) -> None:
        for tier in self.tiers:
            if tier.reuse.enabled:
                k = ghost_key(key)
                tier.reuse.put(k, tier.reuse.peek(k) + 1)

    # -- the native API ------------------------------------------------------------------
    def device_cached(self, blocks: list[int], keys: list[bytes], parent: bytes | None, tokens: list[int],
                      depth: int, request_tokens: int) -> None:  # fmt: skip
        bs = self.block_size
        for j, (b, key) in enumerate(zip(blocks, keys)):
            up = keys[j - 1] if j else parent
            if b in self.device:
                continue
            toks = tuple(tokens[j * bs : (j + 1) * bs])
            meta = Meta(0, 1, depth, self.traffic, request_tokens)
            self.device[b] = (key, up, meta, toks)
            self._count_use(key)
            for t, tier in enumerate(self.tiers):
                if tier.write == "write_through" and tier.slot_of(key) is None:
                    if tier.reused_enough(key):
                        self._store(t, DEVICE, b, key, up, toks, meta)
                    else:
                        tier.counters["filtered"] += 1

    def device_cached_named(self, blocks: list[int], parent: bytes, tokens: list[int], depth: int,
                            request_tokens: int) -> None:  # fmt: skip
        """Lineage: each block keeps the name it holds, else takes the name of the tiers'
        copy after the same parent with the same tokens, else a fresh one."""
        bs, up = self.block_size, parent
        for j, b in enumerate(blocks):
            if b in self.device:
                up = self.device[b][0]
                continue
            page = tokens[j * bs : (j + 1) * bs]
            found, keys = self.follow(up, page)
            name = keys if found else self.new_name()
            self.device_cached([b], [name], up, page, depth, request_tokens)
            up = name

    def new_name(self) -> bytes:
        """Lineage: the count of names given, little-endian in key_size bytes."""
        self.names += 1
        return self.names.to_bytes(8, "little")[: self.key_size].ljust(self.key_size, b"\0")

    def admitted(self, tokens: int, blocks: list[int], request_tokens: int) -> int:
        self.traffic += tokens
        depth = 0
        if blocks and blocks[-1] in self.device and self.device[blocks[-1]][2].uses == 1:
            depth = self.device[blocks[-1]][2].depth + 1
        for b in blocks:
            if b not in self.device:
                continue
            key, up, m, toks = self.device[b]
            m.hits += 1
            m.uses += 1
            m.last_use = self.traffic
            m.request_tokens = request_tokens
            m.depth = max(m.depth, depth)
            self._count_use(key)
            for t, tier in enumerate(self.tiers):
                if tier.write == "selective" and m.hits >= tier.min_hits and tier.slot_of(key) is None:
                    if tier.reused_enough(key):
                        self._store(t, DEVICE, b, key, up, toks, m)
                    else:
                        tier.counters["filtered"] += 1
        return depth

    def device_evicted(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self.device:
                continue
            key, up, meta, toks = self.device.pop(b)
            if any(v[0] == key for v in self.device.values()):
                continue
            self._demote(DEVICE, b, key, up, toks, meta)

    def persist(self, t: int) -> int:
        """Copy into keep-on-load tier t what the device, then each tier above, holds and t
        lacks (blocks ascending, slots ascending), at most t's size; the blocks stored."""
        tier = self.tiers[t]
        if not tier.keep_on_load:
            raise ValueError(f"persist: tier {t} does not keep what it loads (only a disk tier persists blocks)")
        sources = [(DEVICE, b, key, up, meta, toks) for b, (key, up, meta, toks) in sorted(self.device.items())]
        sources += [(u, i, s.key, s.parent, s.meta, s.tokens) for u in range(t) for i, s in sorted(self.tiers[u].slots.items())]
        stored = 0
        for src_tier, src, key, parent, meta, tokens in sources:
            if stored >= tier.num_slots or tier.slot_of(key) is not None:
                continue
            before = tier.counters["stores"]
            self._store(t, src_tier, src, key, parent, tokens, meta)
            stored += tier.counters["stores"] - before
        return stored

    def locate(self, key: bytes) -> tuple[int, int] | None:
        for t, tier in enumerate(self.tiers):
            i = tier.slot_of(key)
            if i is not None:
                return (t, i)
        return None

    def parents_in_use(self, names: bytes, key_size: int) -> list[bool]:
        """For each packed name: whether a device block or a slot names it as its parent."""
        parents = {up for _, up, _, _ in self.device.values()}
        parents |= {s.parent for tier in self.tiers for s in tier.slots.values()}
        return [names[i : i + key_size] in parents for i in range(0, len(names), key_size)]

    def follow(self, parent: bytes, tokens: list[int]) -> tuple[list[tuple[int, int]], bytes]:
        """Lineage: each whole block of `tokens` after the block keyed `parent`, found by
        its parent's key and its token ids (the highest tier first), up to the first
        held nowhere; and the found keys, packed."""
        found: list[tuple[int, int]] = []
        keys = b""
        up = parent
        for at in range(0, len(tokens), self.block_size):
            page = tuple(tokens[at : at + self.block_size])
            where = None
            for t, tier in enumerate(self.tiers):  # the highest tier first; in it, the earliest stored
                held = [(s.created, i) for i, s in tier.slots.items() if s.parent == up and s.tokens == page]
                if held:
                    where = (t, min(held)[1])
                    break
            if where is None:
                break
            found.append(where)
            up = self.tiers[where[0]].slots[where[1]].key
            keys += up
        return found, keys

    def pin(self, slots: list[tuple[int, int]]) -> None:
        for t, i in slots:
            self.tiers[t].slots[i].pins += 1

    def unpin(self, slots: list[tuple[int, int]]) -> None:
        for t, i in slots:
            self.tiers[t].slots[i].pins -= 1
            self._push(t, i)

    def load(self, sources: list[tuple[int, int]], dst: list[int], promote: bool = True) -> None:
        for (t, i), b in zip(sources, dst):
            tier = self.tiers[t]
            s = tier.slots[i]
            self.transfers.append((t, i, DEVICE, b))
            tier.counters["loads"] += 1
            self.device[b] = (s.key, s.parent, Meta(**vars(s.meta)), s.tokens)
            if promote:
                self._promote(t, i)

    def finish_loads(self, sources: list[tuple[int, int]]) -> None:
        for t, i in sources:
            self._promote(t, i)

    def _promote(self, t: int, i: int) -> None:
        tier = self.tiers[t]
        s = tier.slots[i]
        s.pins -= 1
        if tier.write == "on_evict" and not tier.keep_on_load:
            if s.pins > 0:
                return
            self._remove(t, i)
            tier.free.append(i)
        else:
            tier.clock += 1
            s.stamp = tier.clock
            self._push(t, i)

    def drop(self, t: int, i: int, failed_write: bool) -> None:
        tier = self.tiers[t]
        if i not in tier.slots:
            return
        self._remove(t, i)
        tier.free.append(i)
        tier.counters["refused" if failed_write else "errors"] += 1

    def drain_transfers(self) -> list[tuple[int, int, int, int]]:
        out, self.transfers = self.transfers, []
        return out
