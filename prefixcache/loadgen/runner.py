"""The timed loop of `prefixcache bench`: requests go out at their arrival times.

Owns `run_bench`: every `BenchRequest` is a task that sleeps until its arrival time
(measured from the run's start), waits for a `--max-concurrency` slot (first come,
first served), and sends (`client.send`). The run ends when every request has finished,
or at `--duration` SECONDS, or when `stop` is set (the CLI sets it on Ctrl-C); then
requests still waiting or in flight are cancelled (closing a stream makes the server
abort the request) and counted as not sent. What finished is always returned.

Must never: send a request before its arrival time, or run past `--duration`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from prefixcache.loadgen.client import RequestResult, send
from prefixcache.loadgen.options import BenchOptions
from prefixcache.loadgen.schedule import BenchRequest

__all__ = ["RunResult", "run_bench", "served_model", "served_vocab_size", "probe_server"]

Progress = Callable[[RequestResult, int, int], None]
"""Called after each request with (its result, requests finished so far, planned)."""


@dataclass(frozen=True)
class RunResult:
    """A run: `results` in the order requests finished, the `model` sent, wall time
    from the first arrival to the end, and why it stopped early ("duration",
    "interrupted", or None)."""

    model: str
    planned: int
    results: tuple[RequestResult, ...]
    duration_s: float
    stopped_by: str | None


async def served_model(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> str:
    """The first model `GET /v1/models` lists (what `--model` defaults to)."""
    try:
        response = await client.get(f"{base_url}/v1/models", timeout=timeout_s)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        raise RuntimeError(f"cannot list the models of {base_url} (pass --model): {type(err).__name__}: {err}") from None


async def served_vocab_size(client: httpx.AsyncClient, base_url: str, timeout_s: float) -> int | None:
    """The `vocab_size` the server's `GET /model_info` reports (`prefixcache serve` does;
    SGLang's HTTP server and vLLM do not): None when it reports none."""
    try:
        response = await client.get(f"{base_url}/model_info", timeout=timeout_s)
        value = response.json().get("vocab_size") if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def probe_server(options: BenchOptions) -> tuple[str, int | None]:
    """Before anything is sent: the model to send (`--model`, else the server's first) and
    the server's vocabulary size (None: it reports none). RuntimeError when the server
    cannot be reached or lists no model."""
    async with httpx.AsyncClient(timeout=options.timeout_s) as client:
        model = options.model or await served_model(client, options.base_url, options.timeout_s)
        return model, await served_vocab_size(client, options.base_url, options.timeout_s)


async def run_bench(
    options: BenchOptions, schedule: Sequence[BenchRequest], *, progress: Progress | None = None,
    stop: asyncio.Event | None = None,
) -> RunResult:
    """Replay `schedule` against `options.base_url` (module docstring)."""
    concurrency = options.max_concurrency or max(1, len(schedule))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(limits=limits, timeout=options.timeout_s) as client:
        model = options.model or await served_model(client, options.base_url, options.timeout_s)
        slots = asyncio.Semaphore(concurrency)
        start = time.perf_counter()

        async def one(request: BenchRequest) -> None:
            delay = start + request.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with slots:
                result = await send(client, options.base_url, model, request, run_start=start,
                                    timeout_s=options.timeout_s)
            results.append(result)
            if progress is not None:
                progress(result, len(results), len(schedule))

        tasks = [asyncio.create_task(one(r)) for r in schedule]
        everything = asyncio.gather(*tasks)
        stopper = asyncio.ensure_future(stop.wait()) if stop is not None else None
        waiting = {everything} | ({stopper} if stopper is not None else set())
        done, _ = await asyncio.wait(waiting, timeout=options.duration_s, return_when=asyncio.FIRST_COMPLETED)
        if stopper is not None:
            stopper.cancel()
        if everything in done:
            stopped_by = None
            everything.result()  # a bug in `one` surfaces here (a failed request is a result, not an error)
        else:
            stopped_by = "interrupted" if stopper in done else "duration"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(everything, return_exceptions=True)  # its CancelledError, retrieved
        duration = time.perf_counter() - start
    return RunResult(model, len(schedule), tuple(results), duration, stopped_by)
