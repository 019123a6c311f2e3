"""The token converter copies what it reads before any Python code runs.

It read a list's item array while calling an item's `__index__`; an `__index__` that
emptied or grew the list freed what it was reading: a crash in both backends. Now a
list is read from a snapshot taken before the first `__index__`, so every converter
(both backends' calls, `token_array`, `token_list`, the hash chain, the radix tree,
hit verification) reads the ids the list held when conversion began. An error the
callback raises itself comes out as it is; only "not an index" becomes the message
that names `tokens[i]`. A list `tolist()` hands over and keeps is copied, not kept.
"""

from __future__ import annotations

import operator

import pytest

import prefixcache
from prefixcache._C import BlockContents, BlockPool, chain_digests, RadixTree, token_array, token_list
from prefixcache.config import CacheConfig, HashConfig

HARMS = {
    "clear": lambda lst: lst.clear(),
    "grow": lambda lst: lst.extend(range(100_000)),
    "grow then clear": lambda lst: (lst.extend(range(50_000)), lst.clear()),
    "replace items": lambda lst: lst.__setitem__(slice(None), [Mutator(lst, None, 9)] * len(lst)),
    "delete the head": lambda lst: lst.__delitem__(slice(0, 3)),
}


class Mutator:
    """A token id whose __index__ first changes the list holding it."""

    def __init__(self, lst, harm, value):
        self.lst, self.harm, self.value = lst, harm, value

    def __index__(self):
        if self.harm is not None:
            self.harm(self.lst)
        return self.value


def hostile(harm, values=(5, 6, 7, 8, 9, 10, 11)):
    """[1, 2, 3, then Mutators]: the ids it holds when conversion starts are 1, 2, 3 and `values`."""
    lst = [1, 2, 3]
    lst += [Mutator(lst, harm, v) for v in values]
    return lst, [1, 2, 3, *values]


CONVERTERS = {
    "token_array q": lambda t: list(token_array(t, "tokens", 8)),
    "token_array i": lambda t: list(token_array(t, "tokens", 4)),
    "token_list": lambda t: token_list(t, "tokens", False),
    "token_list copy": lambda t: token_list(t, "tokens", True),
    "chain_digests": lambda t: chain_digests(t, 2, "sha256_cbor", b"p"),
    "radix tree match": lambda t: RadixTree(BlockPool(4), 1, "lru").match(t, None).num_tokens,
    "block contents": lambda t: BlockContents(BlockPool(4), 2).lookup_chain(b"", 1, t, b""),
}


@pytest.mark.parametrize("harm", HARMS.values(), ids=HARMS.keys())
@pytest.mark.parametrize("convert", CONVERTERS.values(), ids=CONVERTERS.keys())
def test_index_that_changes_the_list_reads_the_snapshot(convert, harm):
    tokens, seen = hostile(harm)
    assert convert(tokens) == convert(seen)  # was: a read of freed memory (SIGSEGV)


@pytest.mark.parametrize("backend", ["hash", "radix"])
@pytest.mark.parametrize("harm", HARMS.values(), ids=HARMS.keys())
def test_backends_read_the_snapshot(backend, harm):
    cache = prefixcache.build_cache(CacheConfig(backend=backend, block_size=2, num_blocks=32))
    tokens, seen = hostile(harm)
    adm = cache.admit("r", tokens)
    assert adm is not None and len(adm.block_table) == 5
    more, more_seen = hostile(harm, (20, 21))
    assert cache.append("r", more) is not None
    cache.commit("r", len(seen) + len(more_seen))
    cache.release("r")
    assert cache.match(hostile(harm)[0]).num_tokens == len(seen) // 2 * 2
    assert cache.match(seen + more_seen).num_tokens == 14
    cache.check_invariants()


class Raises:
    def __init__(self, error):
        self.error = error

    def __index__(self):
        raise self.error


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_errors_an_index_raises_pass_through(backend):
    cache = prefixcache.build_cache(CacheConfig(backend=backend, block_size=2, num_blocks=8))
    with pytest.raises(ZeroDivisionError):
        cache.admit("r", [1, Raises(ZeroDivisionError("own"))])
    with pytest.raises(TypeError, match=r"tokens\[1\]"):  # "not an index": the protocol's message
        cache.admit("r", [1, Raises(TypeError("no"))])
    with pytest.raises(KeyError):
        cache.block_table("r")
    assert cache.pool.num_free == 8


class BadAttribute:
    def __getattr__(self, name):
        raise ZeroDivisionError(name)


def test_an_error_looking_up_tolist_is_not_swallowed():
    with pytest.raises(ZeroDivisionError, match="tolist"):
        token_array(BadAttribute(), "tokens", 8)


class KeepsItsList:
    """tolist() hands over a list it keeps, and changes later."""

    def __init__(self, ids):
        self.ids = list(ids)

    def tolist(self):
        return self.ids


def test_a_list_tolist_keeps_is_copied():
    """hash keeps ids beyond int64 as a list: it must be its own, not the caller's."""
    cache = prefixcache.build_cache(CacheConfig(block_size=2, num_blocks=8, hash=HashConfig("sha256_cbor")))
    prompt = [2**70, 1, 2, 3, 4]
    obj = KeepsItsList(prompt)
    assert token_list(obj, "tokens", True) is not obj.ids
    cache.admit("r", obj)
    obj.ids[:] = [0, 0, 0, 0, 0]
    cache.commit("r", 5)
    cache.release("r")
    assert cache.match(prompt).num_tokens == 4
    cache.check_invariants()


def test_numpy_ints_in_a_list_read_alike():
    np = pytest.importorskip("numpy")
    tokens = [1, np.int64(2), np.int32(3), operator.index(4)]
    assert list(token_array(tokens, "tokens", 8)) == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_numpy_object_array_is_read_through_tolist(backend):
    """fuzz_tokens: numpy 2 exports an object array as a buffer of format 'O', which
    the buffer reader refused ("expected a sequence of int token ids"); its items are
    Python objects, read through tolist() like any sequence."""
    np = pytest.importorskip("numpy")
    ids = np.array([1, 2, 3, np.int64(4)], dtype=object)
    assert list(token_array(ids, "tokens", 4)) == [1, 2, 3, 4]
    cache = prefixcache.build_cache(CacheConfig(backend=backend, block_size=2, num_blocks=8))
    assert cache.admit("r", ids) is not None
    with pytest.raises(TypeError, match=r"tokens\[1\]"):
        token_array(np.array([1, 2.5], dtype=object), "tokens", 8)
