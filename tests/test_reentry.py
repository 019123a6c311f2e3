"""Rule 8: a cache is never re-entered from its own callbacks.

Every kind of callback a built-in cache makes (an eviction policy's `priority()`, the
comparison of the keys it returns, the `usable_hit` / `partial_hit` / `blocks_cached`
hooks, a token object's `tolist()` and `__index__`, a request id's `__hash__`) calls back
into the cache. The call from inside is refused with RuntimeError before it changes
anything; if the callback lets that error out, the outer call raises it and the cache is
as it was (the pool, every block table, the stats), consistent, and pins nothing once
every request is released. A callback that catches the refusal lets the outer call
finish normally. The native tree and evictor refuse a callback that changes them in the
middle of their own calls the same way (raw-API users, no cache in between).
"""

from __future__ import annotations

import pytest

import prefixcache
from prefixcache.backends.hash import HashCache
from prefixcache.backends.radix import RadixCache
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.eviction import EvictionPolicy
from prefixcache._C import BlockPool, CallbackBlockEvictor, RadixTree

REFUSED = "never re-entered"


class Callback:
    """What a test's callbacks do: `action(cache)` once per callback while armed; each
    refusal it meets is kept in `refused`, and raised on unless `swallow`."""

    def __init__(self) -> None:
        self.cache = None
        self.action = None
        self.swallow = False
        self.refused: list[RuntimeError] = []

    def arm(self, cache, action, *, swallow: bool = False) -> None:
        self.cache, self.action, self.swallow = cache, action, swallow
        self.refused.clear()

    def disarm(self) -> None:
        self.action = None

    def __call__(self) -> None:
        if self.action is None:
            return
        try:
            self.action(self.cache)
        except RuntimeError as err:
            self.refused.append(err)
            if not self.swallow:
                raise


CALLBACK = Callback()


class Reentering(EvictionPolicy):
    """A Python policy (no native order) whose priority() runs CALLBACK first."""

    def priority(self, candidate):
        CALLBACK()
        return (candidate.last_access_time,)


class ReenteringKey:
    """A priority whose comparison runs CALLBACK."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __lt__(self, other: ReenteringKey) -> bool:
        CALLBACK()
        return self.value < other.value


class ReenteringKeys(EvictionPolicy):
    def priority(self, candidate):
        return ReenteringKey(candidate.last_access_time)


class MixedKeys(EvictionPolicy):
    """None (or a str) for some candidates and ints for others, while `broken`."""

    broken = True
    odd: object = None

    def priority(self, candidate):
        return type(self).odd if type(self).broken and candidate.creation_time % 2 else candidate.creation_time


class MixedNone(MixedKeys):
    odd = None


class MixedStr(MixedKeys):
    odd = "odd"


def policy(cls) -> str:
    """A policy by "module:Class" path, as a user names one: nothing is registered."""
    return f"{__name__}:{cls.__name__}"


class HookedRadix(RadixCache):
    def usable_hit(self, tokens, num_tokens, namespace=None):
        CALLBACK()
        return num_tokens


class HookedHash(HashCache):
    def usable_hit(self, tokens, num_tokens, namespace=None):
        CALLBACK()
        return num_tokens


class PartialHook(HashCache):
    partial_hits = True

    def partial_hit(self, tokens, namespace, digests, num_hit_blocks, limit):
        CALLBACK()
        return None


class StoredHook(HashCache):
    def blocks_cached(self, request, start, stop):
        CALLBACK()


class TokensThatCallBack:
    """Token ids whose tolist() runs CALLBACK."""

    def __init__(self, ids):
        self.ids = list(ids)

    def tolist(self):
        CALLBACK()
        return list(self.ids)


class IdThatCallsBack:
    """A token id whose __index__ runs CALLBACK."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        CALLBACK()
        return self.value


class RequestIdThatCallsBack:
    def __hash__(self) -> int:
        CALLBACK()
        return 7


def build(backend="radix", cls=None, *, eviction="lru", algorithm="sha256_cbor", block_size=2, num_blocks=12):
    config = CacheConfig(backend=backend, block_size=block_size, num_blocks=num_blocks, eviction=eviction,
                         hash=HashConfig(algorithm))
    return prefixcache.build_cache(config) if cls is None else cls(BlockPool(num_blocks), config)


