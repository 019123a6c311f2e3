"""Belady's rule over a hybrid layout: what eviction alone could keep at a pool size when
a hit needs every layer group's blocks, not only full attention's.

Owns `layout_belady(plan, layout, capacity_blocks, block_size)`, the reference line an A/B shows
beside each arm with a hybrid layout (`cache.layout`). Must never: call a real cache or
follow one strategy's retention rules (it keeps every unit a request computed, and lets
Belady choose).

Units. Each group keeps one unit per full block of the plan (`plan.block_size` TOKENS,
written B below): its KV for the attention kinds, for `mamba` the recurrent state after
the block's last token. A state costs one block of the pool, as in the shared
`BlockPool` (or `state_blocks`, where states have a pool apart that charges their
bytes: `radix`); so does a unit of KV when the plan's blocks are the pool's. Hits finer than
the pool's block (`state_granule`): plan at the granule, pass the pool's `block_size`,
and a unit of KV costs its share of a block; KV is then kept per granule, which a pool
of whole blocks cannot do, so there the line is an idealisation. Units of different
groups are separate: a sliding-window block may be gone while the full-attention block
with the same tokens stays.

A hit of h blocks needs, in every group, the units [first(h), h):
  full_attention            every block, first = 0
  sliding_window            the ceil((window - 1) / B) blocks before the cut (vLLM's rule)
  chunked_local_attention   the blocks from the start of the chunk the cut lies in
  mamba                     the state the cut ends on, first = h - 1
and is the largest h <= `hittable` for which every group holds them (0 always qualifies).

Replay: the model of `prefixcache.workloads.blocks`, one request at a time. A running
request holds, per group, `footprint` blocks of full attention, at most its window (or
chunk) plus one of a local group and one state: its hit units are pinned, the rest are
made room for at admission. At release it offers every unit it computed or hit, in every
group (the densest retention any strategy could choose), and Belady decides what stays.

Belady. A unit's next use is the next request that would read it: the request whose
target hit needs it, where the target is that request's hit with an infinite cache (the
full-attention ceiling: with every unit kept, nothing else limits a hit). A request that
computes the unit again before anyone reads it makes its next use never; one that
neither reads nor computes it (a sliding-window block deep inside its hit) is passed
over. When room is needed, at admission or after a release, the unit used furthest in
the future goes first; a full-attention block only once no cached block of its group
extends it (the leaves-first rule of `prefixcache.workloads.bounds`). With a
full-attention-only layout this is `belady` exactly (a test holds the two equal).

Like `belady`, it is a strong reference, not a proof of optimality: next uses are read
from the infinite-cache targets, and a request that hits short of its target reads units
the order did not plan for; units of unequal cost are ranked by next use alone.

Cost: O(units * log(units)) with a lazy max-heap; next uses in one backward pass.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Sequence

from prefixcache.layout import CHUNKED_LOCAL_ATTENTION, FULL_ATTENTION, MAMBA, SLIDING_WINDOW, LayerGroup, Layout
from prefixcache.workloads.blocks import BlockPlan
from prefixcache.workloads.bounds import BoundResult
from prefixcache.workloads.checks import check_int
from prefixcache.workloads.metrics import HitCounts

__all__ = ["layout_belady"]


class _Rule:
    """What one group needs at a cut and holds while a request runs, in BLOCKS."""

    __slots__ = ("full", "kind", "span", "chunk", "block_size", "cost")

    def __init__(self, group: LayerGroup, block_size: int, state_cost: int) -> None:
        self.kind = group.kind
        self.full = group.kind == FULL_ATTENTION
        self.cost = state_cost if group.kind == MAMBA else 1  # in units of block_size TOKENS of KV
        self.block_size = block_size
        self.chunk = group.chunk or 0
        if group.kind == SLIDING_WINDOW:
            self.span = group.window_blocks(block_size)
        elif group.kind == CHUNKED_LOCAL_ATTENTION:
            self.span = -(-group.chunk // block_size)  # type: ignore[operator]
        else:
            self.span = 0

    def first(self, h: int) -> int:
        """The first block a hit of `h` BLOCKS needs in this group."""
        if self.kind == SLIDING_WINDOW:
            return max(0, h - self.span)
        if self.kind == CHUNKED_LOCAL_ATTENTION:
            return h * self.block_size // self.chunk * self.chunk // self.block_size
        if self.kind == MAMBA:
            return max(0, h - 1)
        return 0

    def footprint(self, blocks: int) -> int:
        """Units a request of `blocks` BLOCKS holds at once in this group."""
        if self.full:
            return blocks
        if self.kind == MAMBA:
            return min(blocks, 1)
        return min(blocks, self.span + 1)


def _targets(plan: BlockPlan, running: Sequence[int]) -> list[int]:
    """Each running request's hit with an infinite cache, in BLOCKS (0 for the others)."""
    seen = bytearray(plan.num_keys)
    out = [0] * len(plan)
    for i in running:
        chain, cap = plan.keys[i], plan.hittable[i]
        h = 0
        while h < cap and seen[chain[h]]:
            h += 1
        out[i] = h
        for k in chain:
            seen[k] = 1
    return out


