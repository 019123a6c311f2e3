"""Reference bounds: hand-checked cases, and on random workloads the ceiling against a
brute-force longest-common-prefix model, Belady against a naive Belady and an LRU model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from workload_cases import random_workloads, workload

from prefixcache.workloads import (
    BlockPlan,
    HitCounts,
    TokenSource,
    Workload,
    belady,
    infinite_cache,
    shared_prefix,
)


# ---------------------------------------------------------------- independent models


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def brute_force_ceiling(w: Workload, block_size: int) -> list[int]:
    """Hit TOKENS per request with every earlier request's full blocks cached, from token
    lists only: a prefix of h blocks is cached iff some earlier request in the same
    namespace computed a sequence that starts with it and holds h full blocks."""
    hits, seen = [], []
    for r in w.requests:
        prompt = r.prompt.tolist()
        cap = (len(prompt) - 1) // block_size
        best = max((min(lcp(prompt, s), len(s)) // block_size for ns, s in seen if ns == r.namespace), default=0)
        hits.append(min(best, cap) * block_size)
        seen.append((r.namespace, prompt + r.output.tolist()))
    return hits


def replay(plan: BlockPlan, capacity: int, choose_victim) -> list[int]:
    """The block-level replay model of `blocks.py` written plainly (O(n) scans):
    `choose_victim(leaves, i, last_used)` picks the block to evict at request i."""
    cached: set[int] = set()
    last_used: dict[int, int] = {}
    hits = [0] * len(plan)
    for i, chain in enumerate(plan.keys):
        if plan.footprint[i] > capacity:
            continue
        h = 0
        while h < plan.hittable[i] and chain[h] in cached:
            h += 1
        hits[i] = h * plan.block_size
        pinned = set(chain[:h])
        while len(cached) + plan.footprint[i] - h > capacity:
            with_child = {plan.parent[k] for k in cached}
            leaves = [k for k in cached if k not in with_child and k not in pinned]
            cached.remove(choose_victim(leaves, i, last_used))
        for k in chain:
            cached.add(k)
            last_used[k] = i
    return hits


def lru(plan: BlockPlan, capacity: int) -> list[int]:
    return replay(plan, capacity, lambda leaves, i, last_used: min(leaves, key=last_used.__getitem__))


def naive_belady(plan: BlockPlan, capacity: int) -> list[int]:
    """Belady by scanning the future at every eviction."""
    never = len(plan)

    def next_hit(k: int, i: int) -> int:
        for r in range(i + 1, len(plan)):
            if plan.footprint[r] <= capacity and k in plan.keys[r]:
                return r if plan.keys[r].index(k) < plan.hittable[r] else never
        return never

    def furthest(leaves, i, last_used):
        # The request being admitted (i) already used its hit blocks; a cached block's
        # next use is measured from the request that last touched it.
        return max(leaves, key=lambda k: (next_hit(k, last_used[k]), k))

    return replay(plan, capacity, furthest)


# ---------------------------------------------------------------- hand-checked cases


def test_ceiling_hand_case_whole_blocks_and_len_minus_one_cap():
    w = workload(
        (list(range(10)), [100, 101]),  # caches 0-3, 4-7, (8 9 100 101)
        (list(range(10)) + [20, 21], []),  # hits 0-7; block 2 differs
        (list(range(8)), []),  # 8 tokens = 2 cached blocks, but at most 7 may hit
    )
    assert infinite_cache(BlockPlan.of(w, 4)).hits.hit_tokens == (0, 8, 4)
    assert infinite_cache(BlockPlan.of(w, 1)).hits.hit_tokens == (0, 10, 7)
    # The output is cached too: a prompt that continues into it hits it.
    follow = workload((list(range(10)), [100, 101]), (list(range(10)) + [100, 101, 7], []))
    assert infinite_cache(BlockPlan.of(follow, 4)).hits.hit_tokens == (0, 12)


def test_namespaces_never_share_blocks():
    w = workload((list(range(9)), [], "a"), (list(range(9)), [], "b"), (list(range(9)), [], "a"))
    assert infinite_cache(BlockPlan.of(w, 4)).hits.hit_tokens == (0, 0, 8)
    assert BlockPlan.of(w, 4).num_keys == 4


def test_plan_counts_blocks():
    plan = BlockPlan.of(workload((list(range(10)), [100, 101]), (list(range(8)), [1])), 4)
    assert plan.hittable == (2, 1)  # floor(9/4), floor(7/4)
    assert plan.footprint == (3, 3)  # ceil(12/4), ceil(9/4)
    assert plan.keys == ([0, 1, 2], [0, 1]) and plan.parent == [-1, 0, 1]
    assert plan.num_keys == 3 and plan.max_footprint == 3 and len(plan) == 2


def test_belady_beats_lru_hand_case():
    """Requests [x, fresh] for x = a b a c b a, block 1, pool of 4 blocks. Each needs 2
    blocks and leaves x plus a never-reused leaf (x, fresh) cached.

    Belady: at r2 (a hits) it evicts b's dead leaf, at r3 (c) a's two dead leaves, at r4
    (b hits) c's dead leaf, at r5 (a hits) b's dead leaf: hits at r2, r4, r5.
    LRU: r2 evicts a's dead leaf (older), r3 must evict two: b's dead leaf, then b itself
    (last used at r1, before a2 at r2); so r4 misses, evicting a2 and then a; r5 misses."""
    src = TokenSource()
    x = {name: src.fresh(1).tolist() for name in "abc"}
    w = workload(*[(x[name] + src.fresh(1).tolist(), []) for name in "abacba"])
    plan = BlockPlan.of(w, 1)
    result = belady(plan, 4)
    assert result.hits.hit_tokens == (0, 0, 1, 0, 1, 1)
    assert result.evictions == 5 and result.rejected == ()
    assert lru(plan, 4) == [0, 0, 1, 0, 0, 0]
    assert naive_belady(plan, 4) == list(result.hits.hit_tokens)
    assert infinite_cache(plan).hits.hit_tokens == (0, 0, 1, 0, 1, 1)


def test_belady_keeps_the_block_needed_soonest():
    """Pool of 3 blocks at block 2: prompts of 3 tokens need 2 blocks and leave 1 cached.
    After A and B only one of them can stay while C runs; A is needed next, so B goes."""
    src = TokenSource()
    first = {name: src.fresh(2).tolist() for name in "ABC"}
    w = workload(*[(first[n] + src.fresh(1).tolist(), []) for n in "ABCAB"])
    plan = BlockPlan.of(w, 2)
    assert plan.footprint == (2,) * 5 and plan.hittable == (1,) * 5
    assert belady(plan, 3).hits.hit_tokens == (0, 0, 0, 2, 0)
    assert lru(plan, 3) == [0, 0, 0, 0, 0]  # LRU evicts A (older) for C, then B for A's rerun


def test_a_block_recomputed_before_its_next_hit_counts_as_never_used():
    """Block 1, pool of 4. r2 (3 fresh tokens) forces 3 evictions: the dead leaves xy and zw,
    then x or z. x appears next in r3 = [x], a 1-token prompt that may hit nothing (len-1
    cap) and recomputes x anyway, so keeping x gains nothing: Belady keeps z, which r4 hits.
    Ranking x by its raw next appearance (r3) would keep x instead and lose r4's hit."""
    x, y, z, w, v, u = 1, 2, 3, 4, 5, 6
    hand = workload(([x, y], []), ([z, w], []), ([10, 11, 12], []), ([x], []), ([z, v], []), ([x, u], []))
    plan = BlockPlan.of(hand, 1)
    assert plan.hittable[3] == 0
    assert belady(plan, 4).hits.hit_tokens == (0, 0, 0, 0, 1, 1)
    assert naive_belady(plan, 4) == [0, 0, 0, 0, 1, 1]