def state(cache, live=()):
    pool = cache.pool
    return (
        pool.free_queue(),
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        pool.num_cached,
        {rid: tuple(cache.block_table(rid)) for rid in live},
        cache.stats(),
    )


def serve(cache, rid, tokens):
    assert cache.admit(rid, tokens) is not None
    cache.commit(rid, len(tokens))
    cache.release(rid)


def warm(cache):
    """Three cached prompts (evictable), one live request "live" holding a hit."""
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12, 13])):
        serve(cache, f"w{i}", prompt)
    assert cache.admit("live", [1, 2, 3, 4, 9]).num_cached_tokens == 4
    return ["live"]


def drained(cache, live):
    """Rule 7 after the test: release what is live, everything evicts, nothing pinned."""
    CALLBACK.disarm()
    for rid in live:
        cache.release(rid)
    cache.check_invariants()
    cache.evict(cache.pool.num_blocks)
    assert cache.pool.num_pinned == 0 and cache.pool.num_free == cache.pool.num_blocks
    assert cache.reset()


# Calls a callback makes into the cache it was called from: every one is refused.
INNER = {
    "evict": lambda c: c.evict(100),
    "admit": lambda c: c.admit("inner", [40, 41, 42]),
    "release": lambda c: c.release("live"),
    "commit": lambda c: c.commit("live", 5),
    "append": lambda c: c.append("live", [1]),
    "match": lambda c: c.match([1, 2, 3]),
    "block_table": lambda c: c.block_table("live"),
    "stats": lambda c: c.stats(),
    "drain_events": lambda c: c.drain_events(),
    "reset": lambda c: c.reset(),
    "check_invariants": lambda c: c.check_invariants(),
}


def expect_refused_and_unchanged(cache, live, outer, inner):
    before = state(cache, live)
    CALLBACK.arm(cache, inner)
    with pytest.raises(RuntimeError, match=REFUSED):
        outer()
    assert CALLBACK.refused, "the callback was never called, or the cache let it in"
    assert state(cache, live) == before, "a call refused from a callback changed the cache"
    CALLBACK.disarm()
    cache.check_invariants()


@pytest.mark.parametrize("inner", INNER.values(), ids=INNER.keys())
def test_radix_python_policy_that_reenters_the_cache(inner):
    """Issue 16 2(a): priority() called cache.evict(...) and the tree's eviction loop
    then held freed nodes: SIGSEGV. Every call from the policy is refused now."""
    cache = build("radix", eviction=policy(Reentering))
    live = warm(cache)
    expect_refused_and_unchanged(cache, live, lambda: cache.evict(3), inner)
    # An admission that must evict: refused too, and it pins nothing and registers nothing.
    expect_refused_and_unchanged(cache, live, lambda: cache.admit("big", list(range(50, 65))), inner)
    with pytest.raises(KeyError):
        cache.block_table("big")
    drained(cache, live)


def test_radix_python_policy_that_catches_the_refusal():
    cache = build("radix", eviction=policy(Reentering))
    live = warm(cache)
    CALLBACK.arm(cache, INNER["evict"], swallow=True)
    assert cache.evict(3) >= 3
    assert CALLBACK.refused
    cache.check_invariants()
    drained(cache, live)


@pytest.mark.parametrize("inner", [INNER["evict"], INNER["admit"], INNER["stats"]], ids=["evict", "admit", "stats"])
def test_hash_python_policy_that_reenters_the_cache(inner):
    """hash ranks a block with a Python policy when its last reference goes (release)."""
    cache = build("hash", eviction=policy(Reentering))
    live = warm(cache)
    expect_refused_and_unchanged(cache, live, lambda: cache.release("live"), inner)
    assert cache.block_table("live")  # still live: the release did nothing
    drained(cache, live)


@pytest.mark.parametrize("backend", ["radix", "hash"])
def test_policy_keys_whose_comparison_reenters(backend):
    """The keys a policy returns are compared in the native heaps: their __lt__ is a
    callback too. A refused comparison used to leave a moved-from (null) key in the
    hash evictor's heap."""
    cache = build(backend, eviction=policy(ReenteringKeys))
    live = warm(cache)
    outer = (lambda: cache.evict(3)) if backend == "radix" else (lambda: cache.release("live"))
    expect_refused_and_unchanged(cache, live, outer, INNER["evict"])
    # An admission whose eviction compares keys: refused, nothing pinned or changed.
    expect_refused_and_unchanged(cache, live, lambda: cache.admit("big", list(range(50, 63))), INNER["stats"])
    drained(cache, live)


