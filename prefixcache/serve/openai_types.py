"""Request bodies of the OpenAI API as vLLM 0.33 accepts them, for the fields we serve.

Owns the pydantic models FastAPI validates `POST /v1/completions` and
`POST /v1/chat/completions` bodies against. Field names, types and defaults are vLLM
0.33's (`vllm/entrypoints/openai/{completion,chat_completion}/protocol.py`): `max_tokens`
defaults to 16 for completions and to "the rest of the context" for chat, a completion
`prompt` is a string or token ids (ids >= 0, never bools), and fields this server does not
know are accepted and ignored, as vLLM's `extra="allow"` does. vLLM's own extensions we
honor: `top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `allowed_token_ids`, `ignore_eos`,
`stop_token_ids`, `include_stop_str_in_output`, `cache_salt`.
Logprobs as vLLM asks for them: a completion's `logprobs` is a count; a chat's `logprobs`
a flag with `top_logprobs` (default 0) the count.

Also served: `echo`, `prompt_logprobs`, `logprob_token_ids`, `bad_words`, `skip_special_tokens`,
`response_format` / `structured_outputs` (a structural tag in vLLM's legacy form), `request_id`, `return_token_ids`,
`return_tokens_as_token_ids`, a completion's `add_special_tokens`, a chat's
`chat_template_kwargs`, `documents`, `add_generation_prompt` and `continue_final_message`,
`truncate_prompt_tokens` and `truncation_side`, `repetition_detection`, a chat's `tools` with
`tool_choice` "required" or a named function (`serve.tools`), `priority` (with
`engine.scheduling_policy: priority`). What we do
not serve is refused by `unsupported()` with the field
named (a 400), never silently ignored: `best_of`, `suffix`, non-text chat content, and
vLLM's fields that change what is generated or answered (beam search, transfer
parameters, ...: `_NEUTRAL`) set to anything but the value that asks for nothing.

Must never: run anything or decide status codes (`errors` does).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

__all__ = ["CompletionRequest", "ChatCompletionRequest", "ChatMessage", "StreamOptions", "unsupported",
           "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"]

TokenId = Annotated[StrictInt, Field(ge=0)]
"""A token id in a request: an int >= 0 (strict: `true` is not 1)."""

_INT64 = (-(2**63), 2**63 - 1)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`: OpenAI's (its `schema`; `name` and `strict` are
    accepted, as vLLM accepts them)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class StructuralTagStructure(_Request):
    """One structure of a structural tag (vLLM's `LegacyStructuralTag`): text `begin`, a
    body that follows the JSON schema `schema`, text `end`."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    begin: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    end: str


class ResponseFormat(_Request):
    """OpenAI's `response_format`, and vLLM's `structural_tag` type: its legacy form
    (`structures`, `triggers`); its `format` form is accepted here and refused by name."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[StructuralTagStructure] | None = None
    triggers: list[str] | None = None
    format: Any = None


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object,
    structural_tag: the JSON text of a legacy structural tag)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Accepted at the values that ask for nothing (vLLM's defaults); anything else is refused.
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class RepetitionDetectionParams(_Request):
    """vLLM's `repetition_detection` (its checks are the engine's: `engine.repetition`)."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0


class _Sampling(_Request):
    """Fields both endpoints share."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=_INT64[0], le=_INT64[1])
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    logprob_token_ids: list[TokenId] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_INT64[1])
    truncation_side: Literal["left", "right"] | None = None
    repetition_detection: RepetitionDetectionParams | None = None
    # Lower goes first under `engine.scheduling_policy: priority`; anything but 0 otherwise is the engine's 400.
    priority: int = Field(0, ge=_INT64[0], le=_INT64[1])
    bad_words: list[str] | None = None
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's fast detokenizer ignores it too (only its slow, Python tokenizers space them).
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(_Request):
    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(_Request):
    """A tool's function: its `name` and the JSON schema of its `parameters`."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Request):
    """One of a chat's `tools` (OpenAI's; functions only, as vLLM's chat endpoint)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming the function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    echo: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None  # served with `server.trust_request_chat_template`
    tools: list[ChatTool] | None = None
    # None: vLLM's default, "auto" with tools and "none" without (`serve.tools`).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True


class TokenizeCompletionRequest(_Request):
    """`POST /tokenize` of a prompt (vLLM's)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatCompletionRequest):
    """`POST /tokenize` of a chat (vLLM's): the chat's fields that shape its prompt."""

    return_token_strs: bool | None = False


class DetokenizeRequest(_Request):
    """`POST /detokenize` (vLLM's)."""

    model: str | None = None
    tokens: list[TokenId]


# vLLM request fields that change what is generated, which this server does not do, with
# the values that ask for nothing: as extra fields they would be accepted and ignored, so
# a request that sets one otherwise is refused rather than answered as if it had not.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None,),  # a completion's (a chat's are served: `serve.tools`)
    "functions": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "use_beam_search": (False,),
    "tool_choice": (None, "none"),  # a completion's
    "prompt_embeds": (None,),
    "watermarking": (None, False),
    "thinking_token_budget": (None, -1),
    "mm_processor_kwargs": (None,),
    # Disaggregated prefill/decode and encoder-cache transfer: a P/D proxy must not believe
    # this replica took part.
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
}


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality, a bool equal only to a bool (`true` is not a penalty of 1)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def unsupported(body: _Sampling) -> tuple[str, str] | None:
    """(field, message) for the first feature `body` asks for that this server does not
    serve, or None."""
    for name, value in (body.model_extra or {}).items():
        neutral = _NEUTRAL.get(name)
        if neutral is not None and not any(_same(value, v) for v in neutral):
            allowed = " or ".join(repr(v) for v in neutral)
            return name, f"{name} is not supported: this server generates without it (only {allowed} is accepted)"
    if isinstance(body, CompletionRequest):
        if body.best_of not in (None, 1):
            return "best_of", "best_of is not supported"
        if body.suffix:
            return "suffix", "suffix is not supported"
    return None
