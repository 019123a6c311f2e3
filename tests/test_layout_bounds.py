"""Belady over a hybrid layout's units (`layout_belady`): hand-checked cases, and on random
workloads and layouts a naive model that scans the future at every eviction, Belady itself
for a full-attention-only layout, and the ceiling for an unbounded pool."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from workload_cases import random_workloads, workload

from prefixcache.layout import LayerGroup, Layout
from prefixcache.workloads import BlockPlan, belady, infinite_cache, layout_belady

FULL = LayerGroup("full_attention")


def swa(window: int) -> LayerGroup:
    return LayerGroup("sliding_window", window=window)


def chunked(chunk: int) -> LayerGroup:
    return LayerGroup("chunked_local_attention", chunk=chunk)


MAMBA = LayerGroup("mamba")


# ---------------------------------------------------------------- an independent model


def first_needed(group: LayerGroup, h: int, block_size: int) -> int:
    """The first block of a hit of h blocks the group reads (written out per kind)."""
    if group.kind == "sliding_window":
        return max(0, h - -(-(group.window - 1) // block_size))
    if group.kind == "chunked_local_attention":
        return (h * block_size // group.chunk * group.chunk) // block_size
    if group.kind == "mamba":
        return max(0, h - 1)
    return 0


def held_at_once(group: LayerGroup, blocks: int, block_size: int) -> int:
    if group.kind == "sliding_window":
        return min(blocks, -(-(group.window - 1) // block_size) + 1)
    if group.kind == "chunked_local_attention":
        return min(blocks, -(-group.chunk // block_size) + 1)
    if group.kind == "mamba":
        return min(blocks, 1)
    return blocks


def naive_layout_belady(
    plan: BlockPlan, layout: list[LayerGroup], capacity: int, per_block: int = 1, state_blocks: int = 1
) -> tuple[list[int], int]:
    """The module docstring's rules with sets and full scans of the future; the pool's
    blocks hold `per_block` of the plan's, and a state costs `state_blocks` whole ones."""
    b = plan.block_size
    n = len(plan)
    capacity *= per_block

    def cost(g: int) -> int:
        return per_block * state_blocks if layout[g].kind == "mamba" else 1

    running = [
        i for i in range(n)
        if sum(cost(g) * held_at_once(group, plan.footprint[i], b) for g, group in enumerate(layout)) <= capacity
    ]
    target, seen = {}, set()
    for i in running:
        chain, t = plan.keys[i], 0
        while t < plan.hittable[i] and chain[t] in seen:
            t += 1
        target[i] = t
        seen.update(chain)

    def next_read(g: int, k: int, after: int) -> int:
        for r in running:
            if r > after and k in plan.keys[r]:
                j, t = plan.keys[r].index(k), target[r]
                if first_needed(layout[g], t, b) <= j < t:
                    return r
                if j >= t:
                    return n  # computed again before anyone reads it
        return n

    cached: set[tuple[int, int]] = set()
    touched: dict[tuple[int, int], int] = {}
    hits = [0] * n
    evictions = 0

    def shrink_to(limit: int, pinned: set[tuple[int, int]]) -> None:
        nonlocal evictions
        while sum(cost(g) for g, _ in cached) > limit:
            extended = {(g, plan.parent[k]) for g, k in cached if layout[g].kind == "full_attention"}
            candidates = [u for u in cached if u not in pinned and u not in extended]
            g, k = max(candidates, key=lambda u: (next_read(u[0], u[1], touched[u]), u[1], -u[0]))
            cached.remove((g, k))
            evictions += 1

    for i in running:
        chain = plan.keys[i]
        h = max(
            h for h in range(plan.hittable[i] + 1)
            if all((g, chain[j]) in cached for g, group in enumerate(layout) for j in range(first_needed(group, h, b), h))
        )
        hits[i] = h * b
        pinned = {(g, chain[j]) for g, group in enumerate(layout) for j in range(first_needed(group, h, b), h)}
        need = sum(
            cost(g) * max(0, held_at_once(group, plan.footprint[i], b) - (h - first_needed(group, h, b)))
            for g, group in enumerate(layout)
        )
        shrink_to(capacity - need, pinned)
        for g, group in enumerate(layout):
            for j in range(first_needed(group, h, b), len(chain)):
                cached.add((g, chain[j]))
                touched[(g, chain[j])] = i
        shrink_to(capacity, set())
    return hits, evictions


