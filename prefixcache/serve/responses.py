"""Response bodies of the OpenAI API as vLLM 0.33 writes them, and streamed text.

Owns the JSON objects `/v1/completions` and `/v1/chat/completions` answer with (a whole
response, a server-sent-event chunk, the final usage chunk), `usage` with
`prompt_tokens_details.cached_tokens` (the request's prefix-cache hit, in TOKENS: vLLM
reports it with `--enable-prompt-tokens-details`; this server always does), and
`IncrementalText`, which turns a growing list of output token ids into text deltas, and
`logprobs`, a choice's logprobs in its endpoint's shape.

Streams follow vLLM: one chunk per engine step that sampled tokens for the request
(chat starts with a chunk whose delta is `{"role": "assistant", "content": ""}`: the
response role, the last message's without `add_generation_prompt`), the
last one carrying `finish_reason`; then, if the request asked for
`stream_options.include_usage`, a chunk with `"choices": []` and `usage`; then
`data: [DONE]`. A request's choices (`n`, a completion's batch of prompts) are listed by
`index`, prompt by prompt; each chunk of a stream carries one choice's.

Logprobs are vLLM's (`serving.py`'s `_create_chat_logprobs` / `_create_completion_logprobs`):
a token is its id decoded alone (special tokens included), a logprob below -9999 (or
-inf) is written -9999.0, and a position's alternatives are vLLM's `Logprob` dict in its
order: the drawn token first, then the top k by rank, a token already listed not again.
A chat lists the first k of them (so the drawn token first, even when it ranks below
the top k), a completion the first k + 1, keyed by token text (two ids decoding to the
same text keep one key, the later's value), with `text_offset`s in CHARACTERS from where
the chunk's text starts.

Must never: decide what a request may ask for (app) or touch the engine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from prefixcache.engine.detokenizer import IncrementalDecoder
from prefixcache.engine.engine import RequestOutput
from prefixcache.engine.logprobs import TokenLogprobs
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.serve.tools import ToolChoice, tool_calls

__all__ = [
    "IncrementalText",
    "usage",
    "completion_body",
    "completion_chunk",
    "chat_body",
    "chat_chunk",
    "ToolDeltas",
    "usage_chunk",
    "running_usage",
    "sse",
    "DONE",
    "stop_reason",
    "logprobs",
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
    and what a stop string cut): the deltas always add up to `output.text`, which leaves
    out special tokens as the deltas do (`skip_special_tokens`, the request's)."""

    def __init__(self, tokenizer: Tokenizer, hold_back: int = 0, skip_special_tokens: bool = True) -> None:
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
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
    """vLLM's `stop_reason`: the stop string or stop token id that ended the request,
    "repetition_detected" for a loop (`repetition_detection`), None for the
    end-of-sequence token or a length limit."""
    if output.stop_str is not None:
        return output.stop_str
    if output.finish_reason == "repetition":
        return "repetition_detected"
    if output.finish_reason == "stop" and output.token_ids and output.token_ids[-1] != eos_token_id:
        return output.token_ids[-1]
    return None


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's `UsageInfo` without details: a stream chunk's with `continuous_usage_stats`
    (its choice's prompt and the tokens it drew so far)."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """vLLM's `UsageInfo` with `prompt_tokens_details.cached_tokens`."""
    return {**running_usage(prompt_tokens, completion_tokens), "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def output_usage(outputs: Sequence[RequestOutput], n: int = 1) -> dict[str, Any]:
    """A request's usage over its choices, `n` per prompt, prompt by prompt (vLLM's): each
    prompt once, every choice's tokens, and per prompt the cached tokens of its choice that
    finished last (the one whose output completes vLLM's parent request), summed over the
    prompts (vLLM reports one prompt's: see docs/serving.md)."""
    groups = [outputs[i : i + n] for i in range(0, len(outputs), n)]
    cached = sum(max(g, key=lambda o: o.metrics.finish_s or 0.0).metrics.cached_tokens for g in groups)
    return usage(sum(len(g[0].prompt_token_ids) for g in groups), sum(len(o.token_ids) for o in outputs), cached)


def _body(rid: str, obj: str, created: int, model: str, choices: Sequence[dict[str, Any]], **rest: Any) -> dict[str, Any]:
    """The envelope every response and chunk shares; `choices` carry their own `index`."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": list(choices), **rest}


def _ending(finish_reason: str | None, stop: int | str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop}


_FLOOR = -9999.0  # vLLM writes a logprob below this (-inf included) as this: JSON has no -inf


def _ranked(lp: TokenLogprobs) -> dict[int, float]:
    """vLLM's `Logprob` dict for a position: the drawn token, then the top ones by rank."""
    out = {lp.token_id: lp.logprob}
    for token_id, value in lp.top:
        out[token_id] = value
    return out


def logprobs(
    tokenizer: Tokenizer, positions: Sequence[TokenLogprobs | None], k: int, *, chat: bool, text_offset: int = 0,
    token_ids: Sequence[int] = (), as_ids: bool = False, every: bool = False,
) -> dict[str, Any]:
    """The `logprobs` of a choice (or a chunk) whose tokens drew `positions`, `k` the
    request's count (see the module docstring). A completion's echoed prompt starts with
    a position that has none (None: its token is `token_ids[i]`, its logprob and top null,
    as vLLM writes it). `as_ids`: each token written "token_id:{id}" (vLLM's
    `return_tokens_as_token_ids`). `every`: each position's every entry, the drawn token
    then the ids the request named (vLLM's `logprob_token_ids`), whatever `k`."""
    if every:
        k = max((len(p.top) for p in positions if p is not None), default=0) + 1
    def text(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])

    if chat:
        def entry(token_id: int, value: float) -> dict[str, Any]:
            t = text(token_id)
            return {"token": t, "logprob": max(value, _FLOOR), "bytes": list(t.encode("utf-8", errors="replace"))}

        return {"content": [{**entry(p.token_id, p.logprob),
                             "top_logprobs": [entry(i, v) for i, v in list(_ranked(p).items())[:k]]}
                            for p in positions]}  # fmt: skip
    tokens = [text(p.token_id if p is not None else token_ids[i]) for i, p in enumerate(positions)]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {
        "text_offset": offsets,
        "token_logprobs": [max(p.logprob, _FLOOR) if p is not None else None for p in positions],
        "tokens": tokens,
        "top_logprobs": [{text(i): max(v, _FLOOR) for i, v in list(_ranked(p).items())[: k + 1]} if p is not None
                         else None for p in positions],
    }


def echoed(prompt: Sequence[TokenLogprobs | None] | None, positions: Sequence[TokenLogprobs],
           echo_only: bool) -> list[TokenLogprobs | None]:
    """The positions a completion's `echo` shows logprobs for: its prompt's (the first
    None), then what it drew unless `echo_only` (vLLM's `max_tokens: 0`)."""
    return [*(prompt or ()), *(() if echo_only else positions)]


def prompt_logprobs(tokenizer: Tokenizer, positions: Sequence[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` field: per prompt token (the first None), its `Logprob`s by
    token id, the prompt token first, then the top ones, each with its rank (the top's by
    place, as vLLM's dict keeps the prompt token's key first and the top entry's rank)."""
    out: list[dict[str, Any] | None] = []
    for p in positions:
        if p is None:
            out.append(None)
            continue
        ranked = {p.token_id: (p.logprob, p.rank)}
        for place, (token_id, value) in enumerate(p.top, 1):
            ranked[token_id] = (value, place)
        out.append({str(t): {"logprob": max(v, _FLOOR), "rank": r, "decoded_token": tokenizer.decode([t])}
                    for t, (v, r) in ranked.items()})
    return out


def completion_body(rid: str, created: int, model: str, outputs: Sequence[RequestOutput], eos: int,
                    logprobs: Sequence[dict[str, Any] | None], n: int = 1, *, echo: Sequence[str] = (),
                    echo_only: bool = False, prompt_logprobs: Sequence[list[Any] | None] = (),
                    token_ids: bool = False) -> dict[str, Any]:
    """A whole completion of one choice per output (choice i: `outputs[i]`, `n` per
    prompt); `logprobs`: each choice's (`logprobs()`), None where not asked for. `echo`:
    each prompt's text, which its choices' texts start with (`echo_only`: nothing after
    it). `prompt_logprobs`: each choice's (`prompt_logprobs()`), where asked for.
    `token_ids`: each choice's prompt and output ids too (vLLM's `return_token_ids`)."""
    choices = []
    for i, (o, lp) in enumerate(zip(outputs, logprobs, strict=True)):
        text = o.text if not echo else echo[i // n] + ("" if echo_only else o.text)
        choice = {"index": i, "text": text, **_ending(o.finish_reason, stop_reason(o, eos), lp)}
        if prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs[i]
        if token_ids:
            choice["prompt_token_ids"], choice["token_ids"] = list(o.prompt_token_ids), list(o.token_ids)
        choices.append(choice)
    return _body(rid, "text_completion", created, model, choices, usage=output_usage(outputs, n))


def completion_chunk(
    rid: str, created: int, model: str, text: str, finish_reason: str | None = None, stop: int | str | None = None,
    logprobs: dict[str, Any] | None = None, index: int = 0, **ids: list[int],
) -> dict[str, Any]:
    """One chunk of a completion; `ids`: its `token_ids` (and a first chunk's `prompt_token_ids`)."""
    choice = {"index": index, "text": text, **_ending(finish_reason, stop, logprobs), **ids}
    return _body(rid, "text_completion", created, model, [choice])


def chat_body(rid: str, created: int, model: str, outputs: Sequence[RequestOutput], eos: int,
              logprobs: Sequence[dict[str, Any] | None], n: int = 1, *,
              prompt_logprobs: Sequence[list[Any] | None] = (), token_ids: bool = False,
              echo: str = "", role: str = "assistant", tools: ToolChoice | None = None) -> dict[str, Any]:
    """A whole chat completion; arguments as `completion_body`'s (vLLM puts a chat's
    `prompt_logprobs` and `prompt_token_ids` beside its choices: the prompt's, one for all;
    `echo` starts each choice's content; `role` its messages'; `tools` a forced tool call,
    which each choice's output is: its message's `tool_calls`)."""
    choices = []
    for i, (o, lp) in enumerate(zip(outputs, logprobs, strict=True)):
        message: dict[str, Any] = {"role": role, "content": echo + o.text, "tool_calls": []}
        finish = o.finish_reason
        calls = tool_calls(tools, o.text) if tools is not None else None
        if calls is not None:
            message = {"role": role, "content": "", "tool_calls": calls}
            finish = _tool_finish(tools, finish)  # type: ignore[arg-type]
        choices.append({"index": i, "message": message, **_ending(finish, stop_reason(o, eos), lp),
                        **({"token_ids": list(o.token_ids)} if token_ids else {})})  # fmt: skip
    extra: dict[str, Any] = {"prompt_logprobs": prompt_logprobs[-1]} if prompt_logprobs else {}
    if token_ids:
        extra["prompt_token_ids"] = list(outputs[-1].prompt_token_ids)
    return _body(rid, "chat.completion", created, model, choices, usage=output_usage(outputs, n), **extra)


def chat_chunk(
    rid: str, created: int, model: str, delta: dict[str, Any], finish_reason: str | None = None,
    stop: int | str | None = None, logprobs: dict[str, Any] | None = None, index: int = 0, **ids: list[int],
) -> dict[str, Any]:
    """One chunk of a chat; `ids`: its `token_ids`."""
    choice = {"index": index, "delta": delta, **_ending(finish_reason, stop, logprobs), **ids}
    return _body(rid, "chat.completion.chunk", created, model, [choice])


def _tool_finish(forced: ToolChoice, finish_reason: str) -> str:
    """vLLM's: "required" calls that ended well finish with "tool_calls"; a named call
    with the output's own reason."""
    return "tool_calls" if forced.name is None and finish_reason == "stop" else finish_reason


class ToolDeltas:
    """A forced tool call's stream (vLLM's chunks): a named function's arguments as they
    are drawn, the first delta with the call's id, type and name; "required" calls whole in
    the chunk that ends the choice (vLLM parses the array as it grows; here the chunks before
    carry an empty delta), or the text as content when it is not a whole array."""

    def __init__(self, forced: ToolChoice) -> None:
        self._forced = forced
        self._started = False
        self._held: list[str] = []

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta of a chunk whose output text is `text`, and its finish reason."""
        forced = self._forced
        if forced.name is not None:
            if self._started:
                return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}, finish_reason
            self._started = True
            call = tool_calls(forced, text)[0]  # type: ignore[index]
            return {"tool_calls": [{"index": 0, **call}]}, finish_reason
        self._held.append(text)
        if finish_reason is None:
            return {}, None
        whole = "".join(self._held)
        calls = tool_calls(forced, whole)
        if calls is None:
            return {"content": whole}, finish_reason
        return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, _tool_finish(forced, finish_reason)


def usage_chunk(rid: str, created: int, model: str, obj: str, outputs: Sequence[RequestOutput],
                n: int = 1) -> dict[str, Any]:
    """The final chunk of a stream that asked for usage: no choices, the usage."""
    return _body(rid, obj, created, model, [], usage=output_usage(outputs, n))
