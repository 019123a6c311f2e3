"""Block hashing: golden digests computed by vLLM's own functions, chain and namespace rules."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.hashing import ALGORITHMS, block_hashes, hash_block, hash_function, none_hash, resolve_seed

GOLDEN_NONE = {
    "sha256_cbor": "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0",
    "sha256": "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198",
}


@pytest.fixture
def no_hash_seed(monkeypatch):
    """Golden digests assume PYTHONHASHSEED is unset (it decides the seed if set)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.mark.parametrize("algorithm", GOLDEN_NONE)
def test_none_hash_golden(algorithm, no_hash_seed):
    assert none_hash(algorithm).hex() == GOLDEN_NONE[algorithm]


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_pythonhashseed_decides_the_seed_when_the_config_gives_none(algorithm, monkeypatch):
    """As vLLM 0.33's resolve_none_hash_seed: PYTHONHASHSEED wins over the default
    (and over the random xxhash seed), an explicit seed wins over PYTHONHASHSEED."""
    fn = hash_function(algorithm)
    monkeypatch.setenv("PYTHONHASHSEED", "12345")
    assert resolve_seed(algorithm) == "12345"
    assert none_hash(algorithm) == fn("12345")
    assert none_hash(algorithm, "s") == fn("s")
    assert block_hashes(list(range(16)), 16, algorithm)[0] == fn((fn("12345"), tuple(range(16)), None))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash(algorithm) == fn("0")  # read on every call, not memoized
    monkeypatch.delenv("PYTHONHASHSEED")
    if algorithm in GOLDEN_NONE:
        assert resolve_seed(algorithm) == "vllm-none-hash"
    else:
        assert resolve_seed(algorithm) not in ("vllm-none-hash", "0", "12345")
        assert len(resolve_seed(algorithm)) == 64  # 32 random bytes, as vLLM


def test_block_hashes_takes_numpy_ids(no_hash_seed):
    expected = block_hashes(list(range(32)), 16)
    assert block_hashes(np.arange(32), 16) == expected
    assert block_hashes(np.arange(32, dtype=np.int32), 16) == expected
    assert block_hashes([np.int64(t) for t in range(32)], 16, "sha256") == block_hashes(list(range(32)), 16, "sha256")
    with pytest.raises(TypeError, match=r"^tokens\[3\]: expected an int token id; got bool True$"):
        block_hashes([0, 1, 2, True], 2)
    with pytest.raises(TypeError, match=r"^tokens: expected a sequence of int token ids"):
        block_hashes(None, 2)


def test_sha256_cbor_chain_golden(no_hash_seed):
    h = block_hashes(list(range(32)), 16)
    assert [x.hex() for x in h] == [
        "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
    ]
    salted = block_hashes(list(range(16)), 16, namespace="salt1")
    assert salted[0].hex() == "d5d12f19983da5bf554a6edbb10aa6ffac8228cc94da98f6e9466f9e69c97af0"


def test_sha256_pickle_golden(no_hash_seed):
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
