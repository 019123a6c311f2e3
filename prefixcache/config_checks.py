"""A `CacheConfig` checked against what it names, and the `cache:` section loaded with it.

Owns `check_cache_config`: the backend and eviction names resolve (a "module:Class" path
is imported, so a typo is reported at load time, not at first use), the `options:` are
what the backend class declares (`PrefixCache.parse_options`), the layout is one the
class builds (`PrefixCache.check_layout`), and a block size is no
larger than hit verification records when the options and hash turn verification on,
with a `SecurityWarning` when a fast hash is trusted. Also `parse_cache_config` and
`load_config`: a `cache:` section or file parsed (`prefixcache.config.from_mapping`) and
then checked, so loading and `prefixcache validate` report what `build_cache` would.

Every loader of a section holding a `CacheConfig` (the engine's and serve's files, A/B
arms, the cluster experiment) calls `check_cache_config`, as `build_cache` does.

Must never: build a cache, or import a backend other than through the registry (which
imports the module a backend name stands for, never torch).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefixcache import limits, registry
from prefixcache.config import (
    CRYPTOGRAPHIC,
    CacheConfig,
    from_mapping,
    load_yaml,
    require_section,
)
from prefixcache.errors import ConfigError, SecurityWarning

__all__ = ["check_cache_config", "load_config", "parse_cache_config"]


def check_cache_config(config: CacheConfig) -> dict[str, Any]:
    """ConfigError (path relative to the `cache:` section: `backend`, `eviction`,
    `options.<key>`, `block_size`) unless `config` names a backend and an eviction policy
    that resolve and options that suit that backend; the options parsed over the
    backend's defaults otherwise (what the backend's `parse_options` gives it)."""
    registry.check_backend_name(config.backend)
    registry.check_eviction_name(config.eviction)
    cls = registry.backend_class(config.backend)
    options = cls.parse_options(config.options, config.backend)
    cls.check_layout(config, options)
    _check_hit_verification(config, options)
    return options


def _check_hit_verification(config: CacheConfig, options: Mapping[str, Any]) -> None:
    """For a backend with the `verify_hits` option (`hash` and its subclasses): the block
    size verification can record, and a warning when a fast hash is trusted."""
    if "verify_hits" not in options:
        return
    mode, algorithm = options["verify_hits"], config.hash.algorithm
    verifies = mode == "always" or (mode == "auto" and algorithm not in CRYPTOGRAPHIC)
    if verifies and config.block_size > limits.MAX_VERIFIED_BLOCK_SIZE:
        raise ConfigError(
            "block_size",
            f"{config.block_size} TOKENS is more than hit verification records ({limits.MAX_VERIFIED_BLOCK_SIZE}); "
            f"it is on for hash.algorithm {algorithm} with options.verify_hits {mode}",
        )
    if mode == "never" and algorithm not in CRYPTOGRAPHIC:
        warnings.warn(
            f"options.verify_hits: never trusts {algorithm}, which is not collision resistant: a crafted or "
            "colliding prompt can be served another prompt's KV, another tenant's included; unsafe with "
            "untrusted tenants (docs/security.md)",
            SecurityWarning,
            stacklevel=3,
        )


def parse_cache_config(
    data: Any, path: str = "cache", source: str | None = None
) -> CacheConfig:
    """A `cache:` mapping -> a checked CacheConfig; errors carry `source` (the file) and
    `path`."""
    try:
        config = from_mapping(CacheConfig, data, path)
        try:
            check_cache_config(config)
        except ConfigError as err:
            raise err.within(path) from None
    except ConfigError as err:
        raise err.within("", source) from None
    return config


def load_config(source: str | Path) -> CacheConfig:
    """The `cache:` section of a YAML file as a checked `CacheConfig` (other top-level
    sections are left to their own loaders)."""
    data = load_yaml(source)
    return parse_cache_config(
        require_section(data, "cache", str(source)), "cache", str(source)
    )
