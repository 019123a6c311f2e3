"""The `hash` strategy over a hybrid layout: vLLM 0.33's hybrid KV cache manager.

Owns `HybridHashCache`, which `HashCache` builds when `cache.layout` has a group that is
not full attention: every group on the one shared `BlockPool`, each with its own block
table per request and its own rules (`backends.hybrid_groups`, vLLM's single-type
managers), and the coordination vLLM's `HybridKVCacheCoordinator` and `KVCacheManager`
do around them. vLLM's names in brackets:

  admit    Hash the prompt's full blocks once [Request.block_hashes]. The hit is
           reconciled over the groups [find_longest_cache_hit] in one native call
           (`_C.HybridHitFinder`; `_reconcile` is its Python definition): groups of one spec
           are looked up together, full attention first (its left-to-right run is the
           first bound), and each other group accepts the candidate length or lowers
           it, until no group lowers it (one pass when the layout is full attention
           plus one other kind). A sliding-window group needs the
           ceil((window - 1) / block_size) blocks before the cut; a mamba group the
           state block that ends on it. When full attention hit further than the
           reconciled hit, that length is a shared-prefix junction the sparse groups
           have not cached yet [shared_prefix_boundary]. The prefill is split the way
           vLLM's scheduler splits a Mamba prefill [_mamba_block_aligned_split]: a
           chunk ends at the last block boundary before the prompt's last token and
           at the junction, floored to a block; those positions are
           `Admission.checkpoints`. Room is checked for the whole prompt, then for the
           first chunk [allocate_slots, full_sequence_must_fit]; a refusal is None
           and changes nothing. Then every group pins its hit blocks (NULL_BLOCK for
           those it skips) before any group allocates, and each group allocates the
           first chunk's blocks (a mamba group: one, the state the chunk ends on).
           With the built-in managers the room check, pins and allocation are one
           native call (`_C.HybridAdmitter`); `_needed`, `add_hit` and `_allocate`
           are its Python definition, which a subclass's own managers run.
  commit   Full blocks up to the commit are keyed, group by group, where the group
           keeps them [cache_blocks]: full and chunked-local attention every block;
           sliding window and mamba only the window tail or the state at a reachable
           boundary (the replay point len(prompt) - 1 and the junction; vLLM's default
           `prefix_cache_retention_interval` 0), or every block with `retention:
           dense`. A commit that reaches a checkpoint frees what the groups no longer
           read [remove_skipped_blocks] and allocates the next chunk, as vLLM's next
           scheduler step does; without room the request waits, and `append(r, [])`
           retries.
  append   Free what no query reads any more (outside a window, a superseded state),
           then allocate for the new tokens [allocate_slots of a decode step]. A
           refusal (None) has still freed those blocks, as vLLM's does. A step that
           would free nothing (the built-in kinds say how far: `quiet_until`) and fits
           the last block only extends the tokens.
  release  Each group frees its table in reverse, NULL_BLOCKs skipped [free].

Block ids are vLLM's minus one (the pool has no null block). Events are vLLM's, one
`BlockStored` per group per commit that caches (only the blocks the group keeps, the
parent hash and token ids of the whole range, `group_idx`, `kv_cache_spec_kind`,
`kv_cache_spec_sliding_window`), one `BlockRemoved` per dropped key with its group.
Eviction is the pool's free queue (LRU, vLLM). What our engine adds to vLLM's order is
that keys enter the index at `commit`, after the KV is written, where vLLM keys them
when it schedules the chunk: with one request at a time the pool sees the same calls
in the same order.

Must never: be used for a full-attention-only layout (`HashCache` is, unchanged), or
change anything when `admit` refuses.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from prefixcache._C import BlockPool, HybridAdmitter, HybridHitFinder, InvariantError
from prefixcache.config import CRYPTOGRAPHIC, CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.events import BlockStored, event_log
from prefixcache.evictors import FreeQueueEvictor
from prefixcache.hashing import none_hash
from prefixcache.layout import FULL_ATTENTION, MAMBA, NULL_BLOCK, SLIDING_WINDOW
from prefixcache.protocol import Admission, BlockIds, Match, Namespace, guarded
from prefixcache.requests import Request, RequestTable, check_namespace, check_priority, check_tokens
from prefixcache.state_cap import replay_victims
from prefixcache.stats import StatsCounter

from .hash_base import HashCacheBase, stored_event
from .hybrid_groups import (
    FullAttentionGroup,
    GroupManager,
    GroupState,
    Lookup,
    MambaGroup,
    admitter,
    hit_finder,
    make_group,
    quiet_until,
)

__all__ = ["HybridHashCache", "HybridRequest", "HitPlan", "HYBRID_OPTIONS", "HYBRID_CHOICES", "RETENTION"]

RETENTION = ("sparse", "dense")
"""`options: {retention: ...}`: sparse (vLLM 0.33's default `prefix_cache_retention_interval`
0: a window tail or a state only at a reachable boundary) or dense (vLLM's None: every
block; with `state_interval` a state every so many tokens)."""

HYBRID_OPTIONS = {"retention": "sparse", "state_interval": 0, "no_tail_cliff": False, "state_granule": 0, "state_cap": 0}
"""Options `hash` takes for a hybrid layout only (defaults: vLLM 0.33). state_interval:
TOKENS, a multiple of block_size (0: none): the prefill also ends a chunk every that many
tokens, so a mamba state exists there to keep (`retention: dense` keeps it).
no_tail_cliff: a cached window or state block a request stopped reading (freed while it
decoded, so older in the LRU than the rest of its branch) is freed again at the
request's release, after its full-attention blocks: the branch's window tail is evicted
after the full KV it completes, so its hit never falls from the whole branch to 0 while
that KV is resident (vLLM evicts the tail first).
state_granule: TOKENS, a proper divisor of block_size (0: the block): keep mamba states
that much finer than the block (`backends.hybrid_fine`).
state_cap: states (0: no cap) a request's path keeps cached per mamba group once it is
released: the others are evicted at once, those that save the least replay first (a
state's replay length is the TOKENS between it and the next cached state before it on
the path, what a hit there would recompute without it); the deepest always stays."""


HYBRID_CHOICES = {
    "retention": RETENTION,
    "no_tail_cliff": (False, True),
    "state_granule": (0, 1, 2, 4, 8, 16, 32, 64, 128, 256),
}
"""The hybrid options with a fixed set of values (`option_choices`); a state_granule
must also divide block_size."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class HitPlan:
    """A reconciled hit (`HybridHashCache._find_hit`).

    blocks:   per group, the hit's blocks (NULL_BLOCK where the group holds none): lists,
              or the native finder's `HitRows` (a row read is a new list; the native
              admitter takes them back unconverted)
    length:   the hit, TOKENS
    junction: a shared prefix beyond the hit that full attention found, TOKENS (0: none)
    sources:  per group, the cached block whose head the request's block at index
              length // block_size copies (`Admission.copies`), NULL_BLOCK for none;
              empty when the hit is whole blocks (always, at vLLM's defaults)
    granules: packed digests of the prompt's granules, for a cache that keeps states
              finer than the block (empty otherwise)
    """

    blocks: Sequence[list[int]]
    length: int
    junction: int = 0
    sources: tuple[int, ...] = ()
    granules: bytes = b""


