"""Connections, bounded in number and in the time they may take to ask.

Owns `guarded_protocol`: a subclass of uvicorn's h11 HTTP protocol (what uvicorn runs
when httptools is not installed; set explicitly, so the guards never depend on what is
installed) with two guards uvicorn lacks:

- a header deadline: a connection must send a whole request line and headers within
  `header_timeout_s` of opening, or of the end of its previous response; past it the
  connection is closed (after a 408 if it had sent part of a request). uvicorn's
  `timeout_keep_alive` closes a connection that sends nothing after a response, but
  stops counting at its first byte, and nothing bounds a new connection: a client
  sending one byte every few seconds held a connection (and a file descriptor) forever;
- a connection cap: at most `max_connections` open. At the cap, a new connection
  displaces the oldest connection that is waiting for a request (idle, or still
  trickling its headers), so a flood of slow sockets cannot lock out a client that asks
  properly; when every connection is busy with a request, the new one is answered 503
  and closed. Without a cap below the process's open-file limit, accepting fails
  (EMFILE) and every new client, `/health` included, waits in the kernel's backlog.

`on_close(reason)` is told of each guard's action: "header_timeout", "connection_shed"
(an idle or slow connection displaced) or "connection_refused" (a 503 at the cap).

Must never: close a connection while its request is being served (only connections
waiting for a request are displaced or timed out), or block the event loop (the cap is
checked in O(connections) only when it is reached).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["guarded_protocol", "default_max_connections"]

_RESERVED_FDS = 64  # descriptors left for everything but client sockets (models, ZeroMQ, pipes)
_REQUEST_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                    b"connection: close\r\ncontent-length: 31\r\n\r\nrequest headers were too slow\r\n")
_UNAVAILABLE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
                b"retry-after: 1\r\nconnection: close\r\ncontent-length: 25\r\n\r\ntoo many open connections")


def default_max_connections() -> int:
    """3/4 of the open-file limit, at most that limit - 64 (`server.max_connections: null`)."""
    try:
        import resource  # POSIX only
    except ImportError:
        return 1024 * 3 // 4
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft <= 0:
        soft = 1 << 20
    return max(2, min(soft - _RESERVED_FDS, soft * 3 // 4))


def guarded_protocol(*, header_timeout_s: float, max_connections: int,
                     on_close: Callable[[str], None] | None = None) -> type[H11Protocol]:
    """An `H11Protocol` subclass with the two guards (see the module docstring), for
    uvicorn's `Config(http=...)`."""

    def tell(reason: str) -> None:
        if on_close is not None:
            on_close(reason)

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_since: float | None = None  # loop time it began waiting for a request; None: serving one
        _cycle_then: Any = None  # the cycle when it began waiting: a different one is a new request

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_request()
            if len(self.connections) > max_connections:
                self._make_room()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._check_started()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request at once
            if not self.transport.is_closing():
                self._await_request()
                self._check_started()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        # -- the guards ---------------------------------------------------------------------
        def _await_request(self) -> None:
            self._disarm()
            self._waiting_since = self.loop.time()
            self._cycle_then = self.cycle
            self._deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _check_started(self) -> None:
            if self._waiting_since is not None and self.cycle is not None and self.cycle is not self._cycle_then:
                self._disarm()

        def _disarm(self) -> None:
            self._waiting_since = None
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or self._waiting_since is None:
                return
            tell("header_timeout")
            if self.conn.trailing_data[0]:  # it began a request: say why it ends
                self.transport.write(_REQUEST_TIMEOUT)
            self.transport.close()

        def _make_room(self) -> None:
            """At the cap: close the connection that has waited longest for a request, if
            another than this one; else refuse this one."""
            victim = min((c for c in self.connections if getattr(c, "_waiting_since", None) is not None
                          and c is not self and not c.transport.is_closing()),
                         key=lambda c: c._waiting_since, default=None)
            if victim is not None:
                tell("connection_shed")
                victim._disarm()
                victim.transport.close()
            else:
                tell("connection_refused")
                self._disarm()
                self.transport.write(_UNAVAILABLE)
                self.transport.close()

    return GuardedH11Protocol
