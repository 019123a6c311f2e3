"""Cache statistics: what a cache counts, in vLLM's `PrefixCacheStats` terms.

Owns `CacheStats` (a frozen snapshot that `PrefixCache.stats()` returns) and
`StatsCounter` (the mutable counters a backend bumps). Counts are cumulative since
construction or the last `reset()`.

Must never: time anything or decide what counts as a hit; the backends do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

__all__ = ["CacheStats", "StatsCounter"]


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
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    evictions: int = 0
    rejected: int = 0
    verify_failures: int = 0
    events_dropped: int = 0

    @property
    def hit_rate(self) -> float:
        """Token hit ratio hits / queries (0.0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class StatsCounter:
    """Mutable counters behind `CacheStats`; backends bump the fields directly."""

    __slots__ = tuple(f.name for f in fields(CacheStats))

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

    def snapshot(self) -> CacheStats:
        return CacheStats(**{name: getattr(self, name) for name in self.__slots__})
