"""Shared pieces of the serving tests: a real replica on 127.0.0.1, and bounded waits."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from prefixcache.engine.loader import LoadedModel
from prefixcache.serve.config import parse_serve_config
from prefixcache.serve.server import Replica

DEADLINE_S = 30.0
LOOPBACK_ZMQ = "tcp://127.0.0.1:*"


def serve_config(backend: str = "hash", *, prefix_caching: bool = True, block_size: int = 4, num_blocks: int = 256,
                 events: bool | dict[str, Any] = False, server: dict[str, Any] | None = None,
                 cache: dict[str, Any] | None = None, **engine: Any):
    """A tiny-model serve config; `events`: True or extra `kv_events:` keys; `server`:
    the `server:` section's keys; `cache`: more `cache:` keys (`tiers`)."""
    data: dict[str, Any] = {
        "cache": {"backend": backend, "block_size": block_size, "num_blocks": num_blocks, **(cache or {})},
        "engine": {"model": "tiny", "prefix_caching": prefix_caching, "num_threads": 1, **engine},
    }
    if events:
        extra = events if isinstance(events, dict) else {}
        data["kv_events"] = {"enabled": True, "endpoint": LOOPBACK_ZMQ, "replay_endpoint": LOOPBACK_ZMQ, **extra}
    if server:
        data["server"] = server
    return parse_serve_config(data)


@contextmanager
def running(loaded: LoadedModel, backend: str = "hash", **kw: Any) -> Iterator[Replica]:
    """A started replica of `loaded` (HTTP on 127.0.0.1, a port the OS picks), stopped on
    exit; `kw` are `serve_config`'s (engine fields included: `model="smollm2"`)."""
    replica = Replica(serve_config(backend, **kw), model=loaded)
    replica.start()
    try:
        yield replica
    finally:
        replica.stop()


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    """Poll `check` (every 10 ms) until it holds; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def in_engine(replica: Replica, fn: Callable[[Any], Any]) -> Any:
    """`fn(engine)` run in the engine's own thread (the only thread that may touch it)."""
    return replica.loop.call(fn).result(timeout=DEADLINE_S)


def idle(replica: Replica) -> None:
    """Wait until the engine has nothing unfinished."""
    wait_until(lambda: not in_engine(replica, lambda e: e.has_unfinished()), "the engine to go idle")
