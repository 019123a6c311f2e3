"""The `hash` strategy: vLLM V1 Automatic Prefix Caching (vLLM 0.33 semantics).

Owns `HashCache`: each live request's chain of block hashes, the hit decision at
admission, when full blocks become hittable (commit), and the KV events and stats that
follow. The shared `BlockPool` owns the rest: reference counts, the free queue (an LRU
of cached content whose blocks keep their hash until reused) and the hash -> blocks
index. Block ids and hashes are vLLM's, except that the pool has no null block, so our
id is vLLM's minus one.

Must never: hash block by block in Python (`prefixcache.hashing.chain_digests` does a
whole request in one native call), change anything when `admit`/`append` refuse, or
share the pool with another cache (check_invariants counts every pinned block).

A request's life, with vLLM's names in brackets:

  admit    Hash the prompt's full blocks [Request.block_hashes] into one bytes of
           packed digests, which the pool reads without a Python object per block.
           The hit is the longest run of cached blocks from the start, stopping at
           the first miss [find_longest_cache_hit], and at most (len(tokens) - 1) // block_size
           blocks: the last prompt token is always computed so its logits exist, which
           recomputes a whole block when the prompt is a multiple of the block size.
           If the blocks still to allocate plus the hit blocks sitting in the free
           queue (touching takes them out) exceed the free blocks, refuse: None,
           nothing changed [allocate_slots]. Else pin the hits [touch] BEFORE
           allocating the rest [get_new_blocks], so allocation cannot evict a hit.
  commit   Full blocks up to the committed length enter the index
           [cache_full_blocks], hashing any that `append` completed. A block computed
           twice (two requests missed on the same prefix at once) is indexed twice:
           block tables are append-only, a look-up returns the earliest copy still
           cached, and reusing one copy drops only its own entry.
  append   Allocate blocks as the token count crosses block boundaries; None and
           nothing changed if the pool has too few free blocks.
  release  Free the table in REVERSE order [free]: keyless blocks go to the FRONT of
           the free queue (reused first), cached ones to the TAIL, each group in the
           order given, so a request's tail is evicted before the prefix it shares.
           A freed cached block stays hittable until allocation reuses it; then its
           hash leaves the index and a `BlockRemoved` is recorded.

Stats are vLLM's `PrefixCacheStats`, recorded at admission: a refused admission is not
counted as a request or a query (vLLM records a lookup only when the request is
scheduled), only in `rejected`. `evictions` counts cached blocks whose hash was dropped,
by reuse or by `evict`.

Events are vLLM's: one `BlockStored` per commit that caches blocks (their hashes, the
parent hash of the first, their tokens, per-block extra keys in vLLM's event form,
`group_idx=0`, `kv_cache_spec_kind="full_attention"`, the adapter's `lora_id`), one
`BlockRemoved` per hash dropped, `AllBlocksCleared` on `reset`. With `enable_events`
off the log is a `NullEventLog`, which never builds them.

Eviction (`prefixcache.evictors`; the backend always holds an evictor and calls it
alike). With `eviction: lru` (the default) the free queue's order is the policy: its
`FreeQueueEvictor` ranks nothing and costs a Python call per call it stands for. Any
other policy (`prefixcache.eviction`, or a plugin's) runs through a `BlockEvictor`
(`csrc/block_evictor.h`): blocks are ranked once, when their last
reference is dropped, and before an allocation takes n blocks the policy's victims are
uncached and moved to the front of the free queue, so allocation only ever reuses
keyless blocks. `admit` takes `priority=` (int) for `eviction: priority`.

Extension hooks for subclasses (docs/extending.md): `usable_hit` (the protocol's) trims
a hit in `match` and `admit` alike; `blocks_cached` is told about every newly indexed
run of blocks; with `partial_hits = True`, `partial_hit` may offer a cached block whose
head matches the first block that missed, which `admit` pins and hands to the engine
as a copy (`Admission.copies`).

Options: `verify_hits` (below).

Hit verification. Under `sha256_cbor`/`sha256` a hash hit is trusted, as vLLM trusts
it: nobody can find SHA-256 collisions, and its `TrustingVerifier` (beside
`BlockContents`, with the same calls) hands back the pool's look-up as it is. Under
`xxhash`/`xxhash_cbor` (128-bit, not collision resistant: a collision would hand a
request another prompt's KV, or another tenant's) every hit is proved before it is
used: `BlockContents` keeps, per cached block, an immutable record of what its KV was
computed from (its exact token ids, the record of the block before it, the namespace
at the chain's start), and a block found by its hash counts only if it holds exactly
the request's tokens after exactly the request's prefix, in its namespace.
Key i's holders are tried earliest first; the first one that proves the position is
the hit; a key whose holders all fail stops the hit there (a miss: the rest is
computed afresh and cached under the same key beside the impostor) and counts in
`stats().verify_failures`. A partial hit's source (whatever `partial_hit` offers) is
proved the same way, on its first n tokens, after exactly the proved full hits; one
that fails is dropped (the hit ends at the full blocks) and counts the same way.
A request's namespace and adapter are part of the proof.
`options: {verify_hits: always}` verifies under SHA-256 too (defense in depth);
`never` trusts even xxhash, as vLLM does (for measurements; not collision-proof).

Namespaces (`prefixcache.isolation`): a str salt, or `Isolation(salt, lora)` with a
LoRA adapter. The salt is `("cache_salt", salt)` on the first block's extra keys, the
adapter `("lora", name, path)` on every block's (vLLM 0.33); events carry the adapter's
name in `lora_name` and, untagged, in `extra_keys`.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from prefixcache._C import BlockContents, BlockPool, InvariantError, append_step, commit_blocks
from prefixcache.block_contents import TrustingVerifier
from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.events import BlockRemoved, BlockStored, event_log
from prefixcache.evictors import FreeQueueEvictor, block_evictor
from prefixcache.hashing import CRYPTOGRAPHIC, native_chain, none_hash
from prefixcache.isolation import exact_bytes
from prefixcache.protocol import Admission, BlockIds, Match, Namespace, PrefixCache, guarded
from prefixcache.registry import register_backend, resolve_eviction_policy
from prefixcache.requests import (
    BlockwiseAppend,
    Request,
    RequestTable,
    check_namespace,
    check_priority,
    check_tokens,
)
from prefixcache.stats import StatsCounter
from prefixcache.tiers import DEVICE, Tiers, token_block_ids

from .hash_base import HashCacheBase, stored_event
from .hybrid_fine import FineStateHashCache
from .hybrid_hash import HYBRID_CHOICES, HYBRID_OPTIONS, HybridHashCache

__all__ = ["HashCache", "HashRequest", "VERIFY_HITS"]

VERIFY_HITS = ("auto", "always", "never")
"""`options: {verify_hits: ...}`: auto (verify under xxhash/xxhash_cbor only), always, never."""

_INT64 = (-(1 << 63), (1 << 63) - 1)


@dataclass(eq=False)
class HashRequest(Request):
    """A live request of the `hash` backend.

    tokens:            array('q') of the request's ids (a list if one is beyond int64)
    digests:           chained hashes of the request's first full blocks, packed back
                       to back in a bytearray (the prompt's at admission, extended in
                       place as commits cover appended blocks: O(new blocks) a commit);
                       block i's is `HashCache._digest(request, i)`
    num_cached_blocks: leading blocks of `block_table` whose hash is in the index
                       (vLLM `num_cached_block`); always `num_computed // block_size`
    priority:          the request's priority (`eviction: priority`)
    copy_source:       the cached block a partial hit copies from, pinned by the
                       request until its first commit or its release (else None)
    namespace_bytes:   `isolation.exact_bytes(namespace)`, what hit verification
                       compares
    depth:             with tiers: the chain depth its blocks are cached with
                       (`Tiers.admitted`)
    """

    digests: bytearray = None  # type: ignore[assignment]
    num_cached_blocks: int = 0
    priority: int = 0
    copy_source: int | None = None
    namespace_bytes: bytes = b""
    depth: int = 0


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@register_backend("hash")
class HashCache(BlockwiseAppend, HashCacheBase):
    """vLLM V1 automatic prefix caching on a `BlockPool` (see the module docstring)."""

    option_defaults = {"verify_hits": "auto", **HYBRID_OPTIONS}
    option_choices = {"verify_hits": VERIFY_HITS, **HYBRID_CHOICES}

    def __new__(cls, pool: BlockPool, config: CacheConfig) -> HashCache:
        # A hybrid layout is vLLM's hybrid manager, a class of its own (backends/hybrid_hash.py).
        if cls is HashCache and config.groups.hybrid:
            fine = config.options.get("state_granule")  # states finer than the block: backends/hybrid_fine.py
            return (FineStateHashCache if fine else HybridHashCache)(pool, config)  # type: ignore[return-value]
        return super().__new__(cls)

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # A subclass with its own commit or append: the fused call inlines ours and must
        # not bypass theirs, so it gets the protocol's default (the two calls).
        if {"commit", "append"} & vars(cls).keys() and "commit_and_append" not in vars(cls):
            cls.commit_and_append = PrefixCache.commit_and_append  # type: ignore[method-assign]

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        super().__init__(pool, config)
        for key, default in HYBRID_OPTIONS.items():
            if self.options[key] != default:
                raise ConfigError(f"options.{key}", "applies to a hybrid cache.layout only (a group that is not full_attention)")
        self.policy = resolve_eviction_policy(config.eviction)()
        self._evictor = block_evictor(pool, self.block_size, self.policy)
        self._trims = type(self).usable_hit is not PrefixCache.usable_hit
        verify = self.options["verify_hits"]  # one of VERIFY_HITS (option_choices)
        self._algorithm = config.hash.algorithm
        self._none_hash = none_hash(self._algorithm, config.hash.seed)
        self._digest_size = len(self._none_hash)  # bytes per block hash in a packed chain
        # Hits found through a non-cryptographic hash are proved against exact contents.
        if verify == "auto":
            verify = "never" if self._algorithm in CRYPTOGRAPHIC else "always"
        self._verifier = BlockContents(pool, self.block_size) if verify == "always" else TrustingVerifier(pool)
        self._requests: RequestTable[HashRequest] = RequestTable()
        self._events = event_log(config.enable_events)
        #: The lower tiers (`cache.tiers`), or None: blocks keyed by their chained hash, as
        #: vLLM's offloading connector keys them (docs/tiers.md).
        self.tiers = Tiers(config, pool.num_blocks, self._digest_size, self._events) if config.tiers else None
        # Where allocating is the pool's allocation alone (the free-queue evictor, no
        # events, the built-in allocation, no tier to tell), a decode step's fresh block is
        # taken natively; where caching a block is also the chain and the pool's index
        # alone (no hit verification, a native chain, no hook), a commit is one native call.
        plain = isinstance(self._evictor, FreeQueueEvictor) and not self._events.enabled
        if (plain and self.tiers is None and type(self)._allocate_if_free is HashCache._allocate_if_free
                and type(self)._take is HashCache._take):  # fmt: skip
            self._append_pool = pool
        self._commit_natively = (
            plain
            and isinstance(self._verifier, TrustingVerifier)
            and native_chain(self._algorithm, self.block_size)
            and type(self).blocks_cached is HashCache.blocks_cached
        )
        self._stats = StatsCounter()
        # `evictions` is the pool's count since the last reset (the pool is ours alone),
        # read when stats are asked for rather than bumped on every allocation.
        self._evicted_at_reset = pool.num_evicted
        # A refused request is normally retried as it is (vLLM keeps it, hashes and all,
        # in its waiting queue): keep the last refusal's hashes so the retry reuses them.
        self._last_refused: tuple[Hashable, Namespace, list[int], bytes] | None = None

    # -- look-up --------------------------------------------------------------------
    @guarded
    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        tokens = check_tokens(tokens, allow_empty=True)
        namespace = check_namespace(namespace)
        digests = self._prompt_digests(tokens, namespace)
        namespace_bytes = exact_bytes(namespace)
        hits, _ = self._verifier.lookup_chain(digests, self._digest_size, tokens, namespace_bytes)
        if self.tiers is not None:
            return self._tiered_match(tokens, namespace, digests, hits)
        partial = None
        if self._trims or self.partial_hits:
            hits, partial, _ = self._usable(tokens, namespace, namespace_bytes, digests, hits, len(tokens))
        if partial is not None:
            return Match(len(hits) * self.block_size + partial[1], (*hits, partial[0]))
        return Match(len(hits) * self.block_size, tuple(hits))

    # -- request lifecycle ------------------------------------------------------------
    @guarded
    def admit(
        self, request_id: Hashable, tokens: Sequence[int], *, namespace: Namespace = None, priority: int = 0,
        read_cache: bool = True,
    ) -> Admission | None:
        """`priority` (int): kept by the blocks the request hits and caches, for
        `eviction: priority`. `read_cache` False: hit nothing (protocol rule 1)."""
        priority = check_priority(priority)
        tokens = check_tokens(tokens)  # our own typed copy, read once in C++: append extends it
        namespace = check_namespace(namespace)
        self._requests.check_new(request_id)
        retry = self._last_refused
        if retry is not None and retry[0] == request_id and retry[1] == namespace and retry[2] == tokens:
            digests = retry[3]
        else:
            digests = self._prompt_digests(tokens, namespace)
        bs, ds = self.block_size, self._digest_size
        # The hit covers at most len(tokens) - 1 tokens: every full block but one that ends the prompt.
        capped = digests if len(tokens) % bs else digests[:-ds]
        if not read_cache:
            capped = b""  # vLLM's skip_reading_prefix_cache: nothing is looked up
        namespace_bytes = exact_bytes(namespace)
        hits, refuted = self._verifier.lookup_chain(capped, ds, tokens, namespace_bytes)
        if self.tiers is not None:
            return self._tiered_admit(request_id, tokens, namespace, priority, digests, capped, hits, refuted,
                                      read_cache)
        partial = None
        if (self._trims or self.partial_hits) and read_cache:  # only a subclass with a hook pays for it
            hits, partial, refuted_partial = self._usable(
                tokens, namespace, namespace_bytes, digests, hits, len(tokens) - 1
            )
            refuted = refuted or refuted_partial
        pinned = hits if partial is None else [*hits, partial[0]]
        num_new = _ceil_div(len(tokens), bs) - len(hits)
        if num_new + (self.pool.count_free(pinned) if pinned else 0) > self.pool.num_free:
            self._stats.rejected += 1
            self._last_refused = (request_id, namespace, tokens, digests)
            return None
        self._last_refused = None
        # Pin before allocating, so allocation cannot evict them: the policy's victims
        # first, never a hit (a failing policy then changes nothing), then the pins;
        # allocation below takes only keyless blocks.
        removed = self._evictor.make_room(num_new, pinned)
        self._evictor.admit(pinned, len(tokens) // bs * bs, priority)
        table = hits + self._take(num_new, removed)
        num_hit_tokens = len(hits) * bs + (partial[1] if partial else 0)
        copies = ((partial[0], table[len(hits)], partial[1]),) if partial else ()
        self._requests.add(
            HashRequest(
                request_id,
                tokens,
                namespace,
                block_table=table,
                num_cached_tokens=num_hit_tokens,
                num_computed=num_hit_tokens,
                digests=bytearray(digests),
                num_cached_blocks=len(hits),
                priority=priority,
                copy_source=partial[0] if partial else None,
                namespace_bytes=namespace_bytes,
            )
        )
        if read_cache:
            self._stats.record_query(len(tokens), num_hit_tokens)
        if refuted:
            self._stats.verify_failures += 1
        return Admission(BlockIds(table), num_hit_tokens, copies)

    append = guarded(BlockwiseAppend.append)

    @guarded
    def commit_and_append(
        self, request_id: Hashable, num_computed_tokens: int, tokens: Sequence[int]
    ) -> list[int] | None:
        """`commit` then `append` (the protocol's default), in one guarded call: a decode
        step's common outcomes (no block filled; no block needed, or a free one) inline."""
        request = self._requests.get(request_id)
        n = num_computed_tokens
        if (
            type(n) is int
            and request.num_computed <= n <= len(request.tokens)
            and n // self.block_size == request.num_cached_blocks
            and request.copy_source is None
        ):
            request.num_computed = n  # no block filled, no copy source to unpin
        else:
            HashCache.commit.__wrapped__(self, request_id, n)  # type: ignore[attr-defined]
        step = append_step(request.tokens, tokens, request.block_table, self.block_size, self._append_pool, 0, 0)
        if type(step) is list:
            return step
        return self._append_rest(request, tokens, step)

    @guarded
    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        request = self._requests.get(request_id)
        n = num_computed_tokens
        # Once per decoded token: test the valid case inline, let check_commit word errors.
        if type(n) is not int or not request.num_computed <= n <= len(request.tokens):
            n = request.check_commit(n)
        num_full_blocks = n // self.block_size
        cached_from = request.num_cached_blocks
        if num_full_blocks > cached_from:  # most decode steps fill no block
            self._cache_full_blocks(request, num_full_blocks)  # may raise: nothing changed yet
        request.num_computed = n
        if request.copy_source is not None:  # the engine has done the copy by now
            self._unpin([request.copy_source], request)
            request.copy_source = None
        if num_full_blocks > cached_from:
            # Last, once the commit is whole: a hook that raises finds it done and consistent.
            self.blocks_cached(request, cached_from, num_full_blocks)

    @guarded
    def release(self, request_id: Hashable) -> None:
        # Every full computed block was cached by its commit; only freeing is left.
        request = self._requests.get(request_id)
        table = request.block_table[::-1]
        if request.copy_source is not None:
            table.append(request.copy_source)
        self._unpin(table, request)  # a Python policy may raise here: then the request stays live
        self._requests.pop(request_id)

    @guarded
    def block_table(self, request_id: Hashable) -> Sequence[int]:
        return BlockIds(self._requests.get(request_id).block_table)

    # -- maintenance (evict, reset, stats, drain_events: HashCacheBase) ----------------
    @guarded
    def drain_transfers(self) -> list[tuple[int, int, int, int]]:
        return self.tiers.drain_transfers() if self.tiers is not None else []

    @guarded
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self._evictor.check_invariants()
        bs = self.block_size
        refs: Counter[int] = Counter()
        for r in self._requests:
            table, who = r.block_table, f"request {r.request_id!r}"
            if len(table) != _ceil_div(len(r.tokens), bs):
                raise InvariantError(f"{who}: {len(table)} blocks for {len(r.tokens)} tokens")
            if len(set(table)) != len(table):
                raise InvariantError(f"{who}: a block appears twice in its table {table}")
            num_hashed = len(r.digests) // self._digest_size
            if r.num_cached_blocks != r.num_computed // bs or num_hashed < r.num_cached_blocks:
                raise InvariantError(
                    f"{who}: {r.num_cached_blocks} cached blocks, {r.num_computed} computed tokens, "
                    f"{num_hashed} hashes"
                )
            proved = self._verifier.verify_table(table[: r.num_cached_blocks], r.tokens, r.namespace_bytes)
            if proved < r.num_cached_blocks:
                # Blocks from the first id beyond int64 on are recorded as unprovable: never hit.
                # Only a shortfall pays for finding them (a trusting verifier proves every block).
                cached_tokens = r.tokens[: r.num_cached_blocks * bs]
                provable = next(
                    (pos // bs for pos, t in enumerate(cached_tokens) if not _INT64[0] <= t <= _INT64[1]),
                    r.num_cached_blocks,
                )
                if proved < provable:
                    raise InvariantError(
                        f"{who}: cached block {table[proved]} (#{proved}) does not hold exactly the request's "
                        "tokens after its prefix"
                    )
            for i, block in enumerate(table):
                key = self.pool.key(block)
                if i < r.num_cached_blocks and key != self._digest(r, i):
                    raise InvariantError(f"{who}: cached block {block} (#{i}) does not hold the request's hash")
                if i >= r.num_cached_blocks and (key is not None or self.pool.ref_count(block) != 1):
                    raise InvariantError(f"{who}: uncached block {block} (#{i}) is shared or holds a hash")
            refs.update(table)
            if r.copy_source is not None:
                if self.pool.key(r.copy_source) is None:
                    raise InvariantError(f"{who}: copy source block {r.copy_source} holds no hash")
                refs[r.copy_source] += 1
        for block, count in refs.items():
            if self.pool.ref_count(block) != count:
                raise InvariantError(
                    f"block {block}: ref count {self.pool.ref_count(block)}, live tables hold it {count} times"
                )
        if self.pool.num_pinned != len(refs):
            raise InvariantError(f"{self.pool.num_pinned} blocks pinned but live tables hold {len(refs)}")
        self._verifier.check_invariants()
        if self.tiers is not None:
            self.tiers.check_invariants(self.pool)
        if self._stats.hits > self._stats.queries:
            raise InvariantError(f"stats: {self._stats.hits} hit tokens > {self._stats.queries} queried")

    # -- lower tiers (docs/tiers.md) ----------------------------------------------------
    def _tiered_match(self, tokens: array, namespace: Namespace, digests: bytes, hits: list[int]) -> Match:
        """`match` with tiers: the device hit, then the chain through every tier."""
        ds, bs = self._digest_size, self.block_size
        found = [(DEVICE, b) for b in hits]
        found += self.tiers.chain(self.pool, digests, len(hits), len(digests) // ds)  # fmt: skip
        if self._trims:
            keep = self.checked_usable_hit(tokens, len(found) * bs, namespace)
            del found[keep // bs :]
        return Match(len(found) * bs, tuple(b for _, b in found), tuple(t for t, _ in found))

    def _tiered_admit(
        self,
        request_id: Hashable,
        tokens: array,
        namespace: Namespace,
        priority: int,
        digests: bytes,
        capped: bytes,
        hits: list[int],
        refuted: bool,
        read_cache: bool,
    ) -> Admission | None:
        """`admit` with tiers (rules T1-T3): the chain through every tier, cut where the
        cost model says computing is cheaper or a disk block fails its checksum; the
        lower-tier blocks kept become loads into fresh device blocks, keyed at once (the
        engine runs the loads before any forward pass, so a hit on them is sound)."""
        tiers, pool, ds, bs = self.tiers, self.pool, self._digest_size, self.block_size
        lead = len(hits)  # the device run: free to use, never cut
        rest = tiers.chain(pool, capped, lead, len(capped) // ds)
        if self._trims:
            keep = self.checked_usable_hit(tokens[: len(tokens) - 1], (lead + len(rest)) * bs, namespace)
            if keep < lead * bs:
                hits, rest = hits[: keep // bs], []
                lead = len(hits)
            del rest[keep // bs - lead :]
        kept = rest[: tiers.usable(rest, lead, len(tokens))]
        pinned = hits + [b for t, b in kept if t == DEVICE]
        sources = [(t, b) for t, b in kept if t != DEVICE]
        num_new = _ceil_div(len(tokens), bs) - len(pinned)
        if num_new + (pool.count_free(pinned) if pinned else 0) > pool.num_free:
            self._stats.rejected += 1
            self._last_refused = (request_id, namespace, tokens, digests)
            return None
        self._last_refused = None
        tiers.pin(sources)  # a demotion caused by the allocation below must not reuse them
        try:
            removed = self._evictor.make_room(num_new, pinned)
            self._evictor.admit(pinned, len(tokens) // bs * bs, priority)
        except BaseException:
            tiers.unpin(sources)
            raise
        fresh = iter(self._take(num_new, removed))
        table = list(hits)
        loaded: list[int] = []  # positions in the table of the loaded blocks
        for t, b in kept:
            if t == DEVICE:
                table.append(b)
            else:
                loaded.append(len(table))
                table.append(next(fresh))
        table.extend(fresh)
        if sources:
            tiers.load(sources, [table[i] for i in loaded])
        num_hit = (lead + len(kept)) * bs
        request = HashRequest(
            request_id,
            tokens,
            namespace,
            block_table=table,
            num_cached_tokens=num_hit,
            num_computed=num_hit,
            digests=bytearray(digests),
            num_cached_blocks=lead + len(kept),
            priority=priority,
            namespace_bytes=exact_bytes(namespace),
        )
        for i in loaded:  # hittable from now on: the engine loads before it computes
            block, key = table[i], digests[i * ds : (i + 1) * ds]
            self._verifier.record(table[i - 1] if i else -1, [block], tokens, i * bs, request.namespace_bytes)
            pool.cache_many_packed([block], key, ds)
            self._evictor.cached([block], key, ds, priority)
            self._events.record_from(self._stored_events, request, i, i + 1)
        request.depth = tiers.admitted(len(tokens) // bs * bs, table[: lead + len(kept)], len(tokens) // bs * bs)
        self._requests.add(request)
        if read_cache:
            self._stats.record_query(len(tokens), num_hit)
        if refuted:
            self._stats.verify_failures += 1
        tier_hits = [0] * (tiers.num_tiers + 1)
        tier_hits[0] = lead * bs
        if rest:
            tiers.count_hit(rest, len(kept))
            for t, _ in kept:
                tier_hits[t + 1] += bs
        loads = tuple((t, b, table[i]) for (t, b), i in zip(sources, loaded, strict=True))
        return Admission(BlockIds(table), num_hit, (), loads, tuple(tier_hits), (len(rest) - len(kept)) * bs)

    # -- extension hooks (docs/extending.md) -------------------------------------------
    def partial_hit(
        self, tokens: list[int], namespace: Namespace, digests: bytes, num_hit_blocks: int, limit: int
    ) -> tuple[int, int] | None:
        """Partial-hit hook, called only when the class sets `partial_hits = True`.

        The first `num_hit_blocks` blocks of `tokens` hit; `digests` packs the chained
        hashes of its full blocks (`block_hash` reads one). Return `(block, n)`: a
        cached block, in the same chain (its parent is hit block num_hit_blocks - 1, or
        the namespace's root), whose first n tokens, 1 <= n <= min(limit, block_size),
        equal the next tokens of the prompt; or None. `limit` is what is left of the
        prompt after the hit (len - 1 - hit in `admit`). Must not change anything.
        Default: None."""
        return None

    def blocks_cached(self, request: HashRequest, start: int, stop: int) -> None:
        """Hook: blocks [start, stop) of `request.block_table` were just indexed under
        `block_hash(request, i)`, called at the end of the `commit` that did it (if it
        raises, the commit is done and the error passed on). Default: nothing."""

    def block_hash(self, request: HashRequest, i: int) -> bytes:
        """The chained hash of the request's block i (its first full blocks only)."""
        return self._digest(request, i)

    @property
    def digest_size(self) -> int:
        """Bytes per block hash in a packed chain (`digests` of `partial_hit`)."""
        return self._digest_size

    def _usable(
        self,
        tokens: list[int],
        namespace: Namespace,
        namespace_bytes: bytes,
        digests: bytes,
        hits: list[int],
        limit: int,
    ) -> tuple[list[int], tuple[int, int] | None, bool]:
        """The hit blocks `usable_hit` keeps, a partial block if the class has
        `partial_hits` and nothing was trimmed, and whether hit verification refuted
        the partial block `partial_hit` offered (then dropped). `limit`: TOKENS a hit
        may cover."""
        bs = self.block_size
        if self._trims:
            keep = self.checked_usable_hit(tokens[:limit], len(hits) * bs, namespace)
            if keep < len(hits) * bs:
                return hits[: keep // bs], None, False
        if not self.partial_hits or limit - len(hits) * bs < 1:
            return hits, None, False
        partial = self.partial_hit(tokens, namespace, digests, len(hits), limit - len(hits) * bs)
        if partial is None:
            return hits, None, False
        block, n = partial
        if not 1 <= n <= min(bs - 1, limit - len(hits) * bs) or self.pool.key(block) is None:
            raise ValueError(f"partial_hit returned {partial!r}: needs a cached block and 1 <= n < block_size")
        # A hook finds sources by hash, so under a hash that is verified a collision can
        # offer any cached block (one of the hits, too): it is proved as a full hit is
        # proved. Under a trusted hash a hit block is the hook's error (ValueError).
        if not self._verifier.verify_head(block, hits, tokens, n, namespace_bytes) or block in hits:
            return hits, None, True
        return hits, partial, False

    def _unpin(self, blocks: list[int], request: HashRequest) -> None:
        """Drop the request's reference on `blocks` (in free-queue order)."""
        self._evictor.free(blocks, request.num_cached_blocks * self.block_size)

    # -- internals --------------------------------------------------------------------
    def _digest(self, request: HashRequest, i: int) -> bytes:
        """The hash of the request's block i."""
        return bytes(request.digests[i * self._digest_size : (i + 1) * self._digest_size])

    def _allocate_if_free(self, n: int) -> list[int] | None:
        """n fresh blocks once the evictor made room, or None when fewer than n are free
        (a refused append)."""
        return None if n > self.pool.num_free else self._take(n, self._evictor.make_room(n))

    def _take(self, n: int, removed: Sequence[bytes]) -> list[int]:
        """n fresh blocks, once the evictor made room for them (a policy's victims, whose
        hashes are `removed`: allocation then takes only keyless blocks) and the caller
        checked there is room. Reports `removed` and what reuse dropped."""
        blocks = self.pool.allocate(n)
        assert blocks is not None, "caller checked the pool has room"
        self._events.record_from(self._allocation_events, removed)
        if self.tiers is not None:
            self.tiers.evicted(blocks)  # what reuse evicted goes down (its KV is intact until computed over)
        return blocks

    def _allocation_events(self, removed: Sequence[bytes]) -> list[BlockRemoved]:
        """The BlockRemoved of the evictor's victims, then of what the latest allocation's reuse dropped."""
        return self._removed_events([*removed, *self.pool.last_removed()])

    def _cache_full_blocks(self, request: HashRequest, num_full_blocks: int) -> None:
        """Index blocks [num_cached_blocks, num_full_blocks) of the request's table."""
        start, bs, ds = request.num_cached_blocks, self.block_size, self._digest_size
        if self._commit_natively and request.namespace is None:
            # The chain, the pool's keys and nothing else: one native call (False: ids
            # beyond int64, kept in a list, which only the Python chain hashes).
            table = request.block_table
            if commit_blocks(self.pool, request.digests, request.tokens, table, start, num_full_blocks, bs,
                             self._algorithm, self._none_hash):  # fmt: skip
                request.num_cached_blocks = num_full_blocks
                if self.tiers is not None:
                    self._tiers_cached(request, start, num_full_blocks,
                                       bytes(request.digests[start * ds : num_full_blocks * ds]))  # fmt: skip
                return
        num_hashed = len(request.digests) // ds
        new = self._extend_chain(request.digests, request.tokens, num_full_blocks, request.namespace)
        if new and num_hashed == start:  # a decode step's commit: the new hashes are the keys
            keys = new
        else:
            keys = bytes(request.digests[start * ds : num_full_blocks * ds])
        blocks = request.block_table[start:num_full_blocks]
        # Recorded first: it validates the tokens (all or nothing), and blocks without a
        # key are never looked up, so recording them early is harmless.
        parent = request.block_table[start - 1] if start else -1
        self._verifier.record(parent, blocks, request.tokens, start * bs, request.namespace_bytes)
        self.pool.cache_many_packed(blocks, keys, ds)
        self._evictor.cached(blocks, keys, ds, request.priority)
        request.num_cached_blocks = num_full_blocks
        self._events.record_from(self._stored_events, request, start, num_full_blocks)
        if self.tiers is not None:
            self._tiers_cached(request, start, num_full_blocks, keys)

    def _tiers_cached(self, request: HashRequest, start: int, stop: int, keys: bytes) -> None:
        """Tell the tiers blocks [start, stop) of the request are cached under `keys`."""
        bs = self.block_size
        ids = token_block_ids(request.tokens, start * bs, stop * bs) if self.tiers.keep_tokens else ()
        if ids is not None:  # ids beyond int64 stay on the device (a tier keeps int64 ids)
            parent_key = self._digest(request, start - 1) if start else None
            self.tiers.cached(request.block_table[start:stop], keys, parent_key, ids, request.depth,
                              len(request.tokens) // bs * bs, request.namespace)  # fmt: skip

    def _stored_events(self, request: HashRequest, start: int, stop: int) -> tuple[BlockStored]:
        """The one event a commit records (`record_from` takes events in a collection)."""
        return (self._stored_event(request, start, stop),)

    def _stored_event(self, request: HashRequest, start: int, stop: int) -> BlockStored:
        """vLLM's BlockStored for blocks [start, stop) of one request."""
        return stored_event(request.digests, self._digest_size, request.tokens, request.namespace, self.block_size, start, stop)
