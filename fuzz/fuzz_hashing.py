"""Fuzz harness: native block hashing against the Python reference.

Each input is a chain to hash: token ids (small, at every CBOR width, negative, beyond
int64, or not ints at all), a block size, a parent digest of any length, and extra keys
for the first and later blocks (salts, adapters, odd values). The native sha256_cbor
chain (`chain_hashes` / `chain_digests`) must equal `reference_chain_hashes` digest for
digest, or both must refuse with the same error type; the same for a second algorithm
drawn from the input's last bytes (pickle or CBOR, SHA-256 or XXH3: each has its own
token encoder); and the native SHA-256 (CPU extensions and portable) must equal hashlib
on arbitrary bytes.

    python fuzz/fuzz_hashing.py -max_total_time=600
"""

from __future__ import annotations

import hashlib

from harness import main
from reader import Reader

from prefixcache import _C
from prefixcache.hashing import ALGORITHMS as _ALGORITHMS
from prefixcache.hashing import chain_digests, chain_hashes, reference_chain_hashes

ALGORITHMS = sorted(_ALGORITHMS)


def extra(r: Reader):
    kind = r.int(0, 4)
    if kind == 0:
        return None
    if kind == 1:
        return (("cache_salt", r.text(8)),)
    if kind == 2:
        return (("lora", r.text(6), r.text(6)), ("cache_salt", r.text(6)))
    if kind == 3:
        return (("mm", r.text(4), r.token()),)
    return ()


def outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except (TypeError, ValueError, OverflowError) as err:
        return type(err).__name__, None


def check_chain(algorithm: str, tokens, block_size: int, parent: bytes, first, later) -> None:
    native = outcome(chain_hashes, tokens, block_size, algorithm, parent, first, later)
    reference = outcome(reference_chain_hashes, tokens, block_size, algorithm, parent, first, later)
    # The reference hashes whatever cbor2 or pickle encodes (floats, strs, bools, None): the
    # native chain takes ints only and must say so with a TypeError rather than a wrong digest.
    if native[0] == "TypeError" and any(type(t) is not int for t in tokens[: len(tokens) // block_size * block_size]):
        return
    assert native == reference, (algorithm, tokens, block_size, parent, first, later, native, reference)
    if native[0] == "ok":
        packed = chain_digests(tokens, block_size, algorithm, parent, first, later)
        assert packed == b"".join(native[1])


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    block_size = r.int(1, 5)
    tokens = [r.token(300) if r.int(0, 30) else r.choice([1.0, "1", True, None]) for _ in range(r.int(0, 24))]
    parent = r.raw(40)
    first, later = extra(r), extra(r)
    check_chain("sha256_cbor", tokens, block_size, parent, first, later)
    message = r.raw(200)
    expected = hashlib.sha256(message).digest()
    assert _C.sha256(message) == expected and _C.sha256_portable(message) == expected
    # Drawn last, so the inputs saved before it decode as they did.
    check_chain(r.choice(ALGORITHMS), tokens, block_size, parent, first, later)


if __name__ == "__main__":
    main(test_one_input)
