"""Where strategies and eviction policies are found by name.

Owns two name tables: backends (`PrefixCache` subclasses) and eviction policies. A
name resolves, in order, to: a class registered with `@register_backend` /
`@register_eviction_policy`; an entry point in the `prefixcache.backends` /
`prefixcache.eviction_policies` groups (how installed plugins are declared; our built-in
backends are declared in `prefixcache.backends` too, see pyproject.toml); a built-in
backend's dotted path (so a source checkout without installed metadata still works); or,
for any spec containing ":", a `"package.module:ClassName"` import path. The built-in
eviction policies have no entry points: they are `prefixcache.eviction.BUILTIN_POLICIES`,
found after the registered names.

A `"module:Class"` path imports that module: a config that names one runs its code, so a
config file is trusted input, like a Python file (docs/security.md). With the environment
variable `PREFIXCACHE_NO_IMPORT=1` (the CLI's `--no-import` sets it) such paths are
refused and only registered names, entry points and the built-ins resolve: for
deployments that load configs from elsewhere. A path must be dotted identifiers
(`pkg.mod:Class`; no relative import), and an abstract class is no backend or policy.

Must never: import `prefixcache.backends` statically (the strategies sit a layer above
the registry, which loads the built-ins by dotted path when one is asked for), check a
whole `CacheConfig` (`prefixcache.config_checks` does, with what it resolves here), or
build anything. `build_cache` lives in `prefixcache/__init__.py`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TypeVar

from prefixcache.errors import ConfigError, did_you_mean, short_repr
from prefixcache.eviction import BUILTIN_POLICIES, EvictionPolicy
from prefixcache.protocol import PrefixCache

__all__ = [
    "register_backend",
    "register_eviction_policy",
    "resolve_backend",
    "backend_class",
    "resolve_eviction_policy",
    "available_backends",
    "available_eviction_policies",
    "check_backend_name",
    "check_eviction_name",
    "imports_allowed",
    "NO_IMPORT_ENV",
]

BACKEND_GROUP = "prefixcache.backends"
EVICTION_GROUP = "prefixcache.eviction_policies"
NO_IMPORT_ENV = "PREFIXCACHE_NO_IMPORT"
"""Set to 1 (or true, yes): refuse "module:Class" paths in configs (module docstring)."""

_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")

# Built-ins by dotted path: imported only when asked for.
_BUILTIN_BACKENDS = {
    "hash": "prefixcache.backends.hash:HashCache",
    "radix": "prefixcache.backends.radix:RadixCache",
}

_backends: dict[str, type] = {}
_eviction_policies: dict[str, type] = {}

C = TypeVar("C", bound=type)


def _check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"{what} name must be a non-empty string without ':', got {name!r}")


def _registrar(table: dict[str, type], name: str, what: str, base: type) -> Callable[[C], C]:
    """A class decorator adding subclasses of `base` to `table` under `name`."""
    _check_name(name, what)

    def decorate(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise TypeError(f"registering {what} {name!r} needs a {base.__name__} subclass, got {cls!r}")
        table[name] = cls
        cls.name = name
        return cls

    return decorate


def register_backend(name: str) -> Callable[[C], C]:
    """Class decorator: make a `PrefixCache` subclass selectable as `backend: name`."""
    return _registrar(_backends, name, "backend", PrefixCache)


def register_eviction_policy(name: str) -> Callable[[C], C]:
    """Class decorator: make an `EvictionPolicy` subclass selectable as `eviction: name`."""
    return _registrar(_eviction_policies, name, "eviction policy", EvictionPolicy)


def _entry_point_names(group: str) -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=group)}


def imports_allowed() -> bool:
    """Whether a config's "module:Class" path may import its module (`NO_IMPORT_ENV`)."""
    return os.environ.get(NO_IMPORT_ENV, "").strip().lower() not in ("1", "true", "yes")


