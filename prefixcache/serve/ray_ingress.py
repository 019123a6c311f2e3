"""The OpenAI-compatible front of `prefixcache cluster serve`: a Ray Serve ingress over the
engine replicas.

Owns `ClusterIngress`, the ingress deployment class: the serving layer's own request
routes and error bodies (`app.add_openai_routes`, `errors.install_handlers`) over a
`RoutedEngine`, plus `GET /cluster/state` (what the request router of the replicas'
deployment sees: `PrefixCacheRequestRouter.state()`), `GET /metrics` (`IngressMetrics`:
what the cluster served, as clients saw it) and `GET /model_info` (SGLang's, as a
replica serves it: the model every replica runs, its `vocab_size` included, which
`prefixcache bench` reads). And `RoutedEngine`: it submits like
an `EngineLoop`, but each request is a streaming call to the `EngineReplica` deployment
through a Ray Serve handle, so the deployment's request router picks its replica.

Failover. When the replica holding a request dies or cannot be reached (a
`RayActorError`, `ReplicaUnavailableError`), or sends nothing for `stall_timeout_s`
SECONDS (the call is then cancelled):
- if the request has not streamed a token yet, it is sent again through the router
  (Ray drops a replica that failed a call from its candidates), up to `max_attempts`
  calls in all;
- else, or when the attempts are spent, its stream ends with a `Failed` holding an
  `APIError` 503 ("Service Unavailable"): an OpenAI-style error chunk then `[DONE]` for a
  stream, a 503 error body for a plain request. Tokens already sent cannot be taken back.
Every submitted request therefore ends with exactly one `Finished` or `Failed`, unless
its client aborts it; nothing waits without a bound.

Must never: run a model (only the tokenizer), pick a replica (the router does), or
answer a request with a 500 for a replica's failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from prefixcache.cluster.live_routers import first_token, live_routers
from prefixcache.engine.engine import GenerationRequest
from prefixcache.engine.loader import load_tokenizer
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.serve.app import ReplicaInfo, add_openai_routes
from prefixcache.serve.engine_loop import Failed, Finished, StreamItem, Tokens
from prefixcache.serve.errors import APIError, install_handlers
from prefixcache.serve.ingress_metrics import IngressMetrics
from prefixcache.serve.metrics import CONTENT_TYPE_LATEST
from prefixcache.serve.ray_replica import Admitted, EngineCall

__all__ = ["ClusterIngress", "RoutedEngine", "RoutedStream", "REPLICA_FAILURES"]

_log = logging.getLogger(__name__)

REPLICA_FAILURES = (RayActorError, ReplicaUnavailableError, TimeoutError)
"""What a call raises when its replica, not its request, failed (TimeoutError: a stall)."""


class RoutedEngine:
    """`EngineLoop`'s `submit` / `abort` over a handle to the replicas (module docstring).
    `stall_timeout_s`: SECONDS a call may go without an item before it counts as failed."""

    def __init__(self, replicas: DeploymentHandle, tokenizer: Tokenizer, *, max_attempts: int = 3,
                 stall_timeout_s: float = 120.0, metrics: IngressMetrics | None = None) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
        self._handle = replicas.options(stream=True)
        self.tokenizer = tokenizer
        self.max_attempts = max_attempts
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics
        self._streams: dict[str, RoutedStream] = {}
        self.resubmitted = 0  # requests sent again after their replica failed before streaming
        self.failed = 0  # requests that ended in a 503 for their replica's failure

    def _count_resubmitted(self) -> None:
        self.resubmitted += 1
        if self.metrics is not None:
            self.metrics.on_resubmitted()

    def _count_failed(self) -> None:
        self.failed += 1

    @property
    def alive(self) -> bool:
        return True

    async def submit(self, request: GenerationRequest) -> RoutedStream:
        """Send `request` (token ids, its `request_id` set) through the router; returns once
        a replica has admitted it. `ValueError` if the engine refuses it (a 400), an
        `APIError` 503 if no replica could take it in `max_attempts` calls."""
        call = EngineCall(request, self.tokenizer.decode(list(request.prompt)))  # type: ignore[arg-type]
        stream = RoutedStream(self, call)
        if self.metrics is not None:
            self.metrics.on_submit(stream.request_id, request.arrival_s)
        try:
            await stream.start()
        except BaseException:
            if self.metrics is not None:
                self.metrics.on_ended(stream.request_id, failed=isinstance(stream.failure, APIError))
            raise
        self._streams[stream.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.cancel()
            if self.metrics is not None:
                self.metrics.on_ended(request_id, failed=False)

    def _done(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _call(self, call: EngineCall) -> DeploymentResponseGenerator:
        # Each call gets an internal request id of its own. Ray Serve 2.60 gives every handle
        # call made while serving one HTTP request that request's id, and its request router
        # finds a pending call by that id (`_pending_requests_by_id`, one entry per id): of
        # two calls in flight at once (a request's n choices), the second is never assigned a
        # replica, and waits until `stall_timeout_s` cancels it.
        context = serve_context._get_serve_request_context()
        token = serve_context._serve_request_context.set(
            dataclasses.replace(context, _internal_request_id=generate_request_id()))
        try:
            return self._handle.generate.remote(call)
        finally:
            serve_context._serve_request_context.reset(token)


class RoutedStream:
    """One request's items from its replica, with failover (module docstring)."""

    def __init__(self, engine: RoutedEngine, call: EngineCall) -> None:
        self._engine = engine
        self._call = call
        self.request_id = call.generation.request_id or ""
        self.prompt_tokens = len(call.prompt_token_ids)
        self.attempts = 0
        self._streamed = False  # a Tokens item went out: no failover any more
        self._resent = False  # counted in `resubmitted` (once per request, not per attempt)
        self._ended = False
        self.failure: APIError | None = None  # why `start` gave up, when it did
        self._gen: DeploymentResponseGenerator | None = None

    async def start(self) -> None:
        """Call replicas until one admits the request."""
        while True:
            self.attempts += 1
            self._gen = self._engine._call(self._call)
            try:
                first = await self._next()
            except REPLICA_FAILURES as err:
                if self.attempts < self._engine.max_attempts:
                    self._count_resent()
                    _log.warning("request %s: its replica failed before admitting it (%s); sending it again",
                                 self.request_id, _why(err))
                    continue
                self._engine._count_failed()
                self.failure = self._unavailable(err)
                raise self.failure from None
            except ValueError as err:  # the engine's refusal, raised in the replica (RayTaskError(ValueError))
                cause = getattr(err, "cause", err)  # the engine's own error: a ConfigError names its field
                raise (cause if isinstance(cause, ValueError) else ValueError(str(cause))) from None
            except BaseException:  # cancelled while waiting (its client left): the call goes with it
                self._gen.cancel()
                raise
            if not isinstance(first, Admitted):
                raise RuntimeError(f"a replica answered {type(first).__name__} before admitting the request")
            return

    def _count_resent(self) -> None:
        # A request may be sent again more than once (its second replica can fail too, or stall
        # under load); the counter says how many requests were sent again, as its name says.
        if not self._resent:
            self._resent = True
            self._engine._count_resubmitted()

    async def _next(self) -> Any:
        assert self._gen is not None
        try:
            return await asyncio.wait_for(self._gen.__anext__(), self._engine.stall_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            self._gen.cancel()
            raise TimeoutError(f"no answer from the replica in {self._engine.stall_timeout_s:g} s") from None

    def __aiter__(self) -> RoutedStream:
        return self

    async def __anext__(self) -> StreamItem:
        if self._ended:
            raise StopAsyncIteration
        while True:
            try:
                item = await self._next()
            except REPLICA_FAILURES as err:
                if not self._streamed and self.attempts < self._engine.max_attempts:
                    self._count_resent()
                    _log.warning("request %s: its replica failed before its first token (%s); sending it again",
                                 self.request_id, _why(err))
                    try:
                        await self.start()
                    except APIError as unavailable:
                        return self._end(Failed(unavailable))
                    continue
                self._engine._count_failed()
                return self._end(Failed(self._unavailable(err)))
            except StopAsyncIteration:
                return self._end(Failed(APIError("the replica's stream ended without a result", status=503)))
            if isinstance(item, Tokens):
                if not self._streamed:  # the request's prefill is done: its router's load drops it
                    first_token(self.request_id)
                self._streamed = True
                if self._engine.metrics is not None:
                    self._engine.metrics.on_tokens(self.request_id)
            elif isinstance(item, (Finished, Failed)):
                return self._end(item)
            return item

    def _end(self, item: StreamItem) -> StreamItem:
        self._ended = True
        self._engine._done(self.request_id)
        metrics = self._engine.metrics
        if metrics is not None:
            if isinstance(item, Finished):
                metrics.on_finished(self.request_id, item.output)
            else:
                replica_failed = isinstance(item, Failed) and isinstance(item.error, APIError) and item.error.status == 503
                metrics.on_ended(self.request_id, failed=replica_failed)
        return item

    def _unavailable(self, err: BaseException) -> APIError:
        where = "while it was streaming" if self._streamed else f"after {self.attempts} attempt(s)"
        return APIError(f"the replica serving this request failed {where}: {_why(err)}", status=503)

    def cancel(self) -> None:
        """The client went away: cancel the call (the replica aborts the request)."""
        self._ended = True
        if self._gen is not None:
            self._gen.cancel()


def _why(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


class ClusterIngress:
    """The ingress deployment class (module docstring); `serve.ingress()` wraps it at
    application build time (`prefixcache.serve.ray_app`). `model`: the engine's model
    name (the tokenizer is loaded from it); `options`: `max_attempts`, `stall_timeout_s`."""

    async def __init__(self, replicas: DeploymentHandle, model: str, chat_template: str | None = None,
                       options: Mapping[str, Any] | None = None, router: str = "") -> None:
        self.tokenizer = load_tokenizer(model, chat_template=chat_template)
        self.info: ReplicaInfo = await replicas.info.remote()
        self.model_info: dict[str, Any] = await replicas.model_info.remote()  # the same model on every replica
        self.metrics = IngressMetrics(model_name=self.info.model_name, router=router)
        self.engine = RoutedEngine(replicas, self.tokenizer, metrics=self.metrics, **dict(options or {}))

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="prefixcache cluster", docs_url=None, redoc_url=None, openapi_url=None)
        install_handlers(app)
        add_openai_routes(app, self.engine, self.info, self.tokenizer)
        engine = self.engine

        metrics = self.metrics

        @app.api_route("/metrics", methods=["GET", "HEAD"])
        async def prometheus() -> Response:
            return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

        model_info = self.model_info

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def get_model_info() -> dict[str, Any]:
            return dict(model_info)

        @app.get("/cluster/state")
        async def cluster_state() -> dict[str, Any]:
            routers = [await r.state_from_any_loop() for r in live_routers()]
            return {"routers": routers, "ingress": {"resubmitted": engine.resubmitted, "failed": engine.failed,
                                                    "in_flight": len(engine._streams)}}

        return app
