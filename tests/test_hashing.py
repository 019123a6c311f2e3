"""Block hashing: golden digests computed by vLLM's own functions, chain and namespace rules."""

from __future__ import annotations

import pytest

from prefixcache.hashing import ALGORITHMS, block_hashes, hash_block, hash_function, none_hash

GOLDEN_NONE = {
    "sha256_cbor": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
    "sha256": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
}


@pytest.mark.parametrize("algorithm", GOLDEN_NONE)
def test_none_hash_golden(algorithm):
    assert none_hash(algorithm).hex() == GOLDEN_NONE[algorithm]


def test_sha256_cbor_chain_golden():
    h = block_hashes(list(range(32)), 16)
    assert [x.hex() for x in h] == [
        "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
    ]
    salted = block_hashes(list(range(16)), 16, namespace="salt1")
    assert salted[0].hex() == "d5d12f19983da5bf554a6edbb10aa6ffac8228cc94da98f6e9466f9e69c97af0"


def test_sha256_pickle_golden():
    h = block_hashes(list(range(16)), 16, "sha256")
    assert h[0].hex() == "fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798"


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_chain_rules(algorithm):
    fn = hash_function(algorithm)
    tokens = list(range(40))
    h = block_hashes(tokens, 16, algorithm, seed="s")
    assert len(h) == 2  # the 8-token tail is not hashed
    root = none_hash(algorithm, "s")
    assert h[0] == hash_block(fn, root, tokens[:16], None) == fn((root, tuple(tokens[:16]), None))
    assert h[1] == fn((h[0], tuple(tokens[16:32]), None))
    # A continued chain equals the tail of the whole chain.
    assert block_hashes(tokens[16:], 16, algorithm, parent=h[0]) == h[1:]
    # None and () as extra keys are different digests (vLLM relies on None).
    assert fn((root, tuple(tokens[:16]), ())) != h[0]
    # The namespace salts only the first block, yet changes the whole chain.
    salted = block_hashes(tokens, 16, algorithm, namespace="a", seed="s")
    assert salted[0] == fn((root, tuple(tokens[:16]), (("cache_salt", "a"),)))
    assert salted[1] == fn((salted[0], tuple(tokens[16:32]), None))
    assert salted[1] != h[1]


def test_xxhash_seed_is_random_per_process_but_stable():
    a, b = none_hash("xxhash"), none_hash("xxhash")
    assert a == b and len(a) == 16
    assert none_hash("xxhash", "x") == none_hash("xxhash", "x") != none_hash("xxhash", "y")


def test_errors():
    with pytest.raises(ValueError, match="allowed values: sha256_cbor, sha256, xxhash, xxhash_cbor"):
        hash_function("md5")
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_hashes([1, 2], 0)
