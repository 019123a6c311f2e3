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

import os
import stat
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
from prefixcache.errors import ConfigError, SecurityWarning, short_repr
from prefixcache.tier_file import file_size, room_for

__all__ = ["check_cache_config", "check_tiers", "load_config", "parse_cache_config"]


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
    if config.tiers:
        check_tiers(config)
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


def check_tiers(config: CacheConfig) -> None:
    """ConfigError (path `tiers[i].<key>`, or `tiers` naming both keys) unless the lower
    tiers can be built: each tier's eviction policy resolves (a Python `priority()` ranks
    a tier's blocks once each, as a number or a pair of numbers: `prefixcache.tiers`),
    the block hash is collision resistant (a tier keyed by hash finds blocks by hash alone;
    required with radix's lineage keys too, so a config means the same with events on or off), no two
    tiers share a file, and each DISK path is a regular file (or a new one) in a
    writable directory, never a symbolic link, whose disk holds the tier once
    `cost_model.kv_bytes_per_token` says how large a block is. (A hybrid `layout` with
    tiers is refused by `CacheConfig` itself.)"""
    if config.hash.algorithm not in CRYPTOGRAPHIC:
        raise ConfigError(
            "tiers",
            f"lower tiers keyed by hash find blocks by their chained hash alone; hash.algorithm {config.hash.algorithm} is not "
            f"collision resistant: use {' or '.join(CRYPTOGRAPHIC)} with cache.tiers",
        )
    paths: dict[str, int] = {}
    for i, tier in enumerate(config.tiers):
        name = tier.eviction or config.eviction
        try:
            registry.check_eviction_name(name)
            registry.resolve_eviction_policy(name)
        except ConfigError as err:
            raise ConfigError(f"tiers[{i}].eviction", err.message) from None
        if tier.medium == "DISK":
            real = os.path.realpath(os.path.abspath(tier.path))
            if real in paths:
                raise ConfigError(f"tiers[{i}].path", f"tiers[{paths[real]}] uses the same file")
            paths[real] = i
            _check_disk_path(config, i)


def _check_disk_path(config: CacheConfig, i: int) -> None:
    """A DISK tier's file: a regular file or a new one, never a link, in a writable
    directory no other user can swap it in, on a disk with room for it."""
    tier = config.tiers[i]
    where = f"tiers[{i}].path"
    path = Path(tier.path)
    if path.is_symlink():
        raise ConfigError(where, f"{tier.path!r} is a symbolic link: refused (a tier never writes through a link)")
    parent = path.parent if str(path.parent) else Path(".")
    try:
        info = parent.stat()
    except OSError as err:
        raise ConfigError(where, f"directory {str(parent)!r}: {err.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(where, f"{str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(where, f"directory {str(parent)!r} is not writable")
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise ConfigError(
            where, f"directory {str(parent)!r} is writable by anyone without the sticky bit: another user could "
            "replace the file with a link; use a private directory"
        )
    if path.exists():
        try:
            st = path.stat()
        except OSError as err:
            raise ConfigError(where, f"{tier.path!r}: {err.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(where, f"{tier.path!r} is not a regular file")
        if not os.access(path, os.R_OK | os.W_OK):
            raise ConfigError(where, f"{tier.path!r} is not readable and writable")
    per_token = config.cost_model.kv_bytes_per_token
    if per_token is None:
        return  # the engine checks it with its model's KV size before it writes
    need = file_size(tier.num_blocks, config.block_size, per_token * config.block_size)
    free = room_for(path)
    if need > free:
        raise ConfigError(
            f"tiers[{i}].num_blocks",
            f"{tier.num_blocks} blocks of {config.block_size} tokens x {per_token} bytes need {need / 1e9:.3g} GB at "
            f"{short_repr(tier.path)}; the disk has {free / 1e9:.3g} GB free",
        )
