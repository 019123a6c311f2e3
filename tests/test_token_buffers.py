"""Tokens cross into native code once, as a buffer, and every hash algorithm is
native with the reference's digests.

Scenarios: each buffer form a caller may hold gives exactly what the same list gives
(numpy of every integer width, strided, byte-swapped, array.array, an integer
memoryview), the forms that are not token ids are refused with the field named, both
backends keep a typed buffer and hand out BlockIds, TokenRuns expand in C++, all four
algorithms match the Python reference (pickle memo references in extra keys included),
and the replay benchmark runs on a generated trace.
"""

from __future__ import annotations

import random
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest

import prefixcache
from prefixcache import _C
from prefixcache.config import CacheConfig
from prefixcache.hashing import chain_digests, none_hash, reference_chain_hashes
from prefixcache.protocol import BlockIds
from prefixcache.workloads import TokenRuns
from prefixcache.workloads.mooncake import synthetic_records, write_records

IDS = [0, 5, 255, 256, 70000, 2**31 - 1]


@pytest.mark.parametrize(
    "form",
    [
        np.array(IDS, dtype=np.int64),
        np.array(IDS, dtype=np.uint32),
        np.array(IDS, dtype=">i8"),  # big-endian: swapped while read
        np.array([IDS, IDS], dtype=np.int64)[:, ::1][0],
        np.array([x for i in IDS for x in (i, -7)], dtype=np.int64)[::2],  # strided
        array("q", IDS),
        array("l", IDS),
        memoryview(array("q", IDS)),
        tuple(IDS),
    ],
)
def test_every_buffer_form_reads_as_the_list(form):
    assert _C.token_array(form).tolist() == IDS
    assert _C.token_array(form, "tokens", 4).tolist() == IDS


def test_small_widths_and_unsigned_read_exactly():
    assert _C.token_array(np.array([-3, 127], dtype=np.int8)).tolist() == [-3, 127]
    assert _C.token_array(np.array([65535], dtype=np.uint16)).tolist() == [65535]
    assert _C.token_array(np.array([2**64 - 1], dtype=np.uint64)) is None  # beyond int64: the caller's bignum path


@pytest.mark.parametrize(
    "bad,message",
    [
        (np.array([True, False]), r"tokens\[0\]: expected an int token id; got bool True"),
        (np.array([1.5]), r"tokens\[0\]: expected an int token id; got float 1.5"),
        (b"ab", "tokens: expected a sequence of int token ids"),
        (bytearray(b"ab"), "tokens: expected a sequence of int token ids"),
        (np.zeros((2, 2), dtype=np.int64), "tokens: expected a sequence of int token ids"),
    ],
)
def test_non_token_buffers_are_refused(bad, message):
    with pytest.raises(TypeError, match=message):
        _C.token_array(bad)


def test_int32_range_is_checked_in_buffers_too():
    with pytest.raises(ValueError, match=r"tokens\[1\]: expected an int32 token id .*got int 2147483648"):
        _C.token_array(np.array([1, 2**31]), "tokens", 4)


def test_token_runs_expand_in_cpp():
    runs = TokenRuns(((3, 6), (10, 12)))
    assert runs.to_array().tolist() == runs.tolist() == [3, 4, 5, 10, 11]
    assert runs.to_array(4).typecode == "i" and runs.to_array().typecode == "q"


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_backends_keep_typed_buffers_and_hand_out_block_ids(backend):
    cache = prefixcache.build_cache(CacheConfig(backend=backend, block_size=4, num_blocks=32))
    prompt = np.arange(1, 14, dtype=np.int32)
    adm = cache.admit("a", prompt)
    assert isinstance(adm.block_table, BlockIds) and adm.block_table == tuple(adm.block_table)
    assert isinstance(cache._requests.get("a").tokens, array)
    cache.commit("a", 13)
    cache.append("a", memoryview(array("q", [20, 21])))
    cache.commit("a", 15)
    cache.release("a")
    again = cache.admit("b", array("q", [*range(1, 14), 20, 21, 22]))
    assert again.num_cached_tokens == 12
    assert again.block_table[:2] == cache.block_table("b")[:2] == list(again.block_table[:2])
    cache.release("b")
    cache.check_invariants()


@pytest.mark.parametrize("algorithm", ["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"])
def test_native_digests_equal_the_reference(algorithm):
    rng = random.Random(algorithm)
    widths = [0, 23, 24, 255, 256, 65535, 65536, -1, -129, 2**31, -(2**31) - 1, 2**40, -(2**40), 2**63 - 1, -(2**63)]
    salt = "cache_salt"  # the same str object as the tag: pickle writes a memo reference
    extras = [(None, None), ((("cache_salt", "a"),), None), ((("lora", "x", "x"), ("cache_salt", salt)), (("lora", "x", "x"),))]
    root = none_hash(algorithm, "seed")
    for bs in (1, 3, 4, 16):
        tokens = [rng.choice(widths) for _ in range(bs * 4 + 1)]
        for first, later in extras:
            want = b"".join(reference_chain_hashes(tokens, bs, algorithm, root, first, later))
            assert chain_digests(tokens, bs, algorithm, root, first, later) == want
            assert chain_digests(np.array(tokens, dtype=np.int64), bs, algorithm, root, first, later) == want


def test_pickle_links_beyond_one_frame_fall_back_to_the_reference():
    tokens = [70000] * 8000  # 5 bytes each: one link of 40 kB, two blocks -> within a frame
    root = none_hash("sha256", "seed")
    assert chain_digests(tokens, 4000, "sha256", root) == b"".join(reference_chain_hashes(tokens, 4000, "sha256", root))
    big = [70000] * 14000  # one 70 kB link: pickle splits frames; the reference hashes it
    assert chain_digests(big, 14000, "sha256", root) == b"".join(reference_chain_hashes(big, 14000, "sha256", root))


def test_replay_speed_runs_on_a_generated_trace(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(40, seed=1))
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "replay_speed.py"
    out = subprocess.run([sys.executable, str(script), "--trace", str(trace), "--repeat", "1", "--capacity-tokens",
                          "100000"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "replay_arm hash/512" in out.stdout and "x hashing floor" in out.stdout
