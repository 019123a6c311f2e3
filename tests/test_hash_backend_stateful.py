"""Random request traffic through `HashCache` against a small pure-Python model of vLLM.

The model is written from vLLM 0.33's rules, independently of the backend and the pool:
plain lists for the free queue, a dict of lists for the hash index, and the reference
(cbor2 + hashlib) chain hashing. After every step the backend must agree with it on
every result, the free-queue order, every block's ref count and hash, the stats and the
events, and pass `check_invariants()`. Prompts share prefixes across a few namespaces on
a pool small enough that admissions are refused and cached blocks evicted.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import prefixcache
from prefixcache import AllBlocksCleared, BlockRemoved, BlockStored, CacheStats
from prefixcache.config import CacheConfig
from prefixcache.events import event_extra_keys
from prefixcache.hashing import namespace_extra_keys, none_hash, reference_chain_hashes

BS = 4
NUM_BLOCKS = 8
NAMESPACES = [None, "a", "b"]
BASES = [[1] * 12 + [2] * 8, list(range(20)), [1] * 12 + [5] * 8]  # 1 and 3 share 3 blocks


class VllmModel:
    """vLLM 0.33's block pool + KV cache manager for one full-attention group."""

    def __init__(self) -> None:
        self.ref = [0] * NUM_BLOCKS
        self.hash: list[bytes | None] = [None] * NUM_BLOCKS
        self.queue = list(range(NUM_BLOCKS))  # front is reused first
        self.index: dict[bytes, list[int]] = {}  # hash -> blocks, caching order
        self.live: dict[str, dict] = {}
        self.stats = dict(requests=0, queries=0, hits=0, evictions=0, rejected=0)
        self.events: list = []

    def hashes(self, tokens, namespace, parent=None):
        root = parent is None
        return reference_chain_hashes(
            tokens,
            BS,
            "sha256_cbor",
            none_hash("sha256_cbor") if root else parent,
            namespace_extra_keys(namespace) if root else None,
        )

    def lookup(self, key):
        blocks = self.index.get(key)
        return blocks[0] if blocks else None

    def drop_hash(self, block):
        key = self.hash[block]
        self.index[key].remove(block)
        if not self.index[key]:
            del self.index[key]
        self.hash[block] = None
        self.stats["evictions"] += 1
        self.events.append(BlockRemoved((key,), group_idx=0))

    def get_new_blocks(self, n):
        out = []
        for _ in range(n):
            block = self.queue.pop(0)
            if self.hash[block] is not None:
                self.drop_hash(block)
            self.ref[block] = 1
            out.append(block)
        return out

    def admit(self, rid, tokens, namespace):
        hashes = self.hashes(tokens, namespace)
        hits = []
        for key in hashes[: (len(tokens) - 1) // BS]:
            block = self.lookup(key)
            if block is None:
                break
            hits.append(block)
        num_new = -(-len(tokens) // BS) - len(hits)
        if num_new + sum(self.ref[b] == 0 for b in hits) > len(self.queue):
            self.stats["rejected"] += 1
            return None
        for block in hits:
            if self.ref[block] == 0:
                self.queue.remove(block)
            self.ref[block] += 1
        table = hits + self.get_new_blocks(num_new)
        self.live[rid] = dict(tokens=list(tokens), ns=namespace, table=table, hashes=hashes, cached=len(hits))
        self.stats["requests"] += 1
        self.stats["queries"] += len(tokens)
        self.stats["hits"] += len(hits) * BS
        return prefixcache.Admission(tuple(table), len(hits) * BS)

    def append(self, rid, tokens):
        r = self.live[rid]
        num_new = -(-(len(r["tokens"]) + len(tokens)) // BS) - len(r["table"])
        if num_new > len(self.queue):
            self.stats["rejected"] += 1
            return None
        new = self.get_new_blocks(max(num_new, 0))
        r["table"] += new
        r["tokens"] += tokens
        return new

    def commit(self, rid, n):
        r = self.live[rid]
        start, stop = r["cached"], n // BS
        if stop <= start:
            return
        if len(r["hashes"]) < stop:
            done = len(r["hashes"])
            parent = r["hashes"][-1] if done else None
            r["hashes"] += self.hashes(r["tokens"][done * BS : stop * BS], r["ns"], parent)
        for block, key in zip(r["table"][start:stop], r["hashes"][start:stop]):
            self.hash[block] = key
            self.index.setdefault(key, []).append(block)
        r["cached"] = stop
        salt = event_extra_keys(namespace_extra_keys(r["ns"]))
        self.events.append(
            BlockStored(
                block_hashes=tuple(r["hashes"][start:stop]),
                parent_block_hash=r["hashes"][start - 1] if start else None,
                token_ids=tuple(r["tokens"][start * BS : stop * BS]),
                block_size=BS,
                extra_keys=tuple(salt if i == 0 else None for i in range(start, stop)),
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        )

    def release(self, rid):
        first, last = [], []
        for block in reversed(self.live.pop(rid)["table"]):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                (first if self.hash[block] is None else last).append(block)
        self.queue = first + self.queue + last

    def evict(self, n):
        victims = [b for b in self.queue if self.hash[b] is not None][:n]
        for block in victims:
            self.drop_hash(block)
        return len(victims)

    def reset(self):
        if any(self.ref):
            return False
        self.hash = [None] * NUM_BLOCKS
        self.index.clear()
        self.stats = dict.fromkeys(self.stats, 0)
        self.events.append(AllBlocksCleared())
        return True


prompts = st.builds(
    lambda base, keep, tail: base[:keep] + tail,
    st.sampled_from(BASES),
    st.integers(0, 20),
    st.lists(st.integers(0, 3), max_size=6),
).filter(bool)
request_ids = st.sampled_from(["r0", "r1", "r2", "r3"])


class HashCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = prefixcache.build_cache(CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS))
        self.model = VllmModel()
        self.computed: dict[str, int] = {}

    @rule(rid=request_ids, tokens=prompts, namespace=st.sampled_from(NAMESPACES))
    def admit(self, rid, tokens, namespace):
        if rid in self.model.live:
            return
        got = self.cache.admit(rid, tokens, namespace=namespace)
        assert got == self.model.admit(rid, tokens, namespace)
        if got is not None:
            self.computed[rid] = got.num_cached_tokens

    @precondition(lambda self: self.model.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), max_size=6))
    def append(self, data, tokens):
        rid = data.draw(st.sampled_from(sorted(self.model.live)))
        assert self.cache.append(rid, tokens) == self.model.append(rid, tokens)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model.live)))
        n = data.draw(st.integers(self.computed[rid], len(self.model.live[rid]["tokens"])))
        self.cache.commit(rid, n)
        self.model.commit(rid, n)
        self.computed[rid] = n

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def release(self, data):
        rid = data.draw(st.sampled_from(sorted(self.model.live)))
        self.cache.release(rid)
        self.model.release(rid)

    @rule(n=st.integers(0, NUM_BLOCKS + 1))
    def evict(self, n):
        assert self.cache.evict(n) == self.model.evict(n)

    @rule()
    def reset(self):
        assert self.cache.reset() == self.model.reset()

    @rule(tokens=prompts, namespace=st.sampled_from(NAMESPACES))
    def match(self, tokens, namespace):
        blocks = []
        for key in self.model.hashes(tokens, namespace):
            block = self.model.lookup(key)
            if block is None:
                break
            blocks.append(block)
        assert self.cache.match(tokens, namespace=namespace) == prefixcache.Match(len(blocks) * BS, tuple(blocks))

    @invariant()
    def agrees_with_model(self):
        self.cache.check_invariants()
        pool, model = self.cache.pool, self.model
        assert pool.free_queue() == model.queue
        assert [pool.ref_count(b) for b in range(NUM_BLOCKS)] == model.ref
        assert [pool.key(b) for b in range(NUM_BLOCKS)] == model.hash
        assert self.cache.stats() == CacheStats(**model.stats)
        assert self.cache.drain_events() == model.events
        model.events = []
        for rid, r in model.live.items():
            assert tuple(self.cache.block_table(rid)) == tuple(r["table"])


HashCacheMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestHashCache = HashCacheMachine.TestCase