def _import_path(spec: str, what: str) -> type:
    """The class a "package.module:ClassName" path names; ConfigError for anything else."""
    module_name, _, attr = spec.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attr):
        raise ConfigError("", f"{what} path {short_repr(spec)} must look like 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError("", f"{what} {short_repr(spec)}: cannot import module {short_repr(module_name)} ({short_repr(str(err))})") from None
    except Exception as err:  # noqa: BLE001 -- the module's own code failed: name it, one line
        raise ConfigError(
            "", f"{what} {short_repr(spec)}: importing module {short_repr(module_name)} raised {type(err).__name__}: {short_repr(str(err))}"
        ) from None
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError("", f"{what} {short_repr(spec)}: module {short_repr(module_name)} has no attribute {short_repr(attr)}") from None
    if not isinstance(obj, type):
        raise ConfigError("", f"{what} {short_repr(spec)} is not a class")
    if inspect.isabstract(obj):
        missing = ", ".join(sorted(getattr(obj, "__abstractmethods__", ())))
        raise ConfigError("", f"{what} {short_repr(spec)} is abstract: it does not implement {missing}")
    return obj


def _user_import_path(spec: str, what: str, known: Callable[[], list[str]]) -> type:
    """`_import_path` for a path a config gave, unless imports are off."""
    if not imports_allowed():
        raise ConfigError(
            "", f"{what} {short_repr(spec)} is an import path, and imports are off ({NO_IMPORT_ENV}=1 or --no-import); "
            f"allowed: the registered names {', '.join(known())}"
        )
    return _import_path(spec, what)


def available_backends() -> list[str]:
    """Every backend name that resolves without a 'module:Class' path."""
    return sorted({*_BUILTIN_BACKENDS, *_backends, *_entry_point_names(BACKEND_GROUP)})


def available_eviction_policies() -> list[str]:
    return sorted({*BUILTIN_POLICIES, *_eviction_policies, *_entry_point_names(EVICTION_GROUP)})


def check_backend_name(spec: str) -> None:
    """ConfigError (path `backend`) unless `spec` can name a backend.

    Names are checked without importing anything; "module:Class" paths are imported
    so a typo is reported at load time, not at first use.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError("backend", f"must be a non-empty string, got {short_repr(spec)}")
    if ":" in spec:
        try:
            _as_backend(_user_import_path(spec, "backend", available_backends), spec)
        except ConfigError as err:
            raise ConfigError("backend", err.message) from None
        return
    if spec in _backends or spec in _BUILTIN_BACKENDS:
        return  # without reading every installed package's entry points (ms a config)
    if spec not in available_backends():
        raise ConfigError(
            "backend",
            f"unknown backend {short_repr(spec)}; known: {', '.join(available_backends())}, "
            f"or 'package.module:ClassName'{did_you_mean(spec, available_backends())}",
        )


def check_eviction_name(spec: str) -> None:
    """ConfigError (path `eviction`) unless `spec` names an eviction policy."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError("eviction", f"must be a non-empty string, got {short_repr(spec)}")
    try:
        resolve_eviction_policy(spec)
    except ConfigError as err:
        raise ConfigError("eviction", err.message) from None


def _as_backend(cls: type, spec: str) -> type[PrefixCache]:
    if not issubclass(cls, PrefixCache):
        raise ConfigError("", f"backend {short_repr(spec)} is {cls.__qualname__}, not a PrefixCache subclass")
    return cls


def resolve_backend(spec: str) -> type[PrefixCache]:
    """The `PrefixCache` class a backend name or 'module:Class' path stands for."""
    if ":" in spec:
        return _as_backend(_user_import_path(spec, "backend", available_backends), spec)
    if spec in _backends:
        return _backends[spec]
    path = _entry_point_names(BACKEND_GROUP).get(spec) or _BUILTIN_BACKENDS.get(spec)
    if path is None:
        raise ConfigError(
            "backend", f"unknown backend {short_repr(spec)}; known: {', '.join(available_backends())}"
        )
    # Importing a registered module usually registers the class under `spec`.
    cls = _as_backend(_import_path(path, "backend"), path)
    return _backends.get(spec, cls)


def backend_class(spec: str) -> type[PrefixCache]:
    """`resolve_backend`, with errors under the path `backend` (for config validation)."""
    try:
        return resolve_backend(spec)
    except ConfigError as err:
        raise ConfigError("backend", err.message) from None


def resolve_eviction_policy(spec: str) -> type[EvictionPolicy]:
    """The `EvictionPolicy` class an eviction name or 'module:Class' path stands for."""
    if ":" in spec:
        cls = _user_import_path(spec, "eviction policy", available_eviction_policies)
    else:
        known = _eviction_policies.get(spec) or BUILTIN_POLICIES.get(spec)
        if known is not None:
            return known
        path = _entry_point_names(EVICTION_GROUP).get(spec)
        if path is None:
            raise ConfigError(
                "eviction",
                f"unknown eviction policy {short_repr(spec)}; known: {', '.join(available_eviction_policies())}, "
                f"or 'package.module:ClassName'{did_you_mean(spec, available_eviction_policies())}",
            )
        cls = _import_path(path, "eviction policy")
        cls = _eviction_policies.get(spec, cls)
    if not issubclass(cls, EvictionPolicy):
        raise ConfigError("eviction", f"{short_repr(spec)} is {cls.__qualname__}, not an EvictionPolicy subclass")
    return cls
