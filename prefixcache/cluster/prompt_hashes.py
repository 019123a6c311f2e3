"""A request's chained block hashes, computed the way its replica's cache computes them.

Owns `PromptHashes` (a prompt's block hashes, packed back to back as one bytes) and
`PromptHasher` (one replica hash config: block size, algorithm, `NONE_HASH` seed), so a
router hashes a prompt once, natively (`prefixcache.hashing.chain_digests`), into the
same chain that the replica's `BlockStored` events carry. A `hash` and a `radix` replica
of the same config report the same chain, so one hasher serves both.

Must never: look anything up or keep per-request state. Only FULL blocks are hashed: a
prompt shorter than one block has no hashes and can match nothing. An xxhash config
without a seed draws a random seed per process (`prefixcache.hashing.resolve_seed`):
routers in another process must be given the replicas' seed to agree with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.config import CacheConfig, HashConfig
from prefixcache.hashing import chain_digests, namespace_extra_keys, none_hash
from prefixcache.isolation import Namespace, check_namespace

__all__ = ["PromptHashes", "PromptHasher"]


@dataclass(frozen=True, slots=True)
class PromptHashes:
    """The chained hashes of a prompt's full blocks, `digest_size` bytes each, packed."""

    packed: bytes
    digest_size: int

    def __len__(self) -> int:
        """BLOCKS hashed (the prompt's full blocks)."""
        return len(self.packed) // self.digest_size

    def digests(self) -> list[bytes]:
        """The digests one by one (what the replica's BlockStored events list)."""
        ds = self.digest_size
        return [self.packed[i : i + ds] for i in range(0, len(self.packed), ds)]


class PromptHasher:
    """Hashes prompts under one replica hash config (block size in TOKENS, algorithm, seed)."""

    __slots__ = ("block_size", "algorithm", "_none_hash")

    def __init__(self, block_size: int, hash_config: HashConfig = HashConfig()) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1 (TOKENS), got {block_size!r}")
        self.block_size = block_size
        self.algorithm = hash_config.algorithm
        self._none_hash = none_hash(hash_config.algorithm, hash_config.seed)

    @classmethod
    def of(cls, config: CacheConfig) -> PromptHasher:
        """The hasher of replicas built from `config`."""
        return cls(config.block_size, config.hash)

    def __call__(self, tokens: Sequence[int], namespace: Namespace = None) -> PromptHashes:
        """The chained hashes of the full blocks of `tokens` (a list of int token ids),
        the first salted with the namespace, as the `hash` backend chains them."""
        namespace = check_namespace(namespace)
        packed = chain_digests(
            tokens,
            self.block_size,
            self.algorithm,
            self._none_hash,
            namespace_extra_keys(namespace),
            namespace_extra_keys(namespace, first_block=False),
        )
        return PromptHashes(packed, len(self._none_hash))
