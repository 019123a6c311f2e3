"""The `radix` backend through the public protocol (plus the documented `cache.tree`).

Scenario values are SGLang's (shared/reference/sglang_tests.md section 6.3), measured
with its RadixCache and `cache_finished_req` as fixed by PR #16521. SGLang counts KV
slots per token; we count blocks per page, so "frees tail [112]" (one slot of a
partial page) reads here as "the partial page's block is freed".
"""

from __future__ import annotations

import numpy as np
import pytest

import prefixcache
from prefixcache import AllBlocksCleared, BlockRemoved, BlockStored, CacheConfig, build_cache
from prefixcache.eviction import EvictionPolicy
from prefixcache.hashing import block_hashes
from prefixcache import registry
from prefixcache.registry import register_eviction_policy


def radix(block_size: int = 4, num_blocks: int = 64, **kw):
    return build_cache(CacheConfig(backend="radix", block_size=block_size, num_blocks=num_blocks, **kw))


def run(cache, rid, prompt, output=(), namespace=None, release=True):
    """One request as an engine drives it: admit, prefill, decode, finish.

    The KV of every token but the last generated one is computed (the last sampled
    token is never fed back), as in SGLang's kv_committed_len.
    """
    adm = cache.admit(rid, prompt, namespace=namespace)
    assert adm is not None
    cache.commit(rid, len(prompt))
    if output:
        assert cache.append(rid, list(output)) is not None
        cache.commit(rid, len(prompt) + len(output) - 1)
    if release:
        cache.release(rid)
    cache.check_invariants()
    return adm


def sizes(cache):
    return cache.tree.evictable_size, cache.tree.protected_size


def test_registered_and_built_from_yaml(tmp_path):
    assert "radix" in prefixcache.available_backends()
    cache = prefixcache.load_cache("configs/radix.yaml")
    assert type(cache).__name__ == "RadixCache" and cache.block_size == 16


def test_lifecycle_dedup_page_4():
    cache = radix(block_size=4, num_blocks=32)
    # A: prompt 1..10, output 11..13 -> the tree holds 12 tokens; the partial page goes.
    a = run(cache, "A", list(range(1, 11)), [11, 12, 13, 14])
    assert a.num_cached_tokens == 0
    assert cache.tree.total_size == 12
    assert cache.pool.num_free == 32 - 3
    # B: prompt 1..10,50,51 hits 8 (prompt[:-1] cut to whole pages).
    b_prompt = [*range(1, 11), 50, 51]
    adm = cache.admit("B", b_prompt)
    assert adm.num_cached_tokens == 8
    assert sizes(cache) == (4, 8)  # the hit is locked; the rest of A's run is not
    cache.commit("B", len(b_prompt))
    cache.append("B", [60, 61, 62])
    cache.commit("B", len(b_prompt) + 2)
    cache.release("B")
    assert cache.tree.total_size == 16 and sizes(cache) == (16, 0)
    assert cache.match([*b_prompt, 60, 61]).num_tokens == 12
    cache.check_invariants()
    # C: A again -> hit 8, its copies of page [9..12] and its tail are freed.
    free_before = cache.pool.num_free
    c = run(cache, "C", list(range(1, 11)), [11, 12, 13, 14])
    assert c.num_cached_tokens == 8
    assert cache.tree.total_size == 16
    assert cache.pool.num_free == free_before
    assert cache.pool.num_pinned == 16 // 4  # only the tree pins blocks (rule 7)


def test_lifecycle_a_then_c_tree_stays_at_12():
    """Issue 4's scenario as written: A, then C with the same prompt and output."""
    cache = radix(block_size=4, num_blocks=32)
    run(cache, "A", list(range(1, 11)), [11, 12, 13, 14])  # 13 tokens computed: 12 cached, the tail freed
    assert cache.tree.total_size == 12 and cache.pool.num_free == 32 - 3
    c = run(cache, "C", list(range(1, 11)), [11, 12, 13, 14])
    assert c.num_cached_tokens == 8  # prompt[:-1] cut to whole pages
    assert cache.tree.total_size == 12  # C's copy of page [9..12] was a duplicate: freed
    assert cache.pool.num_free == 32 - 3 and cache.pool.num_pinned == 3
    assert cache.match(list(range(1, 14))).num_tokens == 12


