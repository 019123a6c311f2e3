"""The tier event soak: random protocol operations on a cache with lower tiers, its KV
events carried over vLLM's wire format to a KV index that keeps per-tier residency, and
that residency compared with the cache's own, block by block.

Owns `soak_tier_events`: a seeded stream of admissions (many sharing prefixes, so hits
land on every tier), commits, releases and evictions through any backend built with
`cache.tiers` and events on; after every operation the cache's events are encoded as a
`KVEventBatch` (`prefixcache.event_wire`) and decoded again, as a subscriber receives
them, and applied to a `KVIndex(lower_media=...)`; every `check_every` operations the
index must hold, per medium, exactly the blocks the cache holds there (the device pool's
cached blocks, counted per copy; each tier's slots), and nothing else. Used by
tests/test_tier_events.py (a few thousand operations) and benchmarks/soak_tier_events.py
(10^6 and more).

Must never: look at the index's answers to decide what the cache does, or skip a
divergence: the first one raises, naming the operation and the medium.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prefixcache import build_cache
from prefixcache._C import block_hash_int
from prefixcache.cluster.kv_index import KVIndex
from prefixcache.config import CacheConfig
from prefixcache.event_wire import decode_batch, encode_batch
from prefixcache.protocol import PrefixCache

__all__ = ["SoakResult", "soak_tier_events", "residency"]


@dataclass(frozen=True)
class SoakResult:
    operations: int
    events: int
    checks: int
    tier_hits: int  # admissions that loaded from a lower tier
    stored_lower: int  # BlockStored events of a lower medium


def residency(cache: PrefixCache) -> dict[str, dict[int, int]]:
    """What the cache holds per medium: {medium: {int block hash: copies}}."""
    out: dict[str, dict[int, int]] = {"GPU": {}}
    device = out["GPU"]
    pool = cache.pool
    page_hash = getattr(cache, "_page_hash", None)
    if page_hash is not None:  # radix: its pages' hashes
        for h in page_hash.values():
            k = block_hash_int(h)
            device[k] = device.get(k, 0) + 1
    else:
        for b in range(pool.num_blocks):
            key = pool.key(b)
            if key is not None:
                k = block_hash_int(key)
                device[k] = device.get(k, 0) + 1
    tiers = cache.tiers
    for t, spec in enumerate(cache.config.tiers):
        held = out.setdefault(spec.event_medium, {})
        for slot in tiers.native.used_slots(t):
            k = block_hash_int(tiers.native.slot_key(t, slot))
            held[k] = held.get(k, 0) + 1
    return out


def _check(index: KVIndex, cache: PrefixCache, what: str) -> None:
    for medium, held in residency(cache).items():
        blocks, copies = index.held_on(medium, 0)
        if (blocks, copies) != (len(held), sum(held.values())):
            raise AssertionError(
                f"{what}: on {medium} the index holds {blocks} blocks ({copies} copies), the cache {len(held)} "
                f"({sum(held.values())})"
            )
        for h, n in held.items():
            if index.holds_on(medium, h, 0) != n:
                raise AssertionError(f"{what}: on {medium} block {h:#x}: the index holds "
                                     f"{index.holds_on(medium, h, 0)} copies, the cache {n}")  # fmt: skip


def soak_tier_events(config: CacheConfig, operations: int, *, seed: int = 0, check_every: int = 1) -> SoakResult:
    """Run `operations` random operations through a cache built from `config` (which has
    tiers; events are turned on), checking the index rebuilt from its events (module
    docstring)."""
    cache = build_cache(config.replace(enable_events=True))
    media = tuple(t.event_medium for t in config.tiers)
    index = KVIndex(lower_media=media)
    index.add_replica(0)
    rng = random.Random(seed)
    bs = config.block_size
    prefixes = [[rng.randrange(1000) for _ in range(bs * rng.randrange(1, 6))] for _ in range(24)]
    live: list[int] = []
    length: dict[int, int] = {}  # tokens of each live request
    next_id = events = checks = tier_hits = stored_lower = 0
    for op in range(operations):
        roll = rng.random()
        if roll < 0.45 or not live:
            prompt = list(rng.choice(prefixes)) + [rng.randrange(1000) for _ in range(rng.randrange(1, 2 * bs))]
            adm = cache.admit(next_id, prompt)
            if adm is not None:
                tier_hits += bool(adm.loads)
                cache.commit(next_id, len(prompt))
                live.append(next_id)
                length[next_id] = len(prompt)
            next_id += 1
        elif roll < 0.85:
            cache.release(live.pop(rng.randrange(len(live))))
        elif roll < 0.95:
            rid = rng.choice(live)
            extra = [rng.randrange(1000) for _ in range(rng.randrange(1, bs + 1))]
            if cache.append(rid, extra) is not None:
                length[rid] += len(extra)
                cache.commit(rid, length[rid])
        else:
            cache.evict(rng.randrange(1, 4))
        cache.drain_transfers()
        batch = cache.drain_events()
        if batch:
            events += len(batch)
            stored_lower += sum(1 for e in batch if getattr(e, "medium", "GPU") not in ("GPU", None)
                                and type(e).__name__ == "BlockStored")  # fmt: skip
            wire = decode_batch(encode_batch(batch, ts=float(op)))
            index.apply(0, wire.events)
        if (op + 1) % check_every == 0:
            _check(index, cache, f"after operation {op}")
            checks += 1
    for rid in live:
        cache.release(rid)
    index.apply(0, decode_batch(encode_batch(cache.drain_events(), ts=float(operations))).events)
    _check(index, cache, "after the last release")
    cache.check_invariants()
    return SoakResult(operations, events, checks + 1, tier_hits, stored_lower)
