"""The native tier manager against its Python model (tests/reference/tiers.py), driven by
random device caching, hits, evictions, loads, drops and persists (a graceful close),
under native orders and Python policies, keyed by hash and by lineage, token ids kept 4 or 8 bytes wide: after every step both hold every key in the same tier and slot, record the same
transfers in the same order and count the same."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache._C import TierManager
from prefixcache.eviction import EvictionPolicy
from prefixcache.registry import resolve_eviction_policy
from prefixcache.tiers import PolicyRank
from reference.tiers import PyTierManager


class HitsThenUse(EvictionPolicy):
    """A Python policy (no native order) with float pairs: fewest hits per use first."""

    def priority(self, candidate):
        return (candidate.hit_count / (candidate.use_count + 1.0), -0.5 * candidate.last_access_time)


class TailsByTraffic(EvictionPolicy):
    """A leaves-only Python policy keyed by one float."""

    leaves_only = True

    def priority(self, candidate):
        return candidate.last_use / 3.0 - candidate.request_tokens

BS = 2
DEVICE_BLOCKS = 6
KEYS = [bytes([k, 0, 0, 128]) for k in range(12)]  # a small universe: keys come back (never a name the manager gives)
ROOT = b"root"  # with lineage: the parent a chain's first block names
CONFIGS = [  # (num_slots, write, min_hits, eviction (a name or a policy class), keep_on_load, store_threshold, reuse_slots)
    [(3, "on_evict", 0, "lru", False, 0, 0), (4, "on_evict", 0, "chain", True, 0, 0)],
    [(3, "write_through", 0, "lfu", False, 0, 0)],
    [(2, "selective", 1, "lru", False, 0, 0), (3, "on_evict", 1, "lru", True, 0, 0)],
    [(4, "on_evict", 0, "chain", False, 0, 0)],
    # reuse trackers smaller than the key universe, so they forget
    [(2, "on_evict", 0, "lru", False, 0, 0), (4, "on_evict", 0, "lru", True, 2, 5)],
    [(3, "write_through", 0, "lru", False, 3, 4)],
    [(2, "selective", 1, "lru", False, 2, 6), (3, "on_evict", 0, "chain", False, 2, 3)],
    # Python policies (prefixcache.tiers.PolicyRank): the same order as their priority()
    [(3, "on_evict", 0, HitsThenUse, False, 0, 0), (4, "on_evict", 0, TailsByTraffic, True, 0, 0)],
    [(2, "write_through", 0, TailsByTraffic, False, 0, 0)],
]


def page(k: int) -> list[int]:
    """Block k's token ids (a key always names the same tokens, as lineage requires)."""
    return [7 * k + i for i in range(BS)]


