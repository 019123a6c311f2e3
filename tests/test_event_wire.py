"""The KV event wire codec: vLLM 0.33's msgpack layout, written out by hand and compared.

The expected payloads are plain lists and dicts in the order vLLM 0.33's
`vllm/distributed/kv_events.py` declares its msgspec structs (a batch is an array,
`array_like=True`; an event a map tagged "type", defaults omitted), compared after
decoding (msgspec writes a struct's map header in its 16-bit form, a dict's in the
shortest); byte parity with vLLM's own encoder is `benchmarks/vllm_wire_parity.py`.
"""

from __future__ import annotations

import hashlib

import pytest

msgspec = pytest.importorskip("msgspec")

from prefixcache.event_wire import (  # noqa: E402
    END_SEQ,
    KVEventBatch,
    WireFormatError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    external_block_hash,
)
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

D0, D1 = hashlib.sha256(b"block 0").digest(), hashlib.sha256(b"block 1").digest()


def low64(digest: bytes) -> int:
    return int.from_bytes(digest[-8:], "big")


def stored(**kw) -> BlockStored:
    fields = dict(block_hashes=(D0, D1), parent_block_hash=None, token_ids=tuple(range(8)), block_size=4,
                  extra_keys=(None, None), group_idx=0, kv_cache_spec_kind="full_attention")
    return BlockStored(**{**fields, **kw})


def test_a_batch_is_vllms_array_of_ts_events_rank_with_tagged_maps():
    events = [stored(), BlockRemoved((D1,), group_idx=0), AllBlocksCleared()]
    want = [
        12.5,
        [
            {"type": "BlockStored", "block_hashes": [low64(D0), low64(D1)], "parent_block_hash": None,
             "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
             "extra_keys": [None, None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
            {"type": "BlockRemoved", "block_hashes": [low64(D1)], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    got = msgspec.msgpack.decode(encode_batch(events, ts=12.5, data_parallel_rank=0))
    assert got == want
    assert [list(e) for e in got[1]] == [list(e) for e in want[1]]  # keys in vLLM's order
    # No rank: nil (msgspec's omit_defaults does not shorten an array-like struct).
    assert msgspec.msgpack.decode(encode_batch(events, ts=12.5)) == [*want[:2], None]


def test_fields_at_their_default_are_omitted_and_set_ones_follow_vllms_order():
    event = stored(parent_block_hash=D0, lora_id=3, lora_name="ad", extra_keys=(("ad", "salt"), ("ad",)),
                   group_idx=None, kv_cache_spec_kind=None, session_id="s1", lookahead_token_ids=((9,), (10,)))
    [got] = msgspec.msgpack.decode(encode_batch([event], ts=0.0))[1]
    assert list(got) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                         "lora_name", "extra_keys", "session_id", "lookahead_token_ids"]
    assert got["parent_block_hash"] == low64(D0) and got["extra_keys"] == [["ad", "salt"], ["ad"]]


def test_block_hashes_are_the_low_64_bits_big_endian_or_the_digest():
    assert external_block_hash(D0) == int.from_bytes(D0, "big") & (2**64 - 1) == low64(D0)
    assert external_block_hash(D0, int_block_hashes=False) == D0
    assert external_block_hash(12345) == 12345  # already in wire form
    raw = decode_batch(encode_batch([stored()], ts=1.0, int_block_hashes=False))
    assert raw.events[0].block_hashes == (D0, D1)


def test_decode_gives_back_the_projects_events():
    events = (stored(lora_id=2, lora_name="x", locality="LOCAL", ownership="o", kv_cache_spec_sliding_window=128,
                     lookahead_token_ids=((1, 2), (3, 4))),
              BlockRemoved((D0, D1), medium="CPU", group_idx=1, locality="REMOTE"), AllBlocksCleared())
    batch = decode_batch(encode_batch(events, ts=99.0, data_parallel_rank=2))
    assert batch == KVEventBatch(99.0, (
        stored(block_hashes=(low64(D0), low64(D1)), lora_id=2, lora_name="x", locality="LOCAL", ownership="o",
               kv_cache_spec_sliding_window=128, lookahead_token_ids=((1, 2), (3, 4))),
        BlockRemoved((low64(D0), low64(D1)), medium="CPU", group_idx=1, locality="REMOTE"),
        AllBlocksCleared(),
    ), 2)


def test_fields_a_newer_publisher_appends_are_skipped_and_missing_required_ones_named():
    newer = [2.0, [{"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "tier_hint": "hbm"}], 0]
    assert decode_batch(msgspec.msgpack.encode(newer)).events == (BlockRemoved((7,), medium="GPU"),)
    older = [1.0, [{"type": "BlockStored", "block_hashes": [7], "parent_block_hash": None, "token_ids": [1, 2],
                    "block_size": 2, "lora_id": None, "medium": "GPU"}]]  # no lora_name: before vLLM 0.33's shape
    with pytest.raises(WireFormatError, match="missing required field `lora_name`"):
        decode_batch(msgspec.msgpack.encode(older))


@pytest.mark.parametrize("payload", [b"", b"\x93\x01", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
                                     msgspec.msgpack.encode({"ts": 1.0, "events": []})])
def test_anything_else_is_a_wire_format_error(payload):
    with pytest.raises(WireFormatError, match="not a vLLM KVEventBatch payload"):
        decode_batch(payload)


def test_sequence_frames():
    assert encode_seq(0) == bytes(8) and encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(2**63 - 1)) == 2**63 - 1 and decode_seq(END_SEQ) == -1
    for bad in (-1, 2**63, 1.0, True):
        with pytest.raises(ValueError, match="sequence number"):
            encode_seq(bad)
    with pytest.raises(WireFormatError, match="8 bytes"):
        decode_seq(b"\x00" * 4)
    with pytest.raises(TypeError, match="not a KV event"):
        encode_batch(["BlockStored"], ts=0.0)