def test_token_arguments_are_checked_with_the_field_named():
    cache = radix(block_size=4)
    seq = r"^tokens: expected a sequence of int token ids \(list, tuple, numpy int array\); got "
    for bad, name in ((None, "NoneType"), (5, "int"), ("abc", "str")):
        with pytest.raises(TypeError, match=seq + name + "$"):
            cache.admit("x", bad)
        with pytest.raises(TypeError, match=seq + name + "$"):
            cache.match(bad)
    item = r"^tokens\[{}\]: expected an int32 token id in \[-2\*\*31, 2\*\*31\); got "
    with pytest.raises(TypeError, match=item.format(0) + r"float 1\.0$"):
        cache.admit("x", [1.0, 2.0])
    with pytest.raises(TypeError, match=item.format(2) + "NoneType None$"):
        cache.match([1, 2, None])
    with pytest.raises(TypeError, match=item.format(0) + "bool True$"):  # was accepted as 1
        cache.admit("x", [True, 2])
    with pytest.raises(ValueError, match=item.format(1) + "int 2147483648$"):
        cache.admit("x", [1, 2**31])
    run(cache, "r", [1, 2, 3, 4, 5], release=False)
    with pytest.raises(TypeError, match=item.format(1) + "float 5.5$"):
        cache.append("r", [7, 5.5])
    assert cache.pool.num_free == 64 - 2 and cache.tree.total_size == 4
    cache.release("r")
    cache.check_invariants()


def test_numpy_ids_are_ints():
    cache = radix(block_size=4)
    prompt = list(range(1, 12))
    run(cache, "a", prompt)
    for form in (np.arange(1, 12), np.arange(1, 12, dtype=np.int32), [np.int64(t) for t in prompt]):
        assert cache.match(form).num_tokens == 8
        assert cache.admit("b", form).num_cached_tokens == 8
        assert cache.append("b", np.array([1], dtype=np.int64)) == []  # 12 tokens: still 3 pages
        cache.release("b")
    cache.check_invariants()


def test_commit_shares_pages_and_frees_the_requests_copy():
    cache = radix(block_size=4, num_blocks=32)
    prompt = list(range(100, 112))
    a = cache.admit("A", prompt)
    cache.commit("A", 8)  # chunked prefill: two pages computed
    b = cache.admit("B", prompt)
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]  # rule 4
    cache.commit("B", 12)
    cache.commit("A", 12)  # A computed page 3 too: radix frees A's copy (rule 4)
    assert cache.block_table("A") == cache.block_table("B")
    assert cache.pool.ref_count(a.block_table[2]) == 0
    cache.check_invariants()
    for rid in ("A", "B"):
        cache.release(rid)
    cache.check_invariants()
    assert cache.pool.num_pinned == 3


@pytest.mark.parametrize("page,length,expected", [(1, 5, 5), (2, 5, 4), (4, 6, 4), (16, 15, 0), (16, 33, 32)])
def test_page_alignment_boundary(page, length, expected):
    cache = radix(block_size=page, num_blocks=64)
    run(cache, "r", list(range(length)))
    assert cache.match(list(range(length))).num_tokens == expected


def test_admit_caps_hit_at_len_minus_one():
    cache = radix(block_size=1)
    run(cache, "r1", [1, 2, 3])
    assert cache.match([1, 2, 3]).num_tokens == 3  # a plain look-up is not capped
    assert cache.admit("r2", [1, 2, 3]).num_cached_tokens == 2  # rule 1


