"""The `radix` strategy over a hybrid layout: SGLang 0.5.23's UnifiedRadixCache and its scheduler.

Owns `HybridRadixCache`, which `RadixCache` builds when `cache.layout` has a group that
is not full attention: the request side of SGLang's unified radix cache over the tree
of `backends.hybrid_radix_tree` (FULL / SWA / MAMBA components on one tree), run natively
(`backends.hybrid_radix_native`: what it frees comes back after each call). What the
protocol's calls do is what SGLang 0.5.23's scheduler does around the cache
(`managers/schedule_batch.py`, `mem_cache/allocation.py`, `mem_cache/common.py`,
`unified_radix_cache.py`), one request at a time:

  admit    `match_prefix` of the prompt but its last token (the walk splits the node
           it ends inside; the hit is where every component accepts: matched first,
           settled, split and recency, once the request is known to fit); with a Mamba
           component the matched state is copied into the request's running state
           slot (copy-on-write: a slot is taken, evicting if none is free); the
           request locks the matched node; then the request's Mamba slots (the
           running one and two ping-pong track slots) and the first extend's pages in
           the FULL and SWA pools, each after evicting the pool's shortfall of SGLang's
           demand (the extend plus a page). The extend is the prompt, or with
           `chunked_prefill_size` its first chunk (SGLang's PrefillAdder cut); each
           chunk's end is in `Admission.checkpoints`. With Mamba, each extend tracks
           one state: at the branching point (where the full-attention hit ran past
           the state hit) if it lies in the extend, else at the extend's last
           state-grid position; that position is in `Admission.checkpoints` too,
           where the engine ends a forward pass so the state exists.
  commit   A commit that reaches the prompt's end is SGLang's checkpoint after the
           prefill: the prompt is inserted (up to the tracked state with Mamba, up to
           the SWA branching point with SWA), the request's duplicates freed and its
           tables re-pointed to the tree's pages, its lock moved to the node the
           insert ended on, its SWA pages out of the window freed. A commit that
           reaches a chunk's end is SGLang's stash_chunked_request: the same
           checkpoint up to there, then the next chunk allocated (if it finds no room
           the request waits: `append(r, [])` retries it). Other commits inside the
           prefill (a state tracked inside an extend, chunks the engine makes on its
           own) insert nothing. Decode commits insert nothing, as SGLang; one that
           lands on the Mamba track interval tracks that state.
  append   A decode step: `check_decode_mem` and `alloc_for_decode` (its SWA
           eviction of the request's out-of-window pages every 128 tokens, a page of
           room, a page when one starts). Other tokens are an extend of their own,
           taking any prefill chunk not allocated yet with them.
  release  `release_kv_cache(checkpoint=True)`: a last insert (with Mamba only up to
           the last tracked state, with SWA the out-of-window part a tombstone), then
           everything the request still owns is freed and its lock dropped. With
           `state_cap` (beyond SGLang), the states on its path but the cap's are then
           evicted, least replay saved first (`prefixcache.state_cap`).

The pools: SGLang keeps a full-attention pool, a sliding-window pool and a Mamba state
pool apart; here they are three budgets on our one `BlockPool` (every id a block of it,
a state a block too): `num_blocks` less what the Mamba group's `slots` take (default:
SGLang's `mamba_full_memory_ratio` 0.9 of the blocks) split between FULL and SWA by the
SWA group's `pool_ratio` (SGLang's `swa_full_tokens_ratio`, default 0.8). A state takes
`Layout.state_blocks` blocks: its bytes over a block's when the layout gives both sizes
(one block holds the state, the others are held back), else one. So the block stays
SGLang's page, never raised to hold a state (vLLM's rule), and a state costs its bytes. Each
budget evicts on its own, as each SGLang pool does. `admit` and `append` first check
that what they take fits after evicting everything evictable, and otherwise return None
having changed nothing (SGLang's scheduler would keep the request waiting or retract
it).

Tables (`block_tables`): FULL and chunked-local groups read the FULL pages (a
chunked-local table is NULL_BLOCK before the chunk of the hit's first query; SGLang
keeps such layers in its full pool); SWA groups the SWA pages (NULL_BLOCK before the
window of the hit's first query, and where the request freed them); Mamba groups the
state slots, at index i the state after (i + 1) * block_size tokens: the matched state
at admission, the ping-pong slot a tracked state is written to.

Events: per layout group, as `hash`'s hybrid events (`group_idx`, `kv_cache_spec_kind`,
`kv_cache_spec_sliding_window`), with the chained block hash: FULL pages when a leaf
enters the tree or goes, SWA pages when they are published, recovered or tombstoned, a
state as the one block it ends on.

Must never: be used for a full-attention-only layout (`RadixCache` is, unchanged), leave
anything changed by an `admit` or `append` that returns None, or free a block the tree
or another request holds.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache._C import BlockPool, HybridInsert, HybridMatch, HybridNodeRef, HybridReceipt, InvariantError, int32_arrays
from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    event_extra_keys,
    event_log,
    event_lora,
)
from prefixcache.hashing import chain_digests, namespace_extra_keys, none_hash
from prefixcache.isolation import exact_key, prune_at
from prefixcache.layout import CHUNKED_LOCAL_ATTENTION, FULL_ATTENTION, MAMBA, NULL_BLOCK, SLIDING_WINDOW
from prefixcache.protocol import Admission, BlockIds, Match, Namespace, PrefixCache, guarded
from prefixcache.requests import Request, RequestTable, check_count, check_namespace, check_priority, check_tokens
from prefixcache.state_cap import replay_victims
from prefixcache.stats import CacheStats, StatsCounter

from .hybrid_radix_native import NativeHybridTree
from .hybrid_radix_tree import Component

__all__ = ["HybridRadixCache", "HYBRID_RADIX_CHOICES", "HYBRID_RADIX_OPTIONS", "MAMBA_FULL_MEMORY_RATIO", "MAMBA_OPTIONS", "SWA_EVICTION_INTERVAL"]

FULL, SWA, STATE = Component.FULL, Component.SWA, Component.MAMBA

HYBRID_RADIX_OPTIONS = {"chunked_prefill_size": 0, "mamba_chunk": 64, "mamba_track_interval": 256, "state_cap": 0,
                        "no_tail_cliff": False}  # fmt: skip
"""Options `radix` takes for a hybrid layout. chunked_prefill_size: TOKENS of a prefill
chunk (SGLang's `--chunked-prefill-size`; 0: the prefill is one extend, as SGLang's -1), a
multiple of block_size; each chunk is allocated when the one before it is committed, and
inserted into the tree then. For a layout with a mamba group (SGLang's defaults):
mamba_chunk: the model's Mamba chunk in TOKENS (FLA's 64 for Qwen3-Next; SGLang's
`mamba_chunk_size`), states are kept every max(mamba_chunk, block_size) tokens;
mamba_track_interval: TOKENS between states tracked while decoding (SGLang's
`--mamba-track-interval`). Beyond SGLang, state_cap: states a request's path keeps when
it is released, the rest evicted least replay first (`prefixcache.state_cap`; 0: off,
SGLang's LRU alone); no_tail_cliff: SWA eviction takes the windows a branch's end reads
last (SGLang PR 35515, open), state eviction each branch's deepest state last, and a leaf
no match can end in (its window or state gone) is evicted with it, so a branch's hit falls
back to its last matchable end instead of to 0 with its KV still cached (`HybridTree`)."""

HYBRID_RADIX_CHOICES = {"no_tail_cliff": (False, True)}
"""The options of HYBRID_RADIX_OPTIONS with a fixed set of values (`option_choices`)."""

MAMBA_OPTIONS = ("mamba_chunk", "mamba_track_interval", "state_cap")
"""The options of HYBRID_RADIX_OPTIONS that only a layout with a mamba group takes."""

MAMBA_FULL_MEMORY_RATIO = 0.9
"""SGLang's default `mamba_full_memory_ratio`: the state pool's size against the KV pool's,
here in blocks (a state taking `Layout.state_blocks`) when the layout gives no `slots`."""

SWA_EVICTION_INTERVAL = 128
"""SGLang's `SGLANG_SWA_EVICTION_INTERVAL`: a decoding request frees its out-of-window SWA
pages once this many TOKENS have slid out."""

_PING_PONG = 2  # SGLang's track slots per request with the overlap schedule (its default)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class HybridRadixRequest(Request):
    """A live request (counts in TOKENS but tables). `block_table` is its FULL pages,
    the tree's below `protected` (SGLang's cache_protected_len), its own above."""

    tree_key: object = None
    prompt_len: int = 0
    swa: list[int] = field(default_factory=list)  # SWA page per FULL page, NULL_BLOCK where none
    states: list[int] = field(default_factory=list)  # Mamba table: the state after (i + 1) pages
    chunk_start: int = 0  # chunked-local tables are NULL_BLOCK below this page
    protected: int = 0
    inserted: int = 0  # SGLang's cache_inserted_len
    receipt: HybridReceipt | None = None
    prefilled: bool = False  # the checkpoint after the prefill has run
    swa_evicted: int = 0  # SWA pages below this TOKEN are freed (SGLang's evicted seqlen)
    swa_branching: int | None = None
    mamba_branching: int | None = None
    decode_steps: int = 0  # SGLang's decode_batch_idx
    running: int | None = None  # Mamba: the running state slot (mamba_pool_idx)
    ping_pong: list[int] = field(default_factory=list)
    next_track: int = 0  # ping-pong index the next tracked state goes to
    last_track: int = 1  # ping-pong index holding the last tracked state
    last_track_len: int | None = None  # TOKENS of the last tracked state (None: none)
    prev_track_len: int | None = None  # TOKENS of the state in the other slot (None: unknown)
    digests: list[bytes] = field(default_factory=list)  # chained hashes of its full pages (events only)
    allocated_to: int = 0  # TOKENS its FULL pages cover
    chunk_ends: list[int] = field(default_factory=list)  # the prefill chunks still to allocate (TOKENS, increasing)
    waiting: bool = False  # the next chunk found no room at the commit that reached it


class _Budget:
    """One of SGLang's pools as a budget on the shared pool: `capacity` blocks, `used` held."""

    __slots__ = ("capacity", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    @property
    def free(self) -> int:
        return self.capacity - self.used


def _size_budgets(num_blocks: int, block_size: int, layout) -> dict[Component, _Budget]:
    """FULL, SWA and Mamba budgets on a pool of `num_blocks` (module docstring);
    ConfigError if one would be empty."""
    out: dict[Component, _Budget] = {}
    rest = num_blocks
    if layout.has_mamba:
        cost = layout.state_blocks(block_size)
        slots = next(g.slots for g in layout if g.kind == MAMBA)
        slots = slots or int(num_blocks * MAMBA_FULL_MEMORY_RATIO / (1 + MAMBA_FULL_MEMORY_RATIO) / cost)
        if not 0 < slots * cost < num_blocks:
            each = f", {cost} blocks each (state_bytes over block_size x bytes_per_token)" if cost > 1 else ""
            raise ConfigError("layout", f"the mamba group's {slots} state slots{each} leave no room in a pool of "
                                        f"{num_blocks} blocks (cache.num_blocks)")  # fmt: skip
        out[STATE] = _Budget(slots)
        rest -= slots * cost  # a state is one pool block; the rest of its bytes are held back
    if any(g.kind == SLIDING_WINDOW for g in layout):
        ratio = next(g.pool_ratio for g in layout if g.kind == SLIDING_WINDOW)
        full = round(rest / (1 + ratio))
        out[SWA] = _Budget(rest - full)
        rest = full
    if rest < 1 or any(b.capacity < 1 for b in out.values()):
        raise ConfigError("num_blocks", f"{num_blocks} blocks split into pools of "
                                        f"{[rest] + [b.capacity for b in out.values()]}: each needs one")  # fmt: skip
    out[FULL] = _Budget(rest)
    return out


class HybridRadixCache(PrefixCache):
    """SGLang 0.5.23's UnifiedRadixCache on a `BlockPool` (module docstring)."""

    name = "radix"
    supports_layout = True
    option_defaults = dict(HYBRID_RADIX_OPTIONS)
    option_choices = dict(HYBRID_RADIX_CHOICES)

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        super().__init__(pool, config)
        self.check_layout(config, self.options)
        layout = config.groups
        bs = self.block_size
        self.layout = layout
        self._kinds = tuple(g.kind for g in layout)
        self._local_chunk = next((g.chunk for g in layout if g.kind == CHUNKED_LOCAL_ATTENTION), None)
        self.window = next((g.window for g in layout if g.kind == SLIDING_WINDOW), None)  # TOKENS a query reads
        self.has_mamba = layout.has_mamba
        chunk, interval = self.options["mamba_chunk"], self.options["mamba_track_interval"]
        self.state_grid = max(chunk, bs)  # mamba_checkpoint_grid: lcm(max(chunk, page), page)
        self.track_grid = math.lcm(self.state_grid, interval)
        self._budgets = _size_budgets(pool.num_blocks, bs, layout)
        components = [FULL] + ([SWA] if self.window else []) + ([STATE] if self.has_mamba else [])
        self._events = event_log(config.enable_events)
        hooks = {"on_store": self._stored, "on_remove": self._removed} if self._events.enabled else {}
        self.tree = NativeHybridTree(bs, components, self._free, window=self.window - 1 if self.window else None,
                               state_grid=self.state_grid, no_tail_cliff=self.options["no_tail_cliff"], **hooks)  # fmt: skip
        self._trims = type(self).usable_hit is not PrefixCache.usable_hit
        self._requests: RequestTable[HybridRadixRequest] = RequestTable()
        self._stats = StatsCounter()
        self._evicting = 0  # > 0 while an eviction walk runs: its frees count as evictions
        self._algorithm = config.hash.algorithm
        self._none_hash = none_hash(self._algorithm, config.hash.seed)
        self._ds = len(self._none_hash)
        self._namespaces: dict[object, Namespace] = {}  # tree key -> namespace (events name it)
        self._namespaces_limit = prune_at(0)

    @classmethod
    def check_layout(cls, config: CacheConfig, options) -> None:
        """What SGLang's unified radix cache builds: one SWA component (one window, one
        pool ratio), one state pool, LRU eviction; the Mamba options sane (module
        docstring); the pools big enough for one page or state each."""
        layout = config.groups
        if config.eviction != "lru":
            raise ConfigError("eviction", f"{config.eviction!r}: a hybrid layout evicts each component in LRU order, "
                                          "as SGLang's unified radix cache; allowed: lru")  # fmt: skip
        windows = {g.window for g in layout if g.kind == SLIDING_WINDOW}
        if len(windows) > 1:
            raise ConfigError("layout", f"sliding_window groups with windows {sorted(windows)}: radix keeps one SWA "
                                        "component, as SGLang (one sliding_window_size); allowed: one window")  # fmt: skip
        ratios = {g.pool_ratio for g in layout if g.kind == SLIDING_WINDOW}
        if len(ratios) > 1:
            raise ConfigError("layout", f"sliding_window groups with pool_ratio {sorted(ratios)}: they share one pool; "
                                        "allowed: one pool_ratio")  # fmt: skip
        states = {g.slots for g in layout if g.kind == MAMBA}
        if len(states) > 1:
            raise ConfigError("layout", f"mamba groups with slots {sorted(states)}: they share one state pool; "
                                        "allowed: one slots value")  # fmt: skip
        bs = config.block_size
        chunk, interval = options["mamba_chunk"], options["mamba_track_interval"]
        chunk_size = options["chunked_prefill_size"]
        if chunk_size < 0 or chunk_size % bs:
            raise ConfigError("options.chunked_prefill_size", f"{chunk_size}: must be 0 (one extend) or a positive "
                                                              f"multiple of block_size {bs} (TOKENS)")  # fmt: skip
        if not layout.has_mamba:
            changed = sorted(k for k in MAMBA_OPTIONS if options[k] != HYBRID_RADIX_OPTIONS[k])
            if changed:
                raise ConfigError(f"options.{changed[0]}", "applies to a cache.layout with a mamba group only")
        elif chunk < 1 or max(chunk, bs) % min(chunk, bs):
            raise ConfigError("options.mamba_chunk", f"{chunk}: must be >= 1 and divide block_size {bs} or be a "
                                                     "multiple of it (SGLang's rule for SSM models)")  # fmt: skip
        elif interval < 1:
            raise ConfigError("options.mamba_track_interval", f"{interval}: must be >= 1 (TOKENS)")
        elif options["state_cap"] < 0:
            raise ConfigError("options.state_cap", f"{options['state_cap']}: must be >= 0 (states a path keeps; 0: off)")
        elif 0 < options["chunked_prefill_size"] < max(chunk, bs):
            # SGLang takes it, but an extend shorter than the state grid tracks no state:
            # no prefill would ever leave one in the tree.
            raise ConfigError("options.chunked_prefill_size", f"{options['chunked_prefill_size']}: with a mamba group "
                              f"must be 0 or >= max(mamba_chunk, block_size) = {max(chunk, bs)} TOKENS, or no prefill "
                              "chunk tracks a state")  # fmt: skip
        _size_budgets(config.num_blocks, bs, layout)

    # -- the pools ------------------------------------------------------------------------
    def _available(self, c: Component) -> int:
        """What component c's pool can hand out now: TOKENS (FULL, SWA), states (Mamba)."""
        free = self._budgets[c].free
        return free if c == STATE else free * self.block_size

    def _take(self, c: Component, n: int) -> list[int]:
        if n <= 0:
            return []
        budget = self._budgets[c]
        assert n <= budget.free, f"{c.name}: {n} blocks passed the room check but only {budget.free} are free"
        blocks = self.pool.allocate(n)
        if blocks is None:
            raise InvariantError(f"radix: the pool has no {n} free blocks for the {c.name} pool's budget")
        budget.used += n
        return blocks

    def _take_pair(self, n: int) -> tuple[list[int], list[int]]:
        """`_take(FULL, n)` then `_take(SWA, n)` in one pool allocation (the same ids)."""
        if n <= 0:
            return [], []
        full, swa = self._budgets[FULL], self._budgets[SWA]
        assert n <= full.free and n <= swa.free, f"{n} blocks each passed the room check but only " \
                                                 f"{full.free} / {swa.free} are free"  # fmt: skip
        blocks = self.pool.allocate(2 * n)
        if blocks is None:
            raise InvariantError(f"radix: the pool has no {2 * n} free blocks for the FULL and SWA pools' budgets")
        full.used += n
        swa.used += n
        return blocks[:n], blocks[n:]

    def _free(self, c: Component, blocks: list[int]) -> None:
        """Blocks back to component c's pool (the tree's callback, and the request side's)."""
        if not blocks:
            return
        self.pool.free(blocks)
        self._budgets[c].used -= len(blocks)
        if self._evicting:
            self._stats.evictions += len(blocks)

    def _evict_for(self, requests: dict[Component, int]) -> None:
        """SGLang's evict_for_alloc: each component's shortfall, walked until its pool can
        serve the allocation (`requests` in TOKENS, states for Mamba)."""
        requests = {c: n for c, n in requests.items() if n > 0}
        if not requests:
            return
        self._evicting += 1
        try:
            # A pool serves once its walk freed its shortfall: what each walk frees comes back
            # to that pool alone, so "reached its target" is "freed what it asked".
            self.tree.evict(requests, reach=requests)
        finally:
            self._evicting -= 1

    def _room_for(self, num_tokens: int, *, swa_freed: int = 0) -> bool:
        """Whether `num_tokens` of new pages fit the FULL and SWA pools once everything
        evictable is evicted (`swa_freed`: SWA TOKENS the caller frees first)."""
        tree = self.tree
        if num_tokens > self._available(FULL) + tree.evictable_size(FULL):
            return False
        return not self.window or num_tokens <= self._available(SWA) + tree.evictable_size(SWA) + swa_freed

    def _make_room(self, num_tokens: int) -> None:
        """The allocator's evict_to_free_tokens: each attention pool's shortfall of `num_tokens`."""
        budgets, bs = self._budgets, self.block_size
        full = num_tokens - budgets[FULL].free * bs
        swa = num_tokens - budgets[SWA].free * bs if self.window else 0
        if full > 0 or swa > 0:  # most decode steps: both pools have the page already
            self._evict_for({FULL: full, SWA: swa} if self.window else {FULL: full})

    # -- look-up --------------------------------------------------------------------------
    def _probe(self, tokens: Sequence[int], namespace: Namespace, tree_key: object) -> HybridMatch:
        """The match of `tokens` (changing nothing), trimmed by `usable_hit`: then the
        match of the tokens cut to the hit it keeps."""
        out = self.tree.probe(tokens, tree_key)
        if self._trims:
            keep = self.checked_usable_hit(tokens, out.num_tokens, namespace)
            if keep < out.num_tokens:
                out = self.tree.probe(tokens[:keep], tree_key)
        return out

    @guarded
    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        toks = check_tokens(tokens, allow_empty=True, itemsize=4)
        namespace = check_namespace(namespace)
        out = self._probe(toks, namespace, exact_key(namespace))
        full = self.tree.hit_pages(out, FULL)
        states = [NULL_BLOCK] * len(full)
        if self.has_mamba and full:
            states[-1] = self.tree.state(out.node)  # type: ignore[assignment]
        table = self._group_view(self._kinds[0], full, self._hit_swa(out), states, self._chunk_start(out.num_tokens))
        return Match(out.num_tokens, tuple(table))

    def _hit_swa(self, out: HybridMatch) -> list[int]:
        """The SWA pages of a hit the first query reads (NULL_BLOCK before its window)."""
        if not self.window:
            return []
        swa = self.tree.hit_pages(out, SWA)
        first = max(0, out.num_tokens - self.window + 1) // self.block_size
        return [NULL_BLOCK] * first + swa[first:]

    # -- request lifecycle ---------------------------------------------------------------
    @guarded
    def admit(
        self, request_id: Hashable, tokens: Sequence[int], *, namespace: Namespace = None, priority: int = 0,
        read_cache: bool = True,
    ) -> Admission | None:
        """`priority` is accepted and ignored (a hybrid layout evicts in LRU order).
        `read_cache` False: hit nothing (protocol rule 1)."""
        check_priority(priority)
        toks = check_tokens(tokens, itemsize=4)  # radix stores int32 ids
        namespace = check_namespace(namespace)
        tree_key = exact_key(namespace)
        self._requests.check_new(request_id)
        bs, n = self.block_size, len(toks)
        # _compute_max_prefix_len: the last prompt token is always computed. A usable_hit
        # that trims the hit cuts the key, so the match splits and locks only that much.
        probe = self._probe(toks[: n - 1 if read_cache else 0], namespace, tree_key)
        hit = probe.num_tokens
        ends = self._chunk_ends(hit, n)
        if len(ends) == 1:  # one extend (most prompts): its track, its checkpoint
            track = self._track_at(hit, n, probe.mamba_branching)
            tracks = [track]
            checkpoints = (track,) if track is not None and track < n else ()
        else:
            tracks = [self._track_at(start, end, probe.mamba_branching) for start, end in zip([hit, *ends], ends)]
            checkpoints = tuple(sorted({*ends[:-1], *(t for t in tracks if t is not None and t < n)}))
        # One native call (csrc/hybrid_radix_admit.h): whether the prompt fits after evicting
        # everything it may (each pool's need against its free plus evictable size, less
        # what locking the hit protects; with Mamba the running slot, the track slots and
        # the state the extend donates); then Req.init_next_round_input's splits and
        # recency, the PrefillAdder's lock, and the pages the tables start from.
        states_needed = 1 + _PING_PONG + (tracks[0] is not None) if self.has_mamba else 0
        budgets = self._budgets
        available = (budgets[FULL].free * bs, budgets[SWA].free * bs if self.window else 0,
                     budgets[STATE].free if self.has_mamba else 0)  # fmt: skip
        got = self.tree.native.admit_hit(probe, n, available, states_needed, self.window or 0)
        if got is None:
            self._stats.rejected += 1
            return None
        m, receipt, full, swa, state = got
        req = HybridRadixRequest(
            request_id, toks, namespace, num_cached_tokens=hit, num_computed=hit, tree_key=tree_key, prompt_len=n,
            protected=hit, swa_branching=m.swa_branching, mamba_branching=m.mamba_branching, receipt=receipt,
        )  # fmt: skip
        # alloc_for_extend: the request's state slots, then the extend's pages.
        if self.has_mamba:
            if state is not None and budgets[STATE].free < 1 + _PING_PONG:
                # Copy-on-write of the matched state: a slot, evicting for one (with the
                # hit locked: the request's lock is held already). With every slot free
                # it is the first of the three taken below, as the pool hands them out.
                req.running = self._state_slot()
            needed = (0 if req.running is not None else 1) + _PING_PONG
            if self._available(STATE) < needed:
                self._evict_for({STATE: needed - self._available(STATE)})
            slots = self._take(STATE, needed)  # the pool hands them out in order: as one, then two
            if req.running is None:
                req.running = slots.pop(0)
            req.ping_pong = slots
            req.next_track, req.last_track = 0, 1
        req.block_table = full
        if self.window:
            req.swa = swa
        if self.has_mamba:
            req.states = [NULL_BLOCK] * (hit // bs)
            if hit:
                req.states[-1] = state  # type: ignore[assignment]
        req.allocated_to, req.chunk_ends = hit, list(ends)
        self._extend(req, tracks[0])
        req.chunk_start = self._chunk_start(hit)
        if tree_key not in self._namespaces and len(self._namespaces) >= self._namespaces_limit:
            self._forget_namespaces()
        self._namespaces[tree_key] = namespace
        self._requests.add(req)
        if read_cache:
            self._stats.record_query(n, hit)
        tables = int32_arrays(BlockIds, self._tables(req))
        return Admission(tables[0], hit, checkpoints=checkpoints, group_tables=tables)

    def _chunk_ends(self, hit: int, n: int) -> list[int]:
        """Where the prefill's extends end (TOKENS, increasing, the last `n`): one extend,
        or with `chunked_prefill_size` SGLang's PrefillAdder with room to spare: a prompt
        whose extend, ceiled to a page, exceeds the size is cut at the size floored to a
        page, then every size TOKENS (`add_chunked_req`)."""
        size = self.options["chunked_prefill_size"]
        if not size or _cdiv(n - hit, self.block_size) * self.block_size <= size:
            return [n]
        ends = [hit + size]  # size is a multiple of the page
        while n - ends[-1] > size:
            ends.append(ends[-1] + size)
        return [*ends, n]

    def _extend(self, req: HybridRadixRequest, track: int | None) -> None:
        """SGLang's alloc_for_extend of the request's next extend, [allocated_to,
        chunk_ends[0]): its pages after evicting the allocator's demand (the extend and a
        page), then the Mamba state that extend tracks at `track` (its `_track_at`; the
        caller checked the room)."""
        bs, start, end = self.block_size, req.allocated_to, req.chunk_ends.pop(0)
        extend = end - start
        self._make_room(extend if bs == 1 else extend + bs)
        own = _cdiv(end, bs) - len(req.block_table)
        if self.window:
            full, swa = self._take_pair(own)
            req.block_table += full
            req.swa += swa
        else:
            req.block_table += self._take(FULL, own)
        if self.has_mamba:
            req.states += [NULL_BLOCK] * own
            if track is not None:  # _mamba_radix_cache_v2_req_prepare_for_extend
                req.last_track, req.next_track = req.next_track, 1 - req.next_track
                req.last_track_len = track
                req.states[track // bs - 1] = req.ping_pong[req.last_track]
        req.allocated_to = end

    def _next_chunk(self, req: HybridRadixRequest) -> bool:
        """The scheduler's next round of a chunked prefill: the next extend if its pages
        fit after evicting everything evictable; False (nothing changed, the request
        waiting) if not."""
        pages = _cdiv(req.chunk_ends[0], self.block_size) - len(req.block_table)
        req.waiting = not self._room_for(pages * self.block_size)
        if not req.waiting:
            self._extend(req, self._track_at(req.allocated_to, req.chunk_ends[0], req.mamba_branching))
        return not req.waiting

    def _track_at(self, hit: int, n: int, branching: int | None) -> int | None:
        """Where the prefill tracks a Mamba state (TOKENS; None: nowhere): the branching
        point if the extend passes it, else the last state-grid position past the hit
        (SGLang's `_mamba_radix_cache_v2_req_prepare_for_extend`, no DCP)."""
        if not self.has_mamba:
            return None
        grid, chunk = self.state_grid, self.options["mamba_chunk"]
        extend = n - hit
        if extend < grid:
            return None
        aligned = hit + extend // grid * grid
        # The kernel reads an aligned state at the extend's end from its last state, else
        # from its chunk states one past it: the branching point must lie before that.
        limit = n if hit + extend // chunk * chunk == aligned else aligned + 1
        if branching is not None and hit < branching < limit and (branching - hit) % grid == 0:
            return branching
        return aligned

    def _chunk_start(self, hit: int) -> int:
        """The page chunked-local tables start at: the chunk of the hit's first query."""
        chunk = self._local_chunk
        return hit // chunk * chunk // self.block_size if chunk is not None else 0

    def _state_slot(self) -> int | None:
        """One Mamba state slot, evicting a state if none is free; None if eviction finds
        none. (SGLang's copy-on-write locks the matched node while it evicts: admit calls
        this holding the request's lock on it.)"""
        if self._available(STATE) < 1:
            self._evict_for({STATE: 1})
        return self._take(STATE, 1)[0] if self._available(STATE) >= 1 else None

    @guarded
    def append(self, request_id: Hashable, tokens: Sequence[int]) -> list[int] | None:
        req = self._requests.get(request_id)
        new = check_tokens(tokens, allow_empty=True, itemsize=4)
        if req.waiting and not self._next_chunk(req):
            self._stats.rejected += 1
            return None
        if not len(new):
            return []
        bs = self.block_size
        held = req.tokens
        before = len(held)
        pages = _cdiv(before + len(new), bs) - len(req.block_table)
        decode = len(new) == 1 and req.prefilled
        # maybe_evict_swa: from the second decode step, once 128 tokens slid out of the window.
        slide = self._out_of_window(req, before, SWA_EVICTION_INTERVAL) if decode and self.window and \
            req.decode_steps >= 1 else None  # fmt: skip
        need = pages * bs
        freed = len(slide[1]) * bs if slide else 0
        if need and not self._room_for(need, swa_freed=freed):
            self._stats.rejected += 1
            return None
        held.extend(new)  # type: ignore[attr-defined]
        if decode:
            # check_decode_mem, then alloc_for_decode: the SWA window slides, a page of room.
            self._make_room(pages * bs)
            self._slide(req, slide)
            self._make_room(bs)
            req.decode_steps += 1
        else:
            # An extend of the tokens without pages: these and any prefill chunk not allocated yet.
            extend = len(held) - req.allocated_to
            self._make_room(extend if bs == 1 else extend + bs)
            req.chunk_ends = []  # the engine chunks the prefill from here (module docstring)
        req.allocated_to = len(held)
        if pages <= 0:  # inside the last page
            blocks = []
        else:
            blocks = self._take(FULL, pages)
            req.block_table.extend(blocks)
            if self.window:
                req.swa.extend(self._take(SWA, pages))
            if self.has_mamba:
                req.states.extend([NULL_BLOCK] * pages)
        if self.has_mamba:
            for pos in range(before, len(held)):
                if req.prefilled and (pos + 1) % self.track_grid == 0:
                    req.states[(pos + 1) // bs - 1] = req.ping_pong[req.next_track]
        return blocks

    @guarded
    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        req = self._requests.get(request_id)
        n = req.check_commit(num_computed_tokens)
        if not req.prefilled:
            # A commit past a chunk's end (a caller that ignored the checkpoints) passes each in order.
            while req.chunk_ends and not req.waiting and req.allocated_to < n:
                self._stash(req)
                if req.waiting:
                    raise RuntimeError(
                        f"commit({request_id!r}, {n}): the prefill passes checkpoint {req.num_computed} and the pools "
                        "have no room for its next chunk; commit at Admission.checkpoints and retry with append(r, [])"
                    )
            if n > req.allocated_to:
                raise RuntimeError(f"commit({request_id!r}, {n}): the next chunk's pages are not allocated yet "
                                   "(append(r, []))")  # fmt: skip
            req.num_computed = n
            if n >= req.prompt_len:  # the checkpoint after the prefill
                req.prefilled = True
                self._checkpoint(req, req.prompt_len, finished=False)
            elif req.chunk_ends and n == req.allocated_to and not req.waiting:
                self._stash(req)
            return
        for length in range(req.num_computed + 1, n + 1):
            if self.has_mamba and length % self.track_grid == 0:
                # The result processor at a track boundary: that step's state is tracked.
                req.last_track = req.next_track
                req.prev_track_len, req.last_track_len = req.last_track_len, length
                req.next_track = 1 - req.next_track
        req.num_computed = n

    @guarded
    def release(self, request_id: Hashable) -> None:
        req = self._requests.get(request_id)
        owned = req.num_computed
        if self.has_mamba and req.last_track_len is not None and req.last_track_len > owned:
            req.last_track_len = None  # the state was never computed (released mid-prefill)
        if req.receipt is not None:
            self._checkpoint(req, owned, finished=True)
        bs = self.block_size
        first = req.protected // bs
        self._free(FULL, req.block_table[first:])
        if self.window:
            self._free(SWA, [b for b in req.swa[first:] if b != NULL_BLOCK])
        if self.has_mamba:
            self._free_states(req, keep=None)
        if req.receipt is not None:
            self.tree.unlock(req.receipt)
            if self.options["state_cap"]:
                self._cap_states(req.receipt.node)
            req.receipt = None
        self._requests.pop(request_id)

    def _cap_states(self, node: HybridNodeRef) -> None:
        """`state_cap`: the states on the path to `node` but the cap's, least replay
        first, never the deepest; a state another request locks stays."""
        states, depth = [], 0
        for n in self.tree.path_nodes(node):
            depth += len(n.key)
            if n.mamba is not None:
                states.append((depth, n))
        victims = [n for n in replay_victims(states, self.options["state_cap"]) if not n.locks[STATE]]
        if victims:
            self._evicting += 1
            try:
                self.tree.drop_states(victims)
            finally:
                self._evicting -= 1

    @guarded
    def block_table(self, request_id: Hashable) -> Sequence[int]:
        return BlockIds(self._tables(self._requests.get(request_id))[0])

    @guarded
    def block_tables(self, request_id: Hashable) -> tuple[Sequence[int], ...]:
        return int32_arrays(BlockIds, self._tables(self._requests.get(request_id)))

    def _tables(self, req: HybridRadixRequest) -> list[list[int]]:
        """Every group's table (the request's own lists: the caller copies them)."""
        full, swa, states, start = req.block_table, req.swa, req.states, req.chunk_start
        return [self._group_view(kind, full, swa, states, start) for kind in self._kinds]

    @staticmethod
    def _group_view(kind: str, full: list[int], swa: list[int], states: list[int], chunk_start: int) -> list[int]:
        """A group's table from the FULL, SWA and state tables (module docstring): one of
        them as it is, or a new list; the caller copies what it hands out."""
        if kind == FULL_ATTENTION:
            return full
        if kind == SLIDING_WINDOW:
            return swa
        if kind == MAMBA:
            return states
        return [NULL_BLOCK] * chunk_start + full[chunk_start:]

    # -- the checkpoint (SGLang's checkpoint_into_tree) --------------------------------------
    def _checkpoint(self, req: HybridRadixRequest, up_to: int, *, finished: bool) -> None:
        """Insert the request's first `up_to` TOKENS as far as its components allow,
        re-point its tables to the tree's pages, move its lock (module docstring)."""
        bs = self.block_size
        length = up_to
        branching = None
        state = keep = None
        if self.window and not self.has_mamba:
            b = req.swa_branching
            if b is not None and b > req.protected and b <= up_to:
                length, branching = b, b
        if self.has_mamba:
            if finished:
                got = self._finished_state(req, up_to)
                length = 0 if got is None else min(length, got[0])
                if got is not None:
                    keep = got[1]
                    state = req.ping_pong[keep]
            elif req.last_track_len is None:
                length = 0
            else:
                slot = self._state_slot()
                if slot is None:
                    length = 0  # no slot for the request's next state: nothing to insert (SGLang asserts)
                else:
                    state = req.ping_pong[req.last_track]
                    req.ping_pong[req.last_track] = slot
                    if req.states[req.last_track_len // bs - 1] == state:
                        req.states[req.last_track_len // bs - 1] = NULL_BLOCK  # the tree's now
                    length = min(length, req.last_track_len)
        if not finished and self.window:
            self._slide(req, self._out_of_window(req, length - 1, 1))
        outcome = None
        if length > 0:
            aligned = length // bs * bs
            if self._events.enabled:
                self._extend_digests(req, aligned // bs)
            outcome = self.tree.insert(
                req.tokens[:aligned], req.tree_key, req.block_table, req.swa if self.window else None,
                prev_prefix_len=req.protected, swa_evicted=req.swa_evicted, swa_branching=branching,
                mamba_value=state, hashes=req.digests if self._events.enabled else None,
            )  # fmt: skip
            self._repoint(req, outcome, aligned)
        self._after_checkpoint(req, outcome, up_to, finished, state, keep)

    def _stash(self, req: HybridRadixRequest) -> None:
        """A prefill chunk ran to `allocated_to`: SGLang's stash_chunked_request (the
        checkpoint there), then the next round allocates the next chunk, if it fits."""
        req.num_computed = req.allocated_to
        self._checkpoint(req, req.allocated_to, finished=False)
        self._next_chunk(req)

    def _finished_state(self, req: HybridRadixRequest, up_to: int) -> tuple[int, int] | None:
        """The state a finished request gives the tree: (TOKENS, ping-pong index), the
        last tracked one if the key reaches it, else the other slot's (SGLang's
        `_select_finished_checkpoint`); None: none to give."""
        length = req.last_track_len or 0
        if length <= up_to:
            return length, req.last_track
        if req.prev_track_len is None or req.prev_track_len > up_to:
            return None
        return req.prev_track_len, 1 - req.last_track

    def _repoint(self, req: HybridRadixRequest, outcome: HybridInsert, aligned: int) -> None:
        """The request's tables after an insert: the tree's pages up to `aligned`, its
        lock on the node the insert ended on."""
        bs = self.block_size
        first, last = req.protected // bs, aligned // bs
        pages = self.tree.path_pages(outcome.node)
        assert len(pages) == last, "an insert's path covers its key"
        req.block_table[first:last] = pages[first:last]
        if self.window:
            req.swa[first:last] = self.tree.path_swa(outcome.node)[first:last]  # NULL_BLOCK in a tombstone
        if self.has_mamba and req.num_cached_tokens:
            req.states[req.num_cached_tokens // bs - 1] = NULL_BLOCK  # the hit's state: read, no longer locked
        assert req.receipt is not None
        self.tree.unlock(req.receipt)
        req.receipt = self.tree.lock(outcome.node)
        req.inserted = max(req.inserted, aligned)
        req.protected = aligned

    def _after_checkpoint(self, req: HybridRadixRequest, outcome: HybridInsert | None, up_to: int,
                          finished: bool, state: int | None, keep: int | None) -> None:  # fmt: skip
        """The components' cleanup_after_caching_req (`up_to`: TOKENS the request has filled)."""
        if self.window and outcome is not None and outcome.swa_branch_inserted:
            req.swa_branching = None
            if not finished:
                self._slide(req, self._out_of_window(req, up_to - 1, 1))
        if not self.has_mamba:
            return
        taken = outcome is not None and not outcome.mamba_exist
        if finished:
            self._free_states(req, keep=keep if taken else None)
            return
        if state is not None and (outcome is None or outcome.mamba_exist):
            self._free(STATE, [state])
        req.last_track_len = req.prev_track_len = None

    def _free_states(self, req: HybridRadixRequest, keep: int | None) -> None:
        """HybridReqToTokenPool.free_mamba_cache: the running slot and the track slots
        but `keep` (given to the tree)."""
        slots = [s for i, s in enumerate(req.ping_pong) if i != keep]
        if req.running is not None:
            slots.insert(0, req.running)
        self._free(STATE, slots)
        req.running = None
        req.ping_pong = []
        req.states = [NULL_BLOCK] * len(req.states)

    # -- the sliding window (free_swa_out_of_window_slots) --------------------------------
    def _out_of_window(self, req: HybridRadixRequest, pre_len: int, interval: int) -> tuple[int, list[int]] | None:
        """Where the request's SWA floor moves (TOKENS) and the pages of its own SWA that
        slid out of the window of its query at `pre_len`, once `interval` TOKENS have;
        None: nothing moves. Pure: `_slide` applies it."""
        bs = self.block_size
        w = self.window - 1  # type: ignore[operator]
        if pre_len - w < req.swa_evicted + interval:
            return None
        floor = max(req.swa_evicted, req.protected)
        threshold = pre_len - _cdiv(max(w, bs), bs) * bs
        if self.has_mamba and req.last_track_len is not None:
            threshold = min(threshold, req.last_track_len - w)  # swa_retain_floor: keep the window behind the state
        new = max(floor, threshold) // bs * bs
        if new <= floor:
            return floor, []
        return new, list(range(floor // bs, new // bs))

    def _slide(self, req: HybridRadixRequest, slide: tuple[int, list[int]] | None) -> None:
        if slide is None:
            return
        floor, pages = slide
        self._free(SWA, [req.swa[i] for i in pages if req.swa[i] != NULL_BLOCK])
        for i in pages:
            req.swa[i] = NULL_BLOCK
        req.swa_evicted = floor

    # -- maintenance ----------------------------------------------------------------------
    @guarded
    def evict(self, num_blocks: int) -> int:
        """SGLang's evict(num_tokens): FULL leaves, least recently used first, with what
        they carry; returns blocks freed in every pool."""
        num_blocks = check_count(num_blocks, "num_blocks")
        before = self._stats.evictions
        self._evicting += 1
        try:
            self.tree.evict({FULL: min(num_blocks, self.pool.num_blocks) * self.block_size})
        finally:
            self._evicting -= 1
        return self._stats.evictions - before

    @guarded
    def reset(self) -> bool:
        if len(self._requests):
            return False
        for node in self.tree.nodes():
            if node is self.tree.root:
                continue
            self._free(FULL, list(node.full or ()))
            if node.swa is not None:
                self._free(SWA, list(node.swa))
            if node.mamba is not None:
                self._free(STATE, [node.mamba])
        self.tree.reset()
        self._namespaces.clear()
        self._stats.reset()
        self._events.record(AllBlocksCleared())
        return True

    @guarded
    def stats(self) -> CacheStats:
        self._stats.events_dropped = self._events.dropped
        return self._stats.snapshot()

    @guarded
    def drain_events(self) -> list[KVEvent]:
        return self._events.drain()

    # -- events ---------------------------------------------------------------------------
    def _extend_digests(self, req: HybridRadixRequest, num_pages: int) -> None:
        have = len(req.digests)
        if have >= num_pages:
            return
        bs, ds = self.block_size, self._ds
        later = namespace_extra_keys(req.namespace, first_block=False)
        packed = chain_digests(
            req.tokens[have * bs : num_pages * bs], bs, self._algorithm, req.digests[-1] if have else self._none_hash,
            later if have else namespace_extra_keys(req.namespace), later,
        )  # fmt: skip
        req.digests.extend(packed[i : i + ds] for i in range(0, len(packed), ds))

    def _groups_of(self, c: Component) -> list[int]:
        kinds = {FULL: (FULL_ATTENTION, CHUNKED_LOCAL_ATTENTION), SWA: (SLIDING_WINDOW,), STATE: (MAMBA,)}[c]
        return [g for g, group in enumerate(self.layout) if group.kind in kinds]

    def _stored(self, event: tuple) -> None:
        """BlockStored for the pages a native store event names, each group of its component."""
        _, _, c, _, _, hashes, parent, depth, tokens, ns = event
        namespace = self._namespaces.get(self.tree.ns_key(ns))
        lora_id, lora_name = event_lora(namespace)
        extra = tuple(
            event_extra_keys(namespace_extra_keys(namespace, first_block=depth + i == 0)) for i in range(len(hashes))
        )
        bs = self.block_size
        for g in self._groups_of(Component(c)):
            group = self.layout[g]
            self._events.record(BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=bs,
                lora_id=lora_id, lora_name=lora_name, extra_keys=extra, group_idx=g, kv_cache_spec_kind=group.kind,
                kv_cache_spec_sliding_window=group.window if group.kind == SLIDING_WINDOW else None,
            ))  # fmt: skip

    def _removed(self, event: tuple) -> None:
        hashes = event[5]
        for g in self._groups_of(Component(event[2])):
            self._events.record(BlockRemoved(block_hashes=hashes, group_idx=g))

    def _forget_namespaces(self) -> None:
        """Drop the tree keys no node and no live request has, so the table follows what
        the tree holds (a scan of the root's children, amortized: the limit doubles past
        what stays)."""
        kept = self.tree.namespaces() | {r.tree_key for r in self._requests}
        self.tree.keep_namespaces(kept)
        self._namespaces = {k: ns for k, ns in self._namespaces.items() if k in kept}
        self._namespaces_limit = prune_at(len(self._namespaces))

    # -- invariants -----------------------------------------------------------------------
    @guarded
    def check_invariants(self) -> None:
        def fail(msg: str) -> None:
            raise InvariantError(f"radix (hybrid): {msg}")

        self.pool.check_invariants()
        try:
            self.tree.check_invariants([r.receipt for r in self._requests if r.receipt is not None])
        except AssertionError as err:
            fail(str(err))
        bs = self.block_size
        held = {c: [] for c in self._budgets}  # type: dict[Component, list[int]]
        for node in self.tree.nodes():
            if node is self.tree.root:
                continue
            held[FULL] += node.full  # type: ignore[operator]
            if node.swa is not None:
                held[SWA] += node.swa
            if node.mamba is not None:
                held[STATE].append(node.mamba)
        tree_blocks = {c: set(v) for c, v in held.items()}
        for r in self._requests:
            rid = r.request_id
            if len(r.block_table) != _cdiv(r.allocated_to, bs) or r.allocated_to != len(r.tokens) and not r.chunk_ends:
                fail(f"request {rid!r} has {len(r.block_table)} FULL pages for {len(r.tokens)} tokens "
                     f"({r.allocated_to} allocated)")  # fmt: skip
            if r.protected % bs or r.protected > r.num_computed and r.prefilled:
                fail(f"request {rid!r} protects {r.protected} tokens")
            first = r.protected // bs
            shared = r.block_table[:first]
            if any(b not in tree_blocks[FULL] for b in shared):
                fail(f"request {rid!r}: its first {r.protected} tokens are not the tree's pages")
            held[FULL] += r.block_table[first:]
            if self.window:
                if len(r.swa) != len(r.block_table):
                    fail(f"request {rid!r}: {len(r.swa)} SWA entries for {len(r.block_table)} pages")
                held[SWA] += [b for b in r.swa[first:] if b != NULL_BLOCK]
                if any(b != NULL_BLOCK for b in r.swa[first : r.swa_evicted // bs]):
                    fail(f"request {rid!r} holds SWA pages below its window floor {r.swa_evicted}")
            if self.has_mamba:
                held[STATE] += ([r.running] if r.running is not None else []) + r.ping_pong
        total = 0
        for c, blocks in held.items():
            if len(set(blocks)) != len(blocks):
                fail(f"a {c.name} block is held twice")
            if len(blocks) != self._budgets[c].used:
                fail(f"{c.name} pool: {self._budgets[c].used} blocks used, {len(blocks)} held")
            if self._budgets[c].used > self._budgets[c].capacity:
                fail(f"{c.name} pool over its budget")
            total += len(blocks)
        every = [b for blocks in held.values() for b in blocks]
        if len(set(every)) != len(every):
            fail("a block is held by two pools")
        for b in every:
            if self.pool.ref_count(b) != 1:
                fail(f"block {b} has {self.pool.ref_count(b)} references, expected 1 (its one owner)")
        if self.pool.num_pinned != total:
            fail(f"{self.pool.num_pinned} blocks pinned but the tree and live requests hold {total}")


__all__ += ["HybridRadixRequest"]
