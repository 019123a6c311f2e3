"""Fuzz harness: callbacks that call back into the cache that called them (rule 8).

Each input picks a backend (`hash` under SHA-256 or verified xxhash, `radix`), a block
size, a small pool and one kind of callback: a Python eviction policy's `priority()`,
the `__lt__` of the keys it returns, the `usable_hit` hook, `partial_hit` or
`blocks_cached` (hash), a token object's `tolist()`, a token id's `__index__`, or a
request id's `__hash__`. Then it makes protocol calls (admit, commit, append, release,
match, evict, reset) that reach the callback. Each time the callback runs inside a
call of the cache, it may make a call of its own into the cache (any public method,
arguments from the input), and then let the refusal out, catch it, or raise an error
of its own.

Every call from inside must be refused with RuntimeError and change nothing (the pool
is read before and after it). An outer call whose callback raised the first time it
ran must raise that error and leave the pool, the block tables and the stats as they
were (a `blocks_cached` hook is told after the fact: its commit stands), with one
exception that docs/concurrency.md states: a `radix` eviction keeps its Python policy's
leaves ranked, so it can evict a leaf ranked earlier before it first calls the policy
(for the parent that leaf leaves behind); what it evicted before the failing call stays
evicted. There the block tables, every block's reference count and the stats but
`evictions` must be as they were. After every
call `check_invariants()` passes; at the end every request is released, everything
evicts and no block stays pinned. Under ASan (tests/test_fuzz_harnesses.py in
.ci/sanitize) the native trees' and evictors' loops are watched for use after free.

    python fuzz/fuzz_reentry.py -max_total_time=600
"""

from __future__ import annotations

import dataclasses

from harness import main
from reader import Reader

from prefixcache.backends.hash import HashCache
from prefixcache.backends.radix import RadixCache
from prefixcache._C import BlockPool
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.eviction import EvictionPolicy

KINDS = ("policy", "key", "usable_hit", "partial_hit", "blocks_cached", "tolist", "index", "request id")
REFUSED = "never re-entered"


class Planted(Exception):
    """The callback's own error: the outer call must raise it as it is."""


class Callback:
    """What the callbacks do, decided by the input, while armed and inside a call."""

    def __init__(self) -> None:
        self.reader: Reader | None = None
        self.cache = None
        self.armed = False
        self.calls = 0  # times the callback ran inside the current outer call
        self.first_raised = False
        self.plan: tuple[bytes, int] | None = None  # replay the same decision each time (a request id's hash)

    def arm(self, fixed: bool) -> None:
        self.calls, self.first_raised, self.armed = 0, False, True
        self.plan = (self.reader.data, self.reader.at) if fixed else None
        if fixed:
            self.reader.raw(8)  # the plan's bytes: the outer call reads on after them

    def __call__(self) -> None:
        cache = self.cache
        if not self.armed or cache is None or not cache._call_guard.held:
            return
        if self.plan is not None:
            r = Reader(self.plan[0])
            r.at = self.plan[1]
        else:
            r = self.reader
        self.calls += 1
        what = r.int(0, 3)
        if what == 0:
            return
        if what == 3:
            self._raised()
            raise Planted("the callback's own error")
        before = pool_state(cache.pool)
        try:
            inner_call(cache, r)
        except RuntimeError as err:
            assert REFUSED in str(err), err
            assert pool_state(cache.pool) == before, "a call refused from a callback changed the pool"
            if what == 1:
                self._raised()
                raise
            return
        raise AssertionError("a call from inside a callback was let in")

    def _raised(self) -> None:
        if self.calls == 1:
            self.first_raised = True


CALLBACK = Callback()


def inner_call(cache, r: Reader) -> None:
    op = r.int(0, 10)
    rid = r.int(0, 3)
    if op == 0:
        cache.evict(r.int(0, 20))
    elif op == 1:
        cache.admit(("inner", rid), [r.int(0, 3) for _ in range(r.int(1, 6))])
    elif op == 2:
        cache.release(rid)
    elif op == 3:
        cache.commit(rid, r.int(0, 8))
    elif op == 4:
        cache.append(rid, [r.int(0, 3)])
    elif op == 5:
        cache.match([r.int(0, 3) for _ in range(r.int(0, 6))])
    elif op == 6:
        cache.block_table(rid)
    elif op == 7:
        cache.stats()
    elif op == 8:
        cache.drain_events()
    elif op == 9:
        cache.reset()
    else:
        cache.check_invariants()


class CallingPolicy(EvictionPolicy):
    def priority(self, candidate):
        CALLBACK()
        return (candidate.last_access_time, candidate.node)


class CallingKey:
    def __init__(self, value) -> None:
        self.value = value

    def __lt__(self, other) -> bool:
        CALLBACK()
        return self.value < other.value


class CallingKeys(EvictionPolicy):
    def priority(self, candidate):
        return CallingKey((candidate.last_access_time, candidate.node))


class UsableHit:
    def usable_hit(self, tokens, num_tokens, namespace=None):
        CALLBACK()
        return num_tokens


class HashUsableHit(UsableHit, HashCache):
    pass


class RadixUsableHit(UsableHit, RadixCache):
    pass


class HashPartialHit(HashCache):
    partial_hits = True

    def partial_hit(self, tokens, namespace, digests, num_hit_blocks, limit):
        CALLBACK()
        return None


class HashBlocksCached(HashCache):
    def blocks_cached(self, request, start, stop):
        CALLBACK()


class Tokens:
    def __init__(self, ids) -> None:
        self.ids = list(ids)

    def tolist(self):
        CALLBACK()
        return list(self.ids)


