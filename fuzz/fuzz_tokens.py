"""Fuzz harness: the token converter (csrc/token_ids.h) against hostile token objects.

Each input builds a token argument: a list or tuple of ids of every kind (ints at the
int32/int64 edges and beyond, bools, floats, strs, None, int subclasses, numpy
integers, objects whose `__index__` empties, grows, rewrites or shrinks the list that
holds them, raises an error of its own, or returns a non-int), an object whose
`tolist()` hands over a list it keeps (and its items then change it) or a non-list,
a sequence whose `__len__` / `__getitem__` lie or raise, or a buffer (numpy arrays of
every integer width and byte order, strided, 2-d, bool, float, object; `array.array`).
It is built twice from the same bytes: one copy goes to a Python reference of the
rule (read a snapshot of the items, then each id), the other to a converter: each of
`token_array` (int32 and int64), `token_list`, the hash chain, the radix tree, hit
verification, or a `hash` / `radix` cache's admit / append / match.

The converter must agree with the reference: the same ids, or an error of the same
kind (TypeError / ValueError from the rule, or exactly the error the object's own
code raised). A cache call that raises must change nothing; `check_invariants()`
passes after every call. Under ASan (tests/test_fuzz_harnesses.py in .ci/sanitize) a
read of freed memory is a report.

    python fuzz/fuzz_tokens.py -max_total_time=600
"""

from __future__ import annotations

import operator
from array import array

from harness import main
from reader import EDGE_INTS, Reader

import prefixcache
from prefixcache._C import BlockContents, BlockPool, RadixTree, chain_digests, token_array, token_list
from prefixcache.config import CacheConfig

try:
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dev dependency
    np = None


class Planted(Exception):
    """An error the object's own code raises: the converter must pass it on as it is."""


class IntSub(int):
    pass


class Index:
    """A token id with `__index__`; `harm` may change the list holding it first."""

    def __init__(self, value, harm=None, holder=None, error=None):
        self.value, self.harm, self.holder, self.error = value, harm, holder, error

    def __index__(self):
        if self.harm is not None and self.holder is not None:
            self.harm(self.holder)
        if self.error is not None:
            raise self.error
        return self.value


HARMS = (
    lambda lst: lst.clear(),
    lambda lst: lst.extend(range(5_000)),
    lambda lst: lst.__setitem__(slice(None), [7.5] * len(lst)),
    lambda lst: lst.__delitem__(slice(0, 2)),
    lambda lst: (lst.extend(range(2_000)), lst.clear()),
    lambda lst: lst.append(lst),
)


class ToList:
    def __init__(self, result, error=None):
        self.result, self.error = result, error

    def tolist(self):
        if self.error is not None:
            raise self.error
        return self.result


class Sequence:
    """The sequence protocol, with a `__len__` that may lie and items that may raise."""

    def __init__(self, items, length, error_at):
        self.items, self.length, self.error_at = items, length, error_at

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if i == self.error_at:
            raise Planted(f"item {i}")
        if i >= len(self.items):
            raise IndexError(i)
        return self.items[i]


def item(r: Reader, holder: list):
    kind = r.int(0, 15)
    if kind <= 6:
        return r.token(5)
    if kind == 7:
        return r.choice([True, False, 1.0, "3", None, b"4"])
    if kind == 8:
        return IntSub(r.token(5))
    if kind == 9 and np is not None:
        return r.choice([np.int64, np.int32, np.uint8, np.int16])(r.int(0, 100))
    if kind in (10, 11, 12):
        return Index(r.choice(EDGE_INTS) if r.int(0, 3) == 0 else r.int(0, 9), r.choice(HARMS), holder)
    if kind == 13:
        return Index(1, error=r.choice([Planted("index"), TypeError("not an index"), ValueError("v"), OverflowError("o")]))
    if kind == 14:
        return Index(r.choice([1.5, "7", None]))  # __index__ returning a non-int: TypeError
    return Index(r.int(0, 9))


def build(r: Reader):
    """One hostile token argument."""
    kind = r.int(0, 9)
    if kind <= 3:
        holder: list = []
        for _ in range(r.int(0, 12)):
            holder.append(item(r, holder))
        return holder if kind != 3 else tuple(holder)
    if kind == 4:
        kept: list = []
        for _ in range(r.int(0, 8)):
            kept.append(item(r, kept))
        return ToList(r.choice([kept, kept, (1, 2), 5, None]), r.choice([None, None, None, Planted("tolist")]))
    if kind == 5:
        items = [r.token(5) for _ in range(r.int(0, 8))]
        return Sequence(items, r.int(0, 10), r.int(-1, 9))
    if kind in (6, 7) and np is not None:
        dtype = r.choice(["<i1", ">i2", "<i4", ">i4", "<i8", ">i8", "<u4", ">u8", "?", "<f4", "O", "<i8"])
        values = [r.choice(EDGE_INTS[:12]) if dtype not in ("?", "O") else r.int(0, 3) for _ in range(r.int(0, 10))]
        if dtype == "O":
            arr = np.array(values, dtype=object)
        else:  # wrapped into the dtype as C casts do
            arr = np.array([v % 2**64 for v in values], dtype=np.uint64).astype(dtype, casting="unsafe")
        shape = r.int(0, 3)
        if shape == 1 and len(arr) > 1:
            return arr[:: r.int(1, 3)]
        if shape == 2 and len(arr) >= 4:
            return arr[:4].reshape(2, 2)
        return arr
    if kind == 8:
        code = r.choice("bhilqBHILQfd")
        lo = 0 if code.isupper() else -100
        return array(code, [r.int(lo, 100) for _ in range(r.int(0, 8))])
    return r.choice([b"\x01\x02", "12", None, 3, {1, 2}, bytearray(b"\x01")])


