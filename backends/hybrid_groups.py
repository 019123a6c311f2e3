"""One layer group's prefix caching in the `hash` strategy: vLLM 0.33's single-type managers.

Owns `GroupManager` and its four kinds (`FullAttentionGroup`, `SlidingWindowGroup`,
`ChunkedLocalGroup`, `MambaGroup`): for one group of a hybrid layout, the longest hit it
accepts (`find_hit`), the blocks a chunk needs (`blocks_needed`, `allocate`), the blocks
it frees once no query reads them (`remove_skipped`), which full blocks it keys at a
commit (`kept`), and its block table per request. Each method is the method of
the same role in vLLM 0.33's `vllm/v1/core/single_type_kv_cache_manager.py`, under the
configuration our `hash` backend runs: one block size for every group (the hash block
is the block), no EAGLE, no KV connector, Mamba in "align" mode without speculative or
prefill-checkpoint blocks, `prefix_cache_retention_interval` 0 (sparse retention: a
sliding-window tail and a Mamba state are kept only at a reachable boundary, the replay
point `len(prompt) - 1` and a shared-prefix junction) unless an option asks for dense.

A group's table holds `NULL_BLOCK` (-1) where vLLM's holds its null block. Keys are the
chained block hash followed by the group index as 4 big-endian bytes, as vLLM's
`BlockHashWithGroupId`, so one pool index serves every group; group 0's key is the hash
alone (no other group's key has its length), so its chain is the request's packed
digests as they are, as in the single-group cache.

For the four built-in kinds, `hit_finder` and `admitter` build the native twins of
`find_hit` (the reconciled hit, `_C.HybridHitFinder`) and of a new request's
`blocks_needed`, `add_hit` and `allocate` (`_C.HybridAdmitter`); these methods stay their
definition and what a subclass runs.

Must never: decide the hit of the whole request (`hybrid_hash.HybridHashCache`, vLLM's
coordinator, reconciles the groups), record events or stats, or run a Python loop per
block where a native call does the work (every group's chain is one
`lookup_chain_packed`, the group's suffix appended in C++).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixcache._C import BlockPool, HybridAdmitter, HybridHitFinder
from prefixcache.layout import (
    CHUNKED_LOCAL_ATTENTION,
    FULL_ATTENTION,
    MAMBA,
    NULL_BLOCK,
    SLIDING_WINDOW,
    LayerGroup,
)

__all__ = [
    "GroupManager",
    "FullAttentionGroup",
    "SlidingWindowGroup",
    "ChunkedLocalGroup",
    "MambaGroup",
    "GroupState",
    "Lookup",
    "group_key",
    "group_suffix",
    "make_group",
    "live_blocks",
    "hit_finder",
    "admitter",
    "quiet_until",
]


def group_suffix(group: int) -> bytes:
    """What follows a block hash in group `group`'s key: vLLM's 4 big-endian bytes of the
    group (`make_block_hash_with_group_id`), nothing for group 0."""
    return group.to_bytes(4, "big") if group else b""


def group_key(digest: bytes, group: int) -> bytes:
    """The pool key of a block hash in group `group`."""
    return digest + group_suffix(group)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def live_blocks(row: Sequence[int]) -> Sequence[int]:
    """The entries of `row` that are not NULL_BLOCK, in order (`row` itself when it has
    none: read it, do not change it). A hit row's NULL_BLOCKs all lead (the blocks a
    group skips), so that case costs two C-level scans and a slice, not a Python step
    per block."""
    nulls = row.count(NULL_BLOCK)
    if not nulls:
        return row
    if row[:nulls] == [NULL_BLOCK] * nulls:  # (a row that is no list falls through: same answer)
        return row[nulls:]
    return [b for b in row if b != NULL_BLOCK]


class Lookup:
    """The pool's index seen through group keys (`group_key`)."""

    __slots__ = ("pool", "digest_size")

    def __init__(self, pool: BlockPool, digest_size: int) -> None:
        self.pool = pool
        self.digest_size = digest_size

    def chain(self, digests: bytes, members: Sequence[int]) -> list[list[int]]:
        """Per member group, the cached blocks of the leading run of `digests` (packed)
        that every member holds (vLLM: `get_cached_block` block by block, all members
        or a miss)."""
        ds = self.digest_size
        rows = [self.pool.lookup_chain_packed(digests, ds, group_suffix(g)) for g in members]
        n = min(len(r) for r in rows)
        return [list(r[:n]) for r in rows]

    def run(self, digests: bytes, first: int, stop: int, members: Sequence[int]) -> list[list[int]]:
        """`chain` over the block hashes of blocks [first, stop) of `digests`."""
        ds = self.digest_size
        return self.chain(digests[first * ds : stop * ds], members)

    def one(self, digest: bytes, members: Sequence[int]) -> list[int] | None:
        """Per member group, the cached block of one block hash; None if any misses."""
        out = []
        for g in members:
            block = self.pool.lookup(digest + group_suffix(g))
            if block is None:
                return None
            out.append(block)
        return out


