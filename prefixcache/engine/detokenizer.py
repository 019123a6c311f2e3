"""A request's output text as it grows, and where it meets a stop string (vLLM 0.33's detokenizer).

Owns `IncrementalDecoder` (token ids -> text, each token decoded once: its bytes
(`Tokenizer.token_bytes`) go through an incremental UTF-8 decoder, so the text so far is
always `Tokenizer.decode` of the ids so far, less the bytes of a character not yet
whole) and `StopStrings` (the first stop string the text reaches, as vLLM's
`check_stop_strings` finds it).

Stop strings, as vLLM 0.33 (`vllm/v1/engine/detokenizer.py`): after each token, each
stop string in the request's order is looked for where the token's new characters could
complete it (from `len(stop) - 1` characters before them); the first in that order that
is found ends the request, even if another one ends earlier in the same new text. The
output text is cut before the stop string, or after it with
`include_stop_str_in_output`. Output token ids are not cut: the token that completed
the string counts as generated. A streamed response holds back `hold_back` characters
(the longest stop string less one; none when the stop string is kept in the output), so
no text it sends is later cut away.

Must never: sample, finish a request or touch the cache (the engine does), or decode the
whole text again (a decoder reads each token's bytes once; a stop check reads the new
characters and the stop strings' reach before them, so a long output costs each token the
same).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from prefixcache.engine.tokenizer import Tokenizer

__all__ = ["IncrementalDecoder", "StopStrings", "check_stop_strings"]


class IncrementalDecoder:
    """The text of a growing list of token ids; `add` returns what new ids completed.
    The text is kept in parts (joined when read), so a long output costs each token the
    same. `skip_special_tokens`: the tokenizer's `special_ids` add nothing (vLLM's
    default for a request)."""

    __slots__ = ("_tokenizer", "_skip", "_utf8", "_parts", "length")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []
        self.length = 0  # CHARACTERS so far

    def add(self, token_ids: Sequence[int]) -> str:
        """The text `token_ids` (appended to the ids so far) complete."""
        delta = self._utf8.decode(b"".join(self._tokenizer.token_bytes(t) for t in token_ids if t not in self._skip))
        if delta:
            self._parts.append(delta)
            self.length += len(delta)
        return delta

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""


def check_stop_strings(stops: Sequence[str], text: str, new_chars: int, include: bool) -> tuple[str, int] | None:
    """vLLM's `check_stop_strings`: (the stop string, the length `text` is cut to) for the
    first of `stops` that ends within the last `new_chars` characters of `text`, or None."""
    if not new_chars:
        return None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if index != -1:
            return stop, index + len(stop) if include else index
    return None


class StopStrings:
    """One request's stop strings over its output text (module docstring). `add(token_id)`
    returns the stop string that token completes, or None; once one is found, `text` is
    the output text cut as the request asked."""

    __slots__ = ("stops", "include", "_decoder", "_tail", "_keep", "stop", "text")

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], include: bool, skip_special_tokens: bool = True) -> None:
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop: each stop string must be a non-empty str, got {list(stops)!r}")
        self.stops = tuple(stops)
        self.include = include
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens)
        self._tail = ""  # the text's last _keep CHARACTERS: where a stop string may have begun
        self._keep = self.hold_back(self.stops, include=False)
        self.stop: str | None = None
        self.text = ""

    @staticmethod
    def hold_back(stops: Sequence[str], include: bool) -> int:
        """CHARACTERS a stream holds back so that nothing it sends is cut later."""
        return 0 if include or not stops else max(len(s) for s in stops) - 1

    def add(self, token_id: int, *, check: bool = True) -> str | None:
        """The stop string `token_id` completes, or None; `check` False (a request short of
        its `min_tokens`, as vLLM's detokenizer skips the check) only decodes it."""
        new = self._decoder.add((token_id,))
        window = self._tail + new
        found = check_stop_strings(self.stops, window, len(new), self.include) if check else None
        if found is None:
            self._tail = window[max(0, len(window) - self._keep) :] if self._keep else ""
            return None
        self.stop, cut = found
        self.text = self._decoder.text[: self._decoder.length - len(window) + cut]
        return self.stop