def test_namespaces_never_share_blocks():
    cache = radix(block_size=1)
    tables = {ns: run(cache, ns or "none", [1, 2, 3, 4], namespace=ns).block_table for ns in ("a", "b", None)}
    seen = set()
    for ns, table in tables.items():
        m = cache.match([1, 2, 3, 4], namespace=ns)
        assert m.block_ids == table
        assert not seen & set(table)
        seen |= set(table)
    assert cache.match([1, 2, 3, 4], namespace="nobody").num_tokens == 0
    assert cache.tree.namespaces() == [None, "a", "b"]
    assert cache.admit("again", [1, 2, 3, 4, 5], namespace="b").block_table[:4] == tables["b"]


def test_events_page_4_chain_parent_hashes():
    cache = radix(block_size=4)
    run(cache, "r", [1, 2, 3, 4, 1, 2, 3, 4, 9])
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    assert len(stored) == 2
    first, second = stored
    assert first.block_hashes != second.block_hashes
    assert first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[0]
    assert (first.token_ids, second.token_ids, first.block_size) == ((1, 2, 3, 4), (1, 2, 3, 4), 4)
    # The same chained hashes the hash backend computes, so one consumer serves both.
    assert [*first.block_hashes, *second.block_hashes] == block_hashes([1, 2, 3, 4, 1, 2, 3, 4], 4, "sha256_cbor")


def test_events_chain_across_commits_and_namespaces():
    cache = radix(block_size=2, hash=prefixcache.HashConfig(algorithm="xxhash", seed="s"))
    tokens = [5, 6, 7, 8, 9, 10, 11]
    cache.admit("r", tokens, namespace="tenant")
    cache.commit("r", 3)  # one page now, the rest at release
    cache.commit("r", 7)
    cache.release("r")
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    expected = block_hashes(tokens, 2, "xxhash", namespace="tenant", seed="s")
    assert [e.block_hashes[0] for e in stored] == expected
    assert [e.parent_block_hash for e in stored] == [None, *expected[:-1]]
    assert stored[0].extra_keys == (("tenant",),)  # vLLM's published (untagged) form, as the hash backend
    assert all(e.extra_keys == (None,) for e in stored[1:])


def test_events_survive_a_split():
    """SGLang test_hash_value_split: [1,2,3,4] then [1,2,5,6] at page 2 splits the first
    node at (1, 2); the new page chains to (1, 2)'s hash, and evicting [3, 4] reports
    the hash stored for it."""
    cache = radix(block_size=2)
    run(cache, "a", [1, 2, 3, 4, 0])
    run(cache, "b", [1, 2, 5, 6, 0])
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    assert [e.token_ids for e in stored] == [(1, 2), (3, 4), (5, 6)]
    assert stored[2].parent_block_hash == stored[0].block_hashes[0]
    assert stored[2].block_hashes[0] == block_hashes([1, 2, 5, 6], 2)[1]
    assert cache.evict(1) == 1  # the LRU leaf: [3, 4]
    assert cache.drain_events() == [BlockRemoved(stored[1].block_hashes, group_idx=0)]


@pytest.mark.parametrize("page", [1, 2])
def test_events_one_per_page(page):
    cache = radix(block_size=page)
    run(cache, "r", [1, 2, 3, 4, 5], [6, 7])
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    assert stored and all(len(e.token_ids) == page == e.block_size for e in stored)
    assert len(stored) == 6 // page


def test_events_removed_on_eviction_and_cleared_on_reset():
    cache = radix(block_size=2)
    run(cache, "a", [1, 2, 3, 4, 5])
    run(cache, "b", [7, 8, 9])
    stored = {e.token_ids: e.block_hashes[0] for e in cache.drain_events() if isinstance(e, BlockStored)}
    assert cache.evict(1) == 2  # the LRU leaf [1,2,3,4] goes whole: 2 blocks
    removed = cache.drain_events()
    assert removed == [BlockRemoved((stored[(1, 2)],), group_idx=0), BlockRemoved((stored[(3, 4)],), group_idx=0)]
    assert cache.stats().evictions == 2
    assert cache.reset() is True
    assert cache.drain_events() == [AllBlocksCleared()]
    assert cache.tree.total_size == 0 and cache.pool.num_free == cache.pool.num_blocks
    assert cache.stats().evictions == 0