class TierMachine(RuleBasedStateMachine):
    @initialize(config=st.sampled_from(CONFIGS), lineage=st.booleans(), token_bytes=st.sampled_from([4, 8]))
    def start(self, config, lineage, token_bytes):
        policies = [policy() if isinstance(policy, type) else resolve_eviction_policy(policy)()
                    for _, _, _, policy, _, _, _ in config]  # fmt: skip
        self.errors = []
        native = [(n, w, h, p.native or PolicyRank(p, "test", self.errors), p.leaves_only, p.native_params(), keep,
                   k, size) for (n, w, h, _, keep, k, size), p in zip(config, policies)]  # fmt: skip
        self.lineage = lineage
        self.native = TierManager(DEVICE_BLOCKS, BS, 4, native, True, False, lineage, token_bytes)
        self.model = PyTierManager(DEVICE_BLOCKS, BS, [(n, w, h, p, p.leaves_only, keep, k, size)
                                                       for (n, w, h, _, keep, k, size), p in zip(config, policies)])  # fmt: skip

    def free_blocks(self):
        return [b for b in range(DEVICE_BLOCKS) if b not in self.model.device]

    def draw_chain(self, data):
        """Free device blocks for a run of KEYS, its first key's index, and its token ids."""
        free = self.free_blocks()
        n = data.draw(st.integers(1, min(3, len(free))))
        blocks = data.draw(st.permutations(free))[:n]
        start = data.draw(st.integers(0, len(KEYS) - n))
        return blocks, start, [t for k in range(start, start + n) for t in page(k)]

    @precondition(lambda self: len(self.free_blocks()) > 0)
    @rule(data=st.data(), depth=st.integers(0, 2), tokens=st.integers(0, 40))
    def cache(self, data, depth, tokens):
        blocks, start, toks = self.draw_chain(data)
        keys = KEYS[start : start + len(blocks)]
        parent = KEYS[start - 1] if start else (ROOT if self.lineage else None)
        self.native.device_cached(blocks, b"".join(keys), parent, toks, depth, tokens, 0)
        self.model.device_cached(blocks, keys, parent, toks, depth, tokens)

    @precondition(lambda self: self.lineage and len(self.free_blocks()) > 0)
    @rule(data=st.data(), depth=st.integers(0, 2), tokens=st.integers(0, 40))
    def cache_named(self, data, depth, tokens):
        # The manager names the blocks: a tier's copy after the same parent lends its name.
        blocks, start, toks = self.draw_chain(data)
        parent = KEYS[start - 1] if start else ROOT
        self.native.device_cached_named(blocks, parent, toks, depth, tokens, 0)
        self.model.device_cached_named(blocks, parent, toks, depth, tokens)

    @precondition(lambda self: self.model.device)
    @rule(data=st.data(), tokens=st.integers(0, 40))
    def hit(self, data, tokens):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.model.device)), max_size=3, unique=True))
        assert self.native.admitted(tokens, blocks, tokens) == self.model.admitted(tokens, blocks, tokens)

    @precondition(lambda self: self.model.device)
    @rule(data=st.data())
    def evict(self, data):
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.model.device)), min_size=1, max_size=3, unique=True))
        self.native.device_evicted(blocks)
        self.model.device_evicted(blocks)

    @precondition(lambda self: self.free_blocks())
    @rule(data=st.data(), promote=st.booleans())
    def load(self, data, promote):
        held = [w for w in map(self.model.locate, KEYS) if w is not None]
        if not held:
            return
        sources = data.draw(st.lists(st.sampled_from(held), min_size=1, max_size=min(2, len(self.free_blocks())),
                                     unique=True))  # fmt: skip
        dst = self.free_blocks()[: len(sources)]
        for m in (self.native, self.model):
            m.pin(sources)
        if data.draw(st.booleans()):  # an admission that allocates while they are pinned
            victims = sorted(self.model.device)[:1]
            self.native.device_evicted(victims)
            self.model.device_evicted(victims)
        self.native.load(sources, dst, promote)
        self.model.load(sources, dst, promote)
        if not promote:
            self.native.finish_loads(sources)
            self.model.finish_loads(sources)

    @rule(data=st.data())
    def persist(self, data):
        keeping = [t for t, tier in enumerate(self.model.tiers) if tier.keep_on_load]
        if keeping:
            t = data.draw(st.sampled_from(keeping))
            assert self.native.persist(t) == self.model.persist(t)

    @rule(data=st.data(), failed=st.booleans())
    def drop(self, data, failed):
        held = [w for w in map(self.model.locate, KEYS) if w is not None]
        if held:
            t, slot = data.draw(st.sampled_from(held))
            self.native.drop(t, slot, failed)
            self.model.drop(t, slot, failed)

    @invariant()
    def agree(self):
        if not hasattr(self, "model"):
            return
        self.native.check_invariants()
        assert not self.errors, self.errors
        assert self.native.drain_transfers().tolist() == [x for t in self.model.drain_transfers() for x in t]
        for key in KEYS:
            assert self.native.locate(key) == self.model.locate(key), key
        for t, tier in enumerate(self.model.tiers):
            assert self.native.counters(t) == tier.counters
            assert sorted(self.native.used_slots(t)) == sorted(tier.slots)
            for slot, s in tier.slots.items():
                assert tuple(self.native.slot_tokens(t, slot)) == s.tokens
        for b in range(DEVICE_BLOCKS):
            assert self.native.device_has(b) == (b in self.model.device)
            assert self.native.device_key(b) == (self.model.device[b][0] if b in self.model.device else None)
        if self.lineage:  # every chain, found from every block, as the model finds it
            for start in range(len(KEYS)):
                tokens = [t for k in range(start, len(KEYS)) for t in page(k)]
                parent = KEYS[start - 1] if start else ROOT
                found, keys = self.native.follow(parent, tokens)
                assert (found, keys) == self.model.follow(parent, tokens)


TierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestTierManagerAgainstModel = TierMachine.TestCase
