"""Backpressure: a bounded number of requests inside the server, the rest refused at once.

Owns `AdmissionGate`. A request counts from the moment its handler starts (before its
body is parsed or tokenized) until its response ends, its client goes away, or it is
refused for its content (its choices past the first, `n`, count too, once its body is
parsed): so the gate bounds the requests running, waiting for a running
slot, and waiting to be tokenized, all at once. One past the limit is answered at once
with 503 "ServiceUnavailableError" and `Retry-After`, which the official OpenAI client
(and any HTTP client that honours the header) waits out and retries: an overloaded
replica answers in milliseconds instead of queueing without bound.

503 is Ray Serve's status for a deployment past its `max_queued_requests` (its
default; it can send 429), and vLLM's for a retryable request failure
(`RetryableRequestError`, type "ServiceUnavailableError"); SGLang's `--max-queued-requests`
answers 429. A router in front of replicas reads 503 as "try another one".

Must never: block (it is called on the event loop, and only there, so it needs no lock),
or release a request twice (each ticket's release is idempotent).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.serve.errors import APIError

__all__ = ["AdmissionGate"]


class AdmissionGate:
    """At most `limit` requests inside the server (see the module docstring).
    `on_refuse` is called once per refused request (the metrics' counter)."""

    def __init__(self, limit: int, *, retry_after_s: int, describe: str = "",
                 on_refuse: Callable[[], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit!r}")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.describe = describe
        self.on_refuse = on_refuse
        self.inside = 0
        self.refused = 0

    def enter(self, count: int = 1) -> Callable[[], None]:
        """Admit `count` requests (a request's choices past its first count as requests:
        each is a sequence of the engine's): their release (call it when they leave;
        idempotent). `APIError` 503 with `Retry-After` when they do not fit beside those
        already inside."""
        if self.inside + count > self.limit:
            self.refused += 1
            if self.on_refuse is not None:
                self.on_refuse()
            raise APIError(f"The server is overloaded: {self.inside} requests are running or waiting, the most it "
                           f"takes{self.describe}. Retry after {self.retry_after_s} s.",
                           status=503, type="ServiceUnavailableError",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.inside += count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inside -= count

        return release
