"""Cache statistics: what a cache counts, in vLLM's `PrefixCacheStats` terms.

Owns `CacheStats` (a frozen snapshot that `PrefixCache.stats()` returns) and
`StatsCounter` (the mutable counters a backend bumps). Counts are cumulative since
construction or the last `reset()`.

Must never: time anything or decide what counts as a hit; the backends do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["CacheStats", "StatsCounter", "TierStats"]


@dataclass(frozen=True)
class TierStats:
    """Counters of one lower tier (`CacheStats.tiers`), since construction or reset.

    medium:        the tier's medium as events name it (CPU, STORAGE)
    hit_tokens:    prompt TOKENS admissions found in this tier (loaded or declined)
    loaded_tokens: of those, TOKENS loaded to the device (the rest were declined by
                   the cost model, or their block failed its checksum)
    loads:         BLOCKS loaded from the tier to the device
    stores:        BLOCKS written into it (demoted, written through, copied)
    evictions:     BLOCKS it dropped or moved down to make room
    demotions:     of those, BLOCKS moved down to the next tier
    refused:       stores refused: no slot could be freed, or the write failed (a full disk)
    errors:        BLOCKS found bad when read (checksum, truncation): misses, never KV
    filtered:      BLOCKS the tier's admission filter kept out: offered (demoted from
                   above, written through, copied) before `store_threshold` requests used
                   them, or demoted to an on_evict tier with fewer than `min_hits` hits
    bytes_written: BYTES of KV stored into it (stores x block bytes of the cost model,
                   or of the engine's model)
    used_blocks:   BLOCKS it holds now
    """

    medium: str
    hit_tokens: int = 0
    loaded_tokens: int = 0
    loads: int = 0
    stores: int = 0
    evictions: int = 0
    demotions: int = 0
    refused: int = 0
    errors: int = 0
    filtered: int = 0
    bytes_written: int = 0
    used_blocks: int = 0


@dataclass(frozen=True)
class CacheStats:
    """Counters of one cache.

    requests:   admissions attempted (vLLM counts each lookup of a new request)
    queries:    prompt tokens looked up, in TOKENS
    hits:       prompt tokens served from the cache, in TOKENS
    evictions:  cached BLOCKS dropped to make room
    rejected:   admissions or appends refused for lack of room
    verify_failures: admissions whose hit stopped at a block found by its hash whose
                recorded tokens or namespace differ from the request's (a hash
                collision, caught by the `hash` backend's hit verification under a
                non-cryptographic hash), or whose partial-hit source was refuted
                the same way; that block and the rest are computed afresh
    events_dropped: KV events the cache's bounded log dropped because nothing drained
                it (`events.EventLog`); counted since construction, not reset
    tiers:      one `TierStats` per lower tier (empty without `cache.tiers`); `hits`
                counts TOKENS from every tier, the device's are hits - their hit_tokens
                loaded
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    rejected: int = 0
    verify_failures: int = 0
    events_dropped: int = 0
    tiers: tuple[TierStats, ...] = ()

    def __repr__(self) -> str:
        shown = [f.name for f in fields(self) if f.name != "tiers" or self.tiers]  # no tiers: as it always read
        return f"CacheStats({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"

    @property
    def hit_rate(self) -> float:
        """Token hit ratio hits / queries (0.0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict[str, float]:
        out = {**asdict(self), "hit_rate": self.hit_rate}
        if not self.tiers:  # a cache without tiers reports what it always did
            del out["tiers"]
        return out


class StatsCounter:
    """Mutable counters behind `CacheStats`; backends bump the fields directly."""

    __slots__ = tuple(f.name for f in fields(CacheStats) if f.name != "tiers")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """One admission that looked up `num_tokens` prompt tokens and hit `num_hit_tokens`."""
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def snapshot(self, tiers: tuple[TierStats, ...] = ()) -> CacheStats:
        return CacheStats(**{name: getattr(self, name) for name in self.__slots__}, tiers=tiers)
