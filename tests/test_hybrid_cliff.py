"""No tail-window cliff: an idle branch's reusable prefix never falls from more than a
window to 0 while its full-attention KV is still resident (`no_tail_cliff: true`, `hash`
and `radix`).

A branch is cached (prompt, then decode long enough that its prompt's window tail falls
out of the window and is freed early), then released and left idle while the pool
evicts one block at a time. After each eviction: the branch's hit (what a request that
continues it would reuse) and how much of its full-attention KV is still cached. vLLM
0.33's order (the default) evicts the early-freed window tail first: the hit falls from
the whole prompt to 0 with every full-attention block still resident (shown below).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import prefixcache
from prefixcache.config import CacheConfig
from prefixcache.hashing import chain_digests, none_hash
from prefixcache.isolation import exact_key
from prefixcache.layout import LayerGroup


def _branch_under_eviction(window: int, prompt_blocks: int, decode: int, bs: int, no_tail_cliff: bool):
    """(hit, full KV resident) of the idle branch after each single-block eviction."""
    groups = (LayerGroup("full_attention"), LayerGroup("sliding_window", window=window))
    blocks = 2 * (prompt_blocks + decode // bs + 2) + 4
    cache = prefixcache.build_cache(CacheConfig(block_size=bs, num_blocks=blocks, layout=groups, enable_events=False,
                                                options={"retention": "dense", "no_tail_cliff": no_tail_cliff}))  # fmt: skip
    prompt = list(range(1, prompt_blocks * bs + 1))
    cache.admit("a", prompt)
    cache.commit("a", len(prompt))
    n = len(prompt)
    for t in range(decode):
        assert cache.append("a", [10_000 + t]) is not None
        n += 1
        cache.commit("a", n)
    cache.release("a")
    probe = prompt + [99_999]
    digests = chain_digests(prompt, bs, "sha256_cbor", none_hash("sha256_cbor"))
    out = []
    while True:
        resident = len(cache.pool.lookup_chain_packed(digests, len(digests) // prompt_blocks)) * bs
        out.append((cache.match(probe).num_tokens, resident))
        if cache.evict(1) == 0:
            return out


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(2, 64),
    prompt_blocks=st.integers(2, 12),
    decode=st.integers(0, 80),
    bs=st.sampled_from([4, 8, 16]),
)
def test_an_idle_branch_never_falls_off_a_cliff(window, prompt_blocks, decode, bs):
    trace = _branch_under_eviction(window, prompt_blocks, decode, bs, no_tail_cliff=True)
    for (before, _), (after, resident) in zip(trace, trace[1:]):
        if before > window and after == 0:
            assert resident < before, f"hit {before} -> 0 with {resident} tokens of full KV resident: {trace}"


def test_vllms_order_has_the_cliff():
    trace = _branch_under_eviction(window=16, prompt_blocks=8, decode=64, bs=8, no_tail_cliff=False)
    assert any(before > 16 and after == 0 and resident >= before for (before, _), (after, resident) in zip(trace, trace[1:]))


# -- radix ------------------------------------------------------------------------------
# SGLang's pools evict on their own: its SWA LRU tombstones a branch's windows whatever
# the branch's full-attention KV does, so a branch whose last matchable window goes keeps
# its full KV cached, unmatchable (SGLang PR 35515). No public call evicts one pool alone,
# so these drive the tree's per-component eviction (`tree.evict`), one unit at a time.

RADIX_LAYOUTS = {
    "full+swa": lambda w: (LayerGroup("full_attention"), LayerGroup("sliding_window", window=w, pool_ratio=1.0)),
    "full+swa+mamba": lambda w: (LayerGroup("full_attention"), LayerGroup("sliding_window", window=w, pool_ratio=1.0),
                                 LayerGroup("mamba", slots=48)),  # fmt: skip
}


def _radix(layout: str, window: int, bs: int, blocks: int, no_tail_cliff: bool):
    options = {"no_tail_cliff": no_tail_cliff}
    if "mamba" in layout:
        options.update(mamba_chunk=bs, mamba_track_interval=bs)
    return prefixcache.build_cache(CacheConfig(backend="radix", block_size=bs, num_blocks=blocks, enable_events=False,
                                               layout=RADIX_LAYOUTS[layout](window), options=options))  # fmt: skip


def _serve(cache, rid, prompt: list[int], decode: list[int]):
    """Admit, commit at the checkpoints and the prompt's end, decode, release; the admission."""
    adm = cache.admit(rid, prompt)
    for c in adm.checkpoints:
        cache.commit(rid, c)
    cache.commit(rid, len(prompt))
    n = len(prompt)
    for t in decode:
        assert cache.append(rid, [t]) is not None
        n += 1
        cache.commit(rid, n)
    cache.release(rid)
    return adm


