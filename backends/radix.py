"""The `radix` backend: SGLang's RadixAttention (`RadixCache`, v0.5.23) on the shared pool.

Owns the request side of SGLang's radix cache: which tree node each live request
locks, which of its blocks are its own and which are the tree's, when blocks are
handed to the tree and when duplicates are freed, the KV events, and the stats. The
tree itself (`prefixcache._C.RadixTree`, reference model `tests/reference/radix_tree.py`)
holds the token runs, the lock refs and the eviction order.

Must never: hash blocks for events when events are disabled (a history policy's
64-bit page keys are the tree's own business), free a block the tree holds, evict a block a
live request uses, or leave anything changed by an `admit`/`append` that returns None.

How SGLang's scheduler calls map onto the protocol (`mem_cache/radix_cache.py`,
`mem_cache/common.py`, `managers/schedule_batch.py`):

- `admit` = `match_prefix` on `tokens[:-1]` (`_compute_max_prefix_len`: the last
  prompt token is always computed) cut to whole pages, a lock on the last matched
  node, then `alloc_for_extend` for the rest of the prompt. Short of room, the tree
  evicts the SHORTFALL of the allocation's demand, as SGLang 0.5.23's allocator does
  (`evict_to_free_tokens`; up to 0.5.6 it evicted the whole demand). The demand is
  SGLang's scheduler's (`mem_cache/allocation.py`), in TOKENS: the extend's tokens,
  plus one page when pages are larger than a token (`alloc_paged_token_slots_extend`
  assumes each request needs a new page). Feasibility is checked first (needed blocks
  <= free blocks + evictable blocks outside the matched path), so a refused admission
  changes nothing: no split, no recency, no stats but `rejected`.
- `append` allocates blocks as tokens grow, evicting like admit. One token is a decode
  step (`alloc_paged_token_slots_decode` demands a whole page of room per request each
  step, whether or not the step starts a page); more tokens are an extend (a prefill
  chunk), demanding them plus one page.
- `commit(n)` = `checkpoint(req, up_to=n)`: the full pages of `tokens[:n]` are
  inserted, the request's copies of pages the tree already had are freed and its block
  table is re-pointed to the tree's blocks (protocol rule 4: radix frees the request's
  copy), and the lock moves to the new last node. `protected` is SGLang's
  `cache_protected_len`: the request's blocks before it belong to the tree;
  `inserted` is its `cache_inserted_len` (what the request inserted so far, 0 at
  admission), which decides where the insert's hit counting starts. Once the request
  has inserted, a commit extends from its locked node (`RadixTree.extend`): O(new
  pages), where SGLang re-inserts the whole sequence (the same result: see the tree).
  A checkpoint past the prompt also re-inserts the prompt with priority + 1
  (`_insert_cache(split_prompt=True)`: the prompt's end becomes a node boundary, so
  eviction can drop the output without the prompt); the prompt path stays locked by
  the request, so doing it once per request leaves the same tree.
- `release` = `release_kv_cache(checkpoint=True)`: a last checkpoint of every token
  whose KV is computed, prompt and generated (SGLang PR #16521); duplicates, the
  unaligned tail and blocks never computed are freed; the lock is dropped.

The tree owns one pool reference per block it holds (request blocks are transferred
on insert); a request's own blocks hold one reference each, so every pinned block of
the pool is the tree's or exactly one live request's (`check_invariants`).

Events: one `BlockStored` per page, carrying the chained block hash of the configured
algorithm from `prefixcache.hashing.block_hashes`, the function the `hash` backend
uses, so one consumer serves both; `BlockRemoved` per evicted page;
`AllBlocksCleared` on reset. Every event says `group_idx=0` (and a `BlockStored`
`kv_cache_spec_kind="full_attention"`), as the `hash` backend's do.

Extension: `usable_hit` (the protocol's hook) trims a hit in `match` and `admit` alike;
`admit` then matches, splits and locks only the part it keeps. Eviction policies come
from `prefixcache.eviction` or a plugin; native ones (and their `native_params`, and a
`history` ghost table) are evaluated in C++; another's `priority()` is called once per
leaf when it becomes a candidate or changes (the tree keeps the keys in its order).

Inspection: `cache.tree` is the tree, with the API documented in
`tests/reference/radix_tree.py` (`total_size`, `evictable_size`, `protected_size`,
`root(namespace)`, `node(id)`, ...).

Lower tiers (`cache.tiers`, docs/tiers.md): a page the tree evicts moves down, and a
match that ends in the tree goes on through the tiers. With events or a DISK tier (or a
tier's `store_threshold`), pages are keyed by their chained hash, which events carry and
a disk file outlives the process with. Otherwise the tiers are built with `lineage`, as
SGLang's HiCache keeps host pages on its tree's nodes: a page is named by a counter
when the tree takes it and found below the tree through its parent's name and its own
tokens, compared in full, so a tiered radix cache hashes nothing.

Namespaces (`prefixcache.isolation`): each gets its own subtree, keyed by
`isolation.exact_key(namespace)`: a str salt is its own key, a namespace with a LoRA
adapter an escaped key no salt can spell. The tree compares tokens, never hashes, so
no hash collision can make it serve another prompt's or another tenant's blocks.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache._C import BlockPool, InvariantError, RadixTree, append_step
from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.events import (
    FULL_ATTENTION,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    event_extra_keys,
    event_log,
    event_lora,
)
from prefixcache.hashing import block_hashes, chain_digests, namespace_extra_keys, none_hash
from prefixcache.isolation import exact_key, prune_at
from prefixcache.limits import RADIX_TOKEN_RANGE
from prefixcache.protocol import Admission, BlockIds, Match, Namespace, PrefixCache, guarded
from prefixcache.registry import register_backend, resolve_eviction_policy
from prefixcache.requests import Request, RequestTable, check_count, check_namespace, check_priority, check_tokens
from prefixcache.stats import CacheStats, StatsCounter
from prefixcache.tiers import DEVICE, Tiers

from .hybrid_radix import HYBRID_RADIX_CHOICES, HYBRID_RADIX_OPTIONS, MAMBA_OPTIONS, HybridRadixCache

__all__ = ["RadixCache"]

_NAME_BYTES = 8  # a page's name with lineage tiers: a uint64 counter
# One full-attention KV cache group, as the `hash` backend reports it.
_GROUP = 0


def _int32_array(tokens: Sequence[int], *, allow_empty: bool = False) -> array:
    """Token ids as an int32 array of our own (read once in C++ from any buffer or
    sequence of ints: ids must fit int32)."""
    return check_tokens(tokens, allow_empty=allow_empty, itemsize=4)


@dataclass(eq=False)
class _RadixRequest(Request):
    """A live request. `tokens` is an int32 array the tree reads in place;
    `block_table[: protected // block_size]` are the tree's blocks, the rest its own."""

    tokens: array
    tree_key: str | None = None  # exact_key(namespace): the tree's name for the namespace
    node: int = 0  # the tree node this request locks (0: none; a root only keeps its namespace's root)
    protected: int = 0  # SGLang's cache_protected_len, in TOKENS
    inserted: int = 0  # SGLang's cache_inserted_len, in TOKENS
    priority: int = 0
    inserted_at: int = -1  # the tree's clock right after this request's latest insert
    prompt_len: int = 0  # TOKENS at admission (SGLang's origin_input_ids)
    prompt_split: bool = False  # the prompt was re-inserted with priority + 1 (once is enough)
    depth: int = 0  # with tiers: the chain depth its pages are cached with (`Tiers.admitted`)
    loading: list = field(default_factory=list)  # tier slots its hit loads from, kept until the pages are in the tree
    digests: bytes = b""  # with tiers: chained hashes of its prompt's pages from page `digests_from` on
    digests_from: int = 0


