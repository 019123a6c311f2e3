"""The HTTP routes of a replica: OpenAI's API as vLLM 0.33 serves it, over the engine loop.

Owns `build_app`: a FastAPI application whose handlers admit a request (`admission`),
have it checked and tokenized off the event loop (`preprocess`), `submit` it to the
`EngineLoop` and await its stream; they never touch the engine. `add_openai_routes` adds
the request routes alone to an app, over anything that submits like an `EngineLoop`
(`RequestSubmitter`): the Ray Serve ingress of `prefixcache cluster serve` serves them
over its replicas with it. Routes:

- `POST /v1/completions`, `POST /v1/chat/completions`: with `"stream": true` as
  server-sent events ending in `data: [DONE]` (`responses`), else one JSON body.
  `usage.prompt_tokens_details.cached_tokens` is the request's prefix-cache hit.
- `GET /v1/models` (the one served model, with `max_model_len`), `GET /health` (200, or
  503 once the engine loop has stopped), `GET /metrics` (Prometheus text format; HEAD too),
  `POST /reset_prefix_cache` (vLLM's: drops the cached blocks; `{"success": false}`
  while requests hold blocks).
- `GET /openapi.json`, `/docs`, `/redoc`: FastAPI's schema and pages, on as in vLLM; the
  schema states what the server does (bodies, 400 for a body that fails validation,
  413, 408, 503), not FastAPI's defaults (a 422 this server never sends).

What a request may ask and how it is refused: `preprocess`. A request that fails in the
engine (its forward pass or sampling) ends alone with a 500 "InternalServerError", as
vLLM answers its `FinishReason.ERROR`.

A client that disconnects is aborted: a stream when its next chunk cannot be sent (the
generator is cancelled, or never started: the response's close aborts it), a plain
request as soon as its connection closes (a watcher task, as vLLM's `with_cancellation`).
Either way `EngineLoop.abort` releases its blocks.

Must never: call the engine directly, run a request's CPU work (parsing, templating,
tokenizing) on the event loop, or answer a bad request with a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.engine.detokenizer import StopStrings
from prefixcache.engine.engine import GenerationRequest, RequestOutput
from prefixcache.engine.logprobs import TokenLogprobs
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.serve import responses as R
from prefixcache.serve.admission import AdmissionGate
from prefixcache.serve.body_limits import BodyLimits
from prefixcache.serve.config import ServerConfig
from prefixcache.serve.engine_loop import EngineLoop, Failed, Finished, StreamItem, Tokens
from prefixcache.serve.errors import APIError, error_body, install_handlers
from prefixcache.serve.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from prefixcache.serve.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from prefixcache.serve.preprocess import Prepared, Preprocessor, ReplicaInfo

__all__ = ["ReplicaInfo", "RequestSubmitter", "SubmittedStream", "add_openai_routes", "build_app"]


class SubmittedStream(Protocol):
    """A submitted request as a handler reads it (`engine_loop.RequestStream`'s shape)."""

    request_id: str
    prompt_tokens: int

    def __aiter__(self) -> SubmittedStream: ...
    async def __anext__(self) -> StreamItem: ...


class RequestSubmitter(Protocol):
    """What the request routes need of an engine (`EngineLoop`'s shape): `submit` raises
    `ValueError` for a request the engine can never run (a 400), before anything streams;
    every stream ends with one `Finished` or `Failed`; `abort` stops one."""

    @property
    def alive(self) -> bool: ...
    async def submit(self, request: GenerationRequest) -> SubmittedStream: ...
    def abort(self, request_id: str) -> None: ...


def build_app(loop: EngineLoop, metrics: ServingMetrics, info: ReplicaInfo, tokenizer: Tokenizer, *,
              server: ServerConfig | None = None, max_num_seqs: int = 1,
              event_drops: Callable[[], dict[str, int]] | None = None) -> FastAPI:
    """The FastAPI application of one replica (see the module docstring): at most
    `max_num_seqs + server.max_queued_requests` requests inside at once, bodies within
    `server`'s size and time limits. `event_drops`: the KV event publisher's dropped
    batches by reason, read at each scrape."""
    server = server or ServerConfig()
    app = FastAPI(title="prefixcache", summary="An OpenAI-compatible replica over a prefix cache",
                  version=_version())
    install_handlers(app)
    gate = AdmissionGate(max_num_seqs + server.max_queued_requests, retry_after_s=server.retry_after_s,
                         describe=f" (engine.max_num_seqs {max_num_seqs} + server.max_queued_requests "
                                  f"{server.max_queued_requests})",
                         on_refuse=lambda: metrics.refused("queue_full"))
    add_openai_routes(app, loop, info, tokenizer, server=server, gate=gate)
    app.add_middleware(BodyLimits, max_body_bytes=server.max_body_bytes, body_timeout_s=server.body_timeout_s,
                       on_refuse=metrics.refused)

    async def prometheus() -> Response:
        await loop.run(metrics.sync_gauges)
        if event_drops is not None:
            metrics.sync_publisher(event_drops())
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # A route per method, so the schema's operationIds stay unique (one route with two
    # methods gets one id twice); HEAD, which aiperf probes before scraping, stays out of it.
    app.get("/metrics")(prometheus)
    app.head("/metrics", include_in_schema=False)(prometheus)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        return {"success": await loop.run(metrics.reset_cache)}

    return app


def add_openai_routes(app: FastAPI, loop: RequestSubmitter, info: ReplicaInfo, tokenizer: Tokenizer, *,
                      server: ServerConfig | None = None, gate: AdmissionGate | None = None) -> None:
    """`/health`, `/v1/models`, `/v1/completions` and `/v1/chat/completions` on `app`
    (whose error handlers `install_handlers` set), serving through `loop`; requests pass
    `gate` when given (none: unbounded, as behind Ray Serve, which bounds its own)."""
    server = server or ServerConfig()
    pre = Preprocessor(info, tokenizer, threads=server.preprocess_threads,
                       trust_request_chat_template=server.trust_request_chat_template,
                       chat_template_timeout_s=server.chat_template_timeout_s)
    app.state.preprocessor = pre  # its threads stop with the replica (`Replica.stop`)
    serving = _Serving(loop, info, tokenizer, pre, gate)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if loop.alive else 503)

    @app.get("/ping")
    async def ping() -> Response:
        """vLLM's (SageMaker's health check): as `/health`."""
        return Response(status_code=200 if loop.alive else 503)

    @app.post("/ping")
    async def ping_post() -> Response:
        """`/ping` by POST, as vLLM also answers it."""
        return Response(status_code=200 if loop.alive else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """vLLM's route, this package's version."""
        return {"version": _version()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": info.model_name, "object": "model", "created": info.created, "owned_by": "prefixcache",
                "root": info.model_root, "parent": None, "max_model_len": info.max_model_len, "permission": []}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest), responses=_ERRORS)
    async def completions(request: Request) -> Response:
        """OpenAI's completions, as vLLM 0.33 serves them."""
        return await serving.serve(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatCompletionRequest), responses=_ERRORS)
    async def chat_completions(request: Request) -> Response:
        """OpenAI's chat completions, as vLLM 0.33 serves them."""
        return await serving.serve(request, chat=True)

    @app.post("/tokenize", openapi_extra=_request_body(TokenizeCompletionRequest, TokenizeChatRequest),
              responses=_ERRORS)  # fmt: skip
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's: a prompt's (or, with `messages`, a chat's) token ids, as generation sees them."""
        return JSONResponse(await pre.run(pre.tokenize_now, await request.body()))

    @app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest), responses=_ERRORS)
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's: the text of token ids."""
        return JSONResponse(await pre.run(pre.detokenize_now, await request.body()))