def _full_resident(cache, tokens: list[int]) -> int:
    """TOKENS of `tokens` whose full-attention pages the tree still holds (matched or not)."""
    return cache.tree.match(tokens, exact_key(None)).full_hit


def _radix_branch_under_eviction(layout, window, prompt_blocks, decode, bs, no_tail_cliff, picks):
    """(hit, full KV resident) of an idle branch (a prompt and its decode, released) after
    each single-unit eviction of the component `picks` draws."""
    from prefixcache.backends.hybrid_radix_tree import Component

    cache = _radix(layout, window, bs, 4 * (prompt_blocks + decode // bs + 2) + 60, no_tail_cliff)
    prompt = list(range(1, prompt_blocks * bs + 1))
    decoded = [10_000 + t for t in range(decode)]
    _serve(cache, "a", prompt, decoded)
    probe = prompt + decoded + [99_999]  # the branch's next turn
    components = [c for c in Component if c in cache.tree.components]
    out = [(cache.match(probe).num_tokens, _full_resident(cache, probe))]
    while cache.tree.num_nodes > 1:
        freed = cache.tree.evict({picks(components): 1})
        if not any(freed.values()):  # that pool has nothing left to evict: full attention does
            cache.tree.evict({Component.FULL: 1})
        cache.check_invariants()
        out.append((cache.match(probe).num_tokens, _full_resident(cache, probe)))
    return out


@settings(max_examples=40, deadline=None)
@given(
    layout=st.sampled_from(sorted(RADIX_LAYOUTS)),
    window=st.integers(2, 64),
    prompt_blocks=st.integers(2, 12),
    decode=st.integers(0, 300),
    bs=st.sampled_from([4, 8, 16]),
    data=st.data(),
)
def test_radix_an_idle_branch_never_falls_off_a_cliff(layout, window, prompt_blocks, decode, bs, data):
    trace = _radix_branch_under_eviction(layout, window, prompt_blocks, decode, bs, True,
                                         lambda cs: data.draw(st.sampled_from(cs)))  # fmt: skip
    for (before, _), (after, resident) in zip(trace, trace[1:]):
        if before > window and after == 0:
            assert resident == 0, f"hit {before} -> 0 with {resident} tokens of full KV resident: {trace}"


def test_sglangs_order_has_the_cliff():
    from prefixcache.backends.hybrid_radix_tree import Component

    # SWA pressure alone: the prompt's windows go first (older), then the decode's tail.
    trace = _radix_branch_under_eviction("full+swa", 16, 8, 64, 8, False, lambda cs: Component.SWA)
    assert any(before > 16 and after == 0 and resident > 16 for (before, _), (after, resident) in zip(trace, trace[1:]))
    trace = _radix_branch_under_eviction("full+swa", 16, 8, 64, 8, True, lambda cs: Component.SWA)
    assert all(after or not resident for _, (after, resident) in zip(trace, trace[1:])), trace


def _evicted_last(cache, component, kept_for_last) -> None:
    """Evict `component` one unit at a time until none is unlocked: a node in
    `kept_for_last()` (node ids) loses it only once every unlocked one is such a node."""
    tree = cache.tree
    reached = False
    while live := {n.id for n in tree.lru[component].order() if not n.locks[component]}:
        last = kept_for_last() & live
        tree.evict({component: 1})
        gone = live - {n.id for n in tree.lru[component].order()}
        assert gone, f"a {component.name} eviction took nothing"
        if gone & last:
            reached = True
            assert live <= last, f"{component.name} of {sorted(gone & last)} went while {sorted(live - last)} stayed"
        cache.check_invariants()
    assert reached, "the walk never reached the nodes kept for last"


def test_radix_branch_tails_are_the_last_windows_evicted():
    """Idle branches off a shared prefix, SWA eviction one unit at a time: a window the end
    of a matchable branch reads goes only once no other unlocked window is left."""
    from prefixcache.backends.hybrid_radix_tree import SWA

    bs, window = 4, 9
    cache = _radix("full+swa", window, bs, 400, True)
    shared = list(range(1, 25))
    for i in range(4):
        _serve(cache, i, shared + [100 * i + k for k in range(1, 13)], [1000 * i + k for k in range(3 + 11 * i)])
    _serve(cache, 9, shared + [7, 7, 7, 7], [])
    tree, w = cache.tree, window - 1

    def branch_end(leaf) -> bool:  # the next turn of the branch ending at `leaf` hits it whole
        tokens = [t for node in tree.path_nodes(leaf) for t in node.key]
        return cache.match(tokens + [99_999]).num_tokens == len(tokens)

    def tails() -> set[int]:
        out = set()
        for leaf in [n for n in tree.nodes() if n is not tree.root and not n.children and branch_end(n)]:
            end = sum(len(n.key) for n in tree.path_nodes(leaf))
            start = 0
            for node in tree.path_nodes(leaf):
                start += len(node.key)
                if start > end - w:  # the node holds a token of the window the leaf's end reads
                    out.add(node.id)
        return out

    _evicted_last(cache, SWA, tails)


def test_radix_a_branchs_deepest_state_is_the_last_evicted():
    """Conversations (each turn extends the last) in a full+mamba tree, state eviction one
    at a time: the state a branch's next turn resumes from (the deepest on its path) goes
    only once no other unlocked state is left."""
    from prefixcache.backends.hybrid_radix_tree import MAMBA

    bs = 4
    cache = prefixcache.build_cache(CacheConfig(
        backend="radix", block_size=bs, num_blocks=600, enable_events=False,
        layout=(LayerGroup("full_attention"), LayerGroup("mamba", slots=120)),
        options={"no_tail_cliff": True, "mamba_chunk": bs, "mamba_track_interval": 2 * bs}))  # fmt: skip
    tree = cache.tree
    rid = 0
    for c in range(3):
        history = [1000 * (c + 1) + k for k in range(10)]
        for turn in range(3):
            answer = [50_000 + 100 * c + 10 * turn + k for k in range(6)]
            _serve(cache, rid, history, answer)
            rid += 1
            history = history + answer + [60_000 + 10 * c + turn] * 3

    def deepest() -> set[int]:
        out = set()
        for leaf in [n for n in tree.nodes() if n is not tree.root and not n.children]:
            with_state = [n.id for n in tree.path_nodes(leaf) if n.mamba is not None]
            if with_state:
                out.add(with_state[-1])
        return out

    _evicted_last(cache, MAMBA, deepest)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), slots=st.integers(6, 40), chunk=st.sampled_from([0, 8]))