@register_backend("radix")
class RadixCache(PrefixCache):
    """SGLang RadixAttention over the shared `BlockPool` (see the module docstring).

    `admit` takes an extra keyword, `priority` (int, default 0): the nodes a request
    inserts keep the highest priority that touched them, for `eviction: priority`.
    """

    token_itemsize = 4  # the tree stores int32 ids
    token_id_range = RADIX_TOKEN_RANGE
    option_defaults = HYBRID_RADIX_OPTIONS  # a hybrid layout's (backends/hybrid_radix.py)
    option_choices = HYBRID_RADIX_CHOICES

    def __new__(cls, pool: BlockPool, config: CacheConfig) -> RadixCache:
        # A hybrid layout is SGLang's UnifiedRadixCache, a class of its own (backends/hybrid_radix.py).
        if cls is RadixCache and config.groups.hybrid:
            return HybridRadixCache(pool, config)  # type: ignore[return-value]
        return super().__new__(cls)

    @classmethod
    def check_layout(cls, config: CacheConfig, options: Mapping[str, Any]) -> None:
        """A hybrid layout is checked as HybridRadixCache builds it; a subclass (a plugin)
        does not cache one; a full-attention layout takes no hybrid option."""
        if config.groups.hybrid:
            if cls is not RadixCache:
                raise ConfigError("layout", f"backend {cls.__qualname__} does not cache hybrid layouts (kinds: "
                                            f"{', '.join(config.groups.kinds())}); the built-in radix and hash do")  # fmt: skip
            HybridRadixCache.check_layout(config, options)
            return
        changed = sorted(k for k, v in HYBRID_RADIX_OPTIONS.items() if options[k] != v)
        if changed:
            where = "a cache.layout with a mamba group" if changed[0] in MAMBA_OPTIONS else "a hybrid cache.layout"
            raise ConfigError(f"options.{changed[0]}", f"applies to {where} only")

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        super().__init__(pool, config)
        self.check_layout(config, self.options)
        self.policy = resolve_eviction_policy(config.eviction)()
        # The tree keeps its leaves in a persistent order: a native policy's keys are
        # computed in C++; another policy's priority() is called once per leaf when it
        # becomes a candidate or changes, and its keys are kept.
        params = self.policy.native_params() if self.policy.native else {}
        ghost = self.policy.history * pool.num_blocks  # pages remembered after eviction
        order = self.policy.native or self.policy.priority
        self.tree = RadixTree(pool, self.block_size, order, ghost_capacity=ghost, **params)
        self._trims = type(self).usable_hit is not PrefixCache.usable_hit
        self._requests: RequestTable[_RadixRequest] = RequestTable()
        self._stats = StatsCounter()
        self._events = event_log(config.enable_events)
        self._page_hash: dict[int, bytes] = {}  # tree block -> its chained hash (events, or hashed tiers)
        #: The lower tiers (`cache.tiers`), or None (module docstring: hashed or lineage keys).
        self._seed_hash = self._none_hash()
        self._digest_size = len(self._seed_hash)
        self._lineage = bool(config.tiers) and not self._events.enabled and all(
            t.medium != "DISK" and t.store_threshold < 2 for t in config.tiers
        )
        self._roots: dict[str | None, bytes] = {}  # with lineage: tree key -> the name its first pages follow
        self._roots_limit = prune_at(0)
        key_size = _NAME_BYTES if self._lineage else self._digest_size
        self.tiers = (Tiers(config, pool.num_blocks, key_size, self._events, lineage=self._lineage,
                            token_bytes=self.token_itemsize) if config.tiers else None)  # fmt: skip
        self._hashes_pages = self._events.enabled or (self.tiers is not None and not self._lineage)

    # -- look-up -----------------------------------------------------------------------
    @guarded
    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        namespace = check_namespace(namespace)
        m = self.tree.match(tokens, exact_key(namespace))
        if self.tiers is not None:
            found = [(DEVICE, b) for b in m.block_ids] + self._tier_chain(tokens, m, namespace)[0]
            if self._trims:
                keep = self.checked_usable_hit(tokens, len(found) * self.block_size, namespace)
                del found[keep // self.block_size :]
            return Match(len(found) * self.block_size, tuple(b for _, b in found), tuple(t for t, _ in found))
        if self._trims:
            keep = self.checked_usable_hit(tokens, m.num_tokens, namespace)
            return Match(keep, tuple(m.block_ids[: keep // self.block_size]))
        return Match(m.num_tokens, tuple(m.block_ids))

    # -- request lifecycle ---------------------------------------------------------------
    @guarded
    def admit(
        self,
        request_id: Hashable,
        tokens: Sequence[int],
        *,
        namespace: Namespace = None,
        priority: int = 0,
        read_cache: bool = True,
    ) -> Admission | None:
        """`read_cache` False: hit nothing (protocol rule 1; SGLang's `logprob_start_len` 0
        caps the match at 0 tokens)."""
        # Every argument is checked before anything changes, the id last: converting the
        # tokens runs their code (tolist, __index__), which must see the table as it is.
        toks = _int32_array(tokens)
        namespace = check_namespace(namespace)
        tree_key = exact_key(namespace)
        priority = check_priority(priority)
        self._requests.check_new(request_id)
        bs = self.block_size
        key = memoryview(toks)[: len(toks) - 1 if read_cache else 0]  # the last prompt token is always computed
        probe = self.tree.match(key, tree_key)
        if self.tiers is not None:
            return self._tiered_admit(request_id, toks, namespace, tree_key, priority, key, probe, read_cache)
        if self._trims:
            keep = self.checked_usable_hit(key, probe.num_tokens, namespace)
            if keep < probe.num_tokens:  # the hit stops earlier: match and lock only that much
                key = key[:keep]
                probe = self.tree.match(key, tree_key)
        needed = -(-len(toks) // bs) - probe.num_tokens // bs
        if needed > self._room(protecting=probe.unlocked_tokens):
            self._stats.rejected += 1
            return None
        hit = self.tree.match_prefix(key, tree_key)
        self.tree.lock(hit.node)  # before evicting, so the hit cannot be evicted
        try:
            table = hit.block_ids + self._allocate(needed, self._extend_demand(len(toks) - hit.num_tokens))
        except BaseException:  # a Python policy raised: what it evicted stays evicted, nothing is pinned
            self.tree.unlock(hit.node)
            raise
        self._requests.add(
            _RadixRequest(
                request_id,
                toks,
                namespace,
                table,
                num_cached_tokens=hit.num_tokens,
                tree_key=tree_key,
                node=hit.node,
                protected=hit.num_tokens,
                priority=priority,
                prompt_len=len(toks),
            )
        )
        if read_cache:
            self._stats.record_query(len(toks), hit.num_tokens)
        return Admission(BlockIds(table), hit.num_tokens)

    @guarded
    def append(self, request_id: Hashable, tokens: Sequence[int]) -> list[int] | None:
        req = self._requests.get(request_id)
        # A decode step (one token), once per generated token: its common outcomes (a
        # block is free and no page starts; the new page allocated) in one native call;
        # SGLang makes a page of room at every decode step, so one block must be free.
        held = req.tokens  # an array('i'): ids beyond int32 are the converter's ValueError
        step = append_step(held, tokens, req.block_table, self.block_size, self.pool, 1, 1)
        if type(step) is list:
            return step
        n = step  # the ids are in; the blocks they need, the general way
        before = len(held) - n
        try:
            return self._grow(req, before, n)
        except BaseException:  # a Python policy raised: the request keeps the tokens it had
            del held[before:]
            raise

    def _grow(self, req: _RadixRequest, before: int, n: int) -> list[int] | None:
        """Blocks for a request's `n` new TOKENS (already in req.tokens after `before`),
        with the room SGLang's scheduler asks for; None (tokens removed) if they do not fit."""
        bs = self.block_size
        needed = -(-(before + n) // bs) - len(req.block_table)
        if n == 1:
            # A decode step: SGLang makes a page of room first, whether or not the step
            # starts a page. It needs eviction only when no block is free, which an
            # allocation of the (at most one) block needed finds out by failing.
            if needed <= 0:
                if self.pool.num_free == 0:
                    self._make_room(bs)
                return []
            blocks = self.pool.allocate(needed)
            if blocks is not None:
                req.block_table.extend(blocks)
                return blocks
        if needed > 0 and needed > self._room(protecting=0):
            del req.tokens[before:]
            self._stats.rejected += 1
            return None
        if n == 0:
            return []
        # More tokens are an extend (a prefill chunk): its tokens plus a page of room.
        demand = bs if n == 1 else self._extend_demand(n)
        if needed <= 0:
            self._make_room(demand)
            return []
        blocks = self._allocate(needed, demand)
        req.block_table.extend(blocks)
        return blocks

    @guarded
    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        req = self._requests.get(request_id)
        req.num_computed = req.check_commit(num_computed_tokens)
        self._insert(req, req.num_computed)

    @guarded
    def release(self, request_id: Hashable) -> None:
        req = self._requests.get(request_id)
        # The cached prefix is computed even if nothing was committed since admission.
        self._insert(req, max(req.num_computed, req.protected))
        tail = req.block_table[req.protected // self.block_size :]
        if tail:
            self.pool.free(tail)  # the unaligned tail and blocks never computed
        self.tree.unlock(req.node)
        if req.loading:
            self.tiers.finish_loads(req.loading)
            req.loading = []
        self._requests.pop(request_id)  # last: until here the request still holds what it held

    @guarded
    def block_table(self, request_id: Hashable) -> Sequence[int]:
        return BlockIds(self._requests.get(request_id).block_table)

    # -- maintenance ---------------------------------------------------------------------
    @guarded
    def evict(self, num_blocks: int) -> int:
        num_blocks = check_count(num_blocks, "num_blocks")
        # The tree never holds more than the pool: a larger request means "all", and
        # must not overflow the tree's int64 token count on the way.
        return self._evict_tokens(min(num_blocks, self.pool.num_blocks) * self.block_size)

    @guarded
    def reset(self) -> bool:
        if len(self._requests):
            return False
        self.tree.reset()
        self._page_hash.clear()
        if self.tiers is not None:
            self.tiers.reset()
        self._stats.reset()
        self._events.record(AllBlocksCleared())
        return True

    @guarded
    def stats(self) -> CacheStats:
        self._stats.events_dropped = self._events.dropped
        return self._stats.snapshot(self.tiers.stats() if self.tiers is not None else ())

    @guarded
    def drain_events(self) -> list[KVEvent]:
        return self._events.drain()

    @guarded
    def drain_transfers(self) -> list[tuple[int, int, int, int]]:
        return self.tiers.drain_transfers() if self.tiers is not None else []

    # -- internals -----------------------------------------------------------------------
    def _room(self, *, protecting: int) -> int:
        """Blocks an allocation can get: free ones plus what eviction can free once
        `protecting` more tokens are locked."""
        return self.pool.num_free + (self.tree.evictable_size - protecting) // self.block_size

    def _extend_demand(self, num_tokens: int) -> int:
        """TOKENS of room SGLang's scheduler asks for before an extend of `num_tokens`:
        exact at token granularity, one page more with pages."""
        return num_tokens + (self.block_size if self.block_size > 1 else 0)

    def _make_room(self, demand: int) -> None:
        """Make `demand` TOKENS of room if the tree can: SGLang 0.5.23's evict_to_free_tokens
        evicts the shortfall."""
        shortfall = demand - self.pool.num_free * self.block_size
        if shortfall > 0:
            self._evict_tokens(shortfall)

    def _allocate(self, num_blocks: int, demand: int) -> list[int]:
        """`num_blocks` fresh blocks after making `demand` TOKENS of room (demand >= the
        blocks' tokens, so the allocation then fits). The caller has checked `_room`."""
        self._make_room(demand)
        blocks = self.pool.allocate(num_blocks) if num_blocks else []
        if blocks is None:
            raise InvariantError(f"radix: {num_blocks} blocks passed the room check but could not be allocated")
        return blocks

    def _evict_tokens(self, num_tokens: int) -> int:
        """Evict at least `num_tokens` tokens if there are; returns blocks freed."""
        freed = 0
        try:
            freed = self.tree.evict(num_tokens) // self.block_size
        except BaseException:
            freed = len(self.tree.last_evicted())  # a Python policy raised; what went, went
            raise
        finally:
            self._stats.evictions += freed
            if self._hashes_pages or self.tiers is not None:
                evicted = self.tree.last_evicted()
                if self._hashes_pages:
                    hashes = [self._page_hash.pop(b) for b in evicted]
                    self._events.record_from(self._evicted_events, hashes)
                if self.tiers is not None:
                    self.tiers.evicted(evicted)  # freed, KV intact until reused: moved down
        return freed

    def _evicted_events(self, hashes: list[bytes]) -> list[BlockRemoved]:
        """One BlockRemoved per page the latest eviction freed."""
        return [BlockRemoved(block_hashes=(h,), group_idx=_GROUP) for h in hashes]

    def _insert(self, req: _RadixRequest, num_computed: int) -> None:
        """SGLang's cache_unfinished_req: hand the computed full pages to the tree, free
        the request's duplicates, re-point its table, move its lock to the new end."""
        bs = self.block_size
        aligned = num_computed // bs * bs
        if aligned == 0 or aligned < req.protected:
            return
        if aligned == req.protected and self.tree.clock == req.inserted_at:
            # Nothing new, and the tree has not moved since this request's last insert:
            # SGLang's re-insert would re-stamp the same path with the newest tick, which
            # orders it exactly as it already is. Skip the walk.
            return
        # Only the request's own pages cross into C++: the tree's are already there.
        first, last = req.protected // bs, aligned // bs
        own = req.block_table[first:last]
        tokens = memoryview(req.tokens)
        if req.inserted < req.protected or req.node == 0:
            # The first insert after a hit walks from the root: SGLang counts a hit on
            # every node past what this request inserted (nothing yet). Node 0: the
            # request holds no node (its namespace had no root), so there is none to
            # extend from.
            result = self.tree.insert(tokens[:aligned], own, req.tree_key, req.priority, req.protected, req.inserted)
        else:
            result = self.tree.extend(req.node, tokens[req.protected : aligned], own, req.priority)
        req.inserted = max(req.inserted, aligned)
        prompt = req.prompt_len // bs * bs
        if not req.prompt_split and 0 < prompt < aligned:
            # SGLang's split_prompt: the prompt, fully present now, again with priority + 1.
            self.tree.insert(tokens[:prompt], [], req.tree_key, min(req.priority + 1, 2**63 - 1), prompt, prompt)
            req.prompt_split = True
        if result.displaced:
            if self.tiers is not None:
                self.tiers.dropped(result.displaced)  # a loaded copy of a page the tree had already
            self.pool.free(result.displaced)
            req.block_table[first:last] = own  # re-pointed to the tree's blocks
        self._record_stored(req, result.prefix_len, aligned)
        self.tree.relock(req.node, result.node)
        req.node = result.node
        req.protected = aligned
        req.inserted_at = self.tree.clock
        if req.loading and aligned >= req.num_cached_tokens:  # the loaded pages are the tree's now
            self.tiers.finish_loads(req.loading)
            req.loading = []

    def _record_stored(self, req: _RadixRequest, start: int, end: int) -> None:
        """One BlockStored per new page in tokens [start, end), chained to the page before;
        with tiers, the pages are reported to them too (with lineage, only that: the tiers
        name them)."""
        if start >= end:
            return
        bs = self.block_size
        first = start // bs
        if self._lineage:  # the tiers name the pages: nothing is hashed
            up = self.tiers.device_key(req.block_table[first - 1]) if first else self._root_name(req.tree_key)
            # A view, not a slice: the tier manager reads the request's own buffer in place.
            self.tiers.cached_named(req.block_table[first : end // bs], up, memoryview(req.tokens)[start:end],
                                    req.depth, req.prompt_len // bs * bs, req.namespace)  # fmt: skip
            return
        if not self._hashes_pages:
            return
        parent = self._page_hash[req.block_table[first - 1]] if first else None
        hashes = self._page_hashes(req, first, end // bs, parent)
        blocks = req.block_table[first : first + len(hashes)]
        for block, block_hash in zip(blocks, hashes):
            self._page_hash[block] = block_hash
        self._events.record_from(self._stored_events, req, first, parent, hashes)
        if self.tiers is not None:
            self.tiers.cached(blocks, b"".join(hashes), parent, req.tokens[start:end], req.depth,
                              req.prompt_len // bs * bs, req.namespace)  # fmt: skip

    def _page_hashes(self, req: _RadixRequest, first: int, last: int, parent: bytes | None) -> list[bytes]:
        """The chained hashes of pages [first, last) of a request, after `parent`: the ones
        its admission computed for the tiers' look-up, the rest hashed now."""
        ds = self._digest_size
        known: list[bytes] = []
        if req.digests and req.digests_from <= first:
            stop = min(last, req.digests_from + len(req.digests) // ds)
            known = [req.digests[(p - req.digests_from) * ds : (p - req.digests_from + 1) * ds] for p in range(first, stop)]
        if first + len(known) >= last:
            return known
        bs = self.block_size
        return known + block_hashes(
            req.tokens[(first + len(known)) * bs : last * bs],
            bs,
            self.config.hash.algorithm,
            namespace=req.namespace,
            seed=self.config.hash.seed,
            parent=known[-1] if known else parent,
        )

    def _stored_events(self, req: _RadixRequest, first: int, parent: bytes | None, hashes: list[bytes]) -> list[BlockStored]:
        """The BlockStored of the pages from page `first` on, whose hashes are `hashes`."""
        bs = self.block_size
        out: list[BlockStored] = []
        lora_id, lora_name = event_lora(req.namespace)
        for i, block_hash in enumerate(hashes):
            page = first + i
            out.append(
                BlockStored(
                    block_hashes=(block_hash,),
                    parent_block_hash=parent,
                    token_ids=tuple(req.tokens[page * bs : (page + 1) * bs]),
                    block_size=bs,
                    lora_id=lora_id,
                    lora_name=lora_name,
                    extra_keys=(event_extra_keys(namespace_extra_keys(req.namespace, first_block=page == 0)),),
                    group_idx=_GROUP,
                    kv_cache_spec_kind=FULL_ATTENTION,
                )
            )
            parent = block_hash
        return out

    # -- lower tiers (docs/tiers.md) ------------------------------------------------------
    def _root_name(self, tree_key: str | None) -> bytes:
        """The name a namespace's first pages follow (lineage); a namespace without one
        gets a fresh name. Names nothing follows any more are forgotten now and then
        (`_forget_roots`), so the table follows what the cache holds."""
        name = self._roots.get(tree_key)
        if name is None:
            if len(self._roots) >= self._roots_limit:
                self._forget_roots()
            name = self._roots[tree_key] = self.tiers.new_name()
        return name

    def _forget_roots(self) -> None:
        """Drop the root names no device page or tier slot follows: no look-up can pass
        through them (one native scan, amortized: the limit doubles past what stays)."""
        keys = list(self._roots)
        used = self.tiers.native.parents_in_use(b"".join(self._roots[k] for k in keys))
        self._roots = {k: self._roots[k] for k, kept in zip(keys, used) if kept}
        self._roots_limit = prune_at(len(self._roots))

    def _none_hash(self) -> bytes:
        """The chain's seed hash (the parent of a namespace's first page)."""
        return none_hash(self.config.hash.algorithm, self.config.hash.seed)

    def _tier_chain(
        self, tokens: Sequence[int], device: object, namespace: Namespace
    ) -> tuple[list[tuple[int, int]], bytes]:
        """Where the full pages of `tokens` after the device match `device` are in the
        lower tiers, up to the first held nowhere, looked up by their chained hashes (with
        lineage: followed from the match's last page); and those keys, packed (an
        admission keeps them for its insert)."""
        bs = self.block_size
        first, full = device.num_tokens // bs, len(tokens) // bs  # type: ignore[attr-defined]
        if first >= full:
            return [], b""
        if self._lineage:
            up = self.tiers.device_key(device.block_ids[-1]) if first else self._roots.get(exact_key(namespace))  # type: ignore[attr-defined]
            if up is None:  # a namespace without a root name: nothing below follows it
                return [], b""
            return self.tiers.follow(up, tokens[first * bs : full * bs])[0], b""
        parent = self._page_hash[device.block_ids[-1]] if first else None  # type: ignore[attr-defined]
        digests = chain_digests(
            tokens[first * bs : full * bs],
            bs,
            self.config.hash.algorithm,
            parent if parent is not None else self._seed_hash,
            namespace_extra_keys(namespace, first_block=parent is None),
            namespace_extra_keys(namespace, first_block=False),
        )
        return self.tiers.chain(None, digests, 0, full - first), digests

    def _tiered_admit(
        self,
        request_id: Hashable,
        toks: array,
        namespace: Namespace,
        tree_key: str | None,
        priority: int,
        key: memoryview,
        probe: object,
        read_cache: bool,
    ) -> Admission | None:
        """`admit` with tiers (rules T1-T3): the tree's match, then the pages after it
        through the tiers, cut by the cost model and the disk verifier; the pages kept
        are loaded into the request's own fresh blocks, which its commit (or release)
        inserts into the tree as it inserts computed pages."""
        tiers, bs = self.tiers, self.block_size
        rest, digests = self._tier_chain(key, probe, namespace)
        if self._trims:
            total = probe.num_tokens + len(rest) * bs  # type: ignore[attr-defined]
            keep = self.checked_usable_hit(key, total, namespace)
            if keep < probe.num_tokens:  # type: ignore[attr-defined]
                key = key[:keep]
                probe, rest, digests = self.tree.match(key, tree_key), [], b""
            else:
                del rest[(keep - probe.num_tokens) // bs :]  # type: ignore[attr-defined]
        lead = probe.num_tokens // bs  # type: ignore[attr-defined]
        use = tiers.usable(rest, lead, len(toks))
        sources = rest[:use]
        needed = -(-len(toks) // bs) - lead
        if needed > self._room(protecting=probe.unlocked_tokens):  # type: ignore[attr-defined]
            self._stats.rejected += 1
            return None
        hit = self.tree.match_prefix(key[: lead * bs], tree_key)
        self.tree.lock(hit.node)  # before evicting, so the hit cannot be evicted
        if sources:
            tiers.pin(sources)  # nor can a demotion reuse the slots it loads from
        try:
            fresh = self._allocate(needed, self._extend_demand(len(toks) - hit.num_tokens))
        except BaseException:
            self.tree.unlock(hit.node)
            if sources:
                tiers.unpin(sources)
            raise
        if sources:
            # The slots stay where they are, pinned, until the request's commit (or release)
            # puts the loaded pages in the tree: until then the tiers still hold, and announce, them.
            tiers.load(sources, fresh[:use], promote=False)
        table = hit.block_ids + fresh
        num_hit = (lead + use) * bs
        req = self._requests.add(
            _RadixRequest(
                request_id,
                toks,
                namespace,
                table,
                num_cached_tokens=num_hit,
                num_computed=num_hit,  # the loaded pages count as computed: release inserts them
                tree_key=tree_key,
                node=hit.node,
                protected=hit.num_tokens,
                priority=priority,
                prompt_len=len(toks),
                loading=sources,
                digests=digests,
                digests_from=lead,
            )
        )
        req.depth = tiers.admitted(len(toks) // bs * bs, table[: lead + use], len(toks) // bs * bs)
        if read_cache:
            self._stats.record_query(len(toks), num_hit)
        if rest:
            tiers.count_hit(rest, use)
        tier_hits = [0] * (tiers.num_tiers + 1)
        tier_hits[0] = lead * bs
        for t, _ in sources:
            tier_hits[t + 1] += bs
        loads = tuple((t, slot, dst) for (t, slot), dst in zip(sources, fresh, strict=False))
        return Admission(BlockIds(table), num_hit, (), loads, tuple(tier_hits), (len(rest) - use) * bs)

    # -- invariants ----------------------------------------------------------------------
    def _tree_blocks(self) -> list[int]:
        out: list[int] = []
        stack = [self.tree.root(ns) for ns in self.tree.namespaces()]
        while stack:
            info = self.tree.node(stack.pop())
            out += info.block_ids
            stack += info.children.values()
        return out

    @guarded
    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise InvariantError(f"radix: {msg}")

        self.pool.check_invariants()
        self.tree.check_invariants([r.node for r in self._requests])
        bs = self.block_size
        tree_blocks = set(self._tree_blocks())
        private: list[int] = []
        for r in self._requests:
            rid = r.request_id
            if len(r.block_table) != -(-len(r.tokens) // bs):
                fail(f"request {rid!r} has {len(r.block_table)} blocks for {len(r.tokens)} tokens")
            if r.protected % bs or r.protected > len(r.tokens):
                fail(f"request {rid!r} protects {r.protected} tokens of {len(r.tokens)}")
            shared = r.block_table[: r.protected // bs]
            m = self.tree.match(r.tokens[: r.protected], r.tree_key)
            if m.num_tokens != r.protected or m.block_ids != shared:
                fail(f"request {rid!r}: its first {r.protected} tokens are not the tree's blocks {shared}")
            private += r.block_table[r.protected // bs :]
        if len(set(private)) != len(private):
            fail("a block is owned by two requests, or twice by one")
        if tree_blocks & set(private):
            fail(f"blocks {sorted(tree_blocks & set(private))} are owned by a request and by the tree")
        for b in [*tree_blocks, *private]:
            if self.pool.ref_count(b) != 1:
                fail(f"block {b} has {self.pool.ref_count(b)} references, expected 1 (its one owner)")
        # The pool is this cache's alone, so nothing else may pin a block.
        if self.pool.num_pinned != len(tree_blocks) + len(private):
            fail(
                f"{self.pool.num_pinned} blocks pinned but the tree holds {len(tree_blocks)} "
                f"and live requests {len(private)}"
            )
        # The page-hash table exists for events and hashed tiers: a cache without them hashes nothing.
        if set(self._page_hash) != (tree_blocks if self._hashes_pages else set()):
            fail("the page-hash table does not cover exactly the tree's blocks (none without events or tiers)")
        if self.tiers is not None:
            self.tiers.check_invariants(None)
            missing = [b for b in tree_blocks if not self.tiers.native.device_has(b)]
            if missing:
                fail(f"tree blocks {sorted(missing)[:8]} are not in the tiers' device mirror")
            stray = [b for b in range(self.pool.num_blocks) if self.tiers.native.device_has(b)
                     and b not in tree_blocks and b not in set(private)]  # fmt: skip
            if stray:
                fail(f"blocks {stray[:8]} are in the tiers' device mirror but neither the tree's nor a request's")
