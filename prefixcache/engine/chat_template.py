"""Chat templates: Jinja source rendered in an immutable sandbox, bounded in time and size.

Owns `render_chat` and `ChatTemplateError`. A template is Jinja source from a GGUF file or
a config file (`engine.chat_template`), so it may come from someone else (a config under
`--no-import` is untrusted input, docs/security.md): Jinja's sandbox already keeps it away
from Python objects and caps `range()` at 100,000 items; this module adds the bounds the
sandbox lacks, so that no template can hold a thread past its deadline or build a string
that no model could take:

- time: every `for` loop iterates through a check of the deadline (the parsed template is
  rewritten so that each loop's iterable is wrapped), and so does every call, filter,
  operator and concatenation the template makes; rendering stops with a
  `ChatTemplateError` at the first check past it;
- size: output is produced chunk by chunk and counted; a call, filter, operator or
  concatenation whose result would pass the bound (`max_chars`) is refused before it
  allocates when its size is known from its arguments (`center`, `ljust`, `indent`,
  `format` widths, `*`, `**`, `+`, `~`, `join`, `replace`, `slice`, `tojson` indents)
  and after it returns otherwise.

A deadline is checked between Python-level steps, so one step (one builtin call on
arguments that passed the checks) is the most it can overrun.

Must never: let a template reach Python objects (the sandbox), or render past its bounds.
"""

from __future__ import annotations

import contextvars
import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["ChatTemplateError", "render_chat", "DEFAULT_TIMEOUT_S", "DEFAULT_MAX_CHARS"]

DEFAULT_TIMEOUT_S = 2.0
"""SECONDS a rendering may take unless the caller says (the server passes its own)."""
DEFAULT_MAX_CHARS = 16 * 1024 * 1024
"""Characters a rendering may produce unless the caller says (the server passes
max_model_len x the tokenizer's longest token)."""

Message = Mapping[str, str]

# Names the rewritten template calls; a template may call them too, to no effect beyond the checks.
_ITER = "__prefixcache_iter"
_CONCAT = "__prefixcache_concat"
_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?|\{[^{}]*?:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*\}")


class ChatTemplateError(ValueError):
    """A chat template that cannot render these messages within its bounds (or at all)."""


@dataclass
class _Budget:
    deadline: float
    max_chars: int
    timeout_s: float

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template took more than {self.timeout_s:g} s to render")

    def allow(self, size: int, what: str) -> None:
        """Refuse a result of `size` characters (or items) past the bound."""
        self.tick()
        if size > self.max_chars:
            raise ChatTemplateError(f"the chat template would build {what} of {size:,} characters or items, "
                                    f"more than the {self.max_chars:,} allowed")

    def result(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            self.allow(len(value), what)
        return value


_budget: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _format_widths(fmt: Any) -> int:
    """The largest width or precision a %- or {}-format string asks for (0 if none)."""
    if not isinstance(fmt, str):
        return 0
    return max((int(g) for m in _FORMAT_WIDTH.finditer(fmt) for g in m.groups() if g), default=0)


def _precheck(name: str, target: Any, args: Sequence[Any], kwargs: Mapping[str, Any], budget: _Budget) -> None:
    """Refuse, before it runs, a call whose result size is known from its arguments."""
    if name in ("center", "ljust", "rjust", "zfill"):
        budget.allow(_int(args[0] if args else kwargs.get("width", 0)), f"a {name}()ed string")
    elif name == "indent" and isinstance(target, str):
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else _int(width)
        budget.allow(len(target) + width * (target.count("\n") + 1), "an indented string")
    elif name == "expandtabs" and isinstance(target, str):
        budget.allow(len(target) + _int(args[0] if args else kwargs.get("tabsize", 8)) * target.count("\t"),
                     "a string with its tabs expanded")
    elif name == "replace" and isinstance(target, str) and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        hits = target.count(old) if old else len(target) + 1
        budget.allow(len(target) + hits * max(0, len(new) - len(old)), "a replaced string")
    elif name in ("format", "format_map"):
        budget.allow(_format_widths(target) + sum(_size(a) for a in args), "a formatted string")
    elif name == "join":  # str.join(items), or the filter: items|join(separator)
        if args and isinstance(args[0], (list, tuple)):
            items, sep = args[0], target
        else:
            items, sep = target, args[0] if args else ""
        if isinstance(items, (list, tuple)):
            budget.allow(sum(_size(x) for x in items) + _size(sep) * len(items), "a joined string")
    elif name == "slice":
        budget.allow(_int(args[0] if args else kwargs.get("slices", 0)), "a list of slices")
    elif name == "tojson":
        budget.allow(_int(args[0] if args else kwargs.get("indent", 0)) * 1024, "an indented JSON text")


def _checked_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    # A filter marked @pass_context / @pass_environment / @pass_eval_context takes that first.
    passes = getattr(fn, "jinja_pass_arg", None) is not None

    @functools.wraps(fn)  # keeps jinja's mark
    def checked(*args: Any, **kwargs: Any) -> Any:
        budget = _budget.get()
        plain = args[1:] if passes else args
        _precheck(name, plain[0] if plain else None, plain[1:], kwargs, budget)
        return budget.result(fn(*args, **kwargs), f"the result of the {name} filter")

    return checked


def _binop(operator: str, left: Any, right: Any) -> int:
    """The size of `left operator right` when it can be known before computing it."""
    if operator == "*":
        if _size(left) and _int(right):
            return _size(left) * _int(right)
        if _size(right) and _int(left):
            return _size(right) * _int(left)
    elif operator == "+":
        return _size(left) + _size(right)
    elif operator == "**" and _int(left) and _int(right) > 0:
        return _int(right) * max(1, abs(_int(left)).bit_length()) // 3  # ~ decimal digits of the power
    elif operator == "%" and isinstance(left, str):
        return _format_widths(left) + len(left)
    return 0


@lru_cache(maxsize=8)
def _environment() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            budget = _budget.get()
            budget.allow(_binop(operator, left, right), f"the result of {operator!r}")
            return budget.result(super().call_binop(context, operator, left, right), f"the result of {operator!r}")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's
            budget = _budget.get()
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            _precheck(getattr(method, "__name__", ""), getattr(method, "__self__", None), args, kwargs, budget)
            return budget.result(super().call(__context, __obj, *args, **kwargs), "a call's result")

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _checked_filter(name, fn) for name, fn in env.filters.items()}
    env.globals[_ITER] = _iterate
    env.globals[_CONCAT] = _concat
    return env


