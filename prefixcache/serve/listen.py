"""Whether a server can listen where it is told to, checked before anything loads.

Owns `check_listen_address`: bind a probe socket to (host, port) and close it, so that a
port in use or a host not of this machine is one error naming the option, in a second,
rather than a failure after a model has loaded or a Ray cluster has started
(`prefixcache serve`, `prefixcache cluster serve`); `check_serve_addresses`: the HTTP
server's and every fixed-port KV event socket's, for `prefixcache serve`. And
`tcp_bind_address`: the host and port a ZeroMQ bind endpoint takes, when it names a
fixed port.

Must never: keep a socket open, or load a model.
"""

from __future__ import annotations

import socket

from prefixcache.config import ConfigError
from prefixcache.serve.config import ServeConfig
from prefixcache.serve.publisher import bind_address, is_bind_endpoint

__all__ = ["check_listen_address", "check_serve_addresses", "tcp_bind_address"]


def check_listen_address(host: str, port: int, key: str, source: str | None = None) -> None:
    """ConfigError at `key` (in `source`) unless a TCP server can listen on `host:port`
    now (SO_REUSEADDR, as uvicorn and Ray's proxy set it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            raise ConfigError(key, f"{host}:{port} cannot be listened on ({err.strerror or err})", source) from None


def tcp_bind_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a `tcp://HOST:PORT` endpoint with a numeric port (`*` as host:
    every IPv4 interface, 0.0.0.0); None for any other (a free port `*`, ipc://, ...)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    if not port.isdigit():
        return None
    host = host.strip("[]")
    return ("0.0.0.0" if host == "*" else host), int(port)


def check_serve_addresses(config: ServeConfig, host: str, port: int, source: str | None = None) -> None:
    """ConfigError (naming `--port` or the `kv_events` key) unless `prefixcache serve`'s HTTP
    server (`host:port`) and every event socket bound on a fixed port can listen: a
    `tcp://*:PORT` endpoint on `host` (`publisher.bind_address`)."""
    check_listen_address(host, port, "--port")
    events = config.kv_events
    if not events.enabled:
        return
    for key, endpoint in (("kv_events.endpoint", events.endpoint), ("kv_events.replay_endpoint", events.replay_endpoint)):
        if endpoint is None or (key == "kv_events.endpoint" and not is_bind_endpoint(endpoint)):
            continue
        address = tcp_bind_address(bind_address(endpoint, host))
        if address is not None:
            check_listen_address(*address, key, source)
