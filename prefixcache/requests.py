"""Per-request bookkeeping that every backend needs, kept in one place.

Owns `Request` (a live request's tokens, namespace, block table and committed length),
`RequestTable` (live requests by id, with the protocol's error rules: admitting a live
id is a `ValueError`; an unknown or released id is a `KeyError`) and `BlockwiseAppend`
(the `append` of a cache whose tables grow a block as the tokens cross into it, and that
refuses what its allocator cannot give: `hash`, and the engine's no-cache baseline).
Backends subclass `Request` to add their own fields (block hashes, locked tree node).

Must never: touch the pool (an append asks the cache's allocator), hash, or decide what
is cached.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prefixcache._C import BlockPool, append_step
from prefixcache.isolation import check_namespace
from prefixcache.protocol import Namespace, token_buffer

__all__ = [
    "PRIORITY_RANGE",
    "BlockwiseAppend",
    "Request",
    "RequestTable",
    "check_count",
    "check_namespace",
    "check_priority",
    "check_tokens",
]

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


class _Live(dict):
    """Live requests by id: a look-up of an id not live is the protocol's KeyError."""

    def __missing__(self, request_id: Hashable) -> None:
        raise KeyError(f"unknown or released request {request_id!r}")


class RequestTable(Generic[R]):
    """Live requests by id."""

    def __init__(self) -> None:
        self._live: dict[Hashable, R] = _Live()
        #: get(request_id): the live request; KeyError naming the id if it is not live.
        #: The dict's own look-up: every protocol call makes one.
        self.get: Callable[[Hashable], R] = self._live.__getitem__

    def check_new(self, request_id: Hashable) -> None:
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already live; release it before admitting it again")

    def add(self, request: R) -> R:
        self.check_new(request.request_id)
        self._live[request.request_id] = request
        return request

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


class BlockwiseAppend(ABC):
    """`append` for a cache with `_requests` (a `RequestTable`), `block_size` and `_stats`
    (a `StatsCounter`): the tokens go through the one converter (csrc/token_ids.h, empty
    allowed), then `_allocate_if_free(n)` gives the n BLOCKS the table lacks. When it
    gives None the append is refused: None, the tokens taken back, `rejected` counted;
    when it raises (a Python eviction policy) the tokens are taken back too."""

    _requests: RequestTable[Any]
    block_size: int
    _stats: Any
    #: The pool an append may take fresh blocks from itself, in its native step, when
    #: `_allocate_if_free` would be nothing but the pool's allocation (no policy to ask,
    #: no event to record); None: every block goes through `_allocate_if_free`.
    _append_pool: BlockPool | None = None

    @abstractmethod
    def _allocate_if_free(self, num_blocks: int) -> list[int] | None:
        """`num_blocks` fresh blocks, or None (nothing changed) if there is no room."""

    def append(self, request_id: Hashable, tokens: Sequence[int]) -> list[int] | None:
        request = self._requests.get(request_id)
        # Once per decoded token: one native call appends the ids (checked by the one
        # converter, so a bad id never reaches commit) and is all of it if no block is needed.
        step = append_step(request.tokens, tokens, request.block_table, self.block_size, self._append_pool, 0, 0)
        if type(step) is list:
            return step
        return self._append_rest(request, tokens, step)

    def _append_rest(self, request: Any, tokens: Sequence[int], step: int | None) -> list[int] | None:
        """`append` once `append_step` declined with `step`: the ids it appended (an
        int), or None (it appended nothing: ids beyond int64, or a list of ids)."""
        held = request.tokens
        if step is None:
            # Ids beyond int64 (CBOR bignums): the request keeps its ids as ints from now on.
            before = len(held)
            new = token_buffer(tokens)
            if isinstance(held, array):
                held = request.tokens = held.tolist()
            held.extend(new)  # type: ignore[attr-defined]
        else:
            before = len(held) - step
        bs = self.block_size
        num_new = (len(held) + bs - 1) // bs - len(request.block_table)
        if num_new <= 0:
            return []
        try:
            blocks = self._allocate_if_free(num_new)
        except BaseException:
            del held[before:]  # type: ignore[attr-defined]
            raise
        if blocks is None:
            del held[before:]  # type: ignore[attr-defined]
            self._stats.rejected += 1
            return None
        request.block_table.extend(blocks)
        return blocks