@dataclass(eq=False)
class HybridRequest(Request):
    """A live request of the hybrid `hash` cache (counts in TOKENS but `groups`).

    digests:      its full blocks' chained hashes, packed (extended as commits cover
                  appended blocks)
    num_prompt:   prompt TOKENS at admission
    groups:       per layout group, its table and bookkeeping (`GroupState`)
    junction:     shared-prefix junction found at admission, 0 if none (vLLM
                  `shared_prefix_boundary`)
    chunk_ends:   the prefill chunks' ends still to allocate (TOKENS, increasing; the
                  last is the prompt's end)
    allocated_to: TOKENS the tables were last allocated for
    waiting:      a chunk's blocks found no room at the commit that reached it
    quiet_to:     up to this num_computed (TOKENS) no group frees a block, as found by
                  the last `_remove_skipped` since a table last grew (-1: look)
    keyed_blocks: full blocks up to which every block-keyed group's num_cached reaches
    """

    digests: bytearray = field(default_factory=bytearray)
    num_prompt: int = 0
    groups: list[GroupState] = field(default_factory=list)
    junction: int = 0
    chunk_ends: list[int] = field(default_factory=list)
    allocated_to: int = 0
    waiting: bool = False
    retired: list[tuple[int, bytes]] = field(default_factory=list)  # no_tail_cliff: (block, key) freed early
    sources: list[int] = field(default_factory=list)  # copy sources pinned until the first commit
    granules: bytearray = field(default_factory=bytearray)  # finer states: packed granule digests
    quiet_to: int = -1  # TOKENS: up to this num_computed no group frees a block (`quiet_until`)
    keyed_blocks: int = 0  # full blocks every block-keyed group has offered to the index