class Id:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        CALLBACK()
        return self.value


class RequestId:
    """A request id whose __hash__ runs the callback. The callback does the same each time
    within one outer call, as a dict key's hash must: a hash that fails only now and then
    breaks any dict, ours included."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        CALLBACK()
        return hash(("rid", self.n))

    def __eq__(self, other) -> bool:
        return isinstance(other, RequestId) and other.n == self.n


def pool_state(pool) -> tuple:
    return (pool.free_queue(), [pool.ref_count(b) for b in range(pool.num_blocks)], pool.num_cached)


def state(cache, live) -> tuple:
    return (pool_state(cache.pool), {rid: tuple(cache.block_table(rid)) for rid in live}, cache.stats())


def state_but_evictions(cache, live) -> tuple:
    """`state` less what evicting unpinned cached blocks changes (the free queue, the
    cached count, the tree's own references and the `evictions` counter): the block
    tables, the reference counts of the blocks in them, and the other stats."""
    tables = {rid: tuple(cache.block_table(rid)) for rid in live}
    held = sorted({b for table in tables.values() for b in table})
    return (tables, [cache.pool.ref_count(b) for b in held], dataclasses.replace(cache.stats(), evictions=0))


def make(r: Reader):
    backend = r.choice(("hash", "hash-xxhash", "radix"))
    kind = r.choice(KINDS)
    if backend == "radix" and kind in ("partial_hit", "blocks_cached"):
        kind = "usable_hit"
    # By "module:Class" path, as a user names a plugin: nothing is registered.
    eviction = {"policy": f"{__name__}:CallingPolicy", "key": f"{__name__}:CallingKeys"}.get(kind, "lru")
    config = CacheConfig(
        backend="radix" if backend == "radix" else "hash", block_size=r.int(1, 3), num_blocks=r.int(6, 14),
        eviction=eviction, hash=HashConfig("xxhash" if backend == "hash-xxhash" else "sha256_cbor"),
    )
    if kind == "usable_hit":
        cls = RadixUsableHit if backend == "radix" else HashUsableHit
    elif kind == "partial_hit":
        cls = HashPartialHit
    elif kind == "blocks_cached":
        cls = HashBlocksCached
    else:
        cls = RadixCache if backend == "radix" else HashCache
    return cls(BlockPool(config.num_blocks), config), kind


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    cache, kind = make(r)
    CALLBACK.reader, CALLBACK.cache, CALLBACK.armed = r, cache, False
    live: dict[object, list[int]] = {}  # request id -> [tokens so far, committed]

    def tokens(n: int):
        ids = [r.int(0, 3) for _ in range(n)]
        if kind == "tolist":
            return Tokens(ids)
        if kind == "index" and ids:
            ids[r.int(0, len(ids) - 1)] = Id(ids[0])
        return ids

    def request_id():
        n = r.int(0, 3)
        return RequestId(n) if kind == "request id" else n

    try:
        steps = 0
        while not r.exhausted and steps < 40:
            steps += 1
            op = r.int(0, 7)
            rid = request_id()
            CALLBACK.armed = False
            before = state(cache, live)
            before_evictions = state_but_evictions(cache, live)
            CALLBACK.arm(fixed=kind == "request id")
            committing = None
            try:
                if op <= 1:
                    toks = tokens(r.int(1, 3 * cache.block_size + 1))
                    if rid not in live:
                        adm = cache.admit(rid, toks)
                        if adm is not None:
                            n = len(toks.ids) if isinstance(toks, Tokens) else len(toks)
                            live[rid] = [n, adm.num_cached_tokens]
                elif op == 2 and rid in live:
                    total, done = live[rid]
                    committing = r.int(done, total)
                    cache.commit(rid, committing)
                    live[rid][1] = committing
                elif op == 3 and rid in live:
                    toks = tokens(r.int(0, cache.block_size + 1))
                    if cache.append(rid, toks) is not None:
                        live[rid][0] += len(toks.ids) if isinstance(toks, Tokens) else len(toks)
                elif op == 4 and rid in live:
                    cache.release(rid)
                    del live[rid]
                elif op == 5:
                    cache.match(tokens(r.int(0, 8)))
                elif op == 6:
                    cache.evict(r.int(0, 12))
                elif op == 7 and not live:
                    assert cache.reset()
            except (RuntimeError, Planted) as err:
                CALLBACK.armed = False
                assert isinstance(err, Planted) or REFUSED in str(err), err
                assert CALLBACK.calls, "an outer call raised though no callback ran"
                if kind == "blocks_cached" and committing is not None:
                    live[rid][1] = committing  # told after the fact: the commit stands
                elif CALLBACK.first_raised and isinstance(cache, RadixCache) and kind in ("policy", "key"):
                    assert state_but_evictions(cache, live) == before_evictions, (
                        "a call whose policy raised at once changed more than what it had evicted")
                    refs = [cache.pool.ref_count(b) for b in range(cache.pool.num_blocks)]
                    assert all(now in (then, 0) for then, now in zip(before[0][1], refs)), (
                        "a block's reference count moved other than by its eviction")
                elif CALLBACK.first_raised:
                    assert state(cache, live) == before, "a call whose callback raised at once changed the cache"
            CALLBACK.armed = False
            cache.check_invariants()
    finally:
        CALLBACK.armed = False
    for rid in list(live):
        cache.release(rid)
    cache.check_invariants()
    cache.evict(cache.pool.num_blocks)
    assert cache.pool.num_free == cache.pool.num_blocks, f"{cache.pool.num_pinned} blocks pinned"
    assert cache.reset()


if __name__ == "__main__":
    main(test_one_input)
