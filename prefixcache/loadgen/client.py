"""One request of `prefixcache bench`: sent, streamed back and timed.

Owns `send`: it POSTs a `BenchRequest` to `/v1/completions` as vLLM's own benchmark
does (`prompt` as token ids, `max_tokens`, `ignore_eos: true` so the output has exactly
that length, `temperature: 0`, `stream: true` with `stream_options.include_usage`), and
reads the server-sent events: the first chunk with choices is the first token (TTFT),
each later one an inter-token gap (ITL), `[DONE]` the end (latency); the final usage
chunk gives the token counts and `prompt_tokens_details.cached_tokens`, the server's
prefix-cache hit. A request's `namespace` goes out as vLLM's `cache_salt`.

Every failure (a refused request, a broken stream, a timeout) is a `RequestResult`
with `error` set, never an exception out of `send`.

Must never: retry (a retry would hide what the server did) or wait without a timeout.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from prefixcache.loadgen.schedule import BenchRequest

__all__ = ["RequestResult", "send", "completion_payload"]


@dataclass(frozen=True)
class RequestResult:
    """What one request measured. Times in SECONDS; `start_s` from the run's start."""

    index: int
    start_s: float
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: tuple[float, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2)."""
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def completion_payload(model: str, request: BenchRequest) -> dict:
    payload = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.namespace is not None:
        payload["cache_salt"] = request.namespace
    return payload


async def send(
    client: httpx.AsyncClient, base_url: str, model: str, request: BenchRequest, *, run_start: float, timeout_s: float
) -> RequestResult:
    """Send one request and time its stream (module docstring)."""
    start = time.perf_counter()
    common = dict(index=request.index, start_s=start - run_start, prompt_tokens=len(request.prompt))
    first: float | None = None
    last = start
    gaps: list[float] = []
    chunks = 0
    usage: dict = {}
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=completion_payload(model, request),
                                 timeout=timeout_s) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                return RequestResult(**common, error=f"HTTP {response.status_code}: {_message(body)}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return RequestResult(**common, error=f"stream error: {_message(data)}")
                if event.get("choices"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
                if event.get("usage"):
                    usage = event["usage"]
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return RequestResult(**common, error=f"{type(err).__name__}: {err}")
    end = time.perf_counter()
    if first is None:
        return RequestResult(**common, error="the stream ended without a token")
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        **common,
        output_tokens=int(usage.get("completion_tokens", chunks)),
        cached_tokens=details.get("cached_tokens"),
        ttft_s=first - start,
        latency_s=end - start,
        itl_s=tuple(gaps),
    )


def _message(body: str) -> str:
    """The `error.message` of an OpenAI error body, else the body (cut to 300 chars)."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300]
