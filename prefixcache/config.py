"""Configuration as data: YAML in, frozen dataclasses out, validated once at load.

Owns the schema of the `cache:` section (`CacheConfig`, `HashConfig`) and the generic
loader that turns a YAML mapping into frozen dataclasses: unknown keys, wrong types and
bad values raise `ConfigError`, which names the file, the key path, the bad value and
what is allowed. Other sections (engine, workload, A/B arms) are dataclasses of their
own modules, parsed by the same `from_mapping`.

Must never: import the registry, a backend or an eviction policy, build a cache, or keep
global state. A `CacheConfig` checks its own fields only (types, ranges); what its names
stand for (the backend and eviction policy) and whether its `options:` suit the backend
class are checked by `prefixcache.config_checks`, which `load_config`, `build_cache`,
`prefixcache validate` and every loader of a `cache:` section call.

Loading is bounded, so no file can hang it or exhaust memory: a file is at most
`MAX_CONFIG_BYTES`, YAML nests at most `MAX_YAML_DEPTH` levels, and a document holds at
most `MAX_YAML_NODES` nodes once its aliases are expanded (an alias bomb fails at once;
an alias to its own enclosing node is refused). Every error is one line, and a bad
value is shown as a `short_repr`. Values the native core cannot represent
(`prefixcache.limits`: the pool's block count, the block size) are refused here, naming
the key. `ConfigError`, `SecurityWarning`, `short_repr` and `key_text` live in
`prefixcache.errors` and are re-exported here.

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
import errno
import os
import stat
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar, get_args, get_origin

import yaml

from prefixcache import limits
from prefixcache.errors import ConfigError, SecurityWarning, did_you_mean, key_text, short_repr
from prefixcache.tier_config import CostModel, TierConfig
from prefixcache.layout import LayerGroup, Layout, check_layout

__all__ = [
    "ConfigError",
    "HashConfig",
    "CacheConfig",
    "TierConfig",
    "CostModel",
    "HASH_ALGORITHMS",
    "CRYPTOGRAPHIC",
    "from_mapping",
    "load_yaml",
    "open_regular_file",
    "require_section",
    "did_you_mean",
    "to_plain",
    "short_repr",
    "key_text",
    "SecurityWarning",
    "MAX_CONFIG_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
]

MAX_CONFIG_BYTES = 1 << 18
"""The largest config file read (bytes): 256 KiB. The shipped configs are under 2 KiB."""
MAX_YAML_DEPTH = 32
"""The deepest YAML nesting read (a config needs four levels)."""
MAX_YAML_NODES = 10_000
"""The most YAML nodes a document may hold, aliases expanded (an A/B file of 100 arms
holds about 2,000; PyYAML composes some 50,000 a second)."""

HASH_ALGORITHMS = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")
HashAlgorithm = Literal["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"]
CRYPTOGRAPHIC = ("sha256_cbor", "sha256")
"""The HASH_ALGORITHMS whose collisions nobody can find: the `hash` backend trusts their hits
(`prefixcache.hashing` computes them; this module names them, without importing cbor2 or xxhash)."""


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
                "algorithm", f"{short_repr(self.algorithm)} is not allowed; allowed values: {', '.join(HASH_ALGORITHMS)}"
            )
        if self.seed is not None and not isinstance(self.seed, str):
            raise ConfigError("seed", f"must be a string or null, got {short_repr(self.seed)}")


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
                   `option_choices`); read-only. Checked against the class the
                   backend name resolves to by `prefixcache.config_checks`, not here.
    tiers:         lower tiers below the device pool (`num_blocks` stays the device
                   tier), in order: host memory, disk (`prefixcache.tier_config`;
                   empty: the device pool alone, today's behaviour)
    cost_model:    what a lower-tier load and a recompute cost (read only with tiers)
    layout:        the model's layer groups (`prefixcache.layout.LayerGroup`); empty, or
                   all full_attention: one group, as every backend always had
                   (`self.groups` is the checked `Layout` either way)
    """

    backend: str = "hash"
    block_size: int = 16
    num_blocks: int = 4096
    hash: HashConfig = field(default_factory=HashConfig)
    eviction: str = "lru"
    enable_events: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)
    tiers: tuple[TierConfig, ...] = ()
    cost_model: CostModel = field(default_factory=CostModel)
    layout: tuple[LayerGroup, ...] = ()

    def __post_init__(self) -> None:
        for name, most, why in (
            ("block_size", limits.MAX_BLOCK_SIZE, "block sizes cross into the native core as int64"),
            ("num_blocks", limits.MAX_NUM_BLOCKS, "a pool's block ids are int32"),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {short_repr(value)}")
            if value > most:
                raise ConfigError(name, f"must be at most {most} ({why}), got {short_repr(value)}")
        if not isinstance(self.hash, HashConfig):
            raise ConfigError("hash", f"must be a HashConfig, got {short_repr(self.hash)}")
        for name in ("backend", "eviction"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(name, f"must be a non-empty string, got {short_repr(value)}")
        if not isinstance(self.enable_events, bool):
            raise ConfigError("enable_events", f"must be true or false, got {short_repr(self.enable_events)}")
        if not isinstance(self.options, Mapping):
            raise ConfigError("options", f"must be a mapping, got {short_repr(self.options)}")
        for key in self.options:
            if not isinstance(key, str):
                raise ConfigError("options", f"keys must be strings, got {short_repr(key)}")
        # A frozen dataclass should not hand out a mutable dict.
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))
        if not isinstance(self.tiers, (tuple, list)) or not all(isinstance(t, TierConfig) for t in self.tiers):
            raise ConfigError("tiers", f"must be a list of tier mappings, got {short_repr(self.tiers)}")
        object.__setattr__(self, "tiers", tuple(self.tiers))
        for i, tier in enumerate(self.tiers):
            if tier.num_blocks > limits.MAX_NUM_BLOCKS:
                raise ConfigError(f"tiers[{i}].num_blocks", f"must be at most {limits.MAX_NUM_BLOCKS}, got {tier.num_blocks}")
            if tier.reuse_slots > limits.MAX_NUM_BLOCKS:
                raise ConfigError(f"tiers[{i}].reuse_tracker_size",
                                  f"must be at most {limits.MAX_NUM_BLOCKS} hashes, got {tier.reuse_slots}"
                                  f"{'' if tier.reuse_tracker_size is not None else ' (the default: 4 x num_blocks)'}")
        if not isinstance(self.cost_model, CostModel):
            raise ConfigError("cost_model", f"must be a mapping, got {short_repr(self.cost_model)}")
        if isinstance(self.layout, list):
            object.__setattr__(self, "layout", tuple(self.layout))
        check_layout(self.layout)
        for i, group in enumerate(self.layout):
            if not isinstance(group, LayerGroup):
                raise ConfigError(f"layout[{i}]", f"must be a LayerGroup, got {short_repr(group)}")
        # Lower tiers move whole full-attention blocks only (docs/tiers.md).
        if self.tiers and self.groups.hybrid:
            kinds = sorted({g.kind for g in self.layout} - {"full_attention"})
            raise ConfigError(
                "layout",
                f"a hybrid layout ({', '.join(kinds)} groups) cannot be combined with cache.tiers: lower tiers "
                "hold full-attention blocks only (drop cache.tiers, or use a full-attention layout)",
            )

    @property
    def groups(self) -> Layout:
        """The layout, checked: one full_attention group when `layout` is empty."""
        return Layout(self.layout)

    def replace(self, **changes: Any) -> CacheConfig:
        """A copy with some fields changed (its own fields validated again; what it names is
        checked by `prefixcache.config_checks`, as for any CacheConfig)."""
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
            raise ConfigError(path, f"{short_repr(value)} is not allowed; allowed values: {', '.join(map(str, allowed))}")
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
        raise ConfigError(path, f"must be {_type_name(tp)}, got {short_repr(value)}")
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)
    if origin in (Mapping, dict) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__} {short_repr(value)}")
        key_tp, val_tp = get_args(tp) or (str, Any)
        return {
            _convert(k, key_tp, f"{path}.{k}"): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()
        }
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"must be a list, got {type(value).__name__} {short_repr(value)}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        return tuple(_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {short_repr(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {type(value).__name__} {short_repr(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be a number, got {type(value).__name__} {short_repr(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {type(value).__name__} {short_repr(value)}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(path, f"must be {_type_name(tp)}, got {short_repr(value)}")


