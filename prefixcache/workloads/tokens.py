"""Token sequences of workloads: `TokenRuns` (compact, exact) and `TokenSource` (fresh ids).

Owns how a workload's token ids are represented and drawn. Must never: decide what a
request contains (the generators do) or what is cached (the bounds and backends do).

Representation. A `TokenRuns` is a read-only `Sequence[int]` stored as runs of
consecutive ids `[start, stop)`. The runs are canonical (empty runs dropped, a run that
continues its predecessor merged into it), so two `TokenRuns` hold equal tokens exactly
when they hold equal runs, and a block's content can be named by the runs it overlaps
without listing its tokens. A 12,000-token Mooncake prompt is a handful of runs, which is
what lets a whole trace (145 M prompt tokens) sit in memory; `to_array()` expands one
request straight into an int64 (or int32) array in C++, which is what a cache reads
(no Python int per token); `tolist()` gives plain ints.

Id choice (why equal runs mean real hits and nothing else does). `TokenSource.fresh(n)`
hands out ids from a counter, so every piece of content a generator creates is a range no
other piece touches: unrelated content never shares a single token, let alone a block,
and content is shared only where a generator reuses the very same `TokenRuns` object
(a system prompt, a document, an earlier answer). Ids are therefore unbounded ints
(up to the workload's distinct-token count), not a tokenizer's vocabulary: a model run
must map them into its vocabulary itself.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from itertools import accumulate
from typing import overload

from prefixcache._C import expand_runs

__all__ = ["TokenRuns", "TokenSource", "BlockContent"]

BlockContent = int | tuple[tuple[int, int], ...]
"""Exact name of one block's tokens: the first id when the block lies inside one run
(its tokens are then `range(first, first + block_size)`), else the runs it overlaps.
An int never equals a tuple, so the two forms cannot collide."""


class TokenRuns(Sequence[int]):
    """An immutable token sequence stored as canonical runs of consecutive ids.

    Indexing is O(log runs), `len` O(1), concatenation O(runs). Equality and hashing
    compare contents.
    """

    __slots__ = ("_runs", "_len", "_offsets")

    def __init__(self, runs: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        for start, stop in runs:
            if not (isinstance(start, int) and isinstance(stop, int)) or start < 0 or stop < start:
                raise ValueError(f"token run ({start!r}, {stop!r}) must be ints with 0 <= start <= stop")
            if start == stop:
                continue
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        self._runs: tuple[tuple[int, int], ...] = tuple(merged)
        self._len = sum(stop - start for start, stop in merged)
        self._offsets: list[int] | None = None

    @classmethod
    def of(cls, tokens: Sequence[int] | TokenRuns) -> TokenRuns:
        """`tokens` as `TokenRuns` (the object itself if it already is one)."""
        if isinstance(tokens, TokenRuns):
            return tokens
        if isinstance(tokens, range) and tokens.step == 1:
            return cls(((tokens.start, tokens.stop),))
        if isinstance(tokens, (str, bytes)):
            raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
        tolist = getattr(tokens, "tolist", None)
        ids = tolist() if tolist is not None else list(tokens)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"token ids must be non-negative ints, got {t!r}")
        return cls((t, t + 1) for t in ids)

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """The canonical `(start, stop)` runs."""
        return self._runs

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for start, stop in self._runs:
            yield from range(start, stop)

    def to_array(self, itemsize: int = 8) -> array:
        """All token ids as `array('q')` (itemsize 8) or `array('i')` (4; ValueError if an id
        does not fit int32), expanded in C++: what a cache takes, as one buffer."""
        return expand_runs(self._runs, itemsize)

    def tolist(self) -> list[int]:
        """All token ids as a list (what `protocol.as_tokens` calls)."""
        out: list[int] = []
        for start, stop in self._runs:
            out.extend(range(start, stop))
        return out

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> TokenRuns: ...
    def __getitem__(self, index: int | slice) -> int | TokenRuns:
        if isinstance(index, slice):
            lo, hi, step = index.indices(self._len)
            if step != 1:
                return TokenRuns.of(self.tolist()[index])
            return self._slice(lo, hi)
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"token index {index} out of range for {self._len} tokens")
        offsets = self._run_offsets()
        i = bisect_right(offsets, index) - 1
        return self._runs[i][0] + index - offsets[i]

    def _run_offsets(self) -> list[int]:
        if self._offsets is None:
            self._offsets = [0, *accumulate(stop - start for start, stop in self._runs)][:-1]
        return self._offsets

    def _slice(self, lo: int, hi: int) -> TokenRuns:
        out: list[tuple[int, int]] = []
        pos = 0
        for start, stop in self._runs:
            n = stop - start
            a, b = max(lo - pos, 0), min(hi - pos, n)
            if a < b:
                out.append((start + a, start + b))
            pos += n
            if pos >= hi:
                break
        return TokenRuns(out)

    def __add__(self, other: object) -> TokenRuns:
        if not isinstance(other, TokenRuns):
            return NotImplemented
        return TokenRuns(self._runs + other._runs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenRuns):
            return self._runs == other._runs
        if isinstance(other, (list, tuple, range)):
            return len(other) == self._len and list(other) == self.tolist()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._runs)

    def __repr__(self) -> str:
        shown = ", ".join(f"{a}:{b}" for a, b in self._runs[:4])
        more = f", ... {len(self._runs) - 4} more" if len(self._runs) > 4 else ""
        return f"TokenRuns(len={self._len}, runs=[{shown}{more}])"

    def full_blocks(self, block_size: int) -> Iterator[BlockContent]:
        """The content of each FULL block of `block_size` tokens, in order (partial tail
        excluded). O(blocks + runs); a block inside one run costs one int."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        pieces: list[tuple[int, int]] = []  # a block being assembled across runs
        need = block_size
        for start, stop in self._runs:
            if pieces:
                take = min(need, stop - start)
                pieces.append((start, start + take))
                start += take
                need -= take
                if need:
                    continue
                yield tuple(pieces)
                pieces, need = [], block_size
            whole = (stop - start) // block_size
            yield from range(start, start + whole * block_size, block_size)
            start += whole * block_size
            if start < stop:
                pieces.append((start, stop))
                need = block_size - (stop - start)


class TokenSource:
    """Fresh token ids from a counter: every call returns ids no earlier call returned.

    `start` offsets the counter, so two sources with disjoint `[start, start + total)`
    spans can build workloads that are merged without accidental sharing.
    """

    __slots__ = ("_next",)

    def __init__(self, start: int = 0) -> None:
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"start must be an int >= 0, got {start!r}")
        self._next = start

    @property
    def next_id(self) -> int:
        """The id the next `fresh` call starts at (= one past every id handed out)."""
        return self._next

    def fresh(self, num_tokens: int) -> TokenRuns:
        """`num_tokens` ids never handed out before (an empty sequence for 0)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        start = self._next
        self._next += num_tokens
        return TokenRuns(((start, start + num_tokens),))
