"""Per-request bookkeeping that every backend needs, kept in one place.

Owns `Request` (a live request's tokens, namespace, block table and committed length)
and `RequestTable` (live requests by id, with the protocol's error rules: admitting a
live id is a `ValueError`; an unknown or released id is a `KeyError`). Backends subclass
`Request` to add their own fields (block hashes, locked tree node).

Must never: touch the pool, hash, or decide what is cached.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prefixcache.isolation import check_namespace
from prefixcache.protocol import Namespace, token_buffer

__all__ = ["PRIORITY_RANGE", "Request", "RequestTable", "check_count", "check_namespace", "check_priority", "check_tokens"]

T = TypeVar("T", bound=Sequence[int])

PRIORITY_RANGE = (-(1 << 63), (1 << 63) - 1)
"""Inclusive range of a request priority: what the native trees and evictors store (int64)."""


def check_tokens(
    tokens: Sequence[int],
    *,
    allow_empty: bool = False,
    itemsize: int = 8,
    convert: Callable[[Sequence[int], str], T] | None = None,
) -> T:
    """Tokens in a typed buffer of the request's own (`protocol.token_buffer`: array('q'),
    or array('i') with itemsize 4), or through `convert(tokens, "tokens")` for a backend
    that stores them otherwise, whose errors must be worded alike (csrc/token_ids.h).
    ValueError for an empty prompt unless allowed."""
    out = token_buffer(tokens, "tokens", itemsize=itemsize) if convert is None else convert(tokens, "tokens")
    if not allow_empty and not len(out):
        raise ValueError("tokens: a prompt needs at least one token")
    return out


def _index(value: object, field: str, expected: str) -> int:
    """`value` as an exact int (numpy integers accepted): TypeError naming `field` for
    another type or a bool."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{field}: expected {expected}; got {type(value).__name__} {value!r}")
    return operator.index(value)


def check_count(value: int, field: str) -> int:
    """`value` as an int >= 0 (numpy integers accepted): TypeError naming `field` for
    another type or a bool, ValueError below 0."""
    value = _index(value, field, "an int >= 0")
    if value < 0:
        raise ValueError(f"{field}: expected an int >= 0; got {value}")
    return value


def check_priority(value: int) -> int:
    """A request priority as an int in `PRIORITY_RANGE` (numpy integers accepted):
    TypeError naming `priority` for another type or a bool, ValueError outside int64.
    Backends check it before anything changes: every later native call takes it."""
    lo, hi = PRIORITY_RANGE
    value = _index(value, "priority", "an int64")
    if not lo <= value <= hi:
        raise ValueError(f"priority: expected an int64 in [-2**63, 2**63 - 1]; got {value}")
    return value


@dataclass(eq=False)
class Request:
    """A live request. Counts in TOKENS except `block_table` (block ids)."""

    request_id: Hashable
    tokens: Sequence[int]  # a typed buffer (array) of the request's own; a list for ids beyond int64
    namespace: Namespace
    block_table: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix hit at admission
    num_computed: int = 0  # tokens whose KV is written (commit)

    def blocks_short(self, num_new_tokens: int, block_size: int) -> int:
        """BLOCKS the table lacks to hold `num_new_tokens` more tokens (0 if none)."""
        return max(0, -(-(len(self.tokens) + num_new_tokens) // block_size) - len(self.block_table))

    def check_commit(self, num_computed_tokens: int) -> int:
        """Validate a commit: an int (numpy integers accepted) in [num_computed,
        len(tokens)]; returns it as an exact int."""
        n = _index(num_computed_tokens, "num_computed_tokens", "an int")
        if not self.num_computed <= n <= len(self.tokens):
            raise ValueError(
                f"num_computed_tokens={n} for request {self.request_id!r} must be in "
                f"[{self.num_computed}, {len(self.tokens)}] (committed so far, tokens so far)"
            )
        return n


R = TypeVar("R", bound=Request)


class RequestTable(Generic[R]):
    """Live requests by id."""

    def __init__(self) -> None:
        self._live: dict[Hashable, R] = {}

    def check_new(self, request_id: Hashable) -> None:
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already live; release it before admitting it again")

    def add(self, request: R) -> R:
        self.check_new(request.request_id)
        self._live[request.request_id] = request
        return request

    def get(self, request_id: Hashable) -> R:
        try:
            return self._live[request_id]
        except KeyError:
            raise KeyError(f"unknown or released request {request_id!r}") from None

    def pop(self, request_id: Hashable) -> R:
        request = self.get(request_id)
        del self._live[request_id]
        return request

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[R]:
        return iter(self._live.values())

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._live
