"""Random request lifecycles through `radix` over hybrid layouts, against a small model.

The model (tests/reference/hybrid_radix.py) knows nothing of trees, locks or eviction
order: it keeps what the cache's KV events announced, per layout group, and predicts
every hit from that with SGLang's validators (full-attention pages, a live sliding
window, a state on the page the hit ends), whatever drops a state (eviction, the
`state_cap` option) or a branch (`no_tail_cliff`'s order and pruning). Requests prefill
one extend or, with SGLang's chunked prefill, chunk by chunk between other requests'
steps (a chunk without room waits). Every admission's hit and every `match` must equal
its prediction; after every step `check_invariants()` holds (the tree's sizes, locks,
LRUs and leaf set; every pool's budget; every block held once); once every request is
released and everything evicted, no block is pinned and the events announce nothing.
Which prefixes an eviction takes is SGLang's business (checked against its own code by
benchmarks/hybrid_radix_parity.py); the model only follows what the events say.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache import CacheConfig, build_cache
from prefixcache.layout import LayerGroup
from reference.hybrid_radix import HybridRadixModel

LAYOUTS = {
    "full+swa": (LayerGroup("full_attention"), LayerGroup("sliding_window", window=7)),
    "full+mamba": (LayerGroup("full_attention"), LayerGroup("mamba", slots=24)),
    "full+swa+mamba": (LayerGroup("full_attention"), LayerGroup("sliding_window", window=5), LayerGroup("mamba", slots=24)),
}
NAMESPACES = [None, "a"]


class HybridRadixMachine(RuleBasedStateMachine):
    @initialize(layout=st.sampled_from(sorted(LAYOUTS)), bs=st.sampled_from([1, 2, 4]), blocks=st.integers(32, 90),
                chunk=st.sampled_from([0, 0, 3, 8]), cap=st.sampled_from([0, 0, 1, 2]), cliff=st.booleans())  # fmt: skip
    def build(self, layout: str, bs: int, blocks: int, chunk: int, cap: int, cliff: bool) -> None:
        groups = LAYOUTS[layout]
        options = {"mamba_chunk": bs, "mamba_track_interval": 3 * bs, "state_cap": cap} if "mamba" in layout else {}
        options["chunked_prefill_size"] = chunk * bs  # SGLang's chunked prefill (0: one extend)
        options["no_tail_cliff"] = cliff  # tails last, dead leaves pruned (check_invariants: no dead leaf)
        self.bs = bs
        self.cache = build_cache(CacheConfig(backend="radix", block_size=bs, num_blocks=blocks, layout=groups,
                                             options=options))  # fmt: skip
        self.model = HybridRadixModel(groups, bs)
        self.live: dict[int, list[int]] = {}
        self.pending: dict[int, list[int]] = {}  # mid-prefill: the commits still to make (TOKENS)
        self.prompts: list[list[int]] = []
        self.next_id = 0

    def _sync(self) -> None:
        self.model.consume(self.cache.drain_events())

    @rule(data=st.data(), fresh=st.lists(st.integers(0, 3), min_size=1, max_size=30), ns=st.sampled_from(NAMESPACES))
    def admit(self, data, fresh: list[int], ns: str | None) -> None:
        base: list[int] = []
        if self.prompts and data.draw(st.booleans()):
            prev = data.draw(st.sampled_from(self.prompts))
            base = prev[: data.draw(st.integers(0, len(prev)))]
        self._admit(data, base + fresh, ns)

    @precondition(lambda self: bool(self.prompts))
    @rule(data=st.data(), back=st.integers(1, 10), fresh=st.lists(st.integers(4, 5), min_size=1, max_size=3))
    def branch(self, data, back: int, fresh: list[int]) -> None:
        """A prompt that leaves an earlier one a few tokens before its end: a hit there
        ends in the earlier prompt's last window (where its tombstones begin)."""
        prev = data.draw(st.sampled_from(self.prompts))
        self._admit(data, prev[: max(0, len(prev) - back)] + fresh, data.draw(st.sampled_from(NAMESPACES)))

    def _admit(self, data, tokens: list[int], ns: str | None) -> None:
        self._sync()
        want = self.model.hit(tokens[:-1], ns)
        assert self.cache.match(tokens[:-1], namespace=ns).num_tokens == want, "match disagrees with the model"
        rid = self.next_id
        self.next_id += 1
        adm = self.cache.admit(rid, tokens, namespace=ns)
        if adm is None:
            return
        assert adm.num_cached_tokens == want, f"admit hit {adm.num_cached_tokens}, the events say {want}"
        self.live[rid] = tokens
        self.prompts.append(tokens)
        self.pending[rid] = [*adm.checkpoints, len(tokens)]
        self._prefill(rid, data.draw(st.integers(0, len(self.pending[rid]))))

    def _prefill(self, rid: int, steps: int) -> None:
        """The next `steps` commits of a prefill; a chunk that finds no room waits
        (`append(r, [])` retries it) and stays pending."""
        todo = self.pending[rid]
        for _ in range(steps):
            if self.cache.append(rid, []) is None:
                return
            self.cache.commit(rid, todo.pop(0))
            if not todo:
                del self.pending[rid]
                return

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data(), steps=st.integers(1, 3))
    def prefill(self, data, steps: int) -> None:
        self._prefill(data.draw(st.sampled_from(sorted(self.pending))), steps)

    @precondition(lambda self: len(self.live) > len(self.pending))
    @rule(data=st.data(), steps=st.integers(1, 6))
    def decode(self, data, steps: int) -> None:
        rid = data.draw(st.sampled_from(sorted(set(self.live) - set(self.pending))))
        tokens = self.live[rid]
        for _ in range(steps):
            token = data.draw(st.integers(0, 5))
            if self.cache.append(rid, [token]) is None:
                return
            tokens.append(token)
            self.cache.commit(rid, len(tokens))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def release(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.cache.release(rid)  # mid-prefill too: an engine's preemption
        self.pending.pop(rid, None)
        self.prompts.append(self.live.pop(rid))

    @rule(n=st.integers(1, 12))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule(data=st.data(), ns=st.sampled_from(NAMESPACES))
    def probe(self, data, ns: str | None) -> None:
        if not self.prompts:
            return
        tokens = data.draw(st.sampled_from(self.prompts))
        self._sync()
        assert self.cache.match(tokens, namespace=ns).num_tokens == self.model.hit(tokens, ns)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "cache"):
            self.cache.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for rid in list(self.live):
            self.cache.release(rid)
        self.cache.evict(self.cache.pool.num_blocks)
        self.cache.check_invariants()
        assert self.cache.pool.num_pinned == 0, f"{self.cache.pool.num_pinned} blocks pinned after everything"
        self._sync()
        assert not any(self.model.held), f"events still announce {[dict(h) for h in self.model.held if h]}"


HybridRadixMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestHybridRadix = HybridRadixMachine.TestCase
