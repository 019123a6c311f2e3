"""Random request lifecycles through the `radix` backend against a naive model.

The model knows nothing of trees. It keeps the set of cached page-aligned prefixes
(namespace, tokens) and, per live request, its tokens, committed length, how much of
it the tree holds (`protected`) and how many blocks it owns. From that alone it
predicts every hit, every refusal (needed blocks > free + evictable outside the
locked paths), the pool's free count and every block freed, each allocation making the
room SGLang 0.5.23's scheduler asks for (its shortfall: a page per decode step, an
extend's tokens plus a page). Which unlocked prefixes an
eviction takes is the policy's business (tested in test_radix_tree*.py); the model
only requires that an eviction keeps every locked prefix, frees what it reports, and
frees at least what was asked (leaves go whole) or everything evictable.

After every step: the backend's `check_invariants()`, the pool's free count, and every
cached prefix still matching.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache import CacheConfig, build_cache

NAMESPACES = [None, "a"]
POLICIES = ["lru", "lfu", "fifo", "mru", "filo", "priority"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ModelRequest:
    tokens: list[int]
    namespace: str | None
    computed: int  # committed tokens
    protected: int  # leading tokens whose blocks are the tree's
    owned: int  # blocks the request owns (not the tree's)


class ModelledCache:
    """The backend and the naive model side by side."""

    def __init__(self, block_size: int, num_blocks: int, eviction: str) -> None:
        self.bs = block_size
        self.cache = build_cache(
            CacheConfig(backend="radix", block_size=block_size, num_blocks=num_blocks, eviction=eviction)
        )
        self.num_blocks = num_blocks
        self.cached: set[tuple[str | None, tuple[int, ...]]] = set()
        self.free = num_blocks
        self.requests: dict[int, ModelRequest] = {}
        self.next_id = 0

    # -- the model's predictions -----------------------------------------------------
    def prefixes(self, ns, tokens, num_tokens) -> set:
        return {(ns, tuple(tokens[:end])) for end in range(self.bs, num_tokens + 1, self.bs)}

    def hit(self, ns, tokens) -> int:
        n = 0
        while n + self.bs <= len(tokens) and (ns, tuple(tokens[: n + self.bs])) in self.cached:
            n += self.bs
        return n

    def locked(self) -> set:
        out = set()
        for r in self.requests.values():
            out |= self.prefixes(r.namespace, r.tokens, r.protected)
        return out

    def observe_eviction(self, must_keep: set, needed_blocks: int) -> int:
        """Sync `cached` with the cache after an eviction; returns pages freed."""
        still = {p for p in self.cached if self.cache.match(p[1], namespace=p[0]).num_tokens == len(p[1])}
        assert must_keep <= still, "an eviction took a locked prefix"
        freed = len(self.cached) - len(still)
        evictable = len(self.cached - must_keep)
        assert freed >= min(needed_blocks, evictable), (freed, needed_blocks, evictable)
        self.cached = still
        return freed

    def demand(self, num_new_tokens: int, decode: bool) -> int:
        """TOKENS of room SGLang's scheduler asks for: a decode step a page, an extend its
        tokens plus a page when pages are larger than a token (mem_cache/allocation.py)."""
        if decode:
            return self.bs
        return num_new_tokens + (self.bs if self.bs > 1 and num_new_tokens else 0)

    def make_room(self, needed: int, demand: int, locked: set, evictions_before: int) -> None:
        """An allocation of `needed` blocks after making `demand` TOKENS of room: SGLang 0.5.23
        evicts the shortfall's worth when short (leaves go whole, so whole pages or more)."""
        shortfall = demand - self.free * self.bs
        if shortfall > 0:
            freed = self.observe_eviction(locked, ceil_div(shortfall, self.bs))
            assert self.cache.stats().evictions - evictions_before == freed
            self.free += freed
        else:
            assert self.cache.stats().evictions == evictions_before
        self.free -= needed

    # -- operations ----------------------------------------------------------------------
    def admit(self, ns, tokens):
        rid = self.next_id
        self.next_id += 1
        hit = self.hit(ns, tokens[:-1])
        needed = ceil_div(len(tokens), self.bs) - hit // self.bs
        locked = self.locked() | self.prefixes(ns, tokens, hit)
        room = self.free + len(self.cached - locked)
        hit_blocks = self.cache.match(tokens[:hit], namespace=ns).block_ids
        evictions = self.cache.stats().evictions
        adm = self.cache.admit(rid, tokens, namespace=ns)
        if needed > room:
            assert adm is None
            return
        assert adm is not None
        assert adm.num_cached_tokens == hit
        assert len(adm.block_table) == ceil_div(len(tokens), self.bs)
        assert adm.block_table[: hit // self.bs] == hit_blocks
        self.make_room(needed, self.demand(len(tokens) - hit, decode=False), locked, evictions)
        self.requests[rid] = ModelRequest(list(tokens), ns, 0, hit, needed)

    def append(self, rid, tokens):
        r = self.requests[rid]
        needed = ceil_div(len(r.tokens) + len(tokens), self.bs) - ceil_div(len(r.tokens), self.bs)
        locked = self.locked()
        room = self.free + len(self.cached - locked)
        evictions = self.cache.stats().evictions
        got = self.cache.append(rid, tokens)
        if needed > room:
            assert got is None
            return
        assert got is not None and len(got) == needed
        self.make_room(needed, self.demand(len(tokens), decode=len(tokens) == 1), locked, evictions)
        r.tokens += tokens
        r.owned += needed

    def insert(self, r: ModelRequest, computed: int) -> None:
        """What a commit or release hands to the tree."""
        aligned = computed // self.bs * self.bs
        if aligned == 0 or aligned < r.protected:
            return
        new = self.prefixes(r.namespace, r.tokens, aligned) - self.prefixes(r.namespace, r.tokens, r.protected)
        duplicates = len(new & self.cached)
        self.free += duplicates  # radix frees the request's copy
        r.owned -= len(new)
        self.cached |= new
        r.protected = aligned

    def commit(self, rid, n):
        r = self.requests[rid]
        self.cache.commit(rid, n)
        r.computed = n
        self.insert(r, n)

    def release(self, rid):
        r = self.requests.pop(rid)
        self.cache.release(rid)
        self.insert(r, max(r.computed, r.protected))
        self.free += r.owned

    def evict(self, num_blocks):
        evictions = self.cache.stats().evictions
        freed = self.cache.evict(num_blocks)
        assert freed == self.observe_eviction(self.locked(), num_blocks)
        assert self.cache.stats().evictions - evictions == freed
        self.free += freed

    def match(self, ns, tokens):
        assert self.cache.match(tokens, namespace=ns).num_tokens == self.hit(ns, tokens)

    def reset(self):
        ok = self.cache.reset()
        assert ok == (not self.requests)
        if ok:
            self.cached.clear()
            self.free = self.num_blocks

    def check(self):
        self.cache.check_invariants()
        assert self.cache.pool.num_free == self.free
        assert self.cache.tree.total_size == len(self.cached) * self.bs
        for ns, toks in self.cached:
            assert self.cache.match(toks, namespace=ns).num_tokens == len(toks)
        for rid, r in self.requests.items():
            table = self.cache.block_table(rid)
            assert len(table) == ceil_div(len(r.tokens), self.bs)
            shared = self.cache.match(r.tokens[: r.protected], namespace=r.namespace).block_ids
            assert table[: r.protected // self.bs] == shared
        if not self.requests:
            assert self.cache.tree.protected_size == 0
            assert self.cache.pool.num_pinned == len(self.cached)  # rule 7


prompts = st.lists(st.integers(0, 1), min_size=1, max_size=10)


class BackendMachine(RuleBasedStateMachine):
    @initialize(bs=st.sampled_from([1, 2, 3]), num_blocks=st.integers(4, 14), eviction=st.sampled_from(POLICIES))
    def setup(self, bs, num_blocks, eviction):
        self.m = ModelledCache(bs, num_blocks, eviction)

    def live(self):
        return sorted(self.m.requests)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=prompts)
    def admit(self, ns, tokens):
        self.m.admit(ns, tokens)

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 1), max_size=4))
    def append(self, data, tokens):
        self.m.append(data.draw(st.sampled_from(self.live())), tokens)

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(self.live()))
        r = self.m.requests[rid]
        self.m.commit(rid, data.draw(st.integers(r.computed, len(r.tokens))))

    @precondition(lambda self: self.m.requests)
    @rule(data=st.data())
    def release(self, data):
        self.m.release(data.draw(st.sampled_from(self.live())))

    @rule(num_blocks=st.integers(0, 6))
    def evict(self, num_blocks):
        self.m.evict(num_blocks)

    @rule(ns=st.sampled_from(NAMESPACES), tokens=st.lists(st.integers(0, 1), max_size=10))
    def match(self, ns, tokens):
        self.m.match(ns, tokens)

    @rule()
    def reset(self):
        self.m.reset()

    @invariant()
    def agrees(self):
        if hasattr(self, "m"):
            self.m.check()


BackendMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_radix_backend_matches_model = BackendMachine.TestCase


def test_long_random_lifecycles_match_model():
    """Seeded walks of 300 steps with many requests in flight, then everything released."""
    for seed in range(12):
        rng = random.Random(seed)
        m = ModelledCache(rng.choice([1, 2, 4]), rng.randint(6, 20), POLICIES[seed % len(POLICIES)])

        def toks(lo, hi):
            return [rng.randint(0, 2) for _ in range(rng.randint(lo, hi))]

        def pick():
            return rng.choice(sorted(m.requests))

        def commit():
            rid = pick()
            r = m.requests[rid]
            m.commit(rid, rng.randint(r.computed, len(r.tokens)))

        ops = [
            (5, lambda: m.admit(rng.choice(NAMESPACES), toks(1, 12))),
            (4, lambda: m.requests and m.append(pick(), toks(0, 3))),
            (4, lambda: m.requests and commit()),
            (3, lambda: m.requests and m.release(pick())),
            (1, lambda: m.evict(rng.randint(0, 4))),
            (1, lambda: m.match(rng.choice(NAMESPACES), toks(0, 12))),
            (1, lambda: rng.random() < 0.1 and m.reset()),
        ]
        weights = [w for w, _ in ops]
        for _ in range(300):
            rng.choices(ops, weights)[0][1]()
            m.check()
        for rid in sorted(m.requests):
            m.release(rid)
        m.check()