# ------------------------------------------------------------------ the rule, in Python


def reference_ids(obj, int32: bool = False) -> list[int]:
    """What the converter must read: the ids `obj` holds when conversion starts (see
    csrc/token_ids.h), or the error it must raise. With `int32`, an id outside int32
    is a ValueError where it is met (the converter checks each id as it reads it)."""
    if isinstance(obj, (list, tuple)):
        items = tuple(obj)
    elif np is not None and isinstance(obj, np.ndarray) and obj.dtype != object:
        if obj.ndim != 1 or obj.dtype.kind not in "iu":
            if obj.ndim == 1 and obj.dtype.kind in "bf" and len(obj) == 0:
                return []
            raise TypeError("not a sequence of int ids")
        return in_range([int(v) for v in obj], int32)
    elif isinstance(obj, array):
        if obj.typecode in "fd":
            if len(obj) == 0:
                return []
            raise TypeError("float ids")
        return in_range(list(obj), int32)
    elif isinstance(obj, (str, bytes, bytearray)):
        raise TypeError("text is not ids")
    else:
        try:
            tolist = obj.tolist
        except AttributeError:
            tolist = None
        if tolist is not None:
            out = tolist()
            if not isinstance(out, list):
                raise TypeError("tolist() gave no list")
            items = tuple(out)
        else:
            if not hasattr(type(obj), "__getitem__") or isinstance(obj, (dict, set)):
                raise TypeError("not a sequence")
            items = tuple(list(obj))
    ids = []
    for x in items:
        if type(x) is int:
            ids.append(x)
        elif isinstance(x, bool):
            raise TypeError("a bool id")
        else:
            ids.append(operator.index(x))  # its own errors pass; TypeError: not an index
        in_range(ids[-1:], int32)
    return ids


def in_range(ids: list[int], int32: bool) -> list[int]:
    if int32 and not all(-(2**31) <= t < 2**31 for t in ids):
        raise ValueError("an id beyond int32")
    return ids


def outcome(call, obj):
    try:
        return ("ok", call(obj))
    except (Planted, TypeError, ValueError, OverflowError, IndexError) as err:
        return (type(err), None)


def expect(converter: str, ids: list[int]):
    """What `converter` returns for the reference ids `ids` (int32 ones checked already)."""
    if converter == "array64":
        return ("ok", ids if all(-(2**63) <= t < 2**63 for t in ids) else None)
    return ("ok", 0 if converter == "radix tree" else ids)


INT32 = ("array32", "radix tree")


CONVERTERS = {
    "array32": lambda t: list(token_array(t, "tokens", 4)),
    "array64": lambda t: (lambda a: None if a is None else list(a))(token_array(t, "tokens", 8)),
    "list": lambda t: list(token_list(t, "tokens", True)),
    "radix tree": lambda t: RadixTree(BlockPool(2), 1, "lru").match(t, None).num_tokens,
}


def state(cache):
    pool = cache.pool
    return (pool.free_queue(), [pool.ref_count(b) for b in range(pool.num_blocks)], pool.num_cached, cache.stats())


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    target = r.int(0, 6)
    start = r.at
    obj = build(r)

    def twin(int32: bool = False):
        again = Reader(data)
        again.at = start
        try:
            return ("ok", reference_ids(build(again), int32))
        except (Planted, TypeError, ValueError, OverflowError, IndexError) as err:
            return (type(err), None)

    if target <= 3:  # a converter on its own
        name = list(CONVERTERS)[target]
        got = outcome(CONVERTERS[name], obj)
        ref = twin(int32=name in INT32)
        want = expect(name, ref[1]) if ref[0] == "ok" else ref
        assert got == want, (name, got, want)
        return
    if target == 4:  # hashing reads the full blocks only: the same digests when both read
        got = outcome(lambda t: chain_digests(t, 2, "sha256_cbor", b"p"), obj)
        ref = twin()
        if got[0] == "ok" and ref[0] == "ok" and got[1] is not None:
            ids = ref[1][: len(ref[1]) // 2 * 2]
            assert got[1] == chain_digests(ids, 2, "sha256_cbor", b"p"), (got, ref)
        again = Reader(data)
        again.at = start
        outcome(lambda t: BlockContents(BlockPool(4), 2).lookup_chain(b"", 1, t, b""), build(again))
        return
    # A cache: admit, append and match with the hostile argument; a refusal changes nothing.
    backend = "hash" if target == 5 else "radix"
    cache = prefixcache.build_cache(CacheConfig(backend=backend, block_size=2, num_blocks=16))
    assert cache.admit("live", [1, 2, 3]) is not None
    for call in (lambda t: cache.admit("r", t), lambda t: cache.append("live", t), lambda t: cache.match(t)):
        r_again = Reader(data)
        r_again.at = start
        fresh = build(r_again)
        before = state(cache)
        try:
            call(fresh)
        except (Planted, TypeError, ValueError, OverflowError, IndexError):
            assert state(cache) == before, "a refused call changed the cache"
        cache.check_invariants()
    for rid in ("live", "r"):
        try:
            cache.release(rid)
        except KeyError:
            pass
    cache.check_invariants()
    cache.evict(16)
    assert cache.pool.num_free == 16


if __name__ == "__main__":
    main(test_one_input)
