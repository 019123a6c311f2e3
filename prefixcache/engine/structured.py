"""Structured outputs: a grammar that decides which tokens a request may draw next (vLLM
0.33's `structured_outputs`, as its `guidance` backend serves them, on llguidance).

Owns `StructuredOutputs` (what a request asks for: exactly one of `json` (a JSON schema),
`regex`, `choice`, `grammar` (Lark or GBNF), `json_object` and `structural_tag`, vLLM's
names), `Grammars`
(an engine's compiler: its tokenizer as llguidance's, built once, and each request's spec
turned into a matcher, a `ConfigError` naming the field for one that does not compile)
and `Grammar` (one request's matcher: which tokens it may draw next, and the tokens it
drew). Once the grammar is complete only the end-of-sequence token may follow, so a
request ends the way any request ends.

A structural tag (vLLM's legacy form, the one its guidance backend serves: `triggers`, and
`structures` of `begin`, `schema`, `end`) allows any text, and wherever the text reaches a
structure's `begin`, a body that follows its JSON schema, then its `end` (llguidance's
`StructTag`: tool calls a model writes among its prose). vLLM 0.33's guidance backend hands
`StructTag` the schema already compiled into a grammar text, which llguidance's `%json`
reads as a schema of unknown keywords: any JSON passes. Here the schema itself goes in, so
a body that breaks it is masked out, as vLLM's xgrammar backend masks it.

llguidance (Microsoft's guidance library, one of vLLM's backends) is a 3 MB wheel with no
dependencies that computes a mask in Rust; xgrammar, vLLM's other backend, pulls triton.
It is an optional extra (`pip install prefixcache[structured]`): without it a request
that asks for structured output is refused by name.

Must never: draw tokens (sampling does), change the logits of a request without a
grammar, or raise into the engine for a request's bad grammar after it was admitted (a
matcher that errs allows no token, which fails that request alone).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from prefixcache.engine.tokenizer import Tokenizer
from prefixcache.errors import ConfigError

__all__ = ["StructuredOutputs", "Grammars", "Grammar"]

_FIELD = "structured_outputs"
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint (vLLM's `StructuredOutputsParams`): `json` a JSON schema (a dict or
    its text), `regex`, `choice` (strings), `grammar` (Lark or GBNF), or `json_object`
    (any JSON object), or `structural_tag` (vLLM's legacy form: a dict, or its JSON text,
    of `triggers` and `structures`; module docstring). `disable_any_whitespace`: JSON
    without free whitespace."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False

    def kind(self) -> str:
        """The one constraint set; ConfigError when none or several are."""
        given = [f.name for f in fields(self) if f.name in _KINDS and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ConfigError(_FIELD, "exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object' or "
                              f"'structural_tag' must be set, got {given or 'none'}")  # fmt: skip
        return given[0]

    def key(self) -> str:
        """A text that names the constraint (for the compiled-grammar cache)."""
        kind = self.kind()
        value = getattr(self, kind)
        return json.dumps([kind, value if not isinstance(value, tuple) else list(value), self.disable_any_whitespace],
                          sort_keys=True, default=str)


class Grammar:
    """One request's matcher (module docstring)."""

    __slots__ = ("_matcher", "_vocab")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab = vocab_size

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab]``: the tokens the grammar allows next (none once it erred)."""
        bias = torch.frombuffer(bytearray(self._matcher.compute_logit_bias()), dtype=torch.uint8)
        out = torch.zeros(self._vocab, dtype=torch.bool)
        n = min(self._vocab, bias.numel())
        out[:n] = bias[:n] > 0
        return out

    def accept(self, token_id: int) -> bool:
        """The request drew `token_id`; False if the grammar does not take it."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class Grammars:
    """An engine's grammar compiler over `tokenizer` (its vocabulary `vocab_size` ids:
    the model's, which may exceed the tokenizer's). A fresh matcher is kept for each of
    the last `cache_size` distinct specs, and copied for the next request that asks for
    the same one (the choices of one request, a client's repeated schema). Any
    thread may compile (llguidance builds a matcher without the GIL, and a large schema
    takes long: `benchmarks/bench_structured.py`), so a server compiles beside the
    engine's thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 64) -> None:
        try:
            import llguidance
        except ImportError:
            raise ConfigError(_FIELD, "structured output needs the 'llguidance' package "
                              "(pip install 'prefixcache[structured]')") from None
        self._ll = llguidance
        self._vocab = vocab_size
        self._tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(tokenizer, vocab_size)),
                                                 n_vocab=vocab_size)  # fmt: skip
        # llguidance builds its token tables at the first mask it ever computes: here, in the
        # thread that compiles, not in an engine step.
        warm = llguidance.LLMatcher(self._tokenizer, llguidance.LLMatcher.grammar_from_regex("a"), log_level=0)
        warm.compute_logit_bias()
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # spec key -> a fresh LLMatcher
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache's; the compiling runs outside it

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """A fresh matcher for `spec`; ConfigError naming the field for a spec that does
        not compile (the message is llguidance's)."""
        key = spec.key()
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
        if template is not None:  # copying a fresh matcher costs a small part of building one
            return Grammar(template.deep_copy(), self._vocab)
        matcher = self._ll.LLMatcher(self._tokenizer, self._grammar(spec), log_level=0)
        if matcher.is_error():
            raise ConfigError(f"{_FIELD}.{spec.kind()}", matcher.get_error().strip())
        with self._lock:
            self._compiled[key] = matcher.deep_copy()  # never advanced: the template of the next copies
            self._compiled.move_to_end(key)
            if len(self._compiled) > self._cache_size:
                self._compiled.popitem(last=False)
        return Grammar(matcher, self._vocab)

    def _grammar(self, spec: StructuredOutputs) -> str:
        kind, ll = spec.kind(), self._ll
        where = f"{_FIELD}.{kind}"
        options = {"whitespace_flexible": not spec.disable_any_whitespace}
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else spec.json
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ConfigError(where, f"must be a JSON schema (an object), got {type(schema).__name__}")
                return ll.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            if kind == "regex":
                return ll.LLMatcher.grammar_from_regex(_text(spec.regex, where))
            if kind == "choice":
                choices = spec.choice
                if not choices or any(not isinstance(c, str) for c in choices):
                    raise ConfigError(where, f"must be a non-empty list of strings, got {choices!r}")
                return ll.grammar_from("choice", list(choices))
            if kind == "structural_tag":
                return ll.StructTag.to_grammar(_struct_tags(ll, spec.structural_tag, options, where))
            return ll.grammar_from("grammar", _text(spec.grammar, where))
        except ConfigError:
            raise
        except (ValueError, TypeError) as err:  # a schema that is not JSON, a grammar that is not Lark/GBNF
            raise ConfigError(where, str(err).strip()) from None


def _struct_tags(ll: Any, value: object, options: dict[str, bool], where: str) -> list[Any]:
    """A legacy structural tag (a dict or its JSON text) as llguidance's StructTags, each
    structure paired with the first trigger its `begin` starts with (vLLM's rule), its
    schema given the request's whitespace option unless it sets its own."""
    tag = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tag, dict):
        raise ConfigError(where, f"must be an object with 'triggers' and 'structures', got {type(tag).__name__}")
    if "structures" not in tag and "format" in tag:
        raise ConfigError(f"{where}.format", "a structural tag's 'format' form is xgrammar's, which this server does "
                          "not run; give 'triggers' and 'structures' (the form vLLM's guidance backend serves)")  # fmt: skip
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ConfigError(f"{where}.triggers", f"must be a non-empty list of non-empty strings, got {triggers!r}")
    if not isinstance(structures, list) or not structures:
        raise ConfigError(f"{where}.structures", "No structural tags found in the grammar spec.")
    out = []
    for i, s in enumerate(structures):
        at = f"{where}.structures[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ConfigError(at, f"must be an object with string 'begin' and 'end', got {s!r}")
        schema = s.get("schema")
        if not isinstance(schema, dict):
            raise ConfigError(f"{at}.schema", f"must be a JSON schema (an object), got {type(schema).__name__}")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ConfigError(f"{at}.begin", f"Trigger {s['begin']} not found in triggers {triggers}")
        out.append(ll.StructTag(trigger=trigger, begin=s["begin"], grammar={"x-guidance": options, **schema},
                                end=s["end"]))  # fmt: skip
    return out


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(where, f"must be a non-empty string, got {value!r}")
    return value


class _Vocabulary:
    """A `Tokenizer` as llguidance's `TokenizerWrapper` reads one: each id's bytes (ids
    past the tokenizer's vocabulary stand for nothing), its special ids, its
    end-of-sequence token, and text -> ids."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        known = min(vocab_size, tokenizer.vocab_size)
        self.tokens: Sequence[bytes] = [tokenizer.token_bytes(i) for i in range(known)] + [b""] * (vocab_size - known)
        self.special_token_ids = sorted(i for i in tokenizer.special_ids if i < vocab_size)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)