@dataclass(eq=False)
class GroupState:
    """One request's bookkeeping in one group (vLLM keeps these in per-manager dicts).

    table:        block ids in token order, `NULL_BLOCK` where the group holds none
    num_cached:   leading table entries already offered to the index (vLLM
                  `num_cached_block`); None until the first commit that caches or a hit
                  sets it (vLLM: the request is not in the dict), which changes how
                  `blocks_needed` counts
    last_state:   mamba: index of the block that held the running state a step ago
                  (vLLM `last_state_block_idx`), freed once the next state is written
    retired:      mamba: table entries before this index were already freed
    allocated:    mamba: a chunk has allocated for it (vLLM `_allocated_block_reqs`)
    """

    table: list[int] = field(default_factory=list)
    num_cached: int | None = None
    last_state: int | None = None
    retired: int = 0
    allocated: bool = False


class GroupManager:
    """One group's rules (see the module docstring); stateless apart from its
    configuration: a request's state is a `GroupState` the cache hands in."""

    kind = FULL_ATTENTION

    def __init__(self, group: LayerGroup, index: int, pool: BlockPool, block_size: int) -> None:
        self.group = group
        self.index = index
        self.pool = pool
        self.block_size = block_size
        self.suffix = group_suffix(index)
        #: TOKENS a table entry stands for (a mamba group keeping finer states: fewer).
        self.entry_tokens = block_size

    # -- look-up -------------------------------------------------------------------------
    def find_hit(
        self, digests: bytes, digest_size: int, max_length: int, members: Sequence[int], lookup: Lookup
    ) -> tuple[list[list[int]], int]:
        """The blocks of the longest hit of at most `max_length` TOKENS the group
        accepts, per member group (groups of one spec are looked up together, vLLM's
        `SpecGroup`), with NULL_BLOCK for blocks it need not hold; and the hit in
        TOKENS. `digests` packs the request's block hashes, `digest_size` bytes each."""
        # Each kind the hybrid cache looks up defines it; hybrid_fine's mamba group does
        # not, its cache finds the hit through its own granule index.
        raise NotImplementedError

    # -- allocation ----------------------------------------------------------------------
    def skipped_tokens(self, num_computed: int) -> int:
        return self.group.skipped_tokens(num_computed)

    def blocks_needed(self, state: GroupState, num_tokens: int, hit: Sequence[int], total_computed: int) -> int:
        """vLLM `get_num_blocks_to_allocate`: fresh blocks a table of `num_tokens`
        TOKENS takes, plus the hit blocks sitting free (touching them takes them out of
        the free queue)."""
        bs = self.block_size
        required = _cdiv(num_tokens, bs)
        held = len(state.table)
        if state.num_cached is not None:  # a running request: no new hits
            return max(required - held, 0)
        skipped_blocks = self.skipped_tokens(total_computed) // bs
        new = max(required - max(skipped_blocks, len(hit) + held), 0)
        live_hit = live_blocks(hit[max(0, skipped_blocks - held) :])
        return new + (self.pool.count_free(live_hit) if live_hit else 0)

    def add_hit(self, state: GroupState, hit: Sequence[int], num_hit_tokens: int) -> None:
        """vLLM `add_local_computed_blocks`: pin the hit blocks the group still reads
        and put them in the table after NULL_BLOCKs for the ones it skips."""
        skipped = self.skipped_tokens(num_hit_tokens) // self.block_size
        kept = list(hit[skipped:]) if skipped > 0 else list(hit)
        live = live_blocks(kept)
        if live:
            self.pool.touch(live)
        state.table.extend([NULL_BLOCK] * max(skipped, 0))
        state.table.extend(kept)
        state.num_cached = len(state.table)

    def allocate(self, state: GroupState, num_tokens: int, take: Callable[[int], list[int]]) -> list[int]:
        """vLLM `allocate_new_blocks`: grow the table to `num_tokens` TOKENS; `take(n)`
        gives n fresh blocks (the caller checked there is room)."""
        new = _cdiv(num_tokens, self.block_size) - len(state.table)
        if new <= 0:
            return []
        blocks = take(new)
        state.table.extend(blocks)
        return blocks

    def remove_skipped(self, state: GroupState, num_computed: int, free: Callable[[list[int]], None]) -> None:
        """vLLM `remove_skipped_blocks`: free the blocks no query reads any more
        (NULL_BLOCK in their place), last first."""
        skipped = self.skipped_tokens(num_computed)
        if skipped <= 0:
            return
        last = min(skipped // self.block_size, len(state.table))
        self._remove_range(state, 0, last, free)

    def quiet_until(self, num_computed: int) -> int:
        """The last `num_computed` (TOKENS) up to which `remove_skipped` frees nothing
        more than it did at `num_computed`, as long as nothing else changes the table (a
        bound, never past it): the cache skips those calls while a request decodes.
        Each built-in kind says how far; any other kind, not at all."""
        return num_computed - 1

    def _remove_range(self, state: GroupState, first: int, last: int, free: Callable[[list[int]], None]) -> None:
        """Free the run of blocks that ends at entry `last` (exclusive) and starts after
        the last NULL_BLOCK in [first, last), last first (vLLM's loop that stops at the
        first null block it meets); slices and C-level scans, not a step per block."""
        table = state.table
        run = table[first:last]
        try:
            start = first + len(run) - run[::-1].index(NULL_BLOCK)  # just past the last null
        except ValueError:
            start = first
        if start < last:
            freed = table[start:last]
            freed.reverse()
            table[start:last] = [NULL_BLOCK] * (last - start)
            free(freed)

    # -- caching -------------------------------------------------------------------------
    def kept(self, start: int, stop: int, boundaries: Sequence[int]) -> Sequence[int] | None:
        """The indices of the full blocks [start, stop) keyed at a commit, in order;
        None: all (vLLM's `reachable_block_mask`, as indices)."""
        return None

    def release_order(self, state: GroupState) -> list[int]:
        """The table's blocks in the order they are freed at release (vLLM `free`:
        reversed, leading NULL_BLOCKs trimmed, inner ones skipped)."""
        return live_blocks(state.table)[::-1]


class FullAttentionGroup(GroupManager):
    """Every token's KV: the hit is the run of cached blocks from the start (vLLM
    `FullAttentionManager`)."""

    kind = FULL_ATTENTION

    def find_hit(self, digests, digest_size, max_length, members, lookup):  # type: ignore[override]
        n = min(max_length // self.block_size, len(digests) // digest_size)
        hits = lookup.chain(digests[: n * digest_size], members)
        return hits, len(hits[0]) * self.block_size

    def release_order(self, state: GroupState) -> list[int]:
        return state.table[::-1]  # full attention holds every block

    def quiet_until(self, num_computed: int) -> int:
        return sys.maxsize  # nothing is ever skipped


class ChunkedLocalGroup(GroupManager):
    """Attention inside fixed chunks: blocks before the query's chunk are skipped; the
    hit is the run of cached blocks from the chunk's start (vLLM
    `ChunkedLocalAttentionManager`)."""

    kind = CHUNKED_LOCAL_ATTENTION

    def find_hit(self, digests, digest_size, max_length, members, lookup):  # type: ignore[override]
        bs, chunk = self.block_size, self.group.chunk
        max_blocks = max_length // bs
        start = (max_length // chunk * chunk if max_length > 0 else 0) // bs  # type: ignore[operator]
        found = lookup.chain(digests[start * digest_size : max_blocks * digest_size], members)
        hits = [[NULL_BLOCK] * start + row for row in found]
        return hits, len(hits[0]) * bs

    def quiet_until(self, num_computed: int) -> int:
        chunk = self.group.chunk
        return (num_computed // chunk + 1) * chunk - 1  # type: ignore[operator]  # the next chunk skips more


class SlidingWindowGroup(GroupManager):
    """The last `window` tokens: a hit needs the `window_blocks` blocks before the cut
    cached, not the ones before them (vLLM `SlidingWindowManager`). The look-up probes
    the leftmost block of a candidate window first and jumps past a miss, so a miss
    costs O(blocks / window + window) probes, not O(blocks); the hit is the one vLLM's
    right-to-left scan finds (the rightmost run of `window_blocks` cached blocks, else
    the cached run from block 0)."""

    kind = SLIDING_WINDOW

    def __init__(self, group: LayerGroup, index: int, pool: BlockPool, block_size: int) -> None:
        super().__init__(group, index, pool, block_size)
        self.need = group.window_blocks(block_size)

    def find_hit(self, digests, digest_size, max_length, members, lookup):  # type: ignore[override]
        bs, need = self.block_size, self.need
        max_blocks = min(max_length // bs, len(digests) // digest_size)
        ds = digest_size

        def probe(i: int) -> list[int] | None:
            return lookup.one(digests[i * ds : (i + 1) * ds], members)

        end = max_blocks - 1
        while need and end - need + 1 >= 0:
            left = end - need + 1
            if probe(left) is None:
                end = left - 1  # every window ending in [left, end] holds block `left`
                continue
            rows = lookup.run(digests, left, end + 1, members)  # the run from `left`, one native call each
            if len(rows[0]) == need:
                return [[NULL_BLOCK] * left + row for row in rows], (end + 1) * bs
            end = left + len(rows[0]) - 1  # windows ending at or past the first miss hold it
        # No full window: the cached run from block 0 (shorter than a window) is the hit.
        rows = lookup.run(digests, 0, min(need, max_blocks) if need else max_blocks, members)
        return rows, len(rows[0]) * bs

    def quiet_until(self, num_computed: int) -> int:
        # Blocks leave when num_computed - window + 1 reaches the next block boundary.
        window, bs = self.group.window, self.block_size
        return (max(0, num_computed - window + 1) // bs + 1) * bs + window - 2  # type: ignore[operator]

    def kept(self, start: int, stop: int, boundaries: Sequence[int]) -> Sequence[int]:
        # Sparse retention: only the `need` blocks that end at each reachable boundary.
        bs, need = self.block_size, self.need
        out: set[int] = set()
        for boundary in boundaries:
            end = boundary // bs
            out.update(range(max(start, end - need), min(stop, end)))
        return sorted(out)


class MambaGroup(GroupManager):
    """A recurrent state per request: block i of a table holds the state after (i + 1)
    * block_size tokens; the hit is the last cached state at or before the limit. A
    request's table is NULL_BLOCK but for the running state and the state a chunk ended
    on, one block per chunk (vLLM `MambaManager`, "align" mode)."""

    kind = MAMBA

    def find_hit(self, digests, digest_size, max_length, members, lookup):  # type: ignore[override]
        bs, ds = self.block_size, digest_size
        for i in range(min(max_length // bs, len(digests) // ds) - 1, -1, -1):
            got = lookup.one(digests[i * ds : (i + 1) * ds], members)
            if got is not None:
                return [[NULL_BLOCK] * i + [b] for b in got], (i + 1) * bs
        return [[] for _ in members], 0

    def blocks_needed(self, state, num_tokens, hit, total_computed):  # type: ignore[override]
        required = _cdiv(num_tokens, self.block_size)
        new = required - len(hit) - len(state.table)
        if new > 0:
            new = min(new, 1)  # one physical block a chunk: the state it ends on
        live_hit = live_blocks(hit)
        return new + (self.pool.count_free(live_hit) if live_hit else 0)

    def allocate(self, state, num_tokens, take):  # type: ignore[override]
        required = _cdiv(num_tokens, self.block_size)
        table = state.table
        if required <= len(table):
            state.allocated = True
            return []
        held = len(table)
        if state.allocated or held > 0:
            state.last_state = held - 1
        if held < required - 1:
            table.extend([NULL_BLOCK] * (required - 1 - held))
        blocks = take(max(required - len(table), 0))
        table.extend(blocks)
        state.allocated = True
        return blocks

    def remove_skipped(self, state, num_computed, free):  # type: ignore[override]
        skipped = num_computed - 1
        if skipped > 0:
            last = min(skipped // self.block_size, len(state.table))
            first = max(0, state.retired)
            if first < last:
                freed = live_blocks(state.table[first:last])[::-1]
                state.table[first:last] = [NULL_BLOCK] * (last - first)
                if freed:
                    free(freed)
                state.retired = last
        held = state.last_state
        if held is not None and held < _cdiv(num_computed, self.block_size) - 1:
            if state.table[held] != NULL_BLOCK:
                free([state.table[held]])
                state.table[held] = NULL_BLOCK

    def quiet_until(self, num_computed: int) -> int:
        # Both the retired range and the previous state move with (num_computed - 1) // block_size.
        bs = self.block_size
        return ((num_computed - 1) // bs + 1) * bs

    def kept(self, start: int, stop: int, boundaries: Sequence[int]) -> Sequence[int]:
        # Sparse retention: only the state that ends on each reachable boundary.
        blocks = {b // self.block_size - 1 for b in boundaries}
        return sorted(j for j in blocks if start <= j < stop)


_KINDS: dict[str, type[GroupManager]] = {
    FULL_ATTENTION: FullAttentionGroup,
    SLIDING_WINDOW: SlidingWindowGroup,
    CHUNKED_LOCAL_ATTENTION: ChunkedLocalGroup,
    MAMBA: MambaGroup,
}


def make_group(group: LayerGroup, index: int, pool: BlockPool, block_size: int) -> GroupManager:
    """The manager of layout group `index`."""
    return _KINDS[group.kind](group, index, pool, block_size)


# The native finder's kind codes (csrc/hybrid_hit.h `HitKind`), by manager class: only these
# four classes' `find_hit` is what the native code mirrors.
_HIT_KINDS: dict[type[GroupManager], int] = {
    FullAttentionGroup: 0,
    SlidingWindowGroup: 1,
    ChunkedLocalGroup: 2,
    MambaGroup: 3,
}


def hit_finder(
    managers: Sequence[GroupManager], spec_groups: Sequence[Sequence[int]], single_pass: bool, digest_size: int
) -> HybridHitFinder | None:
    """The native reconciled look-up (`_C.HybridHitFinder`) of exactly these managers, or
    None when one of them is not a built-in kind (a subclass answers in Python)."""
    if not managers or any(type(m) not in _HIT_KINDS for m in managers):
        return None
    groups = [
        (_HIT_KINDS[type(m)], getattr(m, "need", 0), m.group.chunk or 0, m.suffix)
        for m in managers
    ]  # fmt: skip
    return HybridHitFinder(groups, [list(ids) for ids in spec_groups], single_pass, managers[0].block_size, digest_size)


def quiet_until(managers: Sequence[GroupManager], num_computed: int) -> int:
    """The last `num_computed` (TOKENS) up to which no group's `remove_skipped` frees
    more than at `num_computed` (`GroupManager.quiet_until` over the groups), or
    `num_computed - 1` when one is not a built-in kind (whose own may not say)."""
    if not managers or any(type(m) not in _HIT_KINDS for m in managers):
        return num_computed - 1
    return min(m.quiet_until(num_computed) for m in managers)


def admitter(managers: Sequence[GroupManager]) -> HybridAdmitter | None:
    """The native admission (`_C.HybridAdmitter`: `blocks_needed`, `add_hit` and
    `allocate` of a new request, every group in one call) of exactly these managers, or
    None when one of them is not a built-in kind (a subclass answers in Python)."""
    if not managers or any(type(m) not in _HIT_KINDS for m in managers):
        return None
    groups = [(_HIT_KINDS[type(m)], m.group.window or 0, m.group.chunk or 0) for m in managers]
    return HybridAdmitter(groups, managers[0].block_size)
