"""Tables a cache keeps per namespace follow what it holds, not every namespace it has seen.

Three tables were keyed by namespace and only ever grew: the tiers' namespace tags (the
small int a block's events name its namespace by), a lineage radix cache's root names (what
a namespace's first pages follow in the tiers) and the hybrid radix cache's tree key ->
namespace map (for its events). A server giving each request its own `cache_salt` grew by
about 100 bytes a request, forever. Each is now pruned of the namespaces nothing holds
(`SPARE_NAMESPACES` beyond twice what it kept last time), and these tests hold both halves:
the tables stay bounded, and pruning never forgets a namespace something still carries
(events still name the namespace a block was computed in; a tier copy is still found).
"""

from __future__ import annotations

import pytest

import prefixcache
from prefixcache.config import CacheConfig
from prefixcache.events import BlockStored
from prefixcache.isolation import SPARE_NAMESPACES, Isolation, LoRA
from prefixcache.layout import LayerGroup
from prefixcache.tier_config import TierConfig

BS = 4
TENANTS = 3 * SPARE_NAMESPACES  # enough one-request tenants to prune every table twice


def tiered(backend: str, events: bool, device: int = 16, host: int = 64):
    return prefixcache.build_cache(CacheConfig(backend=backend, block_size=BS, num_blocks=device,
                                               enable_events=events, tiers=(TierConfig("CPU", host),)))  # fmt: skip


def tenant(i: int) -> Isolation:
    """A namespace of its own whose events name it on every block (an adapter)."""
    return Isolation(salt=f"s{i}", lora=LoRA(f"a{i}", "/adapters/a", id=i + 1))


def serve(cache, i: int, prompt: list[int], namespace) -> int:
    adm = cache.admit(i, prompt, namespace=namespace)
    assert adm is not None
    cache.commit(i, len(prompt))
    cache.release(i)
    cache.drain_transfers()
    return adm.num_cached_tokens


@pytest.mark.parametrize("backend", ["hash", "radix"])
@pytest.mark.parametrize("events", [False, True])
def test_one_request_tenants_leave_bounded_tables(backend, events):
    cache = tiered(backend, events)
    for i in range(TENANTS):
        serve(cache, i, [i, i + 1, i + 2] * BS, tenant(i))
        cache.drain_events()
    cache.check_invariants()
    held = cache.config.num_blocks + 64  # device blocks and host slots: each carries one namespace at most
    limit = 2 * (held + 1) + SPARE_NAMESPACES
    assert len(cache.tiers._tags) <= limit and len(cache.tiers._namespaces) <= limit
    if not events:
        assert cache.tiers._tags == {None: 0}  # nothing reads a tag without events
    if backend == "radix" and not events:  # lineage: root names
        assert cache._lineage and len(cache._roots) <= limit


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_a_demoted_block_names_the_namespace_it_was_computed_in(backend):
    """Tags are given out again once pruned: a block demoted long after its namespace's
    last request, past several prunings, still names that namespace in its event."""
    cache = tiered(backend, True, device=16, host=256)
    computed: dict[bytes, tuple] = {}
    lower = 0
    for i in range(TENANTS):
        ns = tenant(i % (TENANTS // 3) if i % 7 == 0 else i)  # some namespaces come back
        serve(cache, i, [i % 97, 5, 6, 7] * BS, ns)
        for e in cache.drain_events():
            if not isinstance(e, BlockStored):
                continue
            names = (e.lora_id, e.lora_name)
            for j, h in enumerate(e.block_hashes):
                if e.medium == "GPU":
                    computed[h] = (names, e.extra_keys[j] if e.extra_keys else None)
                else:
                    lower += 1
                    assert (names, e.extra_keys[j] if e.extra_keys else None) == computed[h], (i, e.medium)
    assert lower > 1000  # the host tier stored blocks throughout
    assert len(cache.tiers._tags) < TENANTS // 2  # and the tags were pruned on the way
    cache.check_invariants()


def test_lineage_keeps_the_root_names_its_tier_copies_follow():
    """A namespace whose pages live only in the host tier keeps its root name through
    every pruning: its next request finds them there."""
    cache = tiered("radix", False, device=16, host=512)
    kept = [100_000 + t for t in range(3 * BS)]
    assert serve(cache, -1, kept, "kept") == 0
    for i in range(TENANTS):
        serve(cache, i, [i, i + 1, i + 2] * BS, tenant(i))
        if i % 100 == 99:  # by now "kept" left the device (16 blocks) for the host
            assert serve(cache, -1, kept, "kept") == len(kept) - BS  # all but the last page (admit never hits it)
    assert len(cache._roots) < TENANTS // 2
    cache.check_invariants()


def test_the_hybrid_radix_cache_forgets_namespaces_its_tree_no_longer_holds():
    layout = (LayerGroup("full_attention"), LayerGroup("sliding_window", window=8, pool_ratio=0.8))
    cache = prefixcache.build_cache(CacheConfig(backend="radix", block_size=BS, num_blocks=64, layout=layout))
    # A request admitted before every other tenant, whose pages reach the tree only at
    # its release, after all of them: its namespace must outlive every pruning.
    first = [9_000 + t for t in range(4 * BS)]
    assert cache.admit("first", first, namespace=tenant(10**6)) is not None
    for i in range(TENANTS):
        serve(cache, i, [i, i + 1, i + 2, i + 3] * BS, tenant(i))
        cache.drain_events()
    assert len(cache._namespaces) < TENANTS // 2
    cache.commit("first", len(first))
    cache.release("first")
    stored = [e for e in cache.drain_events() if isinstance(e, BlockStored)]
    assert stored and all(e.lora_name == "a1000000" for e in stored)
    cache.check_invariants()


def test_parents_in_use_answers_each_name_given_duplicates_and_all():
    cache = tiered("radix", False)
    serve(cache, 0, list(range(3 * BS)), "a")
    root, stranger = cache._roots["a"], cache.tiers.new_name()
    native = cache.tiers.native
    assert native.parents_in_use(root + stranger + root) == [True, False, True]
    assert native.parents_in_use(b"") == []
    with pytest.raises(ValueError, match="whole keys of 8 bytes"):
        native.parents_in_use(root + b"\x00")