def test_events_disabled_never_hash(monkeypatch):
    import prefixcache.backends.radix as backend

    def boom(*args, **kwargs):
        raise AssertionError("hashed with events disabled")

    monkeypatch.setattr(backend, "block_hashes", boom)
    cache = radix(block_size=2, enable_events=False)
    run(cache, "r", [1, 2, 3, 4, 5])
    cache.evict(10)
    cache.reset()
    assert cache.drain_events() == []


def test_admit_evicts_to_make_room():
    cache = radix(block_size=2, num_blocks=6)
    run(cache, "a", [1, 2, 3, 4, 5])  # 2 pages cached
    run(cache, "b", [7, 8, 9, 10, 11])  # 2 more
    assert cache.pool.num_free == 2
    cache.admit("c", [7, 8, 9, 10, 11])  # a hit on b's run refreshes it; 1 block, no eviction
    cache.release("c")
    assert cache.stats().evictions == 0
    # 3 blocks needed, 2 free: like SGLang 0.5.23's allocator (evict_to_free_tokens),
    # evict the shortfall (1 block's worth), not the whole need: the LRU run [1..4]
    # goes whole (2 blocks), b's stays. (SGLang 0.5.6 evicted the need: both runs.)
    adm = cache.admit("d", [20, 21, 22, 23, 24, 25])
    assert adm is not None and adm.num_cached_tokens == 0
    assert cache.stats().evictions == 2
    assert cache.match([1, 2, 3, 4]).num_tokens == 0 and cache.match([7, 8, 9, 10]).num_tokens == 4
    cache.check_invariants()


def test_admit_eviction_spares_its_own_hit():
    cache = radix(block_size=2, num_blocks=5)
    run(cache, "a", [1, 2, 3, 4, 5])  # 2 pages cached, the LRU run
    run(cache, "b", [7, 8, 9])  # 1 page
    adm = cache.admit("c", [1, 2, 3, 4, *range(40, 46)])  # hits 2 pages, needs 3 blocks, 2 free
    assert adm.num_cached_tokens == 4
    assert cache.match([1, 2, 3, 4]).num_tokens == 4  # locked before evicting
    assert cache.match([7, 8]).num_tokens == 0
    cache.check_invariants()


def test_admit_without_room_returns_none_and_changes_nothing():
    cache = radix(block_size=2, num_blocks=6)
    run(cache, "a", [1, 2, 3, 4, 5])
    hold = cache.admit("hold", [1, 2, 3, 4, 6, 7])  # locks [1..4], takes 1 block
    assert hold.num_cached_tokens == 4
    tree = cache.tree
    before = (tree.total_size, tree.num_nodes, tree.clock, sizes(cache), cache.pool.num_free, cache.stats())
    # 4 blocks needed; 3 free and nothing evictable outside the locked path.
    assert cache.admit("big", [1, 2, 3, 4, *range(30, 38)]) is None
    after = (tree.total_size, tree.num_nodes, tree.clock, sizes(cache), cache.pool.num_free, cache.stats())
    assert after[:-1] == before[:-1]
    assert after[-1].rejected == before[-1].rejected + 1
    assert after[-1].requests == before[-1].requests  # a refused admission counts only as rejected
    with pytest.raises(KeyError):
        cache.block_table("big")
    cache.check_invariants()


def test_append_is_atomic():
    cache = radix(block_size=2, num_blocks=4)
    cache.admit("r", [1, 2, 3])  # 2 blocks
    assert cache.append("r", [4]) == []  # fits in the partial page
    assert cache.append("r", [5, 6, 7, 8]) == [2, 3]
    assert cache.append("r", [9]) is None  # nothing left, nothing evictable
    assert len(cache.block_table("r")) == 4 and cache.stats().rejected == 1
    cache.commit("r", 8)
    assert cache.append("r", [9]) is None  # its own pages are locked
    cache.release("r")
    cache.check_invariants()
    assert cache.tree.total_size == 8 and cache.pool.num_free == 0


