"""Tool calls a chat forces (vLLM 0.33's `tool_choice` "required" or a named function), by
constrained decoding.

Owns `ToolChoice` (what a chat's `tools` and `tool_choice` ask for, checked with vLLM's
messages), the JSON schema its output follows (a named function: its `parameters`;
"required": vLLM's array of `{"name", "parameters"}` objects, one per call, each name one of
the tools'), and `tool_calls`, which turns the output into the message's `tool_calls`.
Nothing here guesses at a call in free text: "auto" needs a model-specific parser (vLLM's
`--tool-call-parser`), which this server does not have, so "auto" with tools is vLLM's 400
for a server started without one.

Must never: run anything, or answer a request whose tools it cannot force.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from prefixcache.serve.errors import APIError
from prefixcache.serve.openai_types import ChatCompletionRequest

__all__ = ["ToolChoice", "tool_choice", "tool_calls"]


@dataclass(frozen=True)
class ToolChoice:
    """A forced tool call: `name` the named function's (None: "required", any of the
    tools, one or more calls), `schema` the JSON schema the output follows."""

    name: str | None
    schema: dict[str, Any]
    parallel: bool = True  # "required": every call made, else only the first (vLLM's parallel_tool_calls)


def tool_choice(body: ChatCompletionRequest) -> ToolChoice | None:
    """What `body`'s `tools` and `tool_choice` force (None: nothing, the tools are only
    shown to the chat template), checked as vLLM checks them."""
    tools, choice = body.tools, body.tool_choice
    if tools is not None and not tools:
        raise APIError("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                       "entirely.", param="tools")  # fmt: skip
    if choice is None:
        choice = "auto" if tools else "none"  # vLLM's default
    if choice == "none":
        return None
    if not tools:
        raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if choice == "auto":
        raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set; this '
                       'server has no tool-call parser: ask for "required" or a named function, which it forces by '
                       "constrained decoding", param="tool_choice")  # fmt: skip
    by_name = {t.function.name: t.function.parameters for t in tools}
    if choice == "required":
        return ToolChoice(None, _required_schema(by_name), parallel=body.parallel_tool_calls is not False)
    name = choice.function.name
    if name not in by_name:
        raise APIError(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
    return ToolChoice(name, _parameters(by_name[name]))


def _parameters(params: dict[str, Any] | None) -> dict[str, Any]:
    return params if params else {"type": "object", "properties": {}}


def _required_schema(by_name: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """vLLM's schema for "required": a non-empty array of calls, each `{"name": one of the
    tools, "parameters": its schema}`; the tools' `$defs` lifted to the top (a name defined
    twice differently is vLLM's 400)."""
    defs: dict[str, Any] = {}
    calls = []
    for name, params in by_name.items():
        params = dict(_parameters(params))
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise APIError(f"Tool definition '{key}' has multiple schemas, which is not supported.", param="tools")
            defs[key] = value
        calls.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                      "required": ["name", "parameters"]})  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    return schema


def tool_calls(choice: ToolChoice, text: str) -> list[dict[str, Any]] | None:
    """The `tool_calls` of a message whose output is `text`: the named function's, its
    arguments the text as drawn, or each call of a "required" array, its arguments
    re-serialized (vLLM's `json.dumps(..., ensure_ascii=False)`). None when the text is
    not a whole array of calls (the output was cut by `max_tokens`): the message keeps it
    as content."""
    if choice.name is not None:
        return [_call(choice.name, text)]
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    out = [_call(str(c["name"]), json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]
    return out if choice.parallel else out[:1]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}  # fmt: skip
