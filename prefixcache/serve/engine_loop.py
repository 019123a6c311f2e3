"""The engine in a thread of its own: the one place that calls into the engine and its cache.

Owns `EngineLoop`: a thread that runs the engine's continuous-batching loop (admit what
was submitted, `Engine.run_step`, hand each request its new tokens) and executes
commands between steps: add a request, abort one, run a function on the engine (a
metrics snapshot, a cache reset). HTTP handlers never touch the engine: they
`submit` a request and read its `RequestStream` (an asyncio queue the loop fills through
`call_soon_threadsafe`), and `abort` it when their client goes away. The engine and
its cache are therefore only ever used from this thread, as the protocol requires (a
`PrefixCache` is not thread-safe).

When nothing is unfinished the thread sleeps on its command queue; a step never waits
for a command. A request the engine ends alone with reason "error" (its forward pass or
sampling failed) gets `Failed(RequestFailed(...))`, the others go on. A step that fails
as a whole (a bug in the scheduler or the cache, never bad input: that is refused at
`submit`) fails every request in flight with the error and aborts them, so no block
stays pinned, and the loop goes on.

Must never: run the engine from another thread, block on a handler, or lose a request:
every submitted request's stream ends with exactly one `Finished` or `Failed` item,
unless its handler aborted it (then nothing more is pushed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

from prefixcache.engine.engine import Engine, GenerationRequest, RequestOutput, StepOutput
from prefixcache.engine.logprobs import TokenLogprobs

__all__ = ["EngineLoop", "RequestStream", "Tokens", "Finished", "Failed", "RequestFailed", "StepObserver"]

_log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Tokens:
    """Token ids a request sampled in one step that did not finish it, with their
    logprobs if it asked for them; its first item carries its prompt's logprobs if it
    asked for them (a request that finishes at once has them in its output)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None


@dataclass(frozen=True)
class Finished:
    """The request is done (this step's tokens included); `output` has its whole
    completion and metrics."""

    output: RequestOutput


@dataclass(frozen=True)
class Failed:
    """The engine failed while running the request (a fault, not bad input)."""

    error: BaseException


class RequestFailed(RuntimeError):
    """The engine ended this request alone with finish reason "error" (vLLM's
    `FinishReason.ERROR`, which its server answers with a 500)."""


StreamItem = Tokens | Finished | Failed


class StepObserver(Protocol):
    """What watches the loop from inside its thread (the Prometheus metrics)."""

    def on_add(self, request_id: str, arrival_s: float, prompt_tokens: int) -> None: ...
    def on_step(self, engine: Engine, out: StepOutput, now_s: float) -> None: ...
    def on_abort(self, request_id: str) -> None: ...


class RequestStream:
    """A submitted request as its handler sees it: `request_id`, `prompt_tokens`, and an
    async iterator of `Tokens` items ending with one `Finished` (or `Failed`)."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._loop = loop
        self._queue: asyncio.Queue[StreamItem] = asyncio.Queue()

    def _push(self, item: StreamItem) -> None:
        """From the engine thread: hand `item` to the handler's event loop."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the server's event loop is closed: nobody is listening
            pass

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamItem:
        item = await self._queue.get()
        return item


class EngineLoop:
    """Runs `engine` in a daemon thread (see the module docstring)."""

    def __init__(self, engine: Engine, *, observer: StepObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.steps = 0
        self.failures = 0

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Abort whatever is in flight, stop the thread (within `timeout_s` SECONDS)."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout_s)

    # -- the handlers' side (any thread) -------------------------------------------------------
    def call(self, fn: Callable[[Engine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` in the engine thread between two steps; its result or error."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    future.set_exception(err)

        if not self._thread.is_alive():
            future.set_exception(RuntimeError("the engine loop is not running"))
        else:
            self._commands.put(run)
        return future

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """`call`, awaited from a coroutine."""
        return await asyncio.wrap_future(self.call(fn))

    async def submit(self, request: GenerationRequest, *, request_id: str | None = None) -> RequestStream:
        """Queue `request` (token ids or text; its `arrival_s` stamped now if unset), its
        grammar (`structured_outputs`) compiled first in a worker thread. Raises the
        engine's `ValueError` for a request it can never run, before anything is streamed."""
        rid = request_id or request.request_id or uuid.uuid4().hex
        arrival = time.perf_counter() if request.arrival_s is None else request.arrival_s
        request = replace(request, request_id=rid, arrival_s=arrival)
        loop = asyncio.get_running_loop()
        grammar = None
        if request.structured_outputs is not None:  # compiled beside the engine's thread: it stalls no step
            grammar = await loop.run_in_executor(None, self.engine.compile_grammar, request.structured_outputs)

        def add(engine: Engine) -> RequestStream:
            engine.add_request(request, grammar=grammar)
            seq = engine.scheduler.waiting[-1]
            stream = RequestStream(rid, len(seq.prompt), loop)
            self._streams[rid] = stream
            if self.observer is not None:
                self.observer.on_add(rid, seq.metrics.arrival_s, len(seq.prompt))
            return stream

        return await self.run(add)

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away): its blocks are released; nothing more
        is pushed to its stream. A request that already finished is left alone."""

        def run() -> None:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort(request_id)
                if self.observer is not None:
                    self.observer.on_abort(request_id)

        if self._thread.is_alive():
            self._commands.put(run)

    # -- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            command = self._commands.get() if not self.engine.has_unfinished() else self._next_command()
            stopping = False
            while command is not False:
                if command is None:
                    stopping = True
                    break
                command()
                command = self._next_command()
            if stopping:
                self._fail_all(RuntimeError("the server is shutting down"))
                return
            if self.engine.has_unfinished():
                self._step()

    def _next_command(self) -> Callable[[], None] | None | bool:
        """The next queued command, or False when there is none (never waits)."""
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return False

    def _step(self) -> None:
        try:
            out = self.engine.run_step()
        except Exception as err:  # noqa: BLE001 - fail the requests, keep serving
            self.failures += 1
            _log.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            self._fail_all(err)
            return
        self.steps += 1
        now = time.perf_counter()
        if self.observer is not None:
            self.observer.on_step(self.engine, out, now)
        sampled: dict[str, list[int]] = {}
        for rid, token in out.tokens:
            sampled.setdefault(rid, []).append(token)
        for output in out.finished:  # its last tokens ride in the output (a stop token is not text)
            sampled.pop(output.request_id, None)
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                if output.finish_reason == "error":
                    stream._push(Failed(RequestFailed(output.error or "the request failed")))
                else:
                    stream._push(Finished(output))
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for rid, lp in out.logprobs:
            logprobs.setdefault(rid, []).append(lp)
        prompts = dict(out.prompt_logprobs)
        for rid, tokens in sampled.items():
            stream = self._streams.get(rid)
            if stream is not None:
                stream._push(Tokens(tuple(tokens), tuple(logprobs.get(rid, ())), prompts.get(rid)))

    def _fail_all(self, error: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the engine is already broken; still tell everyone
                _log.exception("abort of %s failed", rid)
            if self.observer is not None:
                self.observer.on_abort(rid)
            stream._push(Failed(error))
        self._streams.clear()

