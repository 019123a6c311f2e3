"""The kit's hybrid rules: the built-in hybrid `hash` passes; each broken one is named.

A gallery of `hash` hybrid caches wrong in one way each: a hit that ignores the mamba
and window groups ("every group"), a sliding window looked up and handed out like full
attention ("window"), a hit that restores the state one block before it ("state"), and a hit inside a block
(states finer than the block) that copies the head of the wrong block ("every group"). Each is rejected by `check_hybrid_backend`, naming its rule.
"""

from __future__ import annotations

import pytest

from prefixcache.backends.hybrid_groups import FullAttentionGroup, MambaGroup, SlidingWindowGroup
from prefixcache.backends.hybrid_fine import FineStateHashCache
from prefixcache.backends.hybrid_hash import HybridHashCache
from prefixcache.layout import NULL_BLOCK, LayerGroup
from prefixcache.testing import RuleViolation
from prefixcache.testing_hybrid import LAYOUTS, check_hybrid_backend


class HitIgnoresOtherGroups(HybridHashCache):
    """The hit is full attention's alone: the other groups are never asked."""

    def __init__(self, pool, config):
        super().__init__(pool, config)
        self._spec_groups = self._spec_groups[:1]


class _WindowAsFull(SlidingWindowGroup):
    find_hit = FullAttentionGroup.find_hit

    def skipped_tokens(self, num_computed):
        return 0

    def kept(self, start, stop, boundaries):
        return None


class WindowHandsOutEveryBlock(HybridHashCache):
    """The sliding-window group keeps and hands out every block of a hit, as full
    attention does: blocks outside the window stay pinned in the request's table."""

    def __init__(self, pool, config):
        super().__init__(pool, config)
        self.managers = tuple(
            _WindowAsFull(m.group, m.index, pool, self.block_size) if isinstance(m, SlidingWindowGroup) else m
            for m in self.managers
        )


class _StateOneBlockEarly(MambaGroup):
    def find_hit(self, digests, digest_size, max_length, members, lookup):
        found, hit = super().find_hit(digests, digest_size, max_length, members, lookup)
        i = hit // self.block_size - 1
        if i >= 1 and (earlier := lookup.one(digests[(i - 1) * digest_size : i * digest_size], members)):
            return [[NULL_BLOCK] * i + [b] for b in earlier], hit
        return found, hit


class RestoresTheStateABlockEarlier(HybridHashCache):
    """A hit on the state after i + 1 blocks hands out the state after i blocks (states
    kept at every block, so both exist)."""

    def __init__(self, pool, config):
        super().__init__(pool, config)
        self.dense, self.state_interval = True, self.block_size
        self.managers = tuple(
            _StateOneBlockEarly(m.group, m.index, pool, self.block_size) if isinstance(m, MambaGroup) else m
            for m in self.managers
        )


class CopiesTheBlockBefore(FineStateHashCache):
    """States every 2 tokens (`state_granule`), and a hit inside a block copies the head
    of the block BEFORE the one that holds the prefix (another position's KV)."""

    def __init__(self, pool, config):
        super().__init__(pool, config.replace(options={"state_granule": 2}))

    def _sources(self, rows, p, granule_key):
        i = p // self.block_size
        if i >= 1 and all(len(row) >= i for row in rows):
            return tuple(row[i - 1] for row in rows)
        return super()._sources(rows, p, granule_key)


GALLERY = [
    (HitIgnoresOtherGroups, "every group", LAYOUTS),
    (WindowHandsOutEveryBlock, "window", [LAYOUTS[0]]),
    (RestoresTheStateABlockEarlier, "state", [LAYOUTS[2]]),
    (CopiesTheBlockBefore, "every group", [LAYOUTS[2]]),
]


@pytest.mark.parametrize(("broken", "rule", "layouts"), GALLERY, ids=[g[0].__name__ for g in GALLERY])
def test_check_hybrid_backend_rejects_it_naming_the_rule(broken, rule, layouts):
    with pytest.raises(RuleViolation) as err:
        check_hybrid_backend(broken, layouts=layouts)
    assert err.value.rule == rule, str(err.value)
    assert str(err.value).startswith(f"{rule} (")


def test_the_built_in_hybrid_hash_passes():
    check_hybrid_backend("hash")


def test_dense_retention_passes_too():
    from prefixcache import BlockPool
    from prefixcache.config import CacheConfig

    def make(bs, n, layout):
        return HybridHashCache(BlockPool(n), CacheConfig(block_size=bs, num_blocks=n, layout=layout,
                                                          options={"retention": "dense", "state_interval": 16}))  # fmt: skip

    check_hybrid_backend(make, layouts=[(LayerGroup("full_attention"), LayerGroup("sliding_window", window=24), LayerGroup("mamba"))])
