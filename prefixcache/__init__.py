"""prefixcache: prefix caching for LLM inference engines.

Two strategies behind one interface (`PrefixCache`): `hash` (vLLM-style automatic
prefix caching over chained block hashes) and `radix` (SGLang-style RadixAttention),
both on one native `BlockPool`. Pick one in YAML and build it with `load_cache(path)`
or `build_cache(config)`.
"""

from __future__ import annotations

from pathlib import Path

from prefixcache._C import BlockPool, InvariantError
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.config_checks import check_cache_config, load_config
from prefixcache.errors import ConfigError
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixcache.isolation import Isolation, LoRA
from prefixcache.protocol import Admission, Match, PrefixCache
from prefixcache.registry import (
    available_backends,
    available_eviction_policies,
    register_backend,
    register_eviction_policy,
    resolve_backend,
)
from prefixcache.stats import CacheStats

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "InvariantError",
    "CacheConfig",
    "HashConfig",
    "ConfigError",
    "PrefixCache",
    "Match",
    "Admission",
    "CacheStats",
    "Isolation",
    "LoRA",
    "KVEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "build_cache",
    "load_cache",
    "load_config",
    "register_backend",
    "register_eviction_policy",
    "available_backends",
    "available_eviction_policies",
]


def build_cache(config: CacheConfig, pool: BlockPool | None = None) -> PrefixCache:
    """The configured strategy over `pool` (a fresh `BlockPool(config.num_blocks)` if None);
    ConfigError, naming the field, if `config` names what does not resolve or fit
    (`check_cache_config`)."""
    check_cache_config(config)
    return _build_checked(config, pool)


def load_cache(path: str | Path) -> PrefixCache:
    """Build the cache described by the `cache:` section of a YAML file (checked once,
    by `load_config`, so its warnings show once)."""
    return _build_checked(load_config(path))


def _build_checked(config: CacheConfig, pool: BlockPool | None = None) -> PrefixCache:
    """`build_cache` for a config `check_cache_config` has passed already."""
    cls = resolve_backend(config.backend)
    return cls(pool if pool is not None else BlockPool(config.num_blocks), config)
