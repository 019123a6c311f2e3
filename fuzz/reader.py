"""Turning a fuzzer's bytes into arguments, the same way with or without atheris.

Owns `Reader`: a cursor over one input that hands out small ints, choices, token
lists, byte strings and text. Every harness in fuzz/ decodes its input only through
it, so an input replays identically under libFuzzer (atheris), in the regression tests
(tests/test_fuzz_harnesses.py, no atheris needed) and from a saved crash file. An
exhausted input reads as zeros, so every input decodes to something.

Must never: raise on any input, or draw randomness from anywhere but the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

# Token ids a harness may try: the ordinary, the edges of int32 / int64, beyond
# int64 (CBOR bignums), negatives.
EDGE_INTS = (
    0, 1, 2, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -1, -(2**31), 2**32,
    2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 2**70, -(2**70),
)  # fmt: skip


class Reader:
    """Consumes one fuzz input from the front."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    @property
    def exhausted(self) -> bool:
        return self.at >= len(self.data)

    def byte(self) -> int:
        if self.at >= len(self.data):
            return 0
        self.at += 1
        return self.data[self.at - 1]

    def int(self, lo: int, hi: int) -> int:
        """An int in [lo, hi] (inclusive), from as few bytes as the range needs."""
        span = hi - lo + 1
        value, scale = 0, 1
        while scale < span:
            value, scale = value * 256 + self.byte(), scale * 256
        return lo + value % span

    def bool(self) -> bool:
        return bool(self.byte() & 1)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.int(0, len(options) - 1)]

    def token(self, alphabet: int = 3) -> int:
        """Mostly a small id from `alphabet` (so prefixes are shared), now and then an edge."""
        if self.int(0, 15) == 0:
            return self.choice(EDGE_INTS)
        return self.int(0, alphabet - 1)

    def tokens(self, max_len: int, alphabet: int = 3) -> list[int]:
        return [self.token(alphabet) for _ in range(self.int(0, max_len))]

    def raw(self, max_len: int) -> bytes:
        n = self.int(0, max_len)
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def text(self, max_len: int) -> str:
        """A short str, sometimes with a lone surrogate or a NUL (names that break encoders)."""
        kind = self.int(0, 7)
        if kind == 0:
            return ""
        if kind == 1:
            return self.choice(["\ud800", "a\udfff", "\0", "\0l", "\0s", "math", "cache_salt", "lora"])
        return self.raw(max_len).decode("utf-8", "surrogateescape")
