"""The error and warning types of configuration, and how a bad value is shown in one.

Owns `ConfigError` (a wrong configuration value, one line naming its key path),
`SecurityWarning` (a valid but unsafe configuration), `short_repr` / `key_text`,
which keep any value, however large or deep, short in a message, and `did_you_mean`,
the one suggestion every unknown name gets (a key, a backend, a policy, an option).

Must never: import anything of prefixcache. It is the leaf every layer raises from;
`prefixcache.config` and the package re-export its names.
"""

from __future__ import annotations

import difflib
import reprlib
from collections.abc import Iterable
from typing import Any

__all__ = ["ConfigError", "SecurityWarning", "did_you_mean", "key_text", "short_repr"]


def did_you_mean(word: Any, candidates: Iterable[Any]) -> str:
    """"; did you mean 'x'?" for the candidate closest to a misspelled `word` (difflib), or ""."""
    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()  # Python 3.11's takes no limits: set them
        self.maxlevel, self.maxdict, self.maxstring, self.maxlong, self.maxother = (
            2,
            3,
            48,
            24,
            48,
        )
        self.maxtuple = self.maxlist = self.maxarray = self.maxset = (
            self.maxfrozenset
        ) = self.maxdeque = 4

    def repr_int(self, x: int, level: int) -> str:
        if (
            x.bit_length() > 256
        ):  # str() of a huge int is slow, and refused past 4300 digits
            return f"<an int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_SHORT = _ShortRepr()


def short_repr(value: Any) -> str:
    """`repr(value)`, cut to about 60 characters whatever the value's size or depth (an
    alias-expanded YAML list, a huge int), for error messages."""
    return _SHORT.repr(value)


def key_text(key: Any) -> str:
    """A mapping key as it appears in a key path: itself if it is a short str, else its
    `short_repr`."""
    return key if isinstance(key, str) and len(key) <= 48 else short_repr(key)


class SecurityWarning(UserWarning):
    """A configuration that is valid but unsafe in some deployments (docs/security.md)."""


class ConfigError(ValueError):
    """A configuration value is wrong. `path` is the dotted key path (e.g. `cache.block_size`).
    The message is one line."""

    MAX_MESSAGE = 1000  # characters: a backstop; values in messages are short_repr'd

    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        message = " ".join(message.split("\n"))
        if len(message) > self.MAX_MESSAGE:
            message = f"{message[: self.MAX_MESSAGE]}... ({len(message):,} characters)"
        self.path = path
        self.message = message
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{path}: {message}" if path else f"{where}{message}")

    def __reduce__(self) -> tuple[type, tuple[str, str, str | None]]:
        # Pickled by its fields (a Ray replica's refusal reaches the ingress this way): the
        # default would call ConfigError(full message) and fail to unpickle.
        return type(self), (self.path, self.message, self.source)

    def within(self, prefix: str, source: str | None = None) -> ConfigError:
        """The same error seen from an enclosing section / file."""
        path = f"{prefix}.{self.path}" if prefix and self.path else prefix or self.path
        return ConfigError(path, self.message, source or self.source)

    def missing_paths(self) -> tuple[str, ...]:
        """The key paths a "missing required key(s)" error names (`validate` tells a key it
        set aside from one the file lacks); () for any other error."""
        prefix = "missing required key(s): "
        if not self.message.startswith(prefix):
            return ()
        return tuple(f"{self.path}.{k}" if self.path else k for k in self.message[len(prefix):].split(", "))