@pytest.mark.parametrize("kind", ["None", "str"])
@pytest.mark.parametrize("backend", ["radix", "hash"])
def test_policy_keys_that_do_not_compare(backend, kind):
    """A policy returning None (or a str) for some candidates and ints for others: a
    TypeError from the call that ranked or compared them, which changes nothing (was:
    SystemError from a null key left in the hash evictor's heap, pins leaked, and lock
    refs left behind by radix admissions). None is refused as soon as it is returned
    (it does not even compare with itself); a str only when it meets an int."""
    Mixed = MixedNone if kind == "None" else MixedStr
    Mixed.broken = True
    cache = build(backend, eviction=policy(Mixed), block_size=1, num_blocks=24)
    failures, live = 0, []
    for i in range(60):
        prompt = [i % 7, 100 + i, 200 + i]
        before = state(cache, live)
        try:
            if cache.admit(i, prompt) is None:
                continue
        except TypeError as err:
            assert "'<' not supported" in str(err)
            failures += 1
            assert state(cache, live) == before
            continue
        cache.commit(i, 3)
        before = state(cache, [*live, i])
        try:
            cache.release(i)
        except TypeError:
            failures += 1
            assert state(cache, [*live, i]) == before  # still live, as it was
            live.append(i)
        cache.check_invariants()
    assert failures
    if backend == "radix" or kind == "None":
        # Nothing of the broken policy stayed behind: fixed, everything drains.
        Mixed.broken = False
        drained(cache, live)


HOOKED = {
    "radix usable_hit": (lambda: build("radix", HookedRadix), "admit"),
    "hash usable_hit": (lambda: build("hash", HookedHash), "admit"),
    "hash partial_hit (verified, xxhash)": (lambda: build("hash", PartialHook, algorithm="xxhash"), "admit"),
}


@pytest.mark.parametrize("inner", [INNER["evict"], INNER["release"], INNER["match"]], ids=["evict", "release", "match"])
@pytest.mark.parametrize("make,outer", HOOKED.values(), ids=HOOKED.keys())
def test_hooks_that_reenter_the_cache(make, outer, inner):
    cache = make()
    live = warm(cache)
    # Both leave room after the 2-block hit, for partial_hit to be asked.
    expect_refused_and_unchanged(cache, live, lambda: cache.admit("new", [1, 2, 3, 4, 5, 9]), inner)
    expect_refused_and_unchanged(cache, live, lambda: cache.match([1, 2, 3, 4, 5]), inner)
    drained(cache, live)


def test_blocks_cached_hook_that_reenters_the_cache():
    """blocks_cached is told after the fact, at the end of the commit: the commit is
    whole (events included) when the hook's error comes out."""
    cache = StoredHook(BlockPool(12), CacheConfig(block_size=2, num_blocks=12, enable_events=True))
    live = warm(cache)
    cache.drain_events()
    assert cache.admit("new", [30, 31, 32, 33, 34]) is not None
    CALLBACK.arm(cache, INNER["evict"])
    with pytest.raises(RuntimeError, match=REFUSED):
        cache.commit("new", 4)
    CALLBACK.disarm()
    cache.check_invariants()
    assert cache.match([30, 31, 32, 33]).num_tokens == 4
    assert [type(e).__name__ for e in cache.drain_events()] == ["BlockStored"]
    cache.commit("new", 5)  # and the request goes on
    drained(cache, [*live, "new"])


