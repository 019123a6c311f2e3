"""Reference bounds for a replay: the infinite-cache ceiling and Belady's rule at a capacity.

Owns `infinite_cache`, `belady` and their result `BoundResult`. Both replay a `BlockPlan`
under exactly the rules a real cache obeys there (whole blocks, hit at most `len - 1`
tokens, full blocks of prompt + output cached at release, the running request's blocks
pinned), so their per-request hits compare one to one with a replay through a
`PrefixCache` of the same block size and pool size. Must never: call a real cache.

Ceiling. Every full block ever computed stays cached; a request hits its longest cached
prefix. No replay with the same block size can hit more on any request.

Belady. A pool of `capacity_blocks` blocks. When a request needs room, evict, among the
cached blocks it does not pin, the LEAF (no cached block extends it) whose next use lies
furthest in the future, until its blocks fit. Leaves first keeps the prefix property: a
block is never evicted while a longer prefix through it is cached (that prefix could not
be hit anyway). "Next use" of a block is the next request that would HIT it (it lies in
that request's first `hittable` blocks); when the block's next appearance is in a request
that recomputes it anyway (beyond its hit cap), keeping it until then gains nothing and
its next use counts as never. Eviction happens only on demand, so a just-released block
whose next use is far away is the first to go: that is Belady with bypass.
A request whose footprint exceeds the pool cannot run (a real cache refuses it): it
counts 0 hit tokens and changes nothing; `rejected` lists those requests.

Belady's rule is the classical optimum for one page per access; here requests pin several
blocks at once and hits need whole prefixes, so it is a strong reference, not a proof of
optimality. Tests check it never loses to LRU on random workloads, equals the ceiling when
nothing must be evicted, and grows with capacity once every request fits (below that,
admitting a large request can evict what a smaller pool would have kept; a test shows it).

Cost: O(blocks * log(blocks)) per capacity with a lazy max-heap; next uses are precomputed
in one backward pass over the plan.
"""

from __future__ import annotations

import heapq
import sys
from dataclasses import dataclass

from prefixcache.workloads.blocks import BlockPlan
from prefixcache.workloads.checks import check_int
from prefixcache.workloads.metrics import HitCounts, HitRatios

__all__ = ["BoundResult", "infinite_cache", "belady"]


@dataclass(frozen=True)
class BoundResult(HitRatios):
    """One bound on one workload: per-request hits and what the replay did.

    `capacity_blocks` is None for an unbounded pool; `evictions` counts evicted BLOCKS;
    `rejected` holds the indices of requests too large for the pool.
    """

    bound: str
    block_size: int
    capacity_blocks: int | None
    hits: HitCounts
    evictions: int = 0
    rejected: tuple[int, ...] = ()


def infinite_cache(plan: BlockPlan) -> BoundResult:
    """The ceiling: every full block ever computed stays cached."""
    seen = bytearray(plan.num_keys)
    hits = []
    for chain, cap in zip(plan.keys, plan.hittable, strict=True):
        h = 0
        while h < cap and seen[chain[h]]:
            h += 1
        hits.append(h * plan.block_size)
        for k in chain:
            seen[k] = 1
    return BoundResult("infinite", plan.block_size, None, HitCounts(hits, plan.prompt_tokens))


def _next_hits(plan: BlockPlan, running: list[int], never: int) -> list[list[int]]:
    """For each running request i and each of its blocks j: the request that next hits
    that block (`never` if none, or if a request recomputes it first)."""
    upcoming = [never] * plan.num_keys  # request of the key's next appearance
    nxt: list[list[int]] = [[] for _ in plan.keys]
    for i in reversed(running):
        chain = plan.keys[i]
        out = nxt[i] = [never] * len(chain)
        for j, k in enumerate(chain):
            r = upcoming[k]
            if r != never and j < plan.hittable[r]:
                out[j] = r
            upcoming[k] = i
    return nxt


def belady(plan: BlockPlan, capacity_blocks: int | None) -> BoundResult:
    """Belady's rule with a pool of `capacity_blocks` BLOCKS (None: unbounded)."""
    if capacity_blocks is not None:
        check_int("capacity_blocks", capacity_blocks, 1)
    n = len(plan)
    limit = capacity_blocks if capacity_blocks is not None else sys.maxsize
    running = [i for i in range(n) if plan.footprint[i] <= limit]
    rejected = tuple(i for i in range(n) if plan.footprint[i] > limit)
    never = n
    next_hit = _next_hits(plan, running, never)
    parent = plan.parent
    present = bytearray(plan.num_keys)
    children = [0] * plan.num_keys  # cached blocks that extend this one
    priority = [0] * plan.num_keys  # next use of a cached block
    version = [0] * plan.num_keys  # heap entries with an older version are stale
    heap: list[tuple[int, int, int]] = []  # (-next use, -key, version): furthest first
    cached = evictions = 0
    hits = [0] * n
    for i in running:
        chain, cap = plan.keys[i], plan.hittable[i]
        h = 0
        while h < cap and present[chain[h]]:
            h += 1
        hits[i] = h * plan.block_size
        need = plan.footprint[i] - h
        # The blocks this request hits are pinned. Each carries priority i (its next hit
        # is this request) and every other cached block a later one, so the max-heap
        # reaches them last; as the footprint fits the pool, the others always make room
        # first. Only the last hit block can be a leaf; reaching it would be a bug.
        while cached + need > limit:
            _, neg_key, entry_version = heapq.heappop(heap)
            k = -neg_key
            if not present[k] or version[k] != entry_version or children[k]:
                continue  # stale, or no longer a leaf (re-pushed when it is one again)
            if h and k == chain[h - 1]:
                raise AssertionError(f"belady: request {i} would lose its own hit block {k}")
            present[k] = 0
            cached -= 1
            evictions += 1
            p = parent[k]
            if p >= 0:
                children[p] -= 1
                if not children[p]:
                    heapq.heappush(heap, (-priority[p], -p, version[p]))
        # Release: every full block of prompt + output is cached, its next use refreshed.
        uses = next_hit[i]
        for j, k in enumerate(chain):
            if not present[k]:
                present[k] = 1
                cached += 1
                if j:
                    children[chain[j - 1]] += 1
            priority[k] = uses[j]
            version[k] += 1
            if not children[k]:
                heapq.heappush(heap, (-uses[j], -k, version[k]))
    return BoundResult("belady", plan.block_size, capacity_blocks, HitCounts(hits, plan.prompt_tokens),
                       evictions, rejected)