def _next_uses(plan: BlockPlan, rules: Sequence[_Rule], running: Sequence[int], target: Sequence[int],
               never: int) -> list[list[list[int]]]:
    """next[g][i][j]: the request that next reads unit j of request i in group g."""
    num_keys = plan.num_keys
    out: list[list[list[int]]] = [[[] for _ in plan.keys] for _ in rules]
    for g, rule in enumerate(rules):
        upcoming = [never] * num_keys
        nxt = out[g]
        for i in reversed(running):
            chain, t = plan.keys[i], target[i]
            nxt[i] = [upcoming[k] for k in chain]
            first = rule.first(t)
            for j in range(first, t):  # units this request's target hit reads
                upcoming[chain[j]] = i
            for j in range(t, len(chain)):  # units it computes again
                upcoming[chain[j]] = never
    return out


def layout_belady(
    plan: BlockPlan, layout: Layout, capacity_blocks: int | None, block_size: int | None = None,
    state_blocks: int = 1,
) -> BoundResult:
    """Belady's rule over `layout`'s units with a pool of `capacity_blocks` BLOCKS of
    `block_size` TOKENS (None: unbounded). Hits are whole units of `plan.block_size`
    TOKENS: the pool's block (the default), or a state granule that divides it, where a
    state still costs `state_blocks` whole blocks (`radix`'s `Layout.state_blocks`; one
    as in vLLM's pool) and KV costs its share of one. Per-request hits in TOKENS;
    `evictions` counts evicted units."""
    check_int("state_blocks", state_blocks, 1)
    if capacity_blocks is not None:
        check_int("capacity_blocks", capacity_blocks, 1)
    granule = plan.block_size
    block_size = granule if block_size is None else block_size
    check_int("block_size", block_size, granule)
    if block_size % granule:
        raise ValueError(f"block_size {block_size} must be a multiple of the plan's {granule} TOKENS")
    per_block = block_size // granule
    layout = Layout(layout)
    rules = [_Rule(g, granule, per_block * state_blocks) for g in layout]
    num_groups, num_keys = len(rules), plan.num_keys
    n = len(plan)
    limit = capacity_blocks * per_block if capacity_blocks is not None else sys.maxsize
    footprint = [sum(r.cost * r.footprint(f) for r in rules) for f in plan.footprint]
    running = [i for i in range(n) if footprint[i] <= limit]
    rejected = tuple(i for i in range(n) if footprint[i] > limit)
    never = n
    target = _targets(plan, running)
    next_use = _next_uses(plan, rules, running, target, never)
    parent = plan.parent
    size = num_groups * num_keys
    present = bytearray(size)
    children = [0] * size  # full attention: cached blocks of the group that extend this one
    priority = [0] * size
    version = [0] * size
    heap: list[tuple[int, int, int, int]] = []  # (-next use, -key, group, version): furthest first
    full_groups = [g for g, r in enumerate(rules) if r.full]
    partial_groups = [g for g, r in enumerate(rules) if not r.full]
    cached = evictions = 0
    hits = [0] * n

    def make_room(limit_units: int, pinned: set[int]) -> None:
        nonlocal cached, evictions
        held = []
        while cached > limit_units:
            entry = heapq.heappop(heap)
            _, neg_key, g, entry_version = entry
            k = -neg_key
            u = g * num_keys + k
            if not present[u] or version[u] != entry_version or children[u]:
                continue  # stale, or no longer a leaf (re-pushed when it is one again)
            if u in pinned:
                held.append(entry)
                continue
            present[u] = 0
            cached -= rules[g].cost
            evictions += 1
            p = parent[k]
            if rules[g].full and p >= 0:
                pu = g * num_keys + p
                children[pu] -= 1
                if not children[pu]:
                    heapq.heappush(heap, (-priority[pu], -p, g, version[pu]))
        for entry in held:
            heapq.heappush(heap, entry)

    for i in running:
        chain, cap = plan.keys[i], plan.hittable[i]
        run = 0
        while run < cap and all(present[g * num_keys + chain[run]] for g in full_groups):
            run += 1
        # A partial group's row: at block j, how many of its units end there with none missing.
        runs = []
        for g in partial_groups:
            base, count, row = g * num_keys, 0, []
            for j in range(run):
                count = count + 1 if present[base + chain[j]] else 0
                row.append(count)
            runs.append((rules[g], row))
        h = run
        while h and not all(row[h - 1] >= h - rule.first(h) for rule, row in runs):
            h -= 1
        hits[i] = h * granule
        pinned = {g * num_keys + chain[j] for g, r in enumerate(rules) for j in range(r.first(h), h)}
        need = sum(r.cost * max(0, r.footprint(plan.footprint[i]) - (h - r.first(h))) for r in rules)
        make_room(limit - need, pinned)
        # Release: every unit the request read or computed is offered, next use refreshed.
        for g, r in enumerate(rules):
            uses, base = next_use[g][i], g * num_keys
            for j in range(r.first(h), len(chain)):
                k = chain[j]
                u = base + k
                if not present[u]:
                    present[u] = 1
                    cached += r.cost
                    if r.full and j:
                        children[base + chain[j - 1]] += 1
                priority[u] = uses[j]
                version[u] += 1
                if not children[u]:
                    heapq.heappush(heap, (-uses[j], -k, g, version[u]))
        make_room(limit, set())
    return BoundResult("layout belady", block_size, capacity_blocks, HitCounts(hits, plan.prompt_tokens),
                       evictions, rejected)
