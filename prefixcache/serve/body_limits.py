"""Request bodies, bounded in size and in time, before any route sees them.

Owns `BodyLimits`, ASGI middleware. It reads a request's whole body before the
application runs, and answers instead of it:

- 413 "Request Entity Too Large" when the body passes `max_body_bytes`: from its
  `Content-Length` before a byte of it is read, else (chunked) as soon as that much
  arrived; the connection is closed (`Connection: close`), so the rest is never read;
- 408 "Request Timeout" when the body has not arrived whole `body_timeout_s` SECONDS after
  the headers (a client that trickles a body, or stops half-way), closing too.

Both are OpenAI-style error bodies, as every other error of the server. The route then
receives the body as one message; later `receive()` calls (a route watching for its
client's disconnect) go to the server as before. uvicorn has no such limit or timeout
(its `h11_max_incomplete_event_size` bounds headers only), which is why this exists;
headers are bounded in time by `connections.GuardedH11Protocol`.

Must never: hand a route a body larger than the limit, or wait on a client past the
deadline.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from prefixcache.serve.errors import error_body

__all__ = ["BodyLimits"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyLimits:
    """ASGI middleware (see the module docstring). `on_refuse(reason)` is called for each
    refusal: "body_too_large" or "body_timeout"."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, body_timeout_s: float,
                 on_refuse: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.on_refuse = on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._refuse(send, 413, f"the request body is {int(length):,} bytes; the most this server "
                                          f"takes is {self.max_body_bytes:,} (server.max_body_bytes)")
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout_s
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
                await self._refuse(send, 408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                                              "(server.body_timeout_s)")
                return
            if message["type"] == "http.disconnect":
                return  # nobody left to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(send, 413, f"the request body is more than {self.max_body_bytes:,} bytes, the most "
                                              "this server takes (server.max_body_bytes)")
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(parts), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse("body_too_large" if status == 413 else "body_timeout")
        phrase = "Request Entity Too Large" if status == 413 else "Request Timeout"
        payload = json.dumps(error_body(message, phrase, status)).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})
