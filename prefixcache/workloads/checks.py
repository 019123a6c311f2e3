"""Input checks shared by the workload layer: every bad value is a `ValueError` that names
the parameter (or file:line) and what is allowed.

Owns the declarative parameter rules of the generators: a parameter annotated
`Positive`, `NonNegative`, `Annotated[int, AtLeast(n)]`, `Probability` or `Rate` is
checked by `checked_params`, in signature order, before the generator's body runs, so
every generator words a bad argument the same way. A rule that relates two parameters
stays in the generator.

Must never: coerce a bad value into a good one (a float count, a bool as an int).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

__all__ = [
    "check_int",
    "check_rate",
    "checked_params",
    "parse_json_object",
    "AtLeast",
    "InUnitInterval",
    "PositiveRate",
    "Positive",
    "NonNegative",
    "Probability",
    "Rate",
    "MAX_REQUESTS",
    "MAX_PROMPT_TOKENS",
]

MAX_REQUESTS = 1_000_000
"""The most requests a workload may hold, generated or read from a trace: about 0.7 GB
of requests and a few minutes to generate; the Mooncake traces hold 4k and 12k."""
MAX_PROMPT_TOKENS = 10**10
"""The most prompt TOKENS a workload may hold (counted with repetition); the Mooncake
conversation trace holds about 1.5e8."""


def check_int(name: str, value: object, minimum: int) -> int:
    """`value` if it is an int >= `minimum`; ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_rate(request_rate: object) -> float | None:
    """`request_rate` (requests per SECOND) if None or a positive finite number."""
    if request_rate is None:
        return None
    r = request_rate
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
        raise ValueError(f"request_rate must be a positive number of requests per second or None, got {r!r}")
    return float(r)


@dataclass(frozen=True)
class AtLeast:
    """Rule: an int >= `minimum` (never a bool)."""

    minimum: int

    def check(self, name: str, value: object) -> None:
        check_int(name, value, self.minimum)


@dataclass(frozen=True)
class InUnitInterval:
    """Rule: a number in [0, 1] (never a bool)."""

    def check(self, name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class PositiveRate:
    """Rule: None or a positive finite number of requests per second (`check_rate`)."""

    def check(self, name: str, value: object) -> None:
        check_rate(value)


Positive = Annotated[int, AtLeast(1)]
"""An int >= 1: a count, or a length in TOKENS that may not be empty."""
NonNegative = Annotated[int, AtLeast(0)]
"""An int >= 0: a length in TOKENS that may be empty."""
Probability = Annotated[float, InUnitInterval()]
Rate = Annotated[float | None, PositiveRate()]
"""`request_rate`: requests per SECOND, or None (all arrive at 0)."""

F = TypeVar("F", bound=Callable[..., Any])


def checked_params(fn: F) -> F:
    """`fn` with each parameter whose annotation carries a rule (`AtLeast`,
    `InUnitInterval`, `PositiveRate`) checked, in signature order, before `fn` runs; a
    bad one is a ValueError naming it and what is allowed. The signature is `fn`'s
    (`inspect.signature` sees through the wrapper)."""
    signature = inspect.signature(fn)
    hints = typing.get_type_hints(fn, include_extras=True)
    rules = [
        (name, rule)
        for name in signature.parameters
        for rule in getattr(hints.get(name), "__metadata__", ())
        if hasattr(rule, "check")
    ]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for name, rule in rules:
            rule.check(name, bound.arguments[name])
        return fn(*args, **kwargs)

    return typing.cast(F, wrapper)


def parse_json_object(where: str, line: str) -> dict:
    """One JSONL line as a dict; ValueError naming `where` (file:line) otherwise (bad
    JSON, an int too long to convert, nesting too deep to parse)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
    except ValueError as e:  # an int of more than 4300 digits
        raise ValueError(f"{where}: not usable JSON ({e})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
    return obj
