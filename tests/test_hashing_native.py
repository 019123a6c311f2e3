"""The native sha256_cbor chain against hashlib + cbor2 (the Python reference).

SHA-256 is checked on both implementations (SHA extensions and portable) across every
padding boundary; the CBOR encoding through whole chains on random token ids of every
width CBOR distinguishes, negative ids, empty and huge inputs, odd parents and extra keys.
"""

from __future__ import annotations

import hashlib
import os

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import _C
from prefixcache.hashing import block_hashes, chain_digests, chain_hashes, none_hash, reference_chain_hashes

ROOT = none_hash("sha256_cbor")
SHA256 = [_C.sha256, _C.sha256_portable]


@pytest.mark.parametrize("fn", SHA256, ids=["best", "portable"])
def test_sha256_matches_hashlib_at_every_padding_boundary(fn):
    for n in [*range(0, 200), 1000, 4095, 4096, 4097, 1 << 20]:
        data = os.urandom(n)
        assert fn(data) == hashlib.sha256(data).digest(), n


def test_sha256_reports_its_implementation():
    assert isinstance(_C.sha256_uses_cpu_extensions(), bool)


def reference(tokens, block_size, parent=ROOT, extra=None):
    return reference_chain_hashes(tokens, block_size, "sha256_cbor", parent, extra)


def native(tokens, block_size, parent=ROOT, extra=None):
    return _C.sha256_cbor_chain(tokens, block_size, parent, None if extra is None else cbor2.dumps(extra, canonical=True))


# Every CBOR integer width: inline (< 24), 1, 2, 4 and 8 bytes, on both signs.
int64 = st.one_of(
    st.integers(0, 23),
    st.integers(24, 2**8 - 1),
    st.integers(2**8, 2**16 - 1),
    st.integers(2**16, 2**32 - 1),
    st.integers(2**32, 2**63 - 1),
    st.integers(-(2**63), -1),
    st.sampled_from([2**63 - 1, -(2**63), -1, -24, -25, -256, -257, 2**32, 2**32 - 1]),
    # pickle's widths: BININT1 / BININT2 / BININT (int32) / LONG1
    st.sampled_from([255, 256, 65535, 65536, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1]),
)
extra_keys = st.one_of(
    st.none(),
    st.just(()),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=30).map(lambda s: (("cache_salt", s),)),
    st.tuples(st.tuples(st.just("mm"), st.text(st.characters(exclude_categories=("Cs",)), max_size=5), st.integers(-(2**40), 2**40))),
)


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(int64, max_size=200),
    block_size=st.integers(1, 40),
    parent=st.one_of(st.just(ROOT), st.binary(max_size=300)),
    extra=extra_keys,
)
def test_chain_matches_reference(tokens, block_size, parent, extra):
    assert native(tokens, block_size, parent, extra) == reference(tokens, block_size, parent, extra)


# Runs of consecutive ids (as synthetic traces make them), some crossing a width's edge.
runs = st.lists(
    st.tuples(st.one_of(int64, st.sampled_from([20, 250, 65530, 2**31 - 5, 2**32 - 5, -30, -260, -(2**31) - 3])),
              st.integers(1, 40)),
    max_size=6,
).map(lambda rs: [max(-(2**63), min(2**63 - 1, v + i)) for v, n in rs for i in range(n)])


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.one_of(st.lists(int64, max_size=120), runs),
    block_size=st.integers(1, 40),
    algorithm=st.sampled_from(["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"]),
)
def test_every_algorithm_encodes_every_width_as_the_reference(tokens, block_size, algorithm):
    """The native encoders write a block's leading run of one width at a fixed stride,
    the rest id by id without branching: every width of both encodings (CBOR heads,
    pickle's BININT1/2, BININT, LONG1), in runs that end mid-block and mixed."""
    root = none_hash(algorithm, "s")
    got = _C.chain_digests(tokens, block_size, algorithm, root, None, None, True)
    assert got == b"".join(reference_chain_hashes(tokens, block_size, algorithm, root))


def test_empty_partial_and_huge_inputs():
    assert native([], 16) == [] == reference([], 16)
    assert native(list(range(15)), 16) == []
    big = [(i * 2654435761) % (1 << 40) for i in range(100_000)]
    assert native(big, 16) == reference(big, 16)
    assert native(big, 50_000) == reference(big, 50_000)  # one link far longer than a SHA block
    assert native(tuple(range(64)), 16) == reference(list(range(64)), 16)  # any sequence