def test_request_errors():
    cache = radix()
    with pytest.raises(ValueError, match="at least one token"):
        cache.admit("r", [])
    cache.admit("r", [1, 2, 3])
    with pytest.raises(ValueError, match="already live"):
        cache.admit("r", [1])
    with pytest.raises(ValueError, match="num_computed_tokens"):
        cache.commit("r", 4)
    with pytest.raises(TypeError, match="namespace"):
        cache.admit("x", [1], namespace=3)
    with pytest.raises(ValueError, match="int32"):
        cache.admit("x", [1 << 40])
    with pytest.raises(ValueError, match="int32"):
        cache.append("r", [1 << 40])
    with pytest.raises(ValueError, match="num_blocks: expected an int >= 0; got -1"):
        cache.evict(-1)
    with pytest.raises(TypeError, match="num_blocks: expected an int >= 0; got float 1.5"):
        cache.evict(1.5)
    cache.release("r")
    with pytest.raises(KeyError):
        cache.release("r")
    with pytest.raises(KeyError):
        cache.append("nobody", [1])
    cache.check_invariants()


def test_reset_refuses_while_a_request_is_live():
    cache = radix()
    run(cache, "a", list(range(9)))
    cache.admit("live", [1, 2])
    assert cache.reset() is False
    assert cache.tree.total_size == 8
    cache.release("live")
    assert cache.reset() is True
    assert cache.stats() == prefixcache.CacheStats()
    cache.check_invariants()


def test_evict_returns_blocks_freed_possibly_more():
    cache = radix(block_size=2)
    run(cache, "a", list(range(9)))  # one 4-page leaf
    assert cache.evict(0) == 0
    assert cache.evict(1) == 4
    assert cache.evict(5) == 0


def test_release_without_commit_keeps_the_hit_and_frees_the_rest():
    cache = radix(block_size=2)
    run(cache, "a", [1, 2, 3, 4, 5])
    cache.admit("b", [1, 2, 3, 4, 9, 9])
    cache.release("b")  # aborted before any commit
    assert cache.tree.total_size == 4
    cache.check_invariants()
    assert cache.pool.num_pinned == 2


def test_stats_count_queries_and_hits():
    cache = radix(block_size=1)
    run(cache, "a", [1, 2, 3, 4])
    run(cache, "b", [1, 2, 3, 4])
    s = cache.stats()
    assert (s.requests, s.queries, s.hits) == (2, 8, 3)


def test_priority_policy_uses_admit_priority():
    cache = radix(block_size=1, eviction="priority")
    cache.admit("vip", [1, 2], priority=5)
    cache.commit("vip", 2)
    cache.release("vip")
    run(cache, "low", [3, 4])
    cache.evict(1)
    assert (cache.match([1, 2]).num_tokens, cache.match([3, 4]).num_tokens) == (2, 0)
    with pytest.raises(TypeError, match="priority"):
        cache.admit("x", [1], priority="high")


class LongestFirst(EvictionPolicy):
    """A plugin policy with no native order: the tree asks Python once per leaf, when it
    becomes a candidate or changes, and keeps the key in its leaf order."""

    calls = 0

    def priority(self, candidate):
        LongestFirst.calls += 1
        return (-candidate.num_tokens, candidate.last_access_time)


@pytest.fixture
def longest_first(monkeypatch):
    """`test_longest_first` registered for one test: the registry other tests list is left as it was."""
    monkeypatch.setattr(registry, "_eviction_policies", dict(registry._eviction_policies))
    register_eviction_policy("test_longest_first")(LongestFirst)


def test_custom_python_policy(longest_first):
    cache = radix(block_size=1, eviction="test_longest_first")
    run(cache, "a", [1, 2, 3, 4, 5, 6])
    run(cache, "b", [7, 8])
    LongestFirst.calls = 0
    assert cache.evict(1) == 6  # the longest run
    run(cache, "c", [9, 9, 9, 9])
    assert cache.evict(1) == 4  # the longest, although the most recent
    assert cache.match([7, 8]).num_tokens == 2
    # a and b ranked as they became candidates, then c; b, unchanged, is not asked again
    # (the tree keeps its key: a leaf order, not a heap rebuilt per eviction).
    assert LongestFirst.calls == 2 + 1


