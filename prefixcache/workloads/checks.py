"""Input checks shared by the workload layer: every bad value is a `ValueError` that names
the parameter (or file:line) and what is allowed.

Must never: coerce a bad value into a good one (a float count, a bool as an int).
"""

from __future__ import annotations

import json
import math

__all__ = ["check_int", "check_rate", "parse_json_object", "MAX_REQUESTS", "MAX_PROMPT_TOKENS"]

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