def from_mapping(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from a mapping: every key known, every value of its type.

    Missing keys take the dataclass defaults. Errors raised by `cls.__post_init__`
    (ConfigError with a field path, or ValueError) come back prefixed with `path`.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"must be a mapping, got {type(data).__name__} {short_repr(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key_text(key)}" if path else key_text(key)
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


class _LimitError(Exception):
    """A YAML document past one of the loader's limits (message: one line)."""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing nesting deeper than `MAX_YAML_DEPTH` while it
    composes (PyYAML's composer recurses) and, before anything is constructed, a node
    graph larger than `MAX_YAML_NODES` with its aliases expanded, or one whose alias
    points into the node that holds it."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._nodes += 1  # aliases too: each stands for at least one node
        try:
            if self._depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise _LimitError(f"line {line}: YAML nested deeper than {MAX_YAML_DEPTH} levels")
            if self._nodes > MAX_YAML_NODES:
                line = self.peek_event().start_mark.line + 1
                raise _LimitError(f"line {line}: YAML holds more than {MAX_YAML_NODES:,} nodes")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self) -> Any:
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expansion(root: yaml.Node) -> None:
    """`_LimitError` if the document, aliases expanded, has more than MAX_YAML_NODES
    nodes or an alias inside the node it names. Iterative, and each distinct node is
    sized once, so a billion-laughs document is refused after a few thousand steps."""
    size: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_nodes.discard(key)
            size[key] = 1 + sum(size[id(child)] for child in _children(node))
            if size[key] > MAX_YAML_NODES:
                line = node.start_mark.line + 1
                raise _LimitError(
                    f"line {line}: YAML aliases expand to more than {MAX_YAML_NODES:,} nodes"
                )
            continue
        if key in size:
            continue
        if key in open_nodes:
            raise _LimitError(f"line {node.start_mark.line + 1}: a YAML alias refers to a node that contains it")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in size)


