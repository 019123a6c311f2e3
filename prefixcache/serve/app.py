"""The HTTP routes of a replica: OpenAI's API as vLLM 0.33 serves it, over the engine loop.

Owns `build_app`: a FastAPI application whose handlers check a request, turn it into a
`GenerationRequest`, `submit` it to the `EngineLoop` and await its stream; they never
touch the engine. `add_openai_routes` adds the request routes alone to an app, over
anything that submits like an `EngineLoop` (`RequestSubmitter`): the Ray Serve ingress
of `prefixcache cluster serve` serves them over its replicas with it. Routes:

- `POST /v1/completions`, `POST /v1/chat/completions`: with `"stream": true` as
  server-sent events ending in `data: [DONE]` (`responses`), else one JSON body.
  `usage.prompt_tokens_details.cached_tokens` is the request's prefix-cache hit.
- `GET /v1/models` (the one served model, with `max_model_len`), `GET /health` (200, or
  503 once the engine loop has stopped), `GET /metrics` (Prometheus text format; HEAD too),
  `POST /reset_prefix_cache` (vLLM's: drops the cached blocks; `{"success": false}`
  while requests hold blocks).

Checks, in vLLM 0.33's terms (errors: 400 BadRequestError unless said):
`model` other than the served name -> 404 NotFoundError (`param: "model"`); an empty
prompt; a token id outside the vocabulary; a prompt of `max_model_len` tokens or more
(`param: "input_tokens"`); `max_tokens` < 1 or > `max_model_len`; a feature this server
does not serve (`openai_types.unsupported`). A request whose prompt plus `max_tokens`
passes the context gets `max_tokens` cut to what is left, as vLLM does.
`max_model_len` = min(the model's context, the pool's tokens).

A client that disconnects is aborted: a stream when its next chunk cannot be sent (the
generator is cancelled), a plain request as soon as its connection closes (a watcher
task, as vLLM's `with_cancellation`). Either way `EngineLoop.abort` releases its blocks.

Must never: call the engine directly, or answer a bad request with a 500.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.engine.engine import GenerationRequest, RequestOutput
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.serve import responses as R
from prefixcache.serve.engine_loop import EngineLoop, Failed, Finished, StreamItem, Tokens
from prefixcache.serve.errors import APIError, error_body, install_handlers
from prefixcache.serve.metrics import CONTENT_TYPE_LATEST, ServingMetrics
from prefixcache.serve.openai_types import ChatCompletionRequest, CompletionRequest, unsupported

__all__ = ["ReplicaInfo", "RequestSubmitter", "SubmittedStream", "add_openai_routes", "build_app"]


@dataclass(frozen=True)
class ReplicaInfo:
    """What the routes need to know about the served model (read-only)."""

    model_name: str  # the name requests use ("model")
    model_root: str  # what engine.model names
    max_model_len: int  # TOKENS: prompt + output
    vocab_size: int
    eos_token_id: int
    default_sampling: SamplingParams
    created: int


class SubmittedStream(Protocol):
    """A submitted request as a handler reads it (`engine_loop.RequestStream`'s shape)."""

    request_id: str

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


def build_app(loop: EngineLoop, metrics: ServingMetrics, info: ReplicaInfo, tokenizer: Tokenizer) -> FastAPI:
    """The FastAPI application of one replica (see the module docstring)."""
    app = FastAPI(title="prefixcache", docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    add_openai_routes(app, loop, info, tokenizer)

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: aiperf probes the page before scraping it
    async def prometheus() -> Response:
        await loop.run(metrics.sync_gauges)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, bool]:
        return {"success": await loop.run(metrics.reset_cache)}

    return app


def add_openai_routes(app: FastAPI, loop: RequestSubmitter, info: ReplicaInfo, tokenizer: Tokenizer) -> None:
    """`/health`, `/v1/models`, `/v1/completions` and `/v1/chat/completions` on `app`
    (whose error handlers `install_handlers` set), serving through `loop`."""
    serving = _Serving(loop, info, tokenizer)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if loop.alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": info.model_name, "object": "model", "created": info.created, "owned_by": "prefixcache",
                "root": info.model_root, "parent": None, "max_model_len": info.max_model_len, "permission": []}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        _check_common(body, info)
        prompt = _completion_prompt(body.prompt, tokenizer)
        return await serving.serve(request, body, prompt, body.max_tokens, "max_tokens", arrival, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        _check_common(body, info)
        prompt = _chat_prompt(body, tokenizer)
        limit, param = ((body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None
                        else (body.max_tokens, "max_tokens"))
        return await serving.serve(request, body, prompt, limit, param, arrival, chat=True)


# -- checks ---------------------------------------------------------------------------------


def _check_common(body: CompletionRequest | ChatCompletionRequest, info: ReplicaInfo) -> None:
    if body.model and body.model != info.model_name:
        raise APIError(f"The model `{body.model}` does not exist. Valid aliases: {info.model_name}.",
                       param="model", status=404)
    refused = unsupported(body)
    if refused is not None:
        raise APIError(refused[1], param=refused[0])


def _completion_prompt(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(f"only one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise APIError("The decoder prompt cannot be empty", param="prompt")
    return ids


def _chat_prompt(body: ChatCompletionRequest, tokenizer: Tokenizer) -> list[int]:
    if not body.messages:
        raise APIError("messages must hold at least one message", param="messages")
    messages = []
    for i, m in enumerate(body.messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(f"only text content parts are supported, got {part.get('type')!r}",
                                   param=f"messages[{i}].content[{j}]")
                parts.append(part["text"])
            content = "".join(parts)
        messages.append({"role": m.role, "content": content})
    try:
        ids = tokenizer.apply_chat_template(messages)
    except Exception as err:  # noqa: BLE001 - a template that cannot render these messages (jinja2 TemplateError)
        raise APIError(f"the chat template cannot render these messages: {err}", param="messages") from None
    if not ids:
        raise APIError("The decoder prompt cannot be empty", param="messages")
    return ids


def _sampling(body: CompletionRequest | ChatCompletionRequest, default: SamplingParams) -> SamplingParams | None:
    """The request's sampling: None (the engine's default) if it sets no sampling field,
    else its fields over `default`, with its own seed."""
    if all(v is None for v in (body.temperature, body.top_p, body.top_k, body.seed)):
        return None
    try:
        return SamplingParams(
            temperature=default.temperature if body.temperature is None else body.temperature,
            top_p=default.top_p if body.top_p is None else body.top_p,
            top_k=default.top_k if body.top_k is None or body.top_k == -1 else body.top_k,
            seed=body.seed,
        )
    except ValueError as err:  # ConfigError names the field: "seed: must be an integer >= 0, got -1"
        raise APIError(str(err), param=getattr(err, "path", None)) from None


# -- serving ----------------------------------------------------------------------------------


class _Serving:
    """Runs checked requests through the engine loop and writes their responses."""

    def __init__(self, loop: RequestSubmitter, info: ReplicaInfo, tokenizer: Tokenizer) -> None:
        self.loop = loop
        self.info = info
        self.tokenizer = tokenizer

    def generation_request(
        self, body: CompletionRequest | ChatCompletionRequest, prompt: list[int], max_tokens: int | None, param: str,
        arrival: float, rid: str,
    ) -> GenerationRequest:
        """What the engine runs; APIError for what it cannot (module docstring)."""
        info = self.info
        top = max(prompt)
        if top >= info.vocab_size:
            raise APIError(f"Token id {top} is out of vocabulary (vocab_size {info.vocab_size})", param="prompt")
        limit = info.max_model_len
        if len(prompt) >= limit:
            room = ("exceeds this limit even without any output tokens" if len(prompt) > limit
                    else "leaves no room for any output token")
            raise APIError(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                           f"{len(prompt)} input tokens, which {room}. Please reduce the length of the input prompt.",
                           param="input_tokens")
        if max_tokens is not None:
            if max_tokens < 1:
                raise APIError(f"{param} must be at least 1, got {max_tokens}.", param=param)
            if max_tokens > limit:
                raise APIError(f"{param}={max_tokens} cannot be greater than max_model_len={limit}. "
                               "Please request fewer output tokens.", param=param)
        room = limit - len(prompt)
        return GenerationRequest(
            prompt=prompt, namespace=body.cache_salt, max_tokens=room if max_tokens is None else min(max_tokens, room),
            sampling=_sampling(body, info.default_sampling), stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, request_id=rid, arrival_s=arrival,
        )

    async def serve(
        self, request: Request, body: CompletionRequest | ChatCompletionRequest, prompt: list[int],
        max_tokens: int | None, param: str, arrival: float, *, chat: bool,
    ) -> Response:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        generation = self.generation_request(body, prompt, max_tokens, param, arrival, rid)
        try:
            stream = await self.loop.submit(generation)
        except ValueError as err:  # the engine's own checks (e.g. the request can never fit the pool)
            raise APIError(str(err)) from None
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self.events(stream, created, chat=chat, include_usage=include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        output = await self.until_finished(stream, request)
        if output is None:  # the client went away; nobody reads this
            return Response(status_code=499)
        make = R.chat_body if chat else R.completion_body
        return JSONResponse(make(rid, created, self.info.model_name, output, self.info.eos_token_id))

    async def until_finished(self, stream: SubmittedStream, request: Request) -> RequestOutput | None:
        """The request's output, or None (and the request aborted) if its client disconnects first."""

        async def finished() -> RequestOutput:
            async for item in stream:
                if isinstance(item, Finished):
                    return item.output
                if isinstance(item, Failed):
                    raise item.error
            raise AssertionError("unreachable: a stream ends with Finished or Failed")

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
                self.loop.abort(stream.request_id)
                aborted = True
        return None if aborted else done_task.result()

    async def events(self, stream: SubmittedStream, created: int, *, chat: bool, include_usage: bool
                     ) -> AsyncIterator[str]:
        """The stream's server-sent events; aborts the request if the client goes away first."""
        text = R.IncrementalText(self.tokenizer)
        rid, model = stream.request_id, self.info.model_name

        def chunk(delta: str, finish: str | None = None, stop: int | None = None) -> str:
            if chat:
                return R.sse(R.chat_chunk(rid, created, model, {"content": delta}, finish, stop))
            return R.sse(R.completion_chunk(rid, created, model, delta, finish, stop))

        finished = False
        try:
            if chat:
                yield R.sse(R.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
            async for item in stream:
                if isinstance(item, Failed):  # the status line is sent: say it in the stream, as vLLM does
                    finished = True
                    yield R.sse(_failure_body(item.error))
                    yield R.DONE
                    return
                if isinstance(item, Tokens):  # one chunk per step, even when its text is still held back (vLLM)
                    yield chunk(text.add(item.token_ids))
                    continue
                assert isinstance(item, Finished)
                finished = True
                output = item.output
                yield chunk(text.finish(output), output.finish_reason, R.stop_reason(output, self.info.eos_token_id))
                if include_usage:
                    obj = "chat.completion.chunk" if chat else "text_completion"
                    yield R.sse(R.usage_chunk(rid, created, model, obj, output))
                yield R.DONE
                return
        finally:
            if not finished:
                self.loop.abort(rid)


def _failure_body(error: BaseException) -> dict:
    """The error object of a request that failed after its response began: an `APIError`'s
    own status and type (a replica that died: 503), else a 500 InternalServerError."""
    if isinstance(error, APIError):
        return error_body(error.message, error.type, error.status, error.param)
    return error_body(str(error) or type(error).__name__, "InternalServerError", 500)
