"""KV events on the wire, byte for byte as vLLM 0.33 publishes them.

Owns the msgspec schema of vLLM 0.33's `vllm/distributed/kv_events.py` (`KVEventBatch`
and the tagged `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, field for field and
in vLLM's order), the conversion between those structs and the project's event types
(`prefixcache.events`), the block-hash wire form (vLLM's `maybe_convert_block_hash`), and
the framing of the ZeroMQ stream (8-byte big-endian sequence numbers, the replay end
marker). `KVEventBatch` is the decoded batch, in the project's types.

What goes on the wire (vLLM 0.33):
- a batch is a msgpack ARRAY `[ts, events, data_parallel_rank]` (`array_like=True`;
  vLLM's publisher always fills in the rank, 0 for a single engine);
- an event is a msgpack MAP whose first key is `"type"` (the class name: msgspec's
  tagged union), then the fields in declaration order, each omitted while it equals
  its default; `BlockStored.lora_id`, `medium` and `lora_name` and
  `BlockRemoved.medium` have no default, so they are always there (nil when None);
- a block hash is by default the low 64 bits of the digest, big-endian, as an int
  (`int_block_hashes=False`: the digest bytes).

Must never: touch a socket (`prefixcache.serve.publisher` and `event_subscriber` do), or
be imported by `import prefixcache`: it needs msgspec (`pip install 'prefixcache[events]'`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

try:
    import msgspec
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "prefixcache.event_wire needs msgspec (vLLM's event encoder): pip install 'prefixcache[events]'"
    ) from err

from prefixcache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "KVEventBatch",
    "WireFormatError",
    "END_SEQ",
    "encode_batch",
    "decode_batch",
    "encode_seq",
    "decode_seq",
    "external_block_hash",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence frame of the replay socket's end-of-replay marker (vLLM's `END_SEQ`)."""

_LOW_64 = (1 << 64) - 1


class WireFormatError(ValueError):
    """A payload or frame that is not a vLLM 0.33 KV event message."""


@dataclass(frozen=True)
class KVEventBatch:
    """One published batch: the events of one engine step, oldest first.

    ts:                 wall-clock SECONDS (time.time()) when the step published it
    events:             the project's event types, block hashes as they were sent
    data_parallel_rank: the publisher's data-parallel rank (None if it sent none)
    """

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# -- vLLM 0.33's structs (same names on the wire: the tag is the class name) ----------


class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _BlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _AllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


class _KVEventBatch(_EventBatch):
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_KVEventBatch)


# -- conversion ---------------------------------------------------------------------


def external_block_hash(block_hash: BlockHash, int_block_hashes: bool = True) -> BlockHash:
    """A block hash in its wire form: the low 64 bits of the digest read big-endian
    (vLLM's default), or the digest bytes unchanged. An int is already in wire form."""
    if isinstance(block_hash, int) or not int_block_hashes:
        return block_hash
    return int.from_bytes(block_hash, "big") & _LOW_64


# Our event types and their wire structs: the same field names (ours may have more).
_WIRE: dict[type, type] = {BlockStored: _BlockStored, BlockRemoved: _BlockRemoved, AllBlocksCleared: _AllBlocksCleared}
_OURS = {wire: ours for ours, wire in _WIRE.items()}


def _to_wire(event: KVEvent, as_int: bool) -> _KVCacheEvent:
    """Our event as its wire struct: its fields by name, block hashes in wire form
    (tuples go out as msgpack arrays, as lists would)."""
    wire = _WIRE.get(type(event))
    if wire is None:
        raise TypeError(f"not a KV event: {type(event).__name__} {event!r}")
    fields = {name: getattr(event, name) for name in wire.__struct_fields__}
    if "block_hashes" in fields:
        fields["block_hashes"] = [external_block_hash(h, as_int) for h in fields["block_hashes"]]
    if fields.get("parent_block_hash") is not None:
        fields["parent_block_hash"] = external_block_hash(fields["parent_block_hash"], as_int)
    return wire(**fields)


def _tuples(value: Any) -> Any:
    """Decoded msgpack arrays as the tuples our frozen event types hold."""
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


def _from_wire(event: _KVCacheEvent) -> KVEvent:
    """A decoded wire struct as our event type (fields it lacks take our defaults)."""
    return _OURS[type(event)](**{name: _tuples(getattr(event, name)) for name in event.__struct_fields__})


# -- batches and frames ---------------------------------------------------------------


def encode_batch(
    events: Sequence[KVEvent],
    *,
    ts: float,
    data_parallel_rank: int | None = None,
    int_block_hashes: bool = True,
) -> bytes:
    """The msgpack payload of one `KVEventBatch`, exactly as vLLM 0.33's publisher
    encodes it (module docstring). `ts` is wall-clock SECONDS."""
    wire = _KVEventBatch(
        ts=ts, events=[_to_wire(e, int_block_hashes) for e in events], data_parallel_rank=data_parallel_rank
    )
    return _encoder.encode(wire)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload from a vLLM 0.33 (or prefixcache) publisher, in the project's types.

    Fields this schema does not know are skipped (msgspec's default), so a newer
    publisher that appends fields still decodes; anything else malformed is a
    `WireFormatError` naming what msgspec found wrong."""
    try:
        wire = _decoder.decode(payload)
    except msgspec.DecodeError as err:
        raise WireFormatError(f"not a vLLM KVEventBatch payload ({len(payload)} bytes): {err}") from None
    return KVEventBatch(wire.ts, tuple(_from_wire(e) for e in wire.events), wire.data_parallel_rank)


def encode_seq(seq: int) -> bytes:
    """A sequence number as the 8-byte big-endian frame vLLM sends (0 <= seq < 2**63)."""
    if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < 1 << 63:
        raise ValueError(f"a sequence number must be an int in [0, 2**63), got {seq!r}")
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number of an 8-byte frame (END_SEQ reads as -1); WireFormatError
    for a frame of another length."""
    if len(frame) != 8:
        raise WireFormatError(f"a sequence frame is 8 bytes, got {len(frame)}: {bytes(frame[:16])!r}")
    return int.from_bytes(frame, "big", signed=True)
