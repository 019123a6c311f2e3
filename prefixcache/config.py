"""Configuration as data: YAML in, frozen dataclasses out, validated once at load.

Owns the schema of the `cache:` section (`CacheConfig`, `HashConfig`) and the generic
loader that turns a YAML mapping into frozen dataclasses: unknown keys, wrong types and
bad values raise `ConfigError`, which names the file, the key path, the bad value and
what is allowed. Other sections (engine, workload, A/B arms) are dataclasses of their
own modules, parsed by the same `from_mapping`.

Must never: build a cache, import a backend eagerly, or keep global state. The allowed
backend and eviction names come from `registry` at validation time, and a backend's
`options:` are checked against the class the name resolves to (importing its module,
never torch).

Example::

    cache:
      backend: hash            # hash | radix | "package.module:ClassName" | entry-point name
      block_size: 16           # tokens per block / page
      num_blocks: 4096         # pool size
      hash: {algorithm: sha256_cbor, seed: null}
      eviction: lru
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

__all__ = [
    "ConfigError",
    "HashConfig",
    "CacheConfig",
    "HASH_ALGORITHMS",
    "from_mapping",
    "load_yaml",
    "load_config",
    "parse_cache_config",
    "require_section",
    "did_you_mean",
    "to_plain",
]

HASH_ALGORITHMS = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")
HashAlgorithm = Literal["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"]


class ConfigError(ValueError):
    """A configuration value is wrong. `path` is the dotted key path (e.g. `cache.block_size`)."""

    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        self.path = path
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}" if path else f"{where}{message}")

    def within(self, prefix: str, source: str | None = None) -> ConfigError:
        """The same error seen from an enclosing section / file."""
        path = f"{prefix}.{self.path}" if prefix and self.path else prefix or self.path
        return ConfigError(path, self.message, source or self.source)


@dataclass(frozen=True)
class HashConfig:
    """How the `hash` backend (and the events of every backend) hash blocks.

    algorithm: sha256_cbor (vLLM's default digest), sha256 (pickle), xxhash, xxhash_cbor.
    seed:      NONE_HASH seed; None = $PYTHONHASHSEED if set, else "vllm-none-hash" for
               sha256 variants and random per process for xxhash variants (as vLLM
               0.33; `prefixcache.hashing.resolve_seed`).
    """

    algorithm: HashAlgorithm = "sha256_cbor"
    seed: str | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in HASH_ALGORITHMS:
            raise ConfigError(
                "algorithm", f"{self.algorithm!r} is not allowed; allowed values: {', '.join(HASH_ALGORITHMS)}"
            )
        if self.seed is not None and not isinstance(self.seed, str):
            raise ConfigError("seed", f"must be a string or null, got {self.seed!r}")


@dataclass(frozen=True)
class CacheConfig:
    """One cache: strategy, geometry and policies.

    backend:       registered name, entry-point name, or "package.module:ClassName"
    block_size:    TOKENS per block (page); 1 = token-level radix matching
    num_blocks:    BLOCKS in the pool (the capacity every A/B arm shares)
    hash:          block hashing (see HashConfig)
    eviction:      eviction policy name (lru, lfu, fifo, mru, filo, priority, or a plugin's)
    enable_events: record KV events for `drain_events()`
    options:       backend-specific options: the keys the backend class declares
                   (`option_defaults`), values of their type (or among its
                   `option_choices`), checked here against the resolved class
    """

    backend: str = "hash"
    block_size: int = 16
    num_blocks: int = 4096
    hash: HashConfig = field(default_factory=HashConfig)
    eviction: str = "lru"
    enable_events: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if not isinstance(self.hash, HashConfig):
            raise ConfigError("hash", f"must be a HashConfig, got {self.hash!r}")
        from prefixcache import registry  # late: registry imports protocol, not config

        registry.check_backend_name(self.backend)
        registry.check_eviction_name(self.eviction)
        registry.backend_class(self.backend).parse_options(self.options, self.backend)
        # A frozen dataclass should not hand out a mutable dict.
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))

    def replace(self, **changes: Any) -> CacheConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- loader

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    origin = get_origin(tp)
    if origin is not None:
        return getattr(origin, "__name__", str(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """`value` as type `tp`, or ConfigError naming `path`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ConfigError(path, f"{value!r} is not allowed; allowed values: {', '.join(map(str, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, f"must be {_type_name(tp)}, got null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as err:
                errors.append(err)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(path, f"must be {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__} {value!r}")
        key_tp, val_tp = get_args(tp) or (str, Any)
        return {
            _convert(k, key_tp, f"{path}.{k}"): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()
        }
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"must be a list, got {type(value).__name__} {value!r}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {type(value).__name__} {value!r}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(path, f"must be {_type_name(tp)}, got {value!r}")


def from_mapping(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from a mapping: every key known, every value of its type.

    Missing keys take the dataclass defaults. Errors raised by `cls.__post_init__`
    (ConfigError with a field path, or ValueError) come back prefixed with `path`.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"must be a mapping, got {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in known:
            raise ConfigError(key_path, f"unknown key; allowed keys: {', '.join(known)}{did_you_mean(key, known)}")
        kwargs[key] = _convert(value, hints[key], key_path)
    missing = [
        name
        for name, f in known.items()
        if name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ConfigError(path, f"missing required key(s): {', '.join(missing)}")
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.within(path) from None
    except ValueError as err:
        raise ConfigError(path, str(err)) from None


def load_yaml(source: str | Path) -> Mapping[str, Any]:
    """Parse a YAML file into its top-level mapping; errors name the file."""
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError("", f"cannot read config file: {err.strerror}", str(path)) from None
    except UnicodeDecodeError as err:
        raise ConfigError("", f"config file is not UTF-8 text (byte {err.start}: {err.reason})", str(path)) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError("", f"invalid YAML: {err}", str(path)) from None
    if not isinstance(data, Mapping):
        raise ConfigError("", f"top level must be a mapping, got {type(data).__name__}", str(path))
    return data


def parse_cache_config(data: Any, path: str = "cache", source: str | None = None) -> CacheConfig:
    """A `cache:` mapping -> CacheConfig; errors carry `source` (the file) and `path`."""
    try:
        return from_mapping(CacheConfig, data, path)
    except ConfigError as err:
        raise err.within("", source) from None


def did_you_mean(word: Any, candidates: Iterable[Any]) -> str:
    """"; did you mean 'x'?" for the candidate closest to a misspelled `word` (difflib), or ""."""
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def require_section(data: Mapping[str, Any], name: str, source: str | None = None) -> Any:
    """`data[name]`, or ConfigError listing the top-level keys found and, when one of
    them is a near miss (`cach:`), suggesting `name`."""
    if name in data:
        return data[name]
    found = [str(k) for k in data]
    hint = difflib.get_close_matches(name, found, n=1)
    suggestion = f"; did you mean {name!r}? (found {hint[0]!r})" if hint else ""
    raise ConfigError(
        name, f"missing required section{suggestion}; top-level keys found: {', '.join(found) or 'none'}", source
    )


def load_config(source: str | Path) -> CacheConfig:
    """The `cache:` section of a YAML file as a validated `CacheConfig` (other
    top-level sections are left to their own loaders)."""
    data = load_yaml(source)
    return parse_cache_config(require_section(data, "cache", str(source)), "cache", str(source))


def to_plain(value: Any) -> Any:
    """A config (dataclasses, read-only mappings, tuples) as plain dicts and lists, for
    YAML and JSON output."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [to_plain(v) for v in value]
    return value
