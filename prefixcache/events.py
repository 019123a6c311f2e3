"""KV-cache events: what a cache tells the outside world about the blocks it holds.

Owns the event value types, shaped like vLLM's `vllm.distributed.kv_events` (same
names, same fields, block hashes as the raw digest bytes) so a router or KV-aware
load balancer written for vLLM reads ours, and `EventLog`, the buffer a backend
appends to and `drain_events()` empties.

Must never: compute hashes or decide when an event happens; backends do both. The
`radix` backend reports pages with the same chained block hash as `hash`, so one
consumer serves both strategies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "KVEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "EventLog",
    "MEDIUM_GPU",
    "event_extra_keys",
]

MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class KVEvent:
    """Base of every KV-cache event."""


@dataclass(frozen=True)
class BlockStored(KVEvent):
    """A run of consecutive full blocks became hittable.

    `block_hashes[i]` is the chained hash of the i-th block; `parent_block_hash` is the
    hash of the block before the first one (None at the start of a sequence);
    `token_ids` are the tokens of all the blocks, `block_size` per block; `extra_keys`
    has one entry per block: the extra keys hashed into it in vLLM's published form
    (`event_extra_keys`: a namespace "a" on the first block is `("a",)`), or None.
    """

    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None


@dataclass(frozen=True)
class BlockRemoved(KVEvent):
    """Blocks stopped being hittable (evicted or reused)."""

    block_hashes: tuple[bytes, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared(KVEvent):
    """The whole cache was reset."""

    medium: str | None = None


def event_extra_keys(extra_keys: tuple[tuple[Any, ...], ...] | None) -> tuple[Any, ...] | None:
    """One block's hash extra keys as vLLM 0.33 publishes them in events.

    Hash extra keys are tagged (`("cache_salt", "a")`, `("mm", id, offset)`); events
    keep the older untagged shape consumers parse: a tag with one value becomes the
    bare value, an "mm" key its `(id, offset)` pair (vLLM `to_event_extra_keys`).
    """
    if extra_keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in extra_keys)


class EventLog:
    """Ordered buffer of events; a disabled log records nothing and costs nothing."""

    __slots__ = ("enabled", "_events")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._events: list[KVEvent] = []

    def record(self, event: KVEvent) -> None:
        if self.enabled:
            self._events.append(event)

    def drain(self) -> list[KVEvent]:
        """Events since the last drain, oldest first; the log is left empty."""
        events, self._events = self._events, []
        return events

    def __len__(self) -> int:
        return len(self._events)
