"""Response bodies of the OpenAI API as vLLM 0.33 writes them, and streamed text.

Owns the JSON objects `/v1/completions` and `/v1/chat/completions` answer with (a whole
response, a server-sent-event chunk, the final usage chunk), `usage` with
`prompt_tokens_details.cached_tokens` (the request's prefix-cache hit, in TOKENS: vLLM
reports it with `--enable-prompt-tokens-details`; this server always does), and
`IncrementalText`, which turns a growing list of output token ids into text deltas.

Streams follow vLLM: one chunk per engine step that sampled tokens for the request
(chat starts with a chunk whose delta is `{"role": "assistant", "content": ""}`), the
last one carrying `finish_reason`; then, if the request asked for
`stream_options.include_usage`, a chunk with `"choices": []` and `usage`; then
`data: [DONE]`.

Must never: decide what a request may ask for (app) or touch the engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prefixcache.engine.detokenizer import IncrementalDecoder
from prefixcache.engine.engine import RequestOutput
from prefixcache.engine.tokenizer import Tokenizer

__all__ = [
    "IncrementalText",
    "usage",
    "completion_body",
    "completion_chunk",
    "chat_body",
    "chat_chunk",
    "usage_chunk",
    "sse",
    "DONE",
    "stop_reason",
]

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class IncrementalText:
    """The text of a request's output so far, handed out as deltas.

    `add(token_ids)` returns the text the new tokens completed (`IncrementalDecoder`: a
    delta that would end inside a character holds its bytes back until the character is
    whole, and each token costs the same however long the output), less the last
    `hold_back` characters, which wait for the next delta (a request with stop strings:
    `StopStrings.hold_back`, so that nothing sent is cut later). `finish(output)` returns
    the rest of the final text, which is authoritative (it leaves out a final stop token
    and what a stop string cut): the deltas always add up to `output.text`."""

    def __init__(self, tokenizer: Tokenizer, hold_back: int = 0) -> None:
        self._decoder = IncrementalDecoder(tokenizer)
        self._hold_back = hold_back
        self._pending = ""  # decoded, not sent: at most hold_back CHARACTERS between calls
        self._sent = 0  # CHARACTERS sent

    def add(self, token_ids: Sequence[int]) -> str:
        self._pending += self._decoder.add(token_ids)
        ready = len(self._pending) - self._hold_back
        if ready <= 0:
            return ""
        delta, self._pending = self._pending[:ready], self._pending[ready:]
        self._sent += ready
        return delta

    def finish(self, output: RequestOutput) -> str:
        delta = output.text[self._sent:]
        self._sent, self._pending = len(output.text), ""
        return delta


def stop_reason(output: RequestOutput, eos_token_id: int) -> int | str | None:
    """vLLM's `stop_reason`: the stop string or stop token id that ended the request, None
    for the end-of-sequence token or a length limit."""
    if output.stop_str is not None:
        return output.stop_str
    if output.finish_reason == "stop" and output.token_ids and output.token_ids[-1] != eos_token_id:
        return output.token_ids[-1]
    return None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's `UsageInfo` with `prompt_tokens_details.cached_tokens`."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def output_usage(output: RequestOutput) -> dict[str, Any]:
    return usage(len(output.prompt_token_ids), len(output.token_ids), output.metrics.cached_tokens)


def _body(rid: str, obj: str, created: int, model: str, choice: dict[str, Any] | None, **rest: Any) -> dict[str, Any]:
    """The envelope every response and chunk shares; `choice` None: no choices."""
    return {"id": rid, "object": obj, "created": created, "model": model,
            "choices": [] if choice is None else [{"index": 0, **choice}], **rest}


def _ending(finish_reason: str | None, stop: int | str | None) -> dict[str, Any]:
    return {"logprobs": None, "finish_reason": finish_reason, "stop_reason": stop}


def completion_body(rid: str, created: int, model: str, output: RequestOutput, eos: int) -> dict[str, Any]:
    choice = {"text": output.text, **_ending(output.finish_reason, stop_reason(output, eos))}
    return _body(rid, "text_completion", created, model, choice, usage=output_usage(output))


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None = None, stop: int | str | None = None
) -> dict[str, Any]:
    return _body(rid, "text_completion", created, model, {"text": text, **_ending(finish_reason, stop)})


def chat_body(rid: str, created: int, model: str, output: RequestOutput, eos: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": output.text, "tool_calls": []}
    choice = {"message": message, **_ending(output.finish_reason, stop_reason(output, eos))}
    return _body(rid, "chat.completion", created, model, choice, usage=output_usage(output))


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None = None,
    stop: int | str | None = None,
) -> dict[str, Any]:
    return _body(rid, "chat.completion.chunk", created, model, {"delta": delta, **_ending(finish_reason, stop)})


def usage_chunk(rid: str, created: int, model: str, obj: str, output: RequestOutput) -> dict[str, Any]:
    """The final chunk of a stream that asked for usage: no choices, the usage."""
    return _body(rid, obj, created, model, None, usage=output_usage(output))