@st.composite
def layouts(draw) -> list[LayerGroup]:
    extra = draw(st.lists(st.one_of(
        st.integers(1, 7).map(swa), st.integers(1, 7).map(chunked), st.just(MAMBA), st.just(FULL),
    ), min_size=1, max_size=3))
    return [FULL, *extra]


# ---------------------------------------------------------------- hand-checked cases


def test_mamba_keeps_only_the_state_the_next_hit_ends_on():
    """Block 1, full + mamba. Request 0 leaves 5 blocks and 5 states; request 1 reads the
    5 blocks and the state after the 5th. A pool of 7 keeps exactly those and one spare
    (states 3, 2, 1 are never read: the largest keys of equal next use go first)."""
    w = workload(([1, 2, 3, 4, 5], []), ([1, 2, 3, 4, 5, 6], []))
    plan = BlockPlan.of(w, 1)
    result = layout_belady(plan, Layout((FULL, MAMBA)), 7)
    assert result.hits.hit_tokens == (0, 5)
    # 3 after request 0; 1 to admit request 1 (state 0); 1 after it (8 units offered).
    assert result.evictions == 5
    assert naive_layout_belady(plan, [FULL, MAMBA], 7) == ([0, 5], 5)


def test_a_window_hit_keeps_the_window_tail_and_drops_the_blocks_before_it():
    """Block 1, full + a 3-token window (2 blocks before the cut). Request 1 reads the 6
    full blocks and the window blocks 4 and 5: a pool of 10 holds them, where keeping all
    of request 0's 12 units would not fit."""
    w = workload(([1, 2, 3, 4, 5, 6], []), ([1, 2, 3, 4, 5, 6, 7], []))
    plan = BlockPlan.of(w, 1)
    layout = (FULL, swa(3))
    assert layout_belady(plan, Layout(layout), 10).hits.hit_tokens == (0, 6)
    assert naive_layout_belady(plan, list(layout), 10)[0] == [0, 6]
    # Full attention alone at the same 10 blocks holds everything.
    assert belady(plan, 10).hits.hit_tokens == (0, 6)


def test_the_units_a_later_hit_reads_outlive_a_request_in_between():
    """Request 2 continues request 0; request 1 in between needs 6 blocks of room. A pool
    of 11 keeps request 0's 4 blocks and the one state request 2 reads (its states 0-2
    go first, never read), so request 2 hits all 4; a pool of 8 cannot keep all five."""
    w = workload(([1, 2, 3, 4], []), ([9, 8, 7, 6, 5], []), ([1, 2, 3, 4, 0], []))
    plan = BlockPlan.of(w, 1)
    result = layout_belady(plan, Layout((FULL, MAMBA)), 11)
    assert result.hits.hit_tokens == (0, 0, 4)
    assert naive_layout_belady(plan, [FULL, MAMBA], 11)[0] == [0, 0, 4]
    small = layout_belady(plan, Layout((FULL, MAMBA)), 8)
    assert small.hits.hit_tokens == tuple(naive_layout_belady(plan, [FULL, MAMBA], 8)[0])
    assert small.hits.hit_tokens[2] < 4


def test_a_request_too_large_for_every_group_together_is_rejected():
    """6 blocks of full attention and 3 of a 3-token window: 9 units, so a pool of 8
    rejects it (full attention alone would take it)."""
    w = workload(([1, 2, 3, 4, 5, 6], []), ([1, 2, 3, 4, 5, 6, 7], []))
    plan = BlockPlan.of(w, 1)
    assert layout_belady(plan, Layout((FULL, swa(3))), 8).rejected == (0, 1)
    assert belady(plan, 8).rejected == ()