def test_ids_beyond_int64_go_to_the_reference():
    for wide in (2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1, -(2**70)):
        tokens = [1] * 15 + [wide]
        assert native(tokens, 16) is None
        # chain_hashes falls back; cbor2 encodes them as 8-byte heads or bignums.
        assert chain_hashes(tokens, 16, "sha256_cbor", ROOT) == reference(tokens, 16)
    # Only hashed blocks are read: a wide id in the partial tail does not matter.
    assert native([1] * 16 + [2**70], 16) == reference([1] * 16, 16)


@pytest.mark.parametrize("bad", ["1", 1.0, None, True, b"x"])
def test_non_int_tokens_are_a_type_error(bad):
    with pytest.raises(TypeError, match=r"tokens\[3\]: expected an int token id"):
        native([0, 1, 2, bad], 2)


def test_argument_errors():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        native([1, 2], 0)
    with pytest.raises(TypeError, match="parent must be bytes"):
        _C.sha256_cbor_chain([1], 1, "root")
    with pytest.raises(TypeError, match="first_extra_cbor must be bytes"):
        _C.sha256_cbor_chain([1], 1, ROOT, ("cache_salt", "x"))
    with pytest.raises(TypeError, match="tokens: expected a sequence of int token ids"):
        _C.sha256_cbor_chain(5, 1, ROOT)


def test_golden_digests_through_native_and_reference():
    # tests/test_hashing.py's vLLM digests, now computed by the native path.
    assert [h.hex() for h in native(list(range(32)), 16)] == [
        "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
    ]
    salted = native(list(range(16)), 16, extra=(("cache_salt", "salt1"),))
    assert salted[0].hex() == "d5d12f19983da5bf554a6edbb10aa6ffac8228cc94da98f6e9466f9e69c97af0"
    assert block_hashes(list(range(16)), 16, namespace="salt1") == salted


def test_continued_chain_equals_the_whole_chain():
    tokens = list(range(1000))
    whole = native(tokens, 16)
    assert native(tokens[320:], 16, parent=whole[19]) == whole[20:]


def test_packed_chain_is_the_list_joined():
    tokens = list(range(100))
    packed = _C.sha256_cbor_chain(tokens, 16, ROOT, None, packed=True)
    assert packed == b"".join(native(tokens, 16)) and len(packed) == 6 * 32
    assert chain_digests(tokens, 16, "sha256_cbor", ROOT) == packed
    assert _C.sha256_cbor_chain([2**70] * 16, 16, ROOT, None, packed=True) is None
    # Other algorithms and wide ids go through the reference, joined the same way.
    for algorithm in ("sha256", "xxhash", "xxhash_cbor"):
        root = none_hash(algorithm, "s")
        assert chain_digests(tokens, 16, algorithm, root) == b"".join(
            reference_chain_hashes(tokens, 16, algorithm, root)
        )
    assert chain_digests([2**70] * 16, 16, "sha256_cbor", ROOT) == b"".join(reference([2**70] * 16, 16))


def test_a_block_size_beyond_the_tokens_hashes_nothing():
    assert native(list(range(10)), 2**62) == [] == native([], 2**40)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from(["b", "h", "i", "l", "q"]))
def test_a_buffer_of_any_signed_width_hashes_as_its_list(data, code):
    """Narrow buffers (radix's array('i') among them) are widened in one typed loop, not
    item by item: the ids read must be the list's, negative ones included, strided too."""
    import array

    bits = array.array(code).itemsize * 8
    ids = data.draw(st.lists(st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1), max_size=80))
    buf = array.array(code, ids)
    want = chain_digests(ids, 4, "sha256_cbor", ROOT)
    assert chain_digests(buf, 4, "sha256_cbor", ROOT) == want
    assert chain_digests(memoryview(buf), 4, "sha256_cbor", ROOT) == want
    doubled = array.array(code, [x for i in ids for x in (i, 0)])
    assert chain_digests(memoryview(doubled)[::2], 4, "sha256_cbor", ROOT) == want  # strided: the item loop
