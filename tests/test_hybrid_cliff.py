"""No tail-window cliff: an idle branch's reusable prefix never falls from more than a
window to 0 while its full-attention KV is still resident (`no_tail_cliff: true`).

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
