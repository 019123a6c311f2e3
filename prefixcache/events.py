"""KV-cache events: what a cache tells the outside world about the blocks it holds.

Owns the event value types, shaped like vLLM 0.33's `vllm.distributed.kv_events` (same
names, same fields in the same order) so a router or KV-aware load balancer written for
vLLM reads ours, and `EventLog`, the bounded buffer a backend appends to and
`drain_events()` empties (`NullEventLog` when events are off; `event_log` picks).
Backends put the raw digest bytes in `block_hashes`; an event decoded from the wire
(`prefixcache.event_wire`) carries what the publisher sent, by default vLLM's int form
(`BlockHash`).

Must never: compute hashes, decide when an event happens (backends do both), or
encode events for the wire (`event_wire` does). The `radix` backend reports pages with
the same chained block hash as `hash`, so one consumer serves both strategies.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prefixcache.isolation import Isolation

__all__ = [
    "KVEvent",
    "BlockHash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "EventLog",
    "NullEventLog",
    "event_log",
    "MEDIUM_GPU",
    "FULL_ATTENTION",
    "EVENT_LOG_CAPACITY",
    "event_extra_keys",
    "event_lora",
]

MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
"""vLLM's `KVCacheSpecKind.FULL_ATTENTION`: the one KV cache group both backends have."""

EVENT_LOG_CAPACITY = 100_000
"""Events an `EventLog` holds before it drops the oldest (vLLM's publisher queue size)."""

BlockHash = bytes | int
"""A block hash in an event: the digest bytes (what backends record, and the wire with
`int_block_hashes: false`) or its low 64 bits as an int, big-endian (vLLM's default wire
form, `ExternalBlockHash`)."""

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEvent:
    """Base of every KV-cache event."""


@dataclass(frozen=True)
class BlockStored(KVEvent):
    """A run of consecutive full blocks became hittable.

    `block_hashes[i]` is the chained hash of the i-th block; `parent_block_hash` is the
    hash of the block before the first one (None at the start of a sequence);
    `token_ids` are the tokens of all the blocks, `block_size` per block; `lora_id` and
    `lora_name` name the adapter (`LoRA.id`, `LoRA.name`); `extra_keys` has one entry
    per block: the extra keys hashed into it in vLLM's published form
    (`event_extra_keys`: a namespace "a" on the first block is `("a",)`), or None.
    Both backends set `group_idx=0` and `kv_cache_spec_kind="full_attention"` (one
    full-attention KV cache group); the fields after it exist so that an event from a
    vLLM server decodes whole, and our backends leave them None.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class BlockRemoved(KVEvent):
    """Blocks stopped being hittable (evicted or reused)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared(KVEvent):
    """The whole cache was reset. (`medium` is ours: vLLM's event has no field, so it
    does not cross the wire.)"""

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


def event_lora(namespace: object) -> tuple[int | None, str | None]:
    """`(lora_id, lora_name)` of a canonical namespace, as `BlockStored` carries them
    (vLLM: the adapter's int id and its name; `(None, None)` without an adapter)."""
    if isinstance(namespace, Isolation) and namespace.lora is not None:
        return namespace.lora.id, namespace.lora.name
    return None, None


class EventLog:
    """Ordered, bounded buffer of events (`NullEventLog` is the disabled form).

    Holds at most `capacity` events (default `EVENT_LOG_CAPACITY`): when full, recording drops the OLDEST event and
    counts it in `dropped` (logged once, as a warning), so a cache whose events nobody
    drains cannot grow without bound. A consumer that sees `dropped` move has missed
    events and must rebuild its view (a reset is the only full resynchronisation).

    `record_from(build, *args)` records the events `build(*args)` returns: a backend
    hands over how to make its events, so that a disabled log never makes them.
    """

    __slots__ = ("capacity", "dropped", "_events")

    #: Whether the log records (a `NullEventLog` does not).
    enabled = True

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is None:
            capacity = EVENT_LOG_CAPACITY
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.dropped = 0
        self._events: deque[KVEvent] = deque(maxlen=capacity)

    def record(self, event: KVEvent) -> None:
        if len(self._events) == self.capacity:
            if not self.dropped:
                _log.warning(
                    "KV event log full (%d events, nothing drains it): dropping the oldest; "
                    "drain_events() regularly, or build the cache with enable_events=False",
                    self.capacity,
                )
            self.dropped += 1
        self._events.append(event)

    def record_from(self, build: Callable[..., Iterable[KVEvent]], *args: Any) -> None:
        """Record each event of `build(*args)`, in order."""
        for event in build(*args):
            self.record(event)

    def drain(self) -> list[KVEvent]:
        """Events since the last drain, oldest first; the log is left empty."""
        events = list(self._events)
        self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)


class NullEventLog:
    """A disabled `EventLog`: records nothing, never calls a `record_from` builder, and
    costs one call per recording site."""

    __slots__ = ()

    enabled = False
    dropped = 0

    def record(self, event: KVEvent) -> None:
        pass

    def record_from(self, build: Callable[..., Iterable[KVEvent]], *args: Any) -> None:
        pass

    def drain(self) -> list[KVEvent]:
        return []

    def __len__(self) -> int:
        return 0


def event_log(enabled: bool, capacity: int | None = None) -> EventLog | NullEventLog:
    """A cache's log: an `EventLog` when `enable_events` is set, else the `NullEventLog`."""
    return EventLog(capacity) if enabled else NullEventLog()