def test_the_running_requests_hit_blocks_are_never_evicted():
    """Pool of 5 at block 1. r2 = [1, 2, 9, 8] hits [1, 2] and needs 2 more blocks: it
    evicts the dead leaf [1, 2, 3], which exposes its own hit block [1, 2] as a leaf. That
    block is pinned, so the second victim must be [5, 6], although r3 hits it next;
    evicting r2's own block instead would let r3 hit 2 tokens."""
    hand = workload(([1, 2, 3], []), ([5, 6], []), ([1, 2, 9, 8], []), ([5, 6, 7], []))
    plan = BlockPlan.of(hand, 1)
    result = belady(plan, 5)
    assert result.hits.hit_tokens == (0, 0, 2, 1)
    assert naive_belady(plan, 5) == [0, 0, 2, 1]


def test_leaves_go_first_even_when_the_parent_is_worth_less():
    """Pool of 4 at block 1. After r0 = [x, y], x's next appearance is r2 = [x], which
    recomputes it (a 1-token prompt hits nothing), so x itself is worth nothing until then,
    while [x, y] is hit by r3. r1 needs 3 blocks and one must go: only the leaf [x, y] may,
    since evicting x under a cached [x, y] would break the prefix. So r3 hits 1 token."""
    x, y = 1, 2
    hand = workload(([x, y], []), ([10, 11, 12], []), ([x], []), ([x, y, 3], []))
    plan = BlockPlan.of(hand, 1)
    assert belady(plan, 4).hits.hit_tokens == (0, 0, 0, 1)
    assert naive_belady(plan, 4) == [0, 0, 0, 1]


def test_a_refreshed_block_is_ranked_by_its_new_next_use():
    """Pool of 4 at block 1. After r1 = [x], x's next appearance r2 = [x] only recomputes
    it (rank: never); r2 refreshes it, and its next use becomes r4's hit. When r3 needs
    room, x must be ranked by that, not by the rank it had before r2: the dead leaf [w, 2]
    and then w (never used again) go, and r4 hits x."""
    w, x = 1, 5
    hand = workload(([w, 2], []), ([x], []), ([x], []), ([10, 11, 12], []), ([x, 6], []))
    plan = BlockPlan.of(hand, 1)
    assert belady(plan, 4).hits.hit_tokens == (0, 0, 0, 0, 1)
    assert naive_belady(plan, 4) == [0, 0, 0, 0, 1]


