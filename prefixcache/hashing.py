"""Chained block hashing, digest-compatible with vLLM V1 (`kv_cache_utils.hash_block_tokens`).

Owns the block-hash function of every algorithm, `NONE_HASH` seeding, and the chain
`block_hash[i] = H((block_hash[i-1], tuple(block_tokens[i]), extra_keys[i]))` from
`NONE_HASH`. This file is the readable reference (`reference_chain_hashes`). For every
algorithm, `chain_hashes` (a list) and `chain_digests` (the same digests packed in one
bytes) compute a whole chain in one native call (`prefixcache._C.chain_digests`: SHA-256
or XXH3-128 over canonical CBOR or pickle protocol 5, in C++); tests require the same
digests as the reference and as vLLM. Tokens may be any buffer of integers (numpy int
arrays, array('i'/'q')) or sequence of ints, read once in C++ (never bools: TypeError).
The reference takes over where the native encoders do not apply: ids beyond int64 (CBOR
bignums, pickle LONG of any width), and pickle links beyond one pickle frame (64 KiB,
blocks of thousands of tokens), for which it needs Python ints (`token_list`).

Must never: look anything up, cache anything, or hash a partial block.

Algorithms (as vLLM 0.33):
  sha256_cbor  sha256(cbor2.dumps(obj, canonical=True))     -- 32 bytes, the default
  sha256       sha256(pickle.dumps(obj, protocol=5))        -- 32 bytes
  xxhash       xxh3_128(pickle.dumps(obj, protocol=5))      -- 16 bytes
  xxhash_cbor  xxh3_128(cbor2.dumps(obj, canonical=True))   -- 16 bytes

Namespaces (`prefixcache.isolation`): the first block of a chain (the one starting at
token 0) carries `extra_keys = (("cache_salt", salt),)`, exactly as vLLM salts with
`cache_salt`; the rest of the chain inherits isolation through its parent hash. A LoRA
adapter adds `("lora", name, path)` to EVERY block, ahead of the salt (vLLM 0.33). The
keys are tagged, so a salt never hashes like an adapter of the same name. `extra_keys`
is `None` (not an empty tuple, which changes the digest) when there is nothing to add.
A chain's blocks after the first carry `later_extra_keys` (the adapter, or None).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from functools import cache, lru_cache
from typing import Any

import cbor2
import xxhash

from prefixcache._C import MAX_PICKLE_LINK
from prefixcache._C import chain_digests as _native_chain_digests
from prefixcache._C import token_array, token_list
from prefixcache.config import CRYPTOGRAPHIC  # re-exported: the schema names the algorithms
from prefixcache.isolation import Namespace, check_namespace
from prefixcache.isolation import extra_keys as namespace_extra_keys  # re-exported: the chain's extra keys

__all__ = [
    "ALGORITHMS",
    "DEFAULT_SEED",
    "CRYPTOGRAPHIC",
    "hash_function",
    "none_hash",
    "resolve_seed",
    "seed_digest",
    "namespace_extra_keys",
    "hash_block",
    "block_hashes",
    "chain_hashes",
    "chain_digests",
    "reference_chain_hashes",
]

DEFAULT_SEED = "vllm-none-hash"

HashFunction = Callable[[Any], bytes]


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def _xxhash_pickle(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=5))


def _xxhash_cbor(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


ALGORITHMS: dict[str, HashFunction] = {
    "sha256_cbor": _sha256_cbor,
    "sha256": _sha256_pickle,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}
# What the native chain computes. An entry of ALGORITHMS replaced at run time (a test
# forcing collisions) is no longer that, so its chains are hashed in Python through it.
_NATIVE = dict(ALGORITHMS)


def hash_function(algorithm: str) -> HashFunction:
    """The object -> digest function of `algorithm`; ValueError naming the allowed ones."""
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown hash algorithm {algorithm!r}; allowed values: {', '.join(ALGORITHMS)}"
        ) from None


@cache
def _process_seed() -> str:
    # One random seed per process, shared by every cache in it, so two caches of the
    # same process agree on digests (vLLM keeps a module-level NONE_HASH likewise).
    return os.urandom(32).hex()


def resolve_seed(algorithm: str, seed: str | None = None) -> str:
    """The seed `NONE_HASH` is derived from, as vLLM 0.33's `resolve_none_hash_seed`.

    An explicit `seed` (config `hash.seed`) wins; else the `PYTHONHASHSEED`
    environment variable if set (any string, used as is, so processes that share it
    share digests with each other and with vLLM); else "vllm-none-hash" for the sha256
    variants and a random per-process seed for the xxhash variants, so an attacker
    cannot precompute colliding chains. The environment is read on every call.
    """
    hash_function(algorithm)  # ValueError naming the allowed algorithms
    if seed is not None:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    return DEFAULT_SEED if algorithm in CRYPTOGRAPHIC else _process_seed()


def none_hash(algorithm: str, seed: str | None = None) -> bytes:
    """`NONE_HASH = H(resolve_seed(algorithm, seed))`, the parent of every chain's first
    block (see `resolve_seed` for where the seed comes from)."""
    return seed_digest(algorithm, resolve_seed(algorithm, seed))


@cache
def seed_digest(algorithm: str, seed: str) -> bytes:
    """`H(seed)` under `algorithm`. Memoized: it depends only on the arguments."""
    return hash_function(algorithm)(seed)


def hash_block(
    fn: HashFunction, parent: bytes, block_tokens: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """One link of the chain: `fn((parent, tuple(block_tokens), extra_keys))`."""
    return fn((parent, tuple(block_tokens), extra_keys))


def reference_chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    algorithm: str,
    parent: bytes,
    extra_keys: tuple | None = None,
    later_extra_keys: tuple | None = None,
) -> list[bytes]:
    """Chained hashes of the FULL blocks of `tokens`, continuing from `parent`; the
    first block carries `extra_keys`, later ones `later_extra_keys`. Plain Python,
    any algorithm."""
    fn = hash_function(algorithm)
    out = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        parent = hash_block(fn, parent, tokens[start : start + block_size], extra_keys)
        out.append(parent)
        extra_keys = later_extra_keys
    return out


@lru_cache(maxsize=1024)
def _cbor(extra_keys: tuple) -> bytes:
    # Extra keys are per request (a namespace), not per block: encode each once.
    return cbor2.dumps(extra_keys, canonical=True)


# pickle.dumps((b"", (0,), extra), 5) is PROTO 5, FRAME + 8 length bytes, then the body:
# SHORT_BINBYTES 0 MEMOIZE, BININT1 0 TUPLE1 MEMOIZE, <extra>, TUPLE3 MEMOIZE STOP.
_PICKLE_HEAD = b"\x80\x05\x95"
_PICKLE_BEFORE_EXTRA = b"C\x00\x94K\x00\x85\x94"
_PICKLE_AFTER_EXTRA = b"\x87\x94."


@lru_cache(maxsize=1024)
def _pickled_extra(extra_keys: tuple) -> bytes:
    """The opcodes pickle protocol 5 writes for `extra_keys` as the third item of a chain
    link, memo numbering from 2 (csrc/hashing.h): cut from a link pickle itself, so any
    object pickle accepts (and its memo references) comes out exactly as vLLM hashes it."""
    link = pickle.dumps((b"", (0,), extra_keys), protocol=5)
    body = link[11:]
    if not (
        link.startswith(_PICKLE_HEAD)
        and body.startswith(_PICKLE_BEFORE_EXTRA)
        and body.endswith(_PICKLE_AFTER_EXTRA)
        and int.from_bytes(link[3:11], "little") == len(body)
    ):
        raise AssertionError(f"unexpected pickle layout for extra keys {extra_keys!r}: {link!r}")
    return body[len(_PICKLE_BEFORE_EXTRA) : -len(_PICKLE_AFTER_EXTRA)]


_PICKLE_ALGORITHMS = ("sha256", "xxhash")


def _chain(
    tokens: Sequence[int],
    block_size: int,
    algorithm: str,
    parent: bytes,
    extra_keys: tuple | None,
    later_extra_keys: tuple | None,
    packed: bool,
) -> list[bytes] | bytes:
    """The chain as a list or, `packed`, one bytes: in one native call, else (a token id
    beyond int64, or a pickle link that would not fit one pickle frame) the reference's,
    on Python ints (a numpy scalar pickles differently)."""
    if hash_function(algorithm) is _NATIVE.get(algorithm):  # also: ValueError naming the allowed ones
        # Extra keys are encoded only if a block carries them, as the reference does (an
        # unencodable key on a block that does not exist is no error).
        num_blocks = len(tokens) // block_size if block_size >= 1 else 0
        encode = _pickled_extra if algorithm in _PICKLE_ALGORITHMS else _cbor
        first = None if extra_keys is None or num_blocks < 1 else encode(extra_keys)
        later = None if later_extra_keys is None or num_blocks < 2 else encode(later_extra_keys)
        extra = max(len(first or b""), len(later or b""))
        # Beyond one pickle frame pickle splits frames; the reference follows it.
        fits = algorithm not in _PICKLE_ALGORITHMS or not num_blocks or (
            16 + max(len(parent), 32) + 10 * block_size + extra + 16 <= MAX_PICKLE_LINK
        )
        if fits:
            # Positionally: a keyword argument costs pybind11 ~0.4 us a call, per request and per decoded block.
            out = _native_chain_digests(tokens, block_size, algorithm, parent, first, later, packed)
            if out is not None:  # None: an id beyond int64
                return out
    ids = tokens if isinstance(tokens, (list, tuple)) else token_list(tokens, "tokens")
    chain = reference_chain_hashes(ids, block_size, algorithm, parent, extra_keys, later_extra_keys)
    return b"".join(chain) if packed else chain


def native_chain(algorithm: str, block_size: int) -> bool:
    """Whether `chain_digests` of `algorithm` at `block_size` TOKENS, without extra keys,
    is the native chain (the algorithm is not replaced at run time, and a pickle link
    of that block fits one frame): what a caller hashing natively itself may rely on."""
    fits = algorithm not in _PICKLE_ALGORITHMS or 16 + 32 + 10 * block_size + 16 <= MAX_PICKLE_LINK
    return hash_function(algorithm) is _NATIVE.get(algorithm) and block_size >= 1 and fits


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    algorithm: str,
    parent: bytes,
    extra_keys: tuple | None = None,
    later_extra_keys: tuple | None = None,
) -> list[bytes]:
    """`reference_chain_hashes`, in one native call (any algorithm).

    `tokens` is typically a whole prompt, so the C++ side sees every block at once.
    """
    return _chain(tokens, block_size, algorithm, parent, extra_keys, later_extra_keys, False)  # type: ignore[return-value]


def chain_digests(
    tokens: Sequence[int],
    block_size: int,
    algorithm: str,
    parent: bytes,
    extra_keys: tuple | None = None,
    later_extra_keys: tuple | None = None,
) -> bytes:
    """`chain_hashes` packed back to back in one bytes, as the pool's `*_packed`
    methods take them: a prompt's chain is then one object, not one per block. This
    is the per-request hot path of the `hash` backend."""
    return _chain(tokens, block_size, algorithm, parent, extra_keys, later_extra_keys, True)  # type: ignore[return-value]


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    algorithm: str = "sha256_cbor",
    namespace: Namespace = None,
    seed: str | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of the FULL blocks of `tokens` (a partial tail is not hashed).

    With `parent=None` the chain starts at `NONE_HASH` and its first block carries the
    namespace's salt; with a parent, `tokens` continue an existing chain and carry no
    salt. Every block carries the namespace's adapter, if it has one.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hash_function(algorithm)  # ValueError naming the allowed algorithms
    # Read once in C++ (buffers too; ids must be ints, never bools); ids beyond int64 as ints.
    ids = token_array(tokens, "tokens")
    tokens = token_list(tokens, "tokens") if ids is None else ids
    namespace = check_namespace(namespace)
    later = namespace_extra_keys(namespace, first_block=False)
    extra = later
    if parent is None:
        parent = none_hash(algorithm, seed)
        extra = namespace_extra_keys(namespace)
    return chain_hashes(tokens, block_size, algorithm, parent, extra, later)