def test_radix_the_inner_state_walk_evicts_what_walking_every_state_would(data, slots, chunk):
    """`no_tail_cliff`'s first state walk visits only the states on inner nodes (a leaf's
    is always its branch's deepest): against a twin whose walk asks every state of the
    LRU, under random conversations and shared prefixes in a crowded state pool, every
    admission hits the same and the trees hold the same states after every request."""
    def build():
        return prefixcache.build_cache(CacheConfig(
            backend="radix", block_size=4, num_blocks=400 + slots, enable_events=False,
            layout=(LayerGroup("full_attention"), LayerGroup("mamba", slots=slots)),
            options={"no_tail_cliff": True, "mamba_chunk": 4, "mamba_track_interval": 8,
                     "chunked_prefill_size": chunk}))  # fmt: skip

    fast, twin = build(), build()

    twin.tree.walk_every_state(True)  # the model's walk_aux with _deepest_state as its skip
    histories = [[1000 * (c + 1) + k for k in range(data.draw(st.integers(4, 12)))] for c in range(6)]
    for rid in range(data.draw(st.integers(6, 30))):
        c = data.draw(st.integers(0, len(histories) - 1))
        answer = [50_000 + 97 * rid + k for k in range(data.draw(st.integers(0, 10)))]
        hits = [_serve(cache, rid, histories[c], answer).num_cached_tokens for cache in (fast, twin)]
        fast.check_invariants()
        twin.check_invariants()
        assert hits[0] == hits[1], (rid, hits)
        assert _state_paths(fast) == _state_paths(twin), rid
        histories[c] = histories[c] + answer + [60_000 + rid] * data.draw(st.integers(1, 6))


def _state_paths(cache) -> list[tuple[int, ...]]:
    """The tokens from the root to every node holding a state, sorted."""
    tree = cache.tree
    return sorted(tuple(t for n in tree.path_nodes(node) for t in n.key) for node in tree.nodes()
                  if node is not tree.root and node.mamba is not None)
