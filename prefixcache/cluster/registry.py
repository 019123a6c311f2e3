"""Where routers are found by name, as backends and eviction policies are.

Owns the router name table. A name resolves, in order, to: a class registered with
`@register_router`; an entry point in the `prefixcache.routers` group (how an installed
plugin declares its router); or, for any spec containing ":", a
`"package.module:ClassName"` import path. The built-in routers register themselves when
`prefixcache.cluster.routers` is imported, which every look-up does first. The name
rules, the decorator and the import-path resolution are `prefixcache.registry`'s own,
reused here, so a router plugin is declared exactly like a backend plugin.

Also `resolve_router_spec`: a router name with its options resolved to the class and
the options parsed by its `Options` (a `ResolvedRouter`). A config's `RouterSpec` is
plain data; the cluster loaders resolve every one here (so a bad name or option is
reported at load time), and so does whatever builds routers from a spec.

Must never: build a router (the cluster simulation and a deployment do), or import a
router module other than the built-ins' before it is asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prefixcache.cluster.router import Router, RouterContext
from prefixcache.errors import ConfigError
from prefixcache.registry import _entry_point_names, _import_path, _registrar

__all__ = ["ROUTER_GROUP", "register_router", "resolve_router", "available_routers", "check_router_name",
           "ResolvedRouter", "resolve_router_spec"]

ROUTER_GROUP = "prefixcache.routers"
_BUILTIN_MODULE = "prefixcache.cluster.routers"

_routers: dict[str, type] = {}

C = TypeVar("C", bound=type)


def register_router(name: str) -> Callable[[C], C]:
    """Class decorator: make a `Router` subclass selectable as `router: name`."""
    return _registrar(_routers, name, "router", Router)


def available_routers() -> list[str]:
    """Every router name that resolves without a 'module:Class' path."""
    importlib.import_module(_BUILTIN_MODULE)
    return sorted({*_routers, *_entry_point_names(ROUTER_GROUP)})


def resolve_router(spec: str) -> type[Router]:
    """The `Router` class a router name or 'module:Class' path stands for; ConfigError
    (path `router`) naming the known routers otherwise."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError("router", f"must be a non-empty string, got {spec!r}")
    if ":" in spec:
        try:
            cls = _import_path(spec, "router")
        except ConfigError as err:
            raise ConfigError("router", err.message) from None
    else:
        importlib.import_module(_BUILTIN_MODULE)
        if spec in _routers:
            return _routers[spec]
        path = _entry_point_names(ROUTER_GROUP).get(spec)
        if path is None:
            raise ConfigError(
                "router",
                f"unknown router {spec!r}; known: {', '.join(available_routers())}, or 'package.module:ClassName'",
            )
        cls = _import_path(path, "router")
        cls = _routers.get(spec, cls)
    if not issubclass(cls, Router):
        raise ConfigError("router", f"{spec!r} is {cls.__qualname__}, not a Router subclass")
    return cls


def check_router_name(spec: str) -> None:
    """ConfigError (path `router`) unless `spec` names a router."""
    resolve_router(spec)


@dataclass(frozen=True)
class ResolvedRouter:
    """A router spec resolved: `router` as given, the class it names and its options
    parsed by that class (`Router.parse_options`)."""

    router: str
    cls: type[Router]
    parsed: Any

    def build(self, context: RouterContext) -> Router:
        """A fresh router of this spec."""
        return self.cls(context, self.parsed)

    def option_values(self) -> dict[str, Any]:
        """The parsed options as a plain dict, defaults included (for reports)."""
        return self.cls.option_values(self.parsed)


def resolve_router_spec(router: str, options: Mapping[str, Any] | None = None) -> ResolvedRouter:
    """`router` (a name or 'module:Class' path) resolved and `options` parsed by its
    class; ConfigError with path `router` or `options.<key>` otherwise."""
    cls = resolve_router(router)
    return ResolvedRouter(router, cls, cls.parse_options(options, "options"))
