"""Ending a request whose output loops (vLLM 0.33's `repetition_detection`).

Owns `RepetitionDetection` (what a request asks for: patterns of `min_pattern_size` to
`max_pattern_size` TOKENS that repeat `min_count` times back to back), checked once with
vLLM's messages, and `ends_in_repetition`, the test a request's output passes after every
token it draws: whether its last tokens are one pattern repeated. A request that fails it
ends with finish reason "repetition" (vLLM's `FinishReason.REPETITION`), its text whole.
The test reads at most `max_pattern_size x min_count` tokens per pattern size, whatever
the output's length.

Must never: draw or change tokens, or end a request for anything but a loop at its end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RepetitionDetection", "ends_in_repetition"]


@dataclass(frozen=True)
class RepetitionDetection:
    """vLLM's `RepetitionDetectionParams`: a pattern of `min_pattern_size` (0: 1) to
    `max_pattern_size` TOKENS (0: detection off) repeated `min_count` (>= 2) times in a row
    at the output's end ends the request."""

    max_pattern_size: int = 0
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"repetition_detection.{name} must be an integer, got {value!r}")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <= "
                             "max_pattern_size. Set both to 0 to disable repetitive pattern detection.")  # fmt: skip
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError("min_count must be >= 2 to detect repetitive patterns in engine output. If you do "
                             "not wish to detect repetitive patterns, set max_pattern_size to 0.")  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0


def ends_in_repetition(output: Sequence[int], spec: RepetitionDetection) -> bool:
    """Whether `output` (a request's drawn token ids) ends with a pattern of a size in
    [min_pattern_size, max_pattern_size] repeated `min_count` times back to back (the
    smallest sizes first, stopping at the first too long to repeat that often)."""
    if not spec.enabled:
        return False
    count = spec.min_count
    for size in range(max(spec.min_pattern_size, 1), spec.max_pattern_size + 1):
        if size * count > len(output):
            return False
        tail = output[len(output) - size :]
        if all(output[len(output) - size * (k + 1) : len(output) - size * k] == tail for k in range(1, count)):
            return True
    return False
