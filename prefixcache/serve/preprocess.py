"""From a request's body bytes to what the engine runs, off the event loop.

Owns `Preprocessor`: the CPU work of a request (parsing its JSON, validating it against
the OpenAI request models, checking it against the served model, rendering the chat
template, tokenizing) done in a few daemon threads of its own, so that one large or
slow request never holds the event loop that answers every other request, `/health`
included. A request goes through `prepare`, which ends in a `Prepared` (the parsed body
and its `GenerationRequest`) or raises what its handler turns into an error body:
FastAPI's `RequestValidationError` (400 "Bad Request", the field's path) or an `APIError`.
`/tokenize` and `/detokenize` go through `tokenize_now` and `detokenize_now`, on the same
threads, with the same chat-template path and checks as a generation's prompt.

The checks, in vLLM 0.33's terms (errors: 400 BadRequestError unless said):
- the body: JSON (Python's parser; a nesting too deep for it is a 400 too), an object of
  the request model's fields (pydantic, lax as FastAPI is: `"16"` is 16, `true` is 1);
  any string holding a lone UTF-16 surrogate (`"\\ud800"`, valid JSON but no Unicode
  text) is refused naming its field, before anything reads it;
- `model` other than the served name -> 404 NotFoundError (`param: "model"`); a feature
  not served (`openai_types.unsupported`); sampling as vLLM's `SamplingParams` checks and
  clamps it (`engine.config.SamplingConfig`);
- a text prompt (or a rendered chat) longer than `max_model_len * max_chars_per_token`
  characters, which cannot fit, is refused before it is tokenized (vLLM's
  `_text_len_check`, `param: "input_text"`); a chat template is rendered within
  `server.chat_template_timeout_s` and that many characters;
- an empty prompt; a token id outside the vocabulary; a prompt of `max_model_len` tokens
  or more (`param: "input_tokens"`); `max_tokens` < 1 or > `max_model_len`; an empty
  stop string, more than `MAX_STOP_STRINGS` of them or one longer than `MAX_STOP_CHARS`
  (`param: "stop"`); a negative `logprobs` (completions), `top_logprobs` below -1 or set
  without `logprobs: true` (chat), or more than `MAX_LOGPROBS` of them (-1: the whole
  vocabulary; the param is the field the count came from); `n` outside [1, `MAX_N`], a
  completion's batch of prompts with an empty one (`prompt[i]`) or more than
  `MAX_CHOICES` choices in all (prompts x n); `min_tokens` below 0 or above the request's
  `max_tokens` (after the cut below); the fields of `truncate_prompt_tokens`,
  `logprob_token_ids`, `repetition_detection`, structured outputs and forced tool calls
  (`serve.tools`) as vLLM checks each. A request
  whose prompt plus `max_tokens` passes the context gets `max_tokens` cut to what is
  left, as vLLM does.

Must never: touch the engine (the handler submits what this returns), run on the event
loop, or let a thread it starts keep the process alive (they are daemons: a rendering cut
short by its deadline is the slowest they get, and shutdown never waits on them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from prefixcache.engine.chat_template import ChatTemplateError
from prefixcache.engine.engine import GenerationRequest
from prefixcache.engine.logprobs import MAX_LOGPROB_TOKEN_IDS
from prefixcache.engine.repetition import RepetitionDetection
from prefixcache.engine.sampling import SamplingParams, child_params
from prefixcache.engine.structured import StructuredOutputs
from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.errors import ConfigError
from prefixcache.serve.errors import APIError
from prefixcache.serve.openai_types import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    unsupported,
)
from prefixcache.serve.tools import ToolChoice, tool_choice

__all__ = ["Preprocessor", "Prepared", "ReplicaInfo", "parse_body"]

T = TypeVar("T")
Body = CompletionRequest | ChatCompletionRequest
MAX_STOP_STRINGS = 64
"""Stop strings a request may give (OpenAI allows 4, vLLM any number)."""
MAX_STOP_CHARS = 1024
"""CHARACTERS in one stop string."""
MAX_N = 128
"""Choices one request may ask for (OpenAI's bound on `n`): each is a sequence of the
engine's, so the count bounds what one request adds to the batch."""
MAX_CHOICES = 1024
"""Choices of one request in all (its prompts x n): each is a sequence of the engine's."""
MAX_LOGPROBS = 20
"""Top logprobs one drawn token may return (vLLM's `max_logprobs` default): each costs a
decoded token and a JSON entry per token, so the count bounds what a response weighs."""
# A JSON string escape of a UTF-16 surrogate: the only way a lone one gets into parsed text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclass(frozen=True)
class ReplicaInfo:
    """What the routes and the checks need to know about the served model (read-only)."""

    model_name: str  # the name requests use ("model")
    model_root: str  # what engine.model names
    max_model_len: int  # TOKENS: prompt + output
    vocab_size: int
    eos_token_id: int
    default_sampling: SamplingParams
    created: int


@dataclass(frozen=True)
class Prepared:
    """A checked request: its body and what the engine runs, one `GenerationRequest` per
    choice, prompt by prompt (a completion may have several), `n` per prompt (vLLM's
    child requests: ids "{j}_{request id}" and seeds seed + j when n > 1,
    `sampling.child_params`); `generation` is the first."""

    body: Body
    generations: tuple[GenerationRequest, ...]
    n: int = 1
    #: With `echo`: a completion's prompts' texts, which its choices' texts start with; a
    #: chat's last message's text, when the assistant's (vLLM's).
    echo: tuple[str, ...] = ()
    #: `echo` with `max_tokens` 0 (vLLM's): the engine draws one token, the response shows the prompt alone.
    echo_only: bool = False
    #: A chat's response role: the assistant's, or without `add_generation_prompt` the last
    #: message's (vLLM's `get_chat_request_role`: the response continues that message).
    role: str = "assistant"
    #: A chat's forced tool call (`tool_choice` "required" or named): its output is the call.
    tools: ToolChoice | None = None

    @property
    def generation(self) -> GenerationRequest:
        return self.generations[0]


class Preprocessor:
    """`threads` daemon threads that prepare requests (see the module docstring)."""

    def __init__(self, model: ReplicaInfo, tokenizer: Tokenizer, *, threads: int = 2,
                 chat_template_timeout_s: float = 2.0, trust_request_chat_template: bool = False) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.chat_template_timeout_s = chat_template_timeout_s
        self.trust_request_chat_template = trust_request_chat_template
        # Characters past which a text has more tokens than the context holds (vLLM's bound).
        self.max_chars = model.max_model_len * tokenizer.max_chars_per_token
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"preprocess-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        """Stop the threads once the jobs queued so far are done (does not wait)."""
        for _ in self._threads:
            self._jobs.put(None)

    async def prepare(self, raw: bytes, *, chat: bool, request_id: str, arrival_s: float) -> Prepared:
        """`raw` (a request body) checked and tokenized in a worker thread."""
        return await self.run(self.prepare_now, raw, chat, request_id, arrival_s)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread, awaited."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as err:  # noqa: BLE001 - handed to the awaiting handler
                    future.set_exception(err)

        self._jobs.put(job)
        return await asyncio.wrap_future(future)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    # -- the checks (a worker thread) ---------------------------------------------------------
    def prepare_now(self, raw: bytes, chat: bool, request_id: str, arrival_s: float) -> Prepared:
        """What `prepare` runs, in the calling thread."""
        body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
        model = self.model
        self._check_model(body.model)
        refused = unsupported(body)
        if refused is not None:
            raise APIError(refused[1], param=refused[0])
        if not 1 <= body.n <= MAX_N:  # before any prompt is tokenized
            raise APIError(f"n must be at least 1 and at most {MAX_N}, got {body.n}.", param="n")
        forced = None
        if isinstance(body, ChatCompletionRequest):
            forced = tool_choice(body)
            messages = _chat_messages(body)
            prompts = [self._chat_prompt(body, messages)]
            limit, param = ((body.max_completion_tokens, "max_completion_tokens")
                            if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
        else:
            prompts = self._completion_prompts(body.prompt, body.add_special_tokens)
            limit, param = body.max_tokens, "max_tokens"
            if body.echo and limit == 0:
                limit = 1  # vLLM's echo_without_generation: one token drawn, none shown
        if len(prompts) * body.n > MAX_CHOICES:
            raise APIError(f"{len(prompts)} prompts x n={body.n} choices is more than {MAX_CHOICES} choices",
                           param="prompt" if len(prompts) > 1 else "n")
        sent, prompts = prompts, [self._truncated(p, body, limit, param) for p in prompts]
        # What the body asks of every prompt alike, checked once.
        named = _logprob_token_ids(body, self.model.vocab_size)
        shared = GenerationRequest(
            namespace=body.cache_salt, sampling=_sampling(body, self.model.default_sampling),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, arrival_s=arrival_s,
            stop=_stop_strings(body), include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=_logprobs(body, self.model.vocab_size, named), logprob_token_ids=named, min_tokens=body.min_tokens,
            skip_special_tokens=body.skip_special_tokens, prompt_logprobs=_prompt_logprobs(body, self.model.vocab_size),
            structured_outputs=_structured_outputs(body, forced), bad_words=_bad_words(body),
            repetition_detection=_repetition_detection(body), priority=body.priority,
        )
        out = []
        for i, prompt in enumerate(prompts):
            # vLLM's ids: "{id}-{i}" per prompt of several, "{j}_{that}" per choice of n > 1.
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            gen = self._generation(shared, prompt, limit, param, rid)
            # Without sampling fields the engine's default applies, whose seed it offsets per request.
            out.extend([gen] if body.n == 1 else
                       [replace(gen, request_id=f"{j}_{rid}", sampling=gen.sampling and child_params(gen.sampling, j))
                        for j in range(body.n)])  # fmt: skip
        if isinstance(body, ChatCompletionRequest):
            role = "assistant" if body.add_generation_prompt else messages[-1]["role"]
            return Prepared(body, tuple(out), body.n, (_chat_echo(messages, role),) if body.echo else (), role=role,
                            tools=forced)  # fmt: skip
        if not body.echo:
            return Prepared(body, tuple(out), body.n)
        return Prepared(body, tuple(out), body.n, self._echo_texts(body, prompts, sent), body.max_tokens == 0)

    def _check_model(self, name: str | None) -> None:
        if name and name != self.model.model_name:
            raise APIError(f"The model `{name}` does not exist. Valid aliases: {self.model.model_name}.",
                           param="model", status=404)

    def tokenize_now(self, raw: bytes) -> dict[str, Any]:
        """vLLM's `/tokenize`: a prompt's token ids, or a chat's through its template, as the
        generation routes tokenize them (the same checks, bounds and errors)."""
        body = parse_body(raw, lambda data: TokenizeChatRequest if isinstance(data, dict) and "messages" in data
                          else TokenizeCompletionRequest)  # fmt: skip
        self._check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = self._chat_prompt(body, _chat_messages(body))
        else:
            self._check_text(body.prompt, "prompt")
            ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = [self.tokenizer.token(t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize_now(self, raw: bytes) -> dict[str, Any]:
        """vLLM's `/detokenize`: the text of token ids (ids past the vocabulary: a 400)."""
        body = parse_body(raw, DetokenizeRequest)
        self._check_model(body.model)
        if bad := [t for t in body.tokens if t >= self.model.vocab_size]:
            raise APIError(f"Token id(s) {bad[:8]} are out of vocabulary (vocab_size {self.model.vocab_size})",
                           param="tokens")  # fmt: skip
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def _echo_texts(self, body: CompletionRequest, prompts: list[list[int]], sent: list[list[int]]) -> tuple[str, ...]:
        """What `echo` repeats of each prompt: its text as sent, or the text of its token ids
        (those `truncate_prompt_tokens` kept, when it cut the prompt: `sent` are the ids
        before it); none with `return_token_ids`, as vLLM: the ids say it."""
        if body.return_token_ids:
            return ("",) * len(prompts)
        prompt = body.prompt
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt[0], str) else [None] * len(prompts)
        return tuple(t if t is not None and len(ids) == len(whole) else self.tokenizer.decode(ids)
                     for t, ids, whole in zip(texts, prompts, sent))  # fmt: skip

    def _truncated(self, prompt: list[int], body: Body, max_tokens: int | None, param: str) -> list[int]:
        """`prompt` cut to `truncate_prompt_tokens` TOKENS (-1: what the context leaves
        after `max_tokens`), its last ones kept (vLLM's left truncation; `truncation_side`
        "right" keeps the first), checked as vLLM checks it."""
        keep = body.truncate_prompt_tokens
        if keep is None:
            return prompt
        limit = self.model.max_model_len
        room = limit - (max_tokens or 0)
        if keep == -1:
            keep = room
        elif keep > room:
            raise APIError(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len - {param} = {room}. "
                           "Please request a smaller truncation size.", param="truncate_prompt_tokens")  # fmt: skip
        if keep >= len(prompt):
            return prompt
        if keep <= 0:
            raise APIError("The decoder prompt cannot be empty", param="truncate_prompt_tokens")
        return prompt[:keep] if body.truncation_side == "right" else prompt[-keep:]

    def _check_text(self, text: str, param: str) -> None:
        if len(text) > self.max_chars:
            limit = self.model.max_model_len
            raise APIError(f"This model's maximum context length is {limit} tokens. However, your prompt contains "
                           f"{len(text)} characters (more than {self.max_chars} characters, which is the upper "
                           f"bound for {limit} input tokens). Please reduce the length of the input prompt.",
                           param=param)

    def _completion_prompts(self, prompt: Any, add_special_tokens: bool = True) -> list[list[int]]:
        """A completion's prompts (one, or a batch as vLLM takes them: a list of strings or
        of token-id lists), each tokenized (with the tokenizer's BOS unless
        `add_special_tokens` is False, vLLM's field) and checked."""
        batch = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        prompts = prompt if batch else [prompt]
        if len(prompts) > MAX_CHOICES:
            raise APIError(f"at most {MAX_CHOICES} prompts per request, got {len(prompts)}", param="prompt")
        out = []
        for i, p in enumerate(prompts):
            where = f"prompt[{i}]" if batch else "prompt"
            if isinstance(p, str):
                self._check_text(p, "input_text")
                ids = self.tokenizer.encode(p, add_special_tokens=add_special_tokens)
            else:
                ids = list(p)
            if not ids:
                raise APIError("The decoder prompt cannot be empty", param=where)
            out.append(ids)
        return out

    def _chat_prompt(self, body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of `messages` (`_chat_messages(body)`) through the chat template."""
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                           param="continue_final_message")  # fmt: skip
        own = body.chat_template if body.chat_template is not None else (body.chat_template_kwargs or {}).get(
            "chat_template")
        if own is not None and not self.trust_request_chat_template:
            raise APIError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                           "Refused request with untrusted chat template.", param="chat_template")  # fmt: skip
        if own is not None and not isinstance(own, str):
            raise APIError(f"chat_template must be a string, got {type(own).__name__}", param="chat_template")
        variables = {k: v for k, v in _template_variables(body).items() if k != "chat_template"}
        try:
            ids = self.tokenizer.apply_chat_template(messages, timeout_s=self.chat_template_timeout_s,
                                                     max_chars=self.max_chars, variables=variables,
                                                     add_generation_prompt=body.add_generation_prompt,
                                                     continue_final_message=body.continue_final_message,
                                                     template=own)  # fmt: skip
        except ChatTemplateError as err:
            param = ("chat_template_kwargs" if str(err).startswith("chat_template_kwargs")
                     else "chat_template" if own is not None else "messages")  # fmt: skip
            raise APIError(str(err), param=param) from None
        if not ids:
            raise APIError("The decoder prompt cannot be empty", param="messages")
        return ids

    def _generation(self, shared: GenerationRequest, prompt: list[int], max_tokens: int | None, param: str,
                    rid: str) -> GenerationRequest:
        """`shared` (what the body asks of every prompt) for one prompt, with its checks:
        the vocabulary, the context, `max_tokens` cut to what the context leaves, and
        `min_tokens` within that."""
        model = self.model
        top = max(prompt)
        if top >= model.vocab_size:
            raise APIError(f"Token id {top} is out of vocabulary (vocab_size {model.vocab_size})", param="prompt")
        limit = model.max_model_len
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
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        if shared.min_tokens < 0:
            raise APIError(f"min_tokens must be greater than or equal to 0, got {shared.min_tokens}.",
                           param="min_tokens")
        if shared.min_tokens > max_tokens:
            raise APIError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                           f"got {shared.min_tokens}.", param="min_tokens")
        return replace(shared, prompt=prompt, max_tokens=max_tokens, request_id=rid)


def _stop_strings(body: Body) -> tuple[str, ...]:
    """The request's stop strings, as vLLM takes them (a string or a list; none empty),
    within MAX_STOP_STRINGS of MAX_STOP_CHARS each: the engine looks for every one after
    each token, so their number and length bound what one request costs every step."""
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
    for s in stops:
        if not s:
            raise APIError("stop cannot contain an empty string.", param="stop")
        if len(s) > MAX_STOP_CHARS:
            raise APIError(f"stop: a stop string of at most {MAX_STOP_CHARS} characters, got {len(s)}", param="stop")
    return stops


def _bad_words(body: Body) -> tuple[str, ...]:
    """The request's bad words, within the stop strings' bounds (each is compared with
    the output's end after every token); a blank one is a 400 naming `bad_words`."""
    words = tuple(body.bad_words or ())
    if len(words) > MAX_STOP_STRINGS:
        raise APIError(f"bad_words: at most {MAX_STOP_STRINGS} words, got {len(words)}", param="bad_words")
    for w in words:
        if not w.strip() or len(w) > MAX_STOP_CHARS:
            raise APIError(f"bad_words: each word must be non-blank and at most {MAX_STOP_CHARS} characters",
                           param="bad_words")
    return words


def _logprob_token_ids(body: Body, vocab_size: int) -> tuple[int, ...] | None:
    """The ids whose logprobs each drawn token returns in place of the most likely ones
    (None: none; vLLM's `logprob_token_ids`), checked as vLLM checks them."""
    ids, param = body.logprob_token_ids, "logprob_token_ids"
    if ids is None:
        return None
    if not ids:
        raise APIError("`logprob_token_ids` must not be an empty list.", param=param)
    if isinstance(body, ChatCompletionRequest):
        if not body.logprobs:
            raise APIError("when using `logprob_token_ids`, `logprobs` must be set to true.", param=param)
    else:
        if body.echo and body.max_tokens == 0:
            raise APIError("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no "
                           "output tokens are generated.", param=param)  # fmt: skip
        if body.logprobs is None:
            raise APIError("when using `logprob_token_ids`, `logprobs` must be set.", param=param)
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise APIError(f"Requested logprob_token_ids of length {len(ids)}, which is greater than max allowed: "
                       f"{MAX_LOGPROB_TOKEN_IDS}", param=param)  # fmt: skip
    if bad := [t for t in ids if t >= vocab_size]:
        raise APIError(f"token_id(s) {bad} in logprob_token_ids contain out-of-vocab token ids. Vocabulary size: "
                       f"{vocab_size}", param=param)  # fmt: skip
    return tuple(ids)


def _logprobs(body: Body, vocab_size: int, named: tuple[int, ...] | None = None) -> int | None:
    """How many top logprobs each drawn token returns (None: no logprobs), checked as
    vLLM checks them: its request models' rules, then `max_logprobs`. With `named` ids
    (`logprob_token_ids`), their number: vLLM drops the count then, so no cap applies."""
    if isinstance(body, ChatCompletionRequest):
        k, param = body.top_logprobs, "top_logprobs"
        if k is not None and k < -1:
            raise APIError("`top_logprobs` must be a positive value or -1.", param=param)
        if k is not None and k != 0 and not body.logprobs:
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.", param=param)
        if not body.logprobs:
            return None
    else:
        k, param = body.logprobs, "logprobs"
        if k is not None and k < 0:
            raise APIError("`logprobs` must be a positive value.", param=param)
    if named:
        return len(named)
    if k is None:
        return None
    wanted = vocab_size if k == -1 else k
    if wanted > MAX_LOGPROBS:
        raise APIError(f"Requested sample logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}",
                       param=param)
    return wanted


_MESSAGE_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The chat's messages as the template takes them: each content a text (its text
    parts joined; no content: empty), with an assistant's `tool_calls` and a tool
    result's `tool_call_id` and `name` as sent. A 400 naming the part that is not text."""
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
        message = {"role": m.role, "content": content}
        for key in _MESSAGE_TOOL_KEYS:  # an agent's earlier turns, for a tool-calling template
            if key in (m.model_extra or {}):
                message[key] = m.model_extra[key]
        messages.append(message)
    return messages


def _repetition_detection(body: Body) -> RepetitionDetection | None:
    """vLLM's `repetition_detection`, checked as it checks it (None: off)."""
    params = body.repetition_detection
    if params is None:
        return None
    try:
        return RepetitionDetection(params.max_pattern_size, params.min_pattern_size, params.min_count)
    except ValueError as err:
        raise APIError(str(err), param="repetition_detection") from None


def _template_variables(body: ChatCompletionRequest) -> dict[str, Any]:
    """What a chat template sees besides its messages: `chat_template_kwargs`, then
    `documents` (vLLM's: a RAG template reads them; any other ignores them) and `tools`
    (a tool-calling template lists them), which a kwarg of the same name does not replace
    (vLLM merges them over the kwargs)."""
    variables = dict(body.chat_template_kwargs or {})
    if body.documents is not None:
        variables["documents"] = body.documents
    if body.tools:  # vLLM's: a tool-calling template lists them
        variables["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
    return variables


def _chat_echo(messages: list[dict[str, Any]], role: str) -> str:
    """What a chat's `echo` repeats (vLLM's): the last message's text when it has the
    response's `role` (the message the response continues), else nothing."""
    return messages[-1]["content"] if messages[-1]["role"] == role else ""


def _structured_outputs(body: Body, forced: ToolChoice | None = None) -> StructuredOutputs | None:
    """The grammar the request's output follows (None: none), from a chat's forced tool
    call (`forced`: its schema), `response_format` (OpenAI's json_object / json_schema,
    vLLM's structural_tag) or vLLM's `structured_outputs`, checked as vLLM checks them; the
    engine compiles it (a 400 naming the field if it does not compile)."""
    rf, so = body.response_format, body.structured_outputs
    if forced is not None:
        if so is not None or (rf is not None and rf.type != "text"):
            raise APIError("You can only either use constraints for structured outputs or tools, not both.",
                           param="tool_choice")  # fmt: skip
        return StructuredOutputs(json=forced.schema)
    if rf is not None and rf.type != "text":
        if so is not None:
            raise APIError("You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                           "'choice').", param="structured_outputs")
        if rf.type == "json_object":
            return StructuredOutputs(json_object=True)
        if rf.type == "structural_tag":
            if rf.structures is None and rf.format is not None:
                raise APIError("response_format.format: a structural tag's 'format' form is xgrammar's, which this "
                               "server does not run; give 'triggers' and 'structures' (the form vLLM's guidance "
                               "backend serves)", param="response_format.format")  # fmt: skip
            if rf.structures is None or rf.triggers is None:
                raise APIError("When response_format type is 'structural_tag', the 'structures' and 'triggers' fields "
                               "must be provided.", param="response_format")  # fmt: skip
            return StructuredOutputs(structural_tag={
                "structures": [{"begin": s.begin, "schema": s.schema_, "end": s.end} for s in rf.structures],
                "triggers": list(rf.triggers)})  # fmt: skip
        if rf.json_schema is None:
            raise APIError("When response_format type is 'json_schema', the 'json_schema' field must be provided.",
                           param="response_format")
        return StructuredOutputs(json=rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {})
    if so is None:
        return None
    for name, neutral in (("disable_fallback", False), ("disable_additional_properties", False),
                          ("whitespace_pattern", None)):
        if getattr(so, name) != neutral:
            raise APIError(f"structured_outputs.{name} is not supported", param=f"structured_outputs.{name}")
    spec = StructuredOutputs(json=so.json_, regex=so.regex, choice=tuple(so.choice) if so.choice is not None else None,
                             grammar=so.grammar, json_object=bool(so.json_object), structural_tag=so.structural_tag,
                             disable_any_whitespace=so.disable_any_whitespace)  # fmt: skip
    try:
        spec.kind()
    except ConfigError as err:  # none set, or several: vLLM's message for several
        several = sum(v not in (None, False) for v in (so.json_, so.regex, so.choice, so.grammar, so.json_object,
                                                        so.structural_tag)) > 1  # fmt: skip
        raise APIError("You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                       "'choice')." if several else str(err), param=err.path) from None
    return spec


def _prompt_logprobs(body: Body, vocab_size: int) -> int | None:
    """How many top logprobs each prompt token returns (None: none), checked as vLLM
    checks them. A completion with `echo` and `logprobs` returns them with its output's
    (vLLM's `to_sampling_params`)."""
    k = body.prompt_logprobs
    if k is not None:
        if body.stream and (k > 0 or k == -1):
            raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        if k < 0 and k != -1:
            raise APIError("`prompt_logprobs` must be a positive value or -1.", param="prompt_logprobs")
    elif isinstance(body, CompletionRequest) and body.echo:
        k = body.logprobs
    if k is None:
        return None
    wanted = vocab_size if k == -1 else k
    if wanted > MAX_LOGPROBS:
        raise APIError(f"Requested prompt logprobs of {wanted}, which is greater than max allowed: {MAX_LOGPROBS}",
                       param="prompt_logprobs" if body.prompt_logprobs is not None else "logprobs")
    return wanted


def _sampling(body: Body, default: SamplingParams) -> SamplingParams | None:
    """The request's sampling: None (the engine's default) if it sets no sampling field,
    else its fields over `default`, with its own seed, checked and clamped as vLLM does
    (the engine checks token ids against the vocabulary: a 400 naming the field)."""
    rest: dict[str, Any] = {name: getattr(body, name)
                            for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")}
    if body.logit_bias:  # {} asks for nothing
        try:
            rest["logit_bias"] = tuple((int(token), bias) for token, bias in body.logit_bias.items())
        except ValueError:
            raise APIError("logit_bias: its keys must be token ids", param="logit_bias") from None
    if body.allowed_token_ids is not None:
        rest["allowed_token_ids"] = tuple(body.allowed_token_ids)
    if all(v is None for v in (body.temperature, body.top_p, body.top_k, body.seed, *rest.values())):
        return None
    try:
        return SamplingParams(
            temperature=default.temperature if body.temperature is None else body.temperature,
            top_p=default.top_p if body.top_p is None else body.top_p,
            top_k=default.top_k if body.top_k is None or body.top_k == -1 else body.top_k,
            seed=body.seed,
            **{name: getattr(default, name) if v is None else v for name, v in rest.items()},
        )
    except ValueError as err:  # ConfigError names the field: "temperature: must be in [0, 2], got 3.0"
        raise APIError(str(err), param=getattr(err, "path", None)) from None


def parse_body(raw: bytes, model: type[BaseModel] | Callable[[Any], type[BaseModel]]) -> Any:
    """`raw` as an instance of `model` (or of the class `model(json)` picks for it), or the
    `RequestValidationError` FastAPI would raise (locations under "body"); a lone surrogate
    anywhere is an error at its field."""
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", err.pos), "msg": "JSON decode error",
                                       "ctx": {"error": err.msg}}]) from None
    except UnicodeDecodeError as err:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", err.start), "msg": "JSON decode error",
                                       "ctx": {"error": f"not UTF-8 ({err.reason})"}}]) from None
    except RecursionError:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "ctx": {"error": "nested too deeply"}}]) from None
    if _SURROGATE_ESCAPE.search(raw):  # cheap: only then look for a lone one, and where
        where = _lone_surrogate(data, ())
        if where is not None:
            raise RequestValidationError([{"type": "string_unicode", "loc": ("body", *where),
                                           "msg": "holds a lone UTF-16 surrogate (e.g. \\ud800), which is not "
                                                  "Unicode text"}])
    if not isinstance(model, type):
        model = model(data)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in err.errors(include_url=False, include_input=False)]
        raise RequestValidationError(errors) from None


def _lone_surrogate(value: Any, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The path of the first string (or key) in `value` that UTF-8 cannot encode."""
    stack = [(value, path)]
    while stack:
        node, at = stack.pop()
        if isinstance(node, str):
            if not _encodable(node):
                return at
        elif isinstance(node, list):
            stack.extend((item, (*at, i)) for i, item in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            for key, item in reversed(list(node.items())):
                if not _encodable(key):  # named as far as it can be printed
                    return (*at, key.encode("utf-8", "backslashreplace").decode("ascii"))
                stack.append((item, (*at, key)))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