class HybridHashCache(HashCacheBase):
    """vLLM 0.33's hybrid KV cache manager on a `BlockPool` (module docstring)."""

    name = "hash"
    supports_layout = True
    option_defaults = {"verify_hits": "auto", **HYBRID_OPTIONS}
    option_choices = {"verify_hits": ("auto", "always", "never"), **HYBRID_CHOICES}

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        super().__init__(pool, config)
        layout = config.groups
        if config.eviction != "lru":
            raise ConfigError("eviction", f"{config.eviction!r}: a hybrid layout evicts in the free queue's LRU order, as vLLM; allowed: lru")
        verify = self.options["verify_hits"]
        if verify == "always" or (verify == "auto" and config.hash.algorithm not in CRYPTOGRAPHIC):
            raise ConfigError(
                "hash.algorithm",
                f"{config.hash.algorithm} with options.verify_hits {verify}: a hybrid layout trusts its hits; "
                f"use {' or '.join(CRYPTOGRAPHIC)}, or verify_hits: never",
            )
        interval = self.options["state_interval"]
        step = self.options["state_granule"] or self.block_size
        if interval < 0 or interval % step:
            raise ConfigError("options.state_interval", f"{interval} is not a multiple of block_size {self.block_size} (TOKENS; 0: none)")
        self.layout = layout
        self.dense = self.options["retention"] == "dense"
        self.no_tail_cliff = self.options["no_tail_cliff"]
        self.state_interval = interval
        self.state_cap = self.options["state_cap"]
        if self.state_cap < 0:
            raise ConfigError("options.state_cap", f"{self.state_cap}: states per path, an integer >= 0 (0: no cap)")
        self._algorithm = config.hash.algorithm
        self._none_hash = none_hash(self._algorithm, config.hash.seed)
        self._digest_size = len(self._none_hash)
        self.managers: tuple[GroupManager, ...] = tuple(make_group(g, i, pool, self.block_size) for i, g in enumerate(layout))
        self._lookup = Lookup(pool, self._digest_size)
        # vLLM `verify_and_split_kv_cache_groups`: groups of one spec are looked up
        # together; full attention first (its run bounds the others), else layout order.
        specs: dict[tuple, list[int]] = {}
        for i, g in enumerate(layout):
            specs.setdefault(g.spec, []).append(i)
        order = sorted(specs.values(), key=lambda ids: layout[ids[0]].kind != FULL_ATTENTION)
        self._spec_groups: tuple[tuple[int, ...], ...] = tuple(tuple(ids) for ids in order)
        self._simple = len(order) == 2 and layout[order[0][0]].kind == FULL_ATTENTION
        self._hit_finder: tuple = ()  # (managers, spec groups, single pass, finder) it was built for
        self._admitter: tuple = ()  # (managers, admitter, which are mamba groups) it was built for
        # A new request's room check, hit pins and first allocation are one native call
        # where they are the built-in managers' and this class's own (`admitter`).
        self._admits_natively = self._keeps("_needed", "_allocate", "_take")
        # A decode step that frees and allocates nothing skips the groups' calls where
        # freeing, counting and allocating are this class's own (`append`).
        self._quiet_steps = self._keeps("_remove_skipped", "_needed", "_allocate")
        self._split = layout.has_mamba  # vLLM's need_mamba_block_aligned_split
        self._requests: RequestTable[HybridRequest] = RequestTable()
        self._events = event_log(config.enable_events)
        self._evictor = FreeQueueEvictor(pool)
        self._stats = StatsCounter()
        self._evicted_at_reset = pool.num_evicted

    @property
    def _block_keyed(self) -> tuple[GroupManager, ...]:
        """The groups `_cache` keys at the block: every group at vLLM's defaults."""
        return self.managers

    # -- look-up --------------------------------------------------------------------
    def _find_hit(self, tokens: Sequence[int], namespace: Namespace, digests: bytes, max_length: int) -> HitPlan:
        """vLLM `HybridKVCacheCoordinator.find_longest_cache_hit`: per-group hit blocks,
        the reconciled hit of at most `max_length` TOKENS and the shared prefix full
        attention found beyond it (the junction). Native (`hit_finder`) when every
        manager is a built-in kind, else `_reconcile`."""
        finder = self.hit_finder
        if finder is None:
            return self._reconcile(digests, max_length)
        length, junction, rows = finder.find(self.pool, digests, max_length)
        return HitPlan(rows, length, junction)

    @property
    def hit_finder(self) -> HybridHitFinder | None:
        """The native `_reconcile` of the current managers and spec groups (built again if
        a subclass replaced them); None when a manager is not a built-in kind."""
        built = self._hit_finder
        if not built or built[0] is not self.managers or built[1] is not self._spec_groups or built[2] != self._simple:
            finder = hit_finder(self.managers, self._spec_groups, self._simple, self._digest_size)
            built = self._hit_finder = (self.managers, self._spec_groups, self._simple, finder)
        return built[3]

    def _keeps(self, *names: str) -> bool:
        """Whether this object's class runs these methods as HybridHashCache defines them
        (a subclass that replaces one runs the Python definitions, not their shortcuts)."""
        return all(getattr(type(self), name) is getattr(HybridHashCache, name) for name in names)

    @property
    def admitter(self) -> HybridAdmitter | None:
        """The native admission of the current managers (built again if a subclass
        replaced them); None when a manager is not a built-in kind, or a subclass
        replaced how this class counts, allocates or takes blocks."""
        if not self._admits_natively:
            return None
        built = self._admitter
        if not built or built[0] is not self.managers:
            mamba = tuple(isinstance(m, MambaGroup) for m in self.managers)
            built = self._admitter = (self.managers, admitter(self.managers), mamba)
        return built[1]

    def _reconcile(self, digests: bytes, max_length: int) -> HitPlan:
        """`_find_hit` in Python, group by group: the definition the native finder
        (csrc/hybrid_hit.h) follows, and what a cache whose managers are not the
        built-in kinds runs."""
        num_groups = len(self.managers)
        hit_length = max_length
        longest = 0
        blocks: list[list[int] | None] = [None] * num_groups
        lengths = [0] * num_groups
        while True:
            curr = hit_length
            for ids in self._spec_groups:
                first = ids[0]
                manager = self.managers[first]
                if isinstance(manager, FullAttentionGroup) and blocks[first] is not None:
                    curr = min(curr, lengths[first])  # downward-closed: trim, never look up again
                    continue
                found, curr = manager.find_hit(digests, self._digest_size, curr, ids, self._lookup)
                for g, row in zip(ids, found):
                    blocks[g] = row
                    lengths[g] = curr
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self._simple:
                break
        keep = _cdiv(hit_length, self.block_size)
        for g, manager in enumerate(self.managers):
            if isinstance(manager, FullAttentionGroup) and blocks[g] is not None:
                del blocks[g][keep:]  # type: ignore[index]
        rows = [row if row is not None else [] for row in blocks]
        return HitPlan(rows, hit_length, longest if longest > hit_length else 0)

    @guarded
    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        tokens = check_tokens(tokens, allow_empty=True)
        namespace = check_namespace(namespace)
        plan = self._find_hit(tokens, namespace, self._prompt_digests(tokens, namespace), len(tokens))
        blocks = plan.blocks[0][: plan.length // self.block_size]
        return Match(plan.length, (*blocks, plan.sources[0]) if plan.sources else tuple(blocks))

    # -- request lifecycle ------------------------------------------------------------
    @guarded
    def admit(
        self, request_id: Hashable, tokens: Sequence[int], *, namespace: Namespace = None, priority: int = 0,
        read_cache: bool = True,
    ) -> Admission | None:
        """`priority` is accepted and ignored (a hybrid layout evicts in LRU order).
        `read_cache` False: hit nothing (protocol rule 1)."""
        check_priority(priority)
        tokens = check_tokens(tokens)
        namespace = check_namespace(namespace)
        self._requests.check_new(request_id)
        digests = self._prompt_digests(tokens, namespace)
        n = len(tokens)
        plan = self._find_hit(tokens, namespace, digests, n - 1 if read_cache else 0)
        hit_blocks, hit, junction = plan.blocks, plan.length, plan.junction
        ends = self._chunk_ends(hit, n, junction)

        def new_request(groups: list[GroupState]) -> HybridRequest:
            return HybridRequest(
                request_id, tokens, namespace, num_cached_tokens=hit, num_computed=hit, digests=bytearray(digests),
                num_prompt=n, groups=groups, junction=junction, granules=bytearray(plan.granules),
            )  # fmt: skip

        sources = [b for b in plan.sources if b != NULL_BLOCK] if plan.sources else []
        native = self.admitter if not sources else None
        if native is not None:  # the Python below, in one call
            got = native.admit(self.pool, hit_blocks, hit, n, ends[0], self.pool.num_free)
            if got is None:
                self._stats.rejected += 1
                return None
            tables, cached, last_states, took = got
            if took:
                self._record_removed(self.pool.last_removed())
            # A mamba group's allocate marks its state allocated, whatever it took.
            request = new_request([GroupState(t, c, s, 0, mamba) for t, c, s, mamba
                                   in zip(tables, cached, last_states, self._admitter[2])])  # fmt: skip
            request.allocated_to = ends[0]
        else:
            hit_blocks = [list(row) for row in hit_blocks]  # a native find's rows, converted once
            request = new_request([GroupState() for _ in self.managers])
            # vLLM allocate_slots(full_sequence_must_fit=True): the whole prompt must fit, then its first chunk.
            free = self.pool.num_free - (self.pool.count_free(sources) if sources else 0)
            if self._needed(request, n, hit_blocks, hit) > free or (
                ends[0] < n and self._needed(request, ends[0], hit_blocks, hit) > free
            ):
                self._stats.rejected += 1
                return None
            if sources:  # pinned before any allocation, so none can take them
                self.pool.touch(sources)
                request.sources = sources
            for manager, state, row in zip(self.managers, request.groups, hit_blocks):
                if hit:  # vLLM adds computed blocks only when some group hit
                    manager.add_hit(state, row, hit)
            self._allocate(request, ends[0])
        request.chunk_ends = ends[1:]
        self._requests.add(request)
        if read_cache:
            self._stats.record_query(n, hit)
        tables = tuple([BlockIds(s.table) for s in request.groups])
        copies = ()
        if sources:
            i = hit // self.block_size
            copies = tuple((src, s.table[i], hit % self.block_size) for src, s in zip(plan.sources, request.groups) if src != NULL_BLOCK)
        return Admission(tables[0], hit, copies, checkpoints=tuple(ends[:-1]), group_tables=tables)

    def _chunk_ends(self, start: int, prompt_end: int, junction: int) -> list[int]:
        """Where the prefill's chunks end (TOKENS), the last at the prompt's end: vLLM's
        scheduler's `_mamba_block_aligned_split` with an unbounded token budget (no
        EAGLE, hash block = block, no prefill-checkpoint blocks), plus every
        `state_interval` tokens with that option."""
        if not self._split:
            return [prompt_end]
        bs = self.state_tokens  # the block, unless states are kept finer
        interval = self.state_interval
        last_cache = (prompt_end - 1) // bs * bs
        ends = []
        while start < prompt_end:
            # The nearest stop past `start` of: the next boundary (from mid-block), the
            # last boundary before the prompt's last token, the junction floored to a
            # block, the next interval.
            end = prompt_end
            if start % bs:
                end = min(end, (start // bs + 1) * bs)
            if start < last_cache < end:
                end = last_cache
            if start < junction < prompt_end:
                stop = start + (junction - start) // bs * bs
                if start < stop < end:
                    end = stop
            if interval:
                end = min(end, (start // interval + 1) * interval)
            ends.append(end)
            start = end
        return ends

    def _needed(self, request: HybridRequest, num_tokens: int, hit_blocks: list[list[int]], hit: int) -> int:
        """vLLM `get_num_blocks_to_allocate` summed over the groups (a mamba group's
        count may be negative, and is summed as it is)."""
        return sum(
            m.blocks_needed(s, num_tokens, row, hit)
            for m, s, row in zip(self.managers, request.groups, hit_blocks)
        )

    def _allocate(self, request: HybridRequest, num_tokens: int) -> None:
        """Grow every group's table to `num_tokens` TOKENS (room was checked)."""
        grew = False
        for manager, state in zip(self.managers, request.groups):
            grew |= bool(manager.allocate(state, num_tokens, self._take))
        request.allocated_to = num_tokens
        if grew:  # a mamba group's previous state moved: the next step looks again
            request.quiet_to = -1

    def _take(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        assert blocks is not None, "caller checked the pool has room"
        self._record_removed(self.pool.last_removed())
        return blocks

    def _free(self, blocks: list[int]) -> None:
        self.pool.free(blocks)

    def _remove_skipped(self, request: HybridRequest, num_computed: int) -> None:
        free = self._free
        if self.no_tail_cliff:

            def free(blocks: list[int]) -> None:
                request.retired.extend((b, key) for b in blocks if (key := self.pool.key(b)) is not None)
                self.pool.free(blocks)

        for manager, state in zip(self.managers, request.groups):
            manager.remove_skipped(state, num_computed, free)
        if self._quiet_steps:
            request.quiet_to = quiet_until(self.managers, num_computed)

    def _next_chunk(self, request: HybridRequest) -> bool:
        """vLLM's next scheduler step of a split prefill: free what no query reads,
        then allocate the next chunk; False (the frees done, nothing allocated) without room."""
        self._remove_skipped(request, request.num_computed)
        end = request.chunk_ends[0]
        if self._needed(request, end, [[]] * len(self.managers), request.num_computed) > self.pool.num_free:
            request.waiting = True
            return False
        self._allocate(request, end)
        request.chunk_ends.pop(0)
        request.waiting = False
        return True

    @guarded
    def append(self, request_id: Hashable, tokens: Sequence[int]) -> list[int] | None:
        request = self._requests.get(request_id)
        new = check_tokens(tokens, allow_empty=True)
        if request.waiting and not self._next_chunk(request):
            self._stats.rejected += 1
            return None
        if not len(new):
            return []
        held = request.tokens
        if isinstance(held, array) and not isinstance(new, array):
            # Ids beyond int64 (CBOR bignums): the request keeps its ids as ints from now on.
            held = request.tokens = held.tolist()
        before = len(held)
        total, bs = before + len(new), self.block_size
        if request.num_computed <= request.quiet_to and not request.chunk_ends and (
            _cdiv(total, bs) <= _cdiv(request.allocated_to, bs)
        ):
            # A decode step inside the last block that no group frees at: the steps
            # below would free nothing, need nothing and allocate nothing.
            held.extend(new)  # type: ignore[attr-defined]
            request.allocated_to = total
            return []
        held.extend(new)  # type: ignore[attr-defined]
        before_blocks = len(request.groups[0].table)
        self._remove_skipped(request, request.num_computed)
        if self._needed(request, len(held), [[]] * len(self.managers), request.num_computed) > self.pool.num_free:
            del held[before:]  # type: ignore[attr-defined]
            self._stats.rejected += 1
            return None
        self._allocate(request, len(held))
        return request.groups[0].table[before_blocks:]

    @guarded
    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        request = self._requests.get(request_id)
        n = request.check_commit(num_computed_tokens)
        if request.sources:  # the engine has copied their heads by now
            self.pool.free(request.sources)
            request.sources = []
        # A commit past a checkpoint (a caller that ignored them) passes each in order.
        while request.chunk_ends and not request.waiting and request.allocated_to < n:
            self._cache(request, request.allocated_to)
            request.num_computed = request.allocated_to
            if not self._next_chunk(request):
                raise RuntimeError(
                    f"commit({request_id!r}, {n}): the prefill passes checkpoint {request.num_computed} and the pool "
                    "has no room for its next chunk; commit at Admission.checkpoints and retry with append(r, [])"
                )
        if n > request.allocated_to and request.waiting:
            raise RuntimeError(f"commit({request_id!r}, {n}): the next chunk's blocks are not allocated yet (append(r, []))")
        self._cache(request, n)
        request.num_computed = n
        if request.chunk_ends and n == request.allocated_to and not request.waiting:
            self._next_chunk(request)

    def _cache(self, request: HybridRequest, num_tokens: int) -> None:
        """vLLM `cache_blocks`: each group keys its full blocks up to `num_tokens`
        where it keeps them."""
        bs, ds = self.block_size, self._digest_size
        num_full = num_tokens // bs
        if num_full <= request.keyed_blocks:
            return  # every group has offered these (a decode step inside a block)
        self._extend_chain(request.digests, request.tokens, num_full, request.namespace)
        boundaries = [request.num_prompt - 1] + ([request.junction] if request.junction else [])
        for manager in self._block_keyed:
            state = request.groups[manager.index]
            start = state.num_cached or 0
            if start >= num_full:
                continue
            kept = None if self.dense else manager.kept(start, num_full, boundaries)
            table = state.table
            # The blocks of [start, num_full) are fresh (hits lie before start): none holds a key.
            if kept is None and isinstance(manager, FullAttentionGroup):
                keyed: Sequence[int] = range(start, num_full)
                blocks = table[start:num_full]
            else:
                keyed = [i for i in (range(start, num_full) if kept is None else kept) if table[i] != NULL_BLOCK]
                blocks = [table[i] for i in keyed]
            if blocks:
                if keyed[-1] - keyed[0] + 1 == len(keyed):  # one run (a range, a window tail): one slice
                    keys = bytes(request.digests[keyed[0] * ds : (keyed[-1] + 1) * ds])
                else:
                    keys = b"".join(request.digests[i * ds : (i + 1) * ds] for i in keyed)
                self.pool.cache_many_packed(blocks, keys, ds, manager.suffix)
            state.num_cached = num_full
            self._events.record_from(self._stored_events, request, manager, start, num_full, keyed)
        request.keyed_blocks = num_full

    @guarded
    def release(self, request_id: Hashable) -> None:
        request = self._requests.get(request_id)
        # no_tail_cliff: the cached blocks it stopped reading, still free and holding its
        # keys, are taken back and freed again after its full-attention blocks.
        self._retain(request)
        retired = [b for b, key in reversed(request.retired) if self.pool.ref_count(b) == 0 and self.pool.key(b) == key]
        if retired:
            self.pool.touch(retired)
        for manager, state in zip(self.managers, request.groups):
            blocks = manager.release_order(state)
            if blocks:
                self.pool.free(blocks)
        if retired:
            self.pool.free(retired)
        if request.sources:
            self.pool.free(request.sources)
        if self.state_cap:
            self._cap_states(request)
        self._requests.pop(request_id)

    def _state_keys(self, request: HybridRequest, manager: GroupManager) -> list[tuple[int, bytes]]:
        """(position in TOKENS, key) of every state the request's computed path may have
        cached in a mamba group."""
        ds = self._digest_size
        return [((i + 1) * self.block_size, bytes(request.digests[i * ds : (i + 1) * ds]) + manager.suffix)
                for i in range(min(request.num_computed // self.block_size, len(request.digests) // ds))]  # fmt: skip

    def _cap_states(self, request: HybridRequest) -> None:
        """options.state_cap: evict the path's cached states beyond the cap, least
        replay saved first (`replay_victims`); states other requests pin stay."""
        for manager in self.managers:
            if manager.kind != MAMBA:
                continue
            cached = []
            for position, key in self._state_keys(request, manager):
                block = self.pool.lookup(key)
                if block is not None:
                    cached.append((position, block))
            if len(cached) <= self.state_cap:
                continue
            free = [b for b in replay_victims(cached, self.state_cap) if self.pool.ref_count(b) == 0]
            if free:
                self._record_removed(self.pool.evict_blocks(free))

    def _retain(self, request: HybridRequest) -> None:
        """Hook: at release, before the tables are freed, key what the request leaves
        behind beyond its commits. Nothing at vLLM's defaults."""

    @guarded
    def block_table(self, request_id: Hashable) -> Sequence[int]:
        return BlockIds(self._requests.get(request_id).groups[0].table)

    @guarded
    def block_tables(self, request_id: Hashable) -> tuple[Sequence[int], ...]:
        return tuple(BlockIds(s.table) for s in self._requests.get(request_id).groups)

    # -- maintenance (evict, reset, stats, drain_events: HashCacheBase) ----------------
    @guarded
    def check_invariants(self) -> None:
        self.pool.check_invariants()
        ds = self._digest_size
        refs: Counter[int] = Counter()
        for r in self._requests:
            who = f"request {r.request_id!r}"
            for g, (manager, state) in enumerate(zip(self.managers, r.groups)):
                table = state.table
                live = [b for b in table if b != NULL_BLOCK]
                if len(set(live)) != len(live):
                    raise InvariantError(f"{who}: group {g}: a block appears twice in its table {table}")
                if len(table) > _cdiv(max(len(r.tokens), r.allocated_to), manager.entry_tokens):
                    raise InvariantError(f"{who}: group {g}: {len(table)} blocks for {len(r.tokens)} tokens")
                if isinstance(manager, FullAttentionGroup) and NULL_BLOCK in table:
                    raise InvariantError(f"{who}: group {g} (full attention) holds a null block: {table}")
                for i, block in enumerate(table[: state.num_cached or 0] if manager in self._block_keyed else ()):
                    key = self.pool.key(block) if block != NULL_BLOCK else None
                    if key is not None and key != bytes(r.digests[i * ds : (i + 1) * ds]) + manager.suffix:
                        raise InvariantError(f"{who}: group {g}: block {block} (#{i}) is keyed with another prefix")
                refs.update(live)
            refs.update(r.sources)
        for block, count in refs.items():
            if self.pool.ref_count(block) != count:
                raise InvariantError(f"block {block}: ref count {self.pool.ref_count(block)}, live tables hold it {count} times")
        if self.pool.num_pinned != len(refs):
            raise InvariantError(f"{self.pool.num_pinned} blocks pinned but live tables hold {len(refs)}")

    # -- internals --------------------------------------------------------------------
    def _stored_events(
        self, request: HybridRequest, manager: GroupManager, start: int, stop: int, keyed: Sequence[int]
    ) -> tuple[BlockStored]:
        """vLLM's BlockStored of one group's commit: the blocks it keyed, the parent and
        the tokens of the whole range [start, stop)."""
        group = manager.group
        window = group.window if group.kind == SLIDING_WINDOW else None
        return (
            stored_event(request.digests, self._digest_size, request.tokens, request.namespace, self.block_size,
                         start, stop, keyed, group_idx=manager.index, kind=group.kind, sliding_window=window),
        )  # fmt: skip


# Re-exported for the kit and the engine, which read a layout's kinds by name.
__all__ += ["MAMBA", "MambaGroup"]