def test_request_larger_than_the_pool_is_rejected_and_can_make_a_bigger_pool_lose():
    """Pool 2: the 3-block request is refused, so x survives and the third request hits it.
    Pool 3: the big request runs, evicting x: a larger pool ends with fewer hits. This is
    why monotonicity in capacity holds only once every request fits."""
    w = workload(([1, 2], []), ([10, 11, 12], []), ([1, 3], []))
    plan = BlockPlan.of(w, 1)
    small, large = belady(plan, 2), belady(plan, 3)
    assert small.rejected == (1,) and small.hits.hit_tokens == (0, 0, 1)
    assert large.rejected == () and large.hits.hit_tokens == (0, 0, 0)
    assert small.hits.prompt_tokens == (2, 3, 2)  # a rejected request still counts in the ratio
    assert small.hit_ratio == pytest.approx(1 / 7)


def test_unbounded_belady_is_the_ceiling_with_no_evictions():
    w = shared_prefix(num_groups=4, prompts_per_group=5, system_prompt_len=30, question_len=7, output_len=3, seed=1)
    plan = BlockPlan.of(w, 4)
    ceiling = infinite_cache(plan)
    for capacity in (None, plan.num_keys + plan.max_footprint):
        result = belady(plan, capacity)
        assert result.hits == ceiling.hits and result.evictions == 0


def test_last_half_ratio_uses_the_second_half_of_requests():
    counts = HitCounts([0, 0, 5, 9], [10, 10, 10, 10])
    assert counts.hit_ratio == pytest.approx(14 / 40) and counts.last_half_hit_ratio == pytest.approx(14 / 20)
    assert HitCounts([0, 0, 1], [5, 5, 5]).last_half_hit_ratio == pytest.approx(1 / 10)  # from index 3 // 2 = 1
    assert HitCounts([], []).hit_ratio == 0.0
    with pytest.raises(ValueError, match=r"request 0: hit_tokens=5 must be in \[0, prompt_tokens=5\)"):
        HitCounts([5], [5])


def test_bad_capacity_and_block_size_are_named():
    plan = BlockPlan.of(workload(([1, 2, 3], [])), 1)
    with pytest.raises(ValueError, match="capacity_blocks must be an int >= 1"):
        belady(plan, 0)
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockPlan.of(workload(([1], [])), 0)


def test_belady_on_a_generated_workload_sits_between_lru_and_the_ceiling():
    w = shared_prefix(num_groups=6, prompts_per_group=6, system_prompt_len=21, question_len=5, output_len=2, seed=3)
    plan = BlockPlan.of(w, 4)
    ceiling = infinite_cache(plan).hits.total_hit_tokens
    previous = 0
    for capacity in (plan.max_footprint, 12, 20, 30, 60):
        best = belady(plan, capacity).hits.total_hit_tokens
        assert sum(lru(plan, capacity)) <= best <= ceiling
        assert best >= previous
        previous = best
    assert previous == ceiling


# ---------------------------------------------------------------- random workloads


@settings(max_examples=200, deadline=None)
@given(random_workloads(), st.integers(1, 4))
def test_ceiling_equals_brute_force_longest_common_prefix(w, block_size):
    assert list(infinite_cache(BlockPlan.of(w, block_size)).hits.hit_tokens) == brute_force_ceiling(w, block_size)


@settings(max_examples=150, deadline=None)
@given(random_workloads(), st.integers(1, 3), st.integers(0, 12))
def test_belady_agrees_with_naive_belady_and_beats_lru(w, block_size, extra):
    plan = BlockPlan.of(w, block_size)
    capacity = max(plan.max_footprint, 1) + extra
    result = belady(plan, capacity)
    assert list(result.hits.hit_tokens) == naive_belady(plan, capacity)
    assert result.hits.total_hit_tokens >= sum(lru(plan, capacity))
    ceiling = infinite_cache(plan).hits.hit_tokens
    assert all(b <= c for b, c in zip(result.hits.hit_tokens, ceiling, strict=True))


@settings(max_examples=150, deadline=None)
@given(random_workloads(), st.integers(1, 3), st.integers(1, 6))
def test_belady_below_the_largest_request_still_agrees_with_the_naive_model(w, block_size, capacity):
    plan = BlockPlan.of(w, block_size)
    result = belady(plan, capacity)
    assert list(result.hits.hit_tokens) == naive_belady(plan, capacity)
    assert result.rejected == tuple(i for i, f in enumerate(plan.footprint) if f > capacity)


@settings(max_examples=150, deadline=None)
@given(random_workloads(), st.integers(1, 3))
def test_belady_grows_with_capacity_once_every_request_fits(w, block_size):
    plan = BlockPlan.of(w, block_size)
    totals = [belady(plan, plan.max_footprint + extra).hits.total_hit_tokens for extra in range(0, 16)]
    assert totals == sorted(totals)
    assert totals[-1] <= infinite_cache(plan).hits.total_hit_tokens
    assert belady(plan, plan.num_keys + plan.max_footprint).hits == infinite_cache(plan).hits
