"""Eviction policies: which unpinned cached entry goes first.

Owns the `EvictionPolicy` strategy (one method: map a candidate to a sortable
priority; the LOWEST priority is evicted first) and the built-in policies, each a few
lines, registered by name for `eviction:` in YAML. A candidate is anything with the
attributes of `Candidate`: for `radix` a tree leaf, for other strategies a block.

Must never: walk a tree, touch the pool or keep state of its own. A backend calls
`priority()` once per candidate when it collects candidates for an eviction, never per
comparison, so a Python policy costs one call per candidate, not per operation; the
built-ins name a `native` ordering and are never called back at all.
Recency and creation are logical clocks (counters), so replays are reproducible.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

from prefixcache.registry import register_eviction_policy

__all__ = ["Candidate", "EvictionPolicy", "LRU", "LFU", "FIFO", "MRU", "FILO", "Priority"]


class Candidate(Protocol):
    """What a policy may read about an eviction candidate."""

    last_access_time: int  # logical clock of the last match / insert that touched it
    creation_time: int  # logical clock when it was created
    hit_count: int  # times it was part of a hit
    priority: int  # request priority that last touched it (0 if none)


class EvictionPolicy(ABC):
    """Orders eviction candidates: `priority(c)` smallest is evicted first."""

    name: ClassVar[str] = ""
    #: Name of the native (C++) ordering with the same result, if there is one; the
    #: native tree then never calls `priority()`.
    native: ClassVar[str | None] = None

    @abstractmethod
    def priority(self, candidate: Candidate) -> Any:
        """A sortable key; lower means evicted sooner."""


@register_eviction_policy("lru")
class LRU(EvictionPolicy):
    native = "lru"

    def priority(self, candidate: Candidate) -> Any:
        return candidate.last_access_time


@register_eviction_policy("lfu")
class LFU(EvictionPolicy):
    """Least hits first, then least recent. Unlike SGLang's plain RadixCache (which never
    increments `hit_count`, so its lfu behaves as lru), our backends count hits."""

    native = "lfu"

    def priority(self, candidate: Candidate) -> Any:
        return (candidate.hit_count, candidate.last_access_time)


@register_eviction_policy("fifo")
class FIFO(EvictionPolicy):
    native = "fifo"

    def priority(self, candidate: Candidate) -> Any:
        return candidate.creation_time


@register_eviction_policy("mru")
class MRU(EvictionPolicy):
    native = "mru"

    def priority(self, candidate: Candidate) -> Any:
        return -candidate.last_access_time


@register_eviction_policy("filo")
class FILO(EvictionPolicy):
    native = "filo"

    def priority(self, candidate: Candidate) -> Any:
        return -candidate.creation_time


@register_eviction_policy("priority")
class Priority(EvictionPolicy):
    """Lowest request priority first, then least recent."""

    native = "priority"

    def priority(self, candidate: Candidate) -> Any:
        return (candidate.priority, candidate.last_access_time)
