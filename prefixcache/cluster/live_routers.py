"""The Ray Serve request-router adapters alive in this process.

Owns `register`, `live_routers` and `first_token` (the ingress's notice of a request's
first token, handed to every adapter alive here). Ray builds a deployment's request router inside each
`DeploymentHandle`, out of the caller's reach, so an adapter registers itself here and
the cluster's ingress, in the same process, reads their state. This lives apart from
`ray_router` because Ray Serve ships a router's module to the handle's process BY VALUE
(`RequestRouterConfig` cloudpickles it with `register_pickle_by_value`): module-level
state there would be a private copy per unpickling, while this module is imported by
reference like any other.

Must never: hold anything but weak references (an adapter lives as long as its handle).
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["register", "live_routers", "first_token"]

_live: weakref.WeakSet[Any] = weakref.WeakSet()


def register(router: Any) -> None:
    """`router` (a request-router adapter) is alive in this process."""
    _live.add(router)


def live_routers() -> list[Any]:
    """The adapters alive in this process, in no particular order."""
    return list(_live)


def first_token(request_id: str) -> None:
    """Request `request_id`'s first token is out: every adapter alive here hears it (the
    one that routed the request ends its prefill load; the others do not know the id)."""
    for router in list(_live):
        router.first_token(request_id)