# -- the OpenAPI schema -----------------------------------------------------------------------

_ERROR_SCHEMA = {"$ref": "#/components/schemas/ErrorResponse"}
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": what, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for status, what in (
        (400, "The body is not JSON, fails validation (the field's path in `param`), or asks for what the model "
              "cannot do"),
        (404, "`model` is not the served model"),
        (408, "The body did not arrive within server.body_timeout_s"),
        (413, "The body is larger than server.max_body_bytes"),
        (500, "The request failed in the engine (it alone)"),
        (503, "Overloaded (with Retry-After), or the engine has stopped"),
    )
}
_ERROR_COMPONENT = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "code": {"type": "integer"}}}},
}


def _request_body(*models: type) -> dict[str, Any]:
    """A body of `models` (one of them, if several) in the OpenAPI schema (`_BODIES`
    holds each one's component)."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# The bodies the handlers parse themselves (`Preprocessor`), as OpenAPI components.
_BODIES = (CompletionRequest, ChatCompletionRequest, TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, made true to this server: the request bodies the handlers parse
    themselves, and no 422 (a body that fails validation is a 400, as in vLLM)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in _BODIES:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        components["ErrorResponse"] = _ERROR_COMPONENT
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("prefixcache")
    except PackageNotFoundError:
        return "0"


# -- serving ----------------------------------------------------------------------------------


class _Serving:
    """Runs requests through the gate, the preprocessor and the engine loop, and writes
    their responses."""

    def __init__(self, loop: RequestSubmitter, info: ReplicaInfo, tokenizer: Tokenizer, pre: Preprocessor,
                 gate: AdmissionGate | None) -> None:
        self.loop = loop
        self.info = info
        self.tokenizer = tokenizer
        self.pre = pre
        self.gate = gate

    async def serve(self, request: Request, *, chat: bool) -> Response:
        arrival = time.perf_counter()
        release = self.gate.enter() if self.gate is not None else _nothing  # a 503 here, before any work
        prefix = "chatcmpl" if chat else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"  # the engine's: unique, whatever the client names its request
        handed_over = False
        try:
            prepared = await self.pre.prepare(await request.body(), chat=chat, request_id=rid, arrival_s=arrival)
            if self.gate is not None and len(prepared.generations) > 1:
                release = self._enter_choices(release, len(prepared.generations),
                                              "n" if len(prepared.generations) == prepared.n else "prompt")
            try:
                streams = await self.submit(prepared.generations)
            except APIError as err:  # a forced tool call's schema is the tools' own: name them
                if prepared.tools is None or not (err.param or "").startswith("structured_outputs"):
                    raise
                raise APIError(err.message.replace(err.param or "", "tools", 1), param="tools") from None
            body, created, gen = prepared.body, int(time.time()), prepared.generation
            # vLLM's response id: the X-Request-Id header, else the body's request_id, else its own.
            named = request.headers.get("X-Request-Id") or body.request_id
            shown = f"{prefix}-{named}" if named else rid
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                # vLLM's should_include_usage: usage in every chunk only with include_usage too.
                continuous = include_usage and bool(body.stream_options.continuous_usage_stats)  # type: ignore[union-attr]
                events = self.events(shown, streams, created, prepared, chat=chat, include_usage=include_usage,
                                     continuous_usage=continuous)

                def close() -> None:
                    self.abort(streams)  # a no-op for the choices that finished
                    release()

                handed_over = True
                return _ClosingStream(events, close, media_type="text/event-stream")
            outputs = await self.until_finished(streams, request)
            if outputs is None:  # the client went away; nobody reads this
                return Response(status_code=499)
            k, tok, as_ids = gen.logprobs, self.tokenizer, bool(body.return_tokens_as_token_ids)
            every = gen.logprob_token_ids is not None
            if prepared.echo and not chat and k is not None:
                lps = [R.logprobs(tok, R.echoed(o.prompt_logprobs, o.logprobs or (), prepared.echo_only), k, chat=False,
                                  token_ids=o.prompt_token_ids, as_ids=as_ids, every=every) for o in outputs]  # fmt: skip
            else:
                lps = [R.logprobs(tok, o.logprobs, k, chat=chat, as_ids=as_ids, every=every)
                       if k is not None and o.logprobs else None for o in outputs]  # fmt: skip
            pls = ([R.prompt_logprobs(tok, o.prompt_logprobs or []) for o in outputs]
                   if gen.prompt_logprobs is not None else [])
            model, eos, ids = self.info.model_name, self.info.eos_token_id, bool(body.return_token_ids)
            if chat:
                return JSONResponse(R.chat_body(shown, created, model, outputs, eos, lps, prepared.n,
                                                prompt_logprobs=pls, token_ids=ids, role=prepared.role,
                                                echo=prepared.echo[0] if prepared.echo else "", tools=prepared.tools))
            return JSONResponse(R.completion_body(shown, created, model, outputs, eos, lps, prepared.n,
                                                  echo=prepared.echo, echo_only=prepared.echo_only,
                                                  prompt_logprobs=pls, token_ids=ids))
        finally:
            if not handed_over:
                release()

    def _enter_choices(self, release: Callable[[], None], n: int, param: str) -> Callable[[], None]:
        """A request of `n` choices (its prompts x n), already inside as one, counts as `n`
        at the gate (each is a sequence of the engine's): the release of all of them. 400
        naming `param` for more than the gate ever takes, 503 for more than it takes now."""
        assert self.gate is not None
        if n > self.gate.limit:
            raise APIError(f"{n} choices are more than this server takes at once ({self.gate.limit}"
                           f"{self.gate.describe})", param=param)
        rest = self.gate.enter(n - 1)

        def release_all() -> None:
            rest()
            release()

        return release_all

    async def submit(self, generations: Sequence[GenerationRequest]) -> list[SubmittedStream]:
        """The engine's streams of a request's choices, submitted at once (so the engine
        takes them in one step and computes their shared prompt once); if one cannot be
        submitted, those that were are aborted (the engine's own checks are a 400)."""
        got = await asyncio.gather(*(self.loop.submit(g) for g in generations), return_exceptions=True)
        streams = [s for s in got if not isinstance(s, BaseException)]
        err = next((e for e in got if isinstance(e, BaseException)), None)
        if err is None:
            return streams
        self.abort(streams)
        if isinstance(err, ValueError):  # the engine's own checks (e.g. the request can never fit the pool)
            raise APIError(str(err), param=getattr(err, "path", None)) from None
        raise err

    def abort(self, streams: Sequence[SubmittedStream]) -> None:
        for stream in streams:
            self.loop.abort(stream.request_id)  # a no-op for a request that finished

    async def until_finished(self, streams: Sequence[SubmittedStream], request: Request) -> list[RequestOutput] | None:
        """The outputs of a request's choices, or None (and the choices aborted) if its
        client disconnects first; a choice that fails aborts the others."""

        async def finished() -> list[RequestOutput]:
            outputs: list[RequestOutput | None] = [None] * len(streams)
            async with contextlib.aclosing(_merged(streams)) as items:  # closed if cancelled: no pump is left
                async for i, item in items:
                    if isinstance(item, Finished):
                        outputs[i] = item.output
                    elif isinstance(item, Failed):
                        raise _as_api_error(item.error)
            return outputs  # type: ignore[return-value]  # every stream ended with Finished

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        done_task = asyncio.create_task(finished())
        watch = asyncio.create_task(disconnected())
        aborted = False
        try:
            await asyncio.wait({done_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not done_task.done():  # the client left first (or this handler was cancelled)
                done_task.cancel()
                self.abort(streams)
                aborted = True
        if aborted:
            return None
        if done_task.exception() is not None:  # one choice failed: the others end with it
            self.abort(streams)
        return done_task.result()

    async def events(self, rid: str, streams: Sequence[SubmittedStream], created: int, prepared: Prepared, *,
                     chat: bool, include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[str]:
        """The server-sent events of a request's choices (`n` per prompt; chunks of each
        carry its `index`, in the order the engine drew them): the last CHARACTERS of each
        choice's text that a stop string could still cut held until its next chunk, its
        tokens' logprobs when the request asked for them, its usage so far when
        `continuous_usage` (vLLM's `continuous_usage_stats`), its token ids with
        `return_token_ids` (the prompt's in a choice's first chunk, or a chat's role chunk);
        with a completion's `echo` a choice's first chunk starts with its prompt and, with
        logprobs, the prompt's (nothing after it with `echo_only`: vLLM's `max_tokens: 0`);
        a chat's `echo` is a chunk of its own after the role chunk.
        Aborts the choices if the client goes away first, and all of them if one fails."""
        model, gen, body, n = self.info.model_name, prepared.generation, prepared.body, prepared.n
        num_logprobs, echo, as_ids = gen.logprobs, prepared.echo, bool(body.return_tokens_as_token_ids)
        with_ids = bool(body.return_token_ids)
        prompts = [g.prompt for g in prepared.generations]
        hold_back = StopStrings.hold_back(gen.stop, gen.include_stop_str_in_output)
        texts = [R.IncrementalText(self.tokenizer, hold_back, gen.skip_special_tokens) for _ in streams]
        sent_chars = [0] * len(streams)  # text sent so far, CHARACTERS: where a chunk's text_offsets start
        sent_logprobs = [0] * len(streams)  # positions whose logprobs were sent
        drawn = [0] * len(streams)  # tokens each choice drew so far
        echoed = [not echo or chat] * len(streams)  # a completion's prompt was sent (or is not to be)
        first = [True] * len(streams)  # nothing of the choice was sent yet
        tool_deltas = [R.ToolDeltas(prepared.tools) for _ in streams] if chat and prepared.tools else []

        def sse(i: int, body: dict[str, Any]) -> str:
            if continuous_usage:
                body["usage"] = R.running_usage(streams[i].prompt_tokens, drawn[i])
            return R.sse(body)

        def chunk(i: int, delta: str, token_ids: Sequence[int], positions: Sequence[TokenLogprobs] = (),
                  finish: str | None = None, stop: int | str | None = None,
                  prompt: Sequence[TokenLogprobs | None] | None = None) -> str:
            lp = None
            sent_logprobs[i] += len(positions)
            shown: Sequence[TokenLogprobs | None] = positions
            if not echoed[i]:  # vLLM's echo: the prompt, then (unless echo_only) what this chunk drew
                echoed[i] = True
                delta = echo[i // n] + ("" if prepared.echo_only else delta)
                shown = R.echoed(prompt, positions, prepared.echo_only)
            if num_logprobs is not None and shown:
                lp = R.logprobs(self.tokenizer, shown, num_logprobs, chat=chat, text_offset=sent_chars[i],
                                token_ids=prompts[i], as_ids=as_ids, every=gen.logprob_token_ids is not None)
            sent_chars[i] += len(delta)
            ids: dict[str, Any] = {}
            if with_ids:
                ids["token_ids"] = list(token_ids)
                if first[i] and not chat:
                    ids["prompt_token_ids"] = list(prompts[i])
            first[i] = False
            if chat:
                said: dict[str, Any] = {"content": delta}
                if tool_deltas:  # a forced tool call: the output is the call's arguments
                    said, finish = tool_deltas[i].delta(delta, finish)
                return sse(i, R.chat_chunk(rid, created, model, said, finish, stop, lp, index=i, **ids))
            return sse(i, R.completion_chunk(rid, created, model, delta, finish, stop, lp, index=i, **ids))

        outputs: list[RequestOutput | None] = [None] * len(streams)
        try:
            if chat:
                for i in range(len(streams)):
                    head = R.chat_chunk(rid, created, model, {"role": prepared.role, "content": ""}, index=i)
                    if with_ids:
                        head["prompt_token_ids"] = list(prompts[i])
                    yield sse(i, head)
                if echo and echo[0]:  # vLLM's chat echo: the last message's text, a chunk of its own
                    for i in range(len(streams)):
                        yield sse(i, R.chat_chunk(rid, created, model, {"content": echo[0]}, index=i))
            async with contextlib.aclosing(_merged(streams)) as items:
                async for i, item in items:
                    if isinstance(item, Failed):  # the status line is sent: say it in the stream, as vLLM does
                        yield R.sse(_failure_body(item.error))
                        yield R.DONE
                        return
                    if isinstance(item, Tokens):  # one chunk per step, even when its text is still held back (vLLM)
                        drawn[i] += len(item.token_ids)
                        yield chunk(i, texts[i].add(item.token_ids), item.token_ids, item.logprobs,
                                    prompt=item.prompt_logprobs)
                        continue
                    output = outputs[i] = item.output
                    last_ids = output.token_ids[drawn[i]:]  # the final step's, which rode in the output
                    drawn[i] = len(output.token_ids)
                    last = (output.logprobs or [])[sent_logprobs[i]:]
                    yield chunk(i, texts[i].finish(output), last_ids, last, output.finish_reason,
                                R.stop_reason(output, self.info.eos_token_id), prompt=output.prompt_logprobs)
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield R.sse(R.usage_chunk(rid, created, model, obj, outputs, n))  # type: ignore[arg-type]
            yield R.DONE
        finally:
            self.abort([s for s, o in zip(streams, outputs) if o is None])


async def _merged(streams: Sequence[SubmittedStream]) -> AsyncIterator[tuple[int, StreamItem]]:
    """(choice index, item) from every stream as items arrive, until each has ended (with
    `Finished` or `Failed`); a stream that raises ends with its error as `Failed`."""
    merged: asyncio.Queue[tuple[int, StreamItem]] = asyncio.Queue()

    async def pump(i: int, stream: SubmittedStream) -> None:
        try:
            async for item in stream:
                await merged.put((i, item))
                if isinstance(item, (Finished, Failed)):
                    return
        except Exception as err:  # noqa: BLE001 - the handler answers it as the stream's failure
            await merged.put((i, Failed(err)))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await merged.get()
            left -= isinstance(item, (Finished, Failed))
            yield i, item
    finally:
        for task in pumps:
            task.cancel()


def _nothing() -> None:
    pass


class _ClosingStream(StreamingResponse):
    """A streamed response that calls `on_close` however it ends: sent whole, its client
    gone, or cancelled before its generator ever ran (then no `finally` in the generator
    runs, and the request would go on with nobody reading it)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            # A client gone while the generator waited at a yield leaves it suspended until
            # collected; closing it now stops what it runs (its choices' pumps) at once.
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def _as_api_error(error: BaseException) -> APIError:
    """A request's failure as the error it is answered with: an `APIError` as it is (a
    replica that died: 503), anything else (the engine ended the request alone, as
    vLLM's `FinishReason.ERROR`) a 500 "InternalServerError"."""
    if isinstance(error, APIError):
        return error
    return APIError(str(error) or type(error).__name__, status=500, type="InternalServerError")


def _failure_body(error: BaseException) -> dict:
    """The error object of a request that failed after its response began (as
    `_as_api_error` answers it)."""
    err = _as_api_error(error)
    return error_body(err.message, err.type, err.status, err.param)