def _iterate(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _budget.get()
    for i, item in enumerate(iterable):
        if i % 64 == 0:
            budget.tick()
        yield item


def _concat(*parts: Any) -> str:
    budget = _budget.get()
    texts = [str(p) for p in parts]
    budget.allow(sum(len(t) for t in texts), "a concatenated string")
    return "".join(texts)


def _bounded(template: Any) -> Any:
    """The parsed template with every loop iterating, and every `~` concatenating,
    through the checks above."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def call(name: str, args: list[Any], lineno: int) -> Any:
        return nodes.Call(nodes.Name(name, "load", lineno=lineno), args, [], None, None, lineno=lineno)

    class Bound(NodeTransformer):
        def visit_For(self, node: Any) -> Any:
            node = self.generic_visit(node)
            node.iter = call(_ITER, [node.iter], node.lineno)
            return node

        def visit_Concat(self, node: Any) -> Any:
            node = self.generic_visit(node)
            return call(_CONCAT, list(node.nodes), node.lineno)

    return Bound().visit(template)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    env = _environment()
    try:
        code = env.compile(_bounded(env.parse(template)))
    except Exception as err:  # noqa: BLE001 - jinja2's TemplateSyntaxError and its kin
        raise ChatTemplateError(f"the chat template does not compile: {err}") from None
    return env.template_class.from_code(env, code, env.make_globals(None), None)


def render_chat(
    template: str, messages: Sequence[Message], *, add_generation_prompt: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S, max_chars: int = DEFAULT_MAX_CHARS,
    variables: Mapping[str, Any] | None = None, continue_final_message: bool = False,
) -> str:
    """`messages` ([{"role": ..., "content": ...}, ...]) through a Jinja chat template,
    within `timeout_s` SECONDS and `max_chars` characters of output (and of any string
    built on the way); `ChatTemplateError` (a ValueError) otherwise, or for a template that
    does not compile or raises. `variables`: more names the template sees (vLLM's
    `chat_template_kwargs`, e.g. `enable_thinking`); they cannot replace `messages` or
    `add_generation_prompt`. `continue_final_message`: the text ends where the last
    message's content does, its end-of-turn cut off, so the model continues that message
    (transformers' `apply_chat_template` rule, which vLLM uses)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    rendered = _render(template, messages, add_generation_prompt, timeout_s, max_chars, variables)
    return _cut_after_final_message(rendered, messages[-1]["content"]) if continue_final_message else rendered


def _cut_after_final_message(rendered: str, final: str) -> str:
    """`rendered` up to the end of its last occurrence of the final message's content
    (stripped of spaces; with its trailing spaces where the template kept them)."""
    core = final.strip()
    if core not in rendered:
        raise ChatTemplateError("continue_final_message is set but the final message does not appear in the chat "
                                "after applying the chat template")  # fmt: skip
    at = rendered.rindex(core)
    kept = final.lstrip()
    return rendered[: at + (len(kept) if rendered[at : at + len(kept)] == kept else len(core))]


def _render(
    template: str, messages: Sequence[Message], add_generation_prompt: bool, timeout_s: float, max_chars: int,
    variables: Mapping[str, Any] | None,
) -> str:
    extra = dict(variables or {})
    clash = sorted(set(extra) & {"messages", "add_generation_prompt"})
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs cannot set {clash[0]!r}")
    if not messages:
        raise ValueError("messages: a chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a mapping with string 'role' and 'content', got {m!r}")
    compiled = _compile(template)
    budget = _Budget(time.monotonic() + timeout_s, max_chars, timeout_s)
    token = _budget.set(budget)
    try:
        out, size = [], 0
        chunks = compiled.generate(**extra, messages=[dict(m) for m in messages],
                                   add_generation_prompt=add_generation_prompt)
        for chunk in chunks:
            size += len(chunk)
            budget.allow(size, "a prompt")
            out.append(chunk)
        return "".join(out)
    except ChatTemplateError:
        raise
    except RecursionError:
        raise ChatTemplateError("the chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError("the chat template ran out of memory") from None
    except Exception as err:  # noqa: BLE001 - a template that raises (jinja2 TemplateError, a TypeError in it)
        why = f"{type(err).__name__}: {err}"
        raise ChatTemplateError(f"the chat template cannot render these messages: {why}") from None
    finally:
        _budget.reset(token)