def test_gslru_protects_reused_content_and_remembers_it_after_eviction():
    """gslru on the tree: a prefix used twice outlives a flood of one-off prompts that
    pushes it out under LRU; content evicted and inserted again continues its use count."""
    caches = {e: radix(num_blocks=12, eviction=e, enable_events=False) for e in ("lru", "gslru")}
    shared = list(range(9))
    for cache in caches.values():
        run(cache, "a", shared)
        run(cache, "b", shared)
        for i in range(6):
            run(cache, f"x{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 9)))
        cache.check_invariants()
    assert caches["lru"].match(shared).num_tokens < 8
    assert caches["gslru"].match(shared).num_tokens == 8
    cache = caches["gslru"]
    cache.evict(12)
    assert cache.tree.total_size == 0 and cache.tree.ghost_size > 0
    run(cache, "c", shared)
    leaf = cache.tree.node(cache.tree.match(shared).node)
    assert leaf.use_count == 3  # two uses before the eviction, one now


def test_finished_request_reinserts_its_prompt_with_priority_plus_one():
    """SGLang 0.5.23's checkpoint(split_prompt=True): once a request's insert passes its
    prompt, the prompt is inserted again with priority + 1, so under `priority` the
    output goes before any prompt."""
    cache = radix(block_size=2, eviction="priority")
    run(cache, "a", [1, 2, 3, 4], output=[5, 6, 7])  # prompt [1..4], output [5, 6] cached
    prompt = cache.tree.node(cache.tree.match([1, 2, 3, 4]).node)
    output = cache.tree.node(cache.tree.match([1, 2, 3, 4, 5, 6]).node)
    assert (prompt.priority, output.priority) == (1, 0)
    assert output.parent == prompt.id  # the prompt's end is a node boundary
    run(cache, "b", [9, 9])  # a newer prompt-only run, priority 1
    assert cache.evict(1) == 1  # the output leaf goes first, although older
    assert cache.match([1, 2, 3, 4, 5, 6]).num_tokens == 4 and cache.match([9, 9]).num_tokens == 2


def test_decode_step_makes_a_page_of_room_as_sglang_does():
    """SGLang's paged decode allocation demands a page of room per request every step
    (alloc_paged_token_slots_decode), even on a step that starts no page: with no free
    block left, a decode step evicts one leaf's worth."""
    cache = radix(block_size=2, num_blocks=4)
    run(cache, "a", [1, 2, 3])  # caches [1, 2]
    cache.admit("b", [5, 6, 7])  # 2 blocks, 1 free left
    cache.commit("b", 3)
    assert cache.append("b", [8]) == []  # [7, 8] fits in b's last block
    assert cache.stats().evictions == 0  # one free block: a page of room already
    cache.append("b", [9])
    cache.commit("b", 5)
    assert cache.pool.num_free == 0 and cache.stats().evictions == 0
    assert cache.append("b", [10]) == []  # no block needed, but no room: evict a page
    assert cache.stats().evictions == 1 and cache.match([1, 2]).num_tokens == 0
    cache.check_invariants()


def test_decode_step_that_starts_a_page_evicts_when_no_block_is_free():
    """append's fast path tries the allocation once; when it fails, _grow evicts a cached
    page and allocates (no second failed try, no refusal). Page 1: every step starts one."""
    cache = radix(block_size=1, num_blocks=4)
    run(cache, "a", [1, 2])  # caches [1, 2]
    cache.admit("b", [5, 6])
    cache.commit("b", 2)
    assert cache.pool.num_free == 0
    new = cache.append("b", [7])
    assert len(new) == 1 and cache.block_table("b")[-1] == new[0]
    assert cache.stats().evictions >= 1 and cache.match([1, 2]).num_tokens < 2
    cache.commit("b", 3)
    cache.release("b")
    cache.check_invariants()