def open_regular_file(path: str | Path) -> BinaryIO:
    """`path` opened for reading in binary, if it is a regular file; else OSError
    ("not a regular file"). A FIFO without a writer would block `open()` itself, and a
    device such as /dev/zero never ends, so neither is opened the usual way."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO's open returns at once
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
            raise OSError(errno.EINVAL, f"not a regular file ({kind})", str(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def load_yaml(source: str | Path) -> Mapping[str, Any]:
    """Parse a YAML file (at most MAX_CONFIG_BYTES) into its top-level mapping, within
    the loader's limits; every error is one line that names the file."""
    path = Path(source)
    try:
        with open_regular_file(path) as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError("", f"cannot read config file: {err.strerror}", str(path)) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError("", f"config file is larger than {MAX_CONFIG_BYTES:,} bytes", str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("", f"config file is not UTF-8 text (byte {err.start}: {err.reason})", str(path)) from None
    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 -- a SafeLoader subclass
    except _LimitError as err:
        raise ConfigError("", str(err), str(path)) from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = " ".join(str(x) for x in (err.context, err.problem) if x)
        raise ConfigError("", f"invalid YAML: {where}{what}", str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError("", f"invalid YAML: {err}", str(path)) from None
    except (ValueError, OverflowError) as err:  # a constructor's own: an int of 5000 digits, 2001-02-30
        raise ConfigError("", f"invalid YAML value: {err}", str(path)) from None
    if not isinstance(data, Mapping):
        raise ConfigError("", f"top level must be a mapping, got {type(data).__name__}", str(path))
    return data


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