def test_bad_capacity_is_named():
    plan = BlockPlan.of(workload(([1, 2], [])), 1)
    with pytest.raises(ValueError, match="capacity_blocks must be an int >= 1"):
        layout_belady(plan, Layout((FULL, MAMBA)), 0)


# ---------------------------------------------------------------- random workloads


@settings(max_examples=150, deadline=None)
@given(random_workloads(), st.integers(1, 3), st.integers(1, 30))
def test_full_attention_only_is_belady(w, block_size, capacity):
    plan = BlockPlan.of(w, block_size)
    ours, theirs = layout_belady(plan, Layout(), capacity), belady(plan, capacity)
    assert ours.hits.hit_tokens == theirs.hits.hit_tokens
    assert (ours.evictions, ours.rejected) == (theirs.evictions, theirs.rejected)


@settings(max_examples=150, deadline=None)
@given(random_workloads(), layouts(), st.integers(1, 3))
def test_an_unbounded_pool_is_the_ceiling(w, layout, block_size):
    plan = BlockPlan.of(w, block_size)
    result = layout_belady(plan, Layout(layout), None)
    assert result.hits.hit_tokens == infinite_cache(plan).hits.hit_tokens
    assert result.evictions == 0


@settings(max_examples=150, deadline=None)
@given(random_workloads(), layouts(), st.integers(1, 3), st.integers(1, 40))
def test_agrees_with_the_naive_model(w, layout, block_size, capacity):
    plan = BlockPlan.of(w, block_size)
    result = layout_belady(plan, Layout(layout), capacity)
    hits, evictions = naive_layout_belady(plan, layout, capacity)
    assert list(result.hits.hit_tokens) == hits
    assert result.evictions == evictions


@settings(max_examples=150, deadline=None)
@given(random_workloads(), layouts(), st.integers(1, 2), st.integers(2, 3), st.integers(1, 40))
def test_hits_finer_than_the_pools_block_agree_with_the_naive_model(w, layout, granule, per_block, capacity):
    """A plan at a granule of the pool's block: KV costs its share of a block, a state a
    whole block."""
    plan = BlockPlan.of(w, granule)
    result = layout_belady(plan, Layout(layout), capacity, block_size=granule * per_block)
    hits, evictions = naive_layout_belady(plan, layout, capacity, per_block)
    assert list(result.hits.hit_tokens) == hits
    assert result.evictions == evictions


@settings(max_examples=100, deadline=None)
@given(random_workloads(), layouts(), st.integers(1, 2), st.integers(1, 3), st.integers(2, 4), st.integers(1, 40))
def test_a_state_of_several_blocks_agrees_with_the_naive_model(w, layout, granule, per_block, state_blocks, capacity):
    """`radix`'s states cost the blocks their bytes fill: `state_blocks` whole blocks each."""
    plan = BlockPlan.of(w, granule)
    result = layout_belady(plan, Layout(layout), capacity, granule * per_block, state_blocks)
    hits, evictions = naive_layout_belady(plan, layout, capacity, per_block, state_blocks)
    assert list(result.hits.hit_tokens) == hits
    assert result.evictions == evictions


def test_a_state_costs_a_whole_block_at_a_finer_granule():
    """Granule 1 in blocks of 4: request 0 leaves 5 granules of KV (5/4 of a block) and
    5 states (a block each). A pool of 3 blocks keeps the KV and the one state request 1
    reads; as blocks of 1 the same pool (3 units) could not hold even the KV."""
    w = workload(([1, 2, 3, 4, 5], []), ([1, 2, 3, 4, 5, 6], []))
    plan = BlockPlan.of(w, 1)
    assert layout_belady(plan, Layout((FULL, MAMBA)), 3, block_size=4).hits.hit_tokens == (0, 5)
    assert layout_belady(plan, Layout((FULL, MAMBA)), 3).rejected == (0, 1)
    with pytest.raises(ValueError, match="block_size 6 must be a multiple of the plan's 4 TOKENS"):
        layout_belady(BlockPlan.of(w, 4), Layout((FULL, MAMBA)), 3, block_size=6)