@pytest.mark.parametrize("backend", ["radix", "hash"])
@pytest.mark.parametrize("tokens", ["tolist", "__index__"])
def test_token_objects_that_reenter_the_cache(backend, tokens):
    """tolist() / __index__ run inside the cache's call: a call from there is refused,
    and the outer call raises that RuntimeError (not a TypeError about the token)."""
    cache = build(backend)
    live = warm(cache)
    prompt = [1, 2, 3, 4, 7]

    def hostile():
        return TokensThatCallBack(prompt) if tokens == "tolist" else [1, 2, IdThatCallsBack(3), 4, 7]

    for inner in (INNER["release"], INNER["admit"], INNER["evict"]):
        expect_refused_and_unchanged(cache, live, lambda: cache.admit("new", hostile()), inner)
        expect_refused_and_unchanged(cache, live, lambda: cache.append("live", hostile()), inner)
        expect_refused_and_unchanged(cache, live, lambda: cache.match(hostile()), inner)
    CALLBACK.arm(cache, INNER["evict"], swallow=True)
    assert cache.admit("new", hostile()).num_cached_tokens == 4  # the refusal caught: a normal admission
    drained(cache, [*live, "new"])


@pytest.mark.parametrize("backend", ["radix", "hash"])
def test_request_id_whose_hash_reenters_the_cache(backend):
    cache = build(backend)
    live = warm(cache)
    expect_refused_and_unchanged(cache, live, lambda: cache.admit(RequestIdThatCallsBack(), [1, 2, 3]), INNER["stats"])
    drained(cache, live)


@pytest.mark.parametrize("backend", ["radix", "hash"])
@pytest.mark.parametrize("tokens", ["tolist", "__index__"])
def test_tokens_that_admit_the_same_id_while_converted(backend, tokens):
    """Issue 16 item 4: radix checked the id before converting the tokens, so a tokens
    object that admitted the same id meanwhile left `lock_ref 2 but live requests hold
    1`. The inner admission is refused; the outer one is the only one."""
    cache = build(backend)
    live = warm(cache)
    prompt = [1, 2, 3, 4, 8]
    hostile = TokensThatCallBack(prompt) if tokens == "tolist" else [1, 2, 3, IdThatCallsBack(4), 8]
    CALLBACK.arm(cache, lambda c: c.admit("r", prompt), swallow=True)
    adm = cache.admit("r", hostile)
    assert len(CALLBACK.refused) == 1
    assert adm.num_cached_tokens == 4 and cache.block_table("r") == adm.block_table
    cache.check_invariants()
    drained(cache, [*live, "r"])


# ------------------------------------------------------------- the native objects


SPARE = {}


def warm_tree():
    pool = BlockPool(8)
    tree = RadixTree(pool, 1, None)
    for toks in ([1, 2], [3, 4], [5, 6]):
        tree.insert(toks, pool.allocate(2), None, 0, 0)
    SPARE["block"] = pool.allocate(1)
    return pool, tree


TREE_CALLS = {
    "evict": lambda pool, t: t.evict(1, lambda c: 0),
    "insert": lambda pool, t: t.insert([9], list(SPARE["block"]), None, 0, 0),
    "match_prefix": lambda pool, t: t.match_prefix([1, 2], None),
    "lock": lambda pool, t: t.lock(t.match([1, 2], None).node),
    "reset": lambda pool, t: t.reset(),
}


@pytest.mark.parametrize("inner", TREE_CALLS.values(), ids=TREE_CALLS.keys())
def test_native_tree_refuses_changes_from_its_ranking(inner):
    pool, tree = warm_tree()
    free_before, nodes_before = pool.num_free, tree.num_nodes

    def rank(candidate):
        inner(pool, tree)
        return candidate.last_access_time

    with pytest.raises(RuntimeError, match="RadixTree.evict"):
        tree.evict(4, rank)
    assert (pool.num_free, tree.num_nodes, tree.last_evicted()) == (free_before, nodes_before, [])
    tree.check_invariants()
    assert tree.match([1, 2], None).num_tokens == 2  # reads stay allowed, and see the tree unchanged


def test_native_evictor_refuses_changes_from_its_policy():
    pool = BlockPool(6)
    evictor = None

    def rank(candidate):
        evictor.evict(1)
        return candidate.last_access_time

    evictor = CallbackBlockEvictor(pool, 2, rank)
    blocks = pool.allocate(2)
    pool.cache_many_packed(blocks, b"aabb", 2)
    evictor.cached(blocks, b"aabb", 2)
    with pytest.raises(RuntimeError, match="BlockEvictor.evict"):
        evictor.free(blocks)
    assert [pool.ref_count(b) for b in blocks] == [1, 1] and evictor.num_candidates == 0
    evictor.check_invariants()
