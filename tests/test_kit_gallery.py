"""The conformance kit rejects backends that serve wrong KV, naming the rule each breaks.

A gallery of deliberately broken `hash` backends (subclasses of the built-in, or the
built-in over a wrapped pool), each wrong in one way a real implementation can be:
the parent dropped from the hash chain (a block with the right tokens after the WRONG
prefix is a hit), the namespace applied to the first block only, a block served after
it was evicted and reused, a hit one block too long, a hit on a block only partly
computed, and KV events that disagree with `match`. Each is rejected by
`check_backend` and by the state machine alone at its default example count; the
soak's driver (`prefixcache.stress`) rejects the chain bug with the same message.
The broken classes that a backend's own `check_invariants` would flag check only the
pool, so what catches them is the kit's oracle, not the backend's self-check.
"""

from __future__ import annotations

import dataclasses
import io
import re
import unittest

import pytest
from hypothesis import Phase, settings

import prefixcache
import prefixcache.testing as kit
from prefixcache.backends.hash import HashCache
from prefixcache.config import CacheConfig
from prefixcache.stress import stress


class _LookupStopsAtARepeat:
    """The pool, whose chain look-up ends where a block would be hit twice (a broken
    hash can give two blocks of a prompt one key; the pool refuses to pin a block twice)."""

    def __init__(self, pool):
        self._pool = pool

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def lookup_chain_packed(self, keys, key_size):
        found = self._pool.lookup_chain_packed(keys, key_size)
        return next((found[:i] for i, b in enumerate(found) if b in found[:i]), found)


class DropsParent(HashCache):
    """Every block hashes as a chain start (with the namespace on each, so namespaces
    still isolate): a block is found by its own tokens, whatever came before it."""

    def __init__(self, pool, config):
        super().__init__(_LookupStopsAtARepeat(pool), config)

    def _prompt_digests(self, tokens, namespace):
        bs = self.block_size
        return b"".join(super(DropsParent, self)._prompt_digests(tokens[i * bs : (i + 1) * bs], namespace)
                        for i in range(len(tokens) // bs))


class NamespaceOnFirstBlock(HashCache):
    """The namespace salts block 0's hash, but later blocks chain on the namespace-free
    chain: after its own first block, one tenant continues into another's blocks."""

    def _prompt_digests(self, tokens, namespace):
        salted = super()._prompt_digests(tokens[: self.block_size], namespace)
        return salted + super()._prompt_digests(tokens, None)[len(salted) :]


class _NeverForgettingPool:
    """The pool with a key index of its own that keeps a key after allocation reuses
    its block (the pool's own index drops it)."""

    def __init__(self, pool):
        self._pool = pool
        self._keys = {}

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def cache_many_packed(self, blocks, keys, key_size):
        for j, block in enumerate(blocks):
            self._keys[keys[j * key_size : (j + 1) * key_size]] = block
        return self._pool.cache_many_packed(blocks, keys, key_size)

    def lookup_chain_packed(self, keys, key_size):
        found = []
        for j in range(len(keys) // key_size):
            key = keys[j * key_size : (j + 1) * key_size]
            block = self._pool.lookup(key)
            block = self._keys.get(key) if block is None else block
            if block is None or block in found:
                break
            found.append(block)
        return found


class ServesEvictedBlocks(HashCache):
    """Looks hits up in an index whose entries outlive the blocks' reuse."""

    def __init__(self, pool, config):
        super().__init__(_NeverForgettingPool(pool), config)

    def check_invariants(self):
        self.pool.check_invariants()


class OneBlockTooLong(HashCache):
    """admit claims one block more than is cached, when the prompt leaves room."""

    def admit(self, request_id, tokens, *, namespace=None, priority=0):
        adm = super().admit(request_id, tokens, namespace=namespace, priority=priority)
        if adm is None or adm.num_cached_tokens + self.block_size > len(tokens) - 1:
            return adm
        return dataclasses.replace(adm, num_cached_tokens=adm.num_cached_tokens + self.block_size)


class CachesPartlyComputedBlocks(HashCache):
    """commit(n) also indexes the block n ends in, when its hash is known (a full
    prompt block): a later request hits KV that was only partly written."""

    def commit(self, request_id, num_computed_tokens):
        super().commit(request_id, num_computed_tokens)
        request = self._requests.get(request_id)
        upto = min(-(-num_computed_tokens // self.block_size), len(request.digests) // self.digest_size)
        if upto > request.num_cached_blocks:
            self._cache_full_blocks(request, upto)

    def check_invariants(self):
        self.pool.check_invariants()


class ForgetsBlockRemoved(HashCache):
    """Publishes no BlockRemoved: a consumer keeps routing to evicted blocks."""

    def _removed_events(self, hashes):
        return []


class StoresWithoutParent(HashCache):
    """Every BlockStored says it starts a chain: a consumer cannot follow the chain past
    the first block a commit stored."""

    def _stored_event(self, request, start, stop):
        return dataclasses.replace(super()._stored_event(request, start, stop), parent_block_hash=None)


# (class, the rule check_backend's rejection names, a phrase of its detail, and the rules
# the state machine's first violation may name: a backend that serves evicted blocks
# serves other KV (rule 6), KV its new owner computed only in part (rule 4), or, where
# the new owner computed equal KV, a block whose hash the events announced removed)
GALLERY = [
    (DropsParent, "rule 6", "the same tokens after another prefix", {"rule 6"}),
    (NamespaceOnFirstBlock, "namespaces", "the request needs namespace", {"namespaces"}),
    (ServesEvictedBlocks, "rule 6", "evicted and reused since", {"rule 6", "rule 4", "events"}),
    (OneBlockTooLong, "rule 1", "match(tokens[:-1]) says", {"rule 1"}),
    (CachesPartlyComputedBlocks, "rule 4", "were computed", {"rule 4"}),
    (ForgetsBlockRemoved, "events", "a BlockRemoved missing", {"events"}),
    (StoresWithoutParent, "events", "the KV events announce only", {"events"}),
]
IDS = [g[0].__name__ for g in GALLERY]


@pytest.mark.parametrize(("broken", "rule", "detail", "_"), GALLERY, ids=IDS)
def test_check_backend_rejects_it_naming_the_rule(broken, rule, detail, _):
    with pytest.raises(kit.RuleViolation) as info:
        kit.check_backend(broken)
    assert info.value.rule == rule, str(info.value)
    assert str(info.value).startswith(f"{rule} ({kit.RULES[rule]}) broken: ") and detail in str(info.value)


@pytest.mark.parametrize(("broken", "_", "__", "rules"), GALLERY, ids=IDS)
def test_the_state_machine_alone_rejects_it_naming_the_rule(broken, _, __, rules):
    """At its defaults (block_size 2, 60 examples of up to 40 steps), hypothesis finds
    it. Shrinking is off here: it makes the report minimal (check_backend keeps it),
    and costs minutes on a broken backend; this test is about finding the bug."""
    case = kit.conformance_test_case(broken)
    case.settings = settings(case.settings, phases=[p for p in Phase if p is not Phase.shrink], database=None)
    result = unittest.TextTestRunner(stream=io.StringIO(), verbosity=0).run(
        unittest.defaultTestLoader.loadTestsFromTestCase(case)
    )
    assert not result.wasSuccessful(), f"the state machine passed {broken.__name__}"
    failure = (result.failures or result.errors)[0][1]
    named = re.search(r"RuleViolation: (.+?) \(", failure)
    assert named and named.group(1) in rules, failure


def test_the_soak_driver_rejects_the_dropped_parent_with_the_same_message():
    config = CacheConfig(backend="hash", block_size=4, num_blocks=48)
    with pytest.raises(kit.RuleViolation, match=r"^rule 6 .* the same tokens after another prefix"):
        stress(DropsParent(prefixcache.BlockPool(48), config), operations=2000, seed=0, check_every=100)


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_the_built_ins_pass_every_rule_the_gallery_breaks(backend):
    kit.check_backend(backend, block_sizes=(2,), max_examples=20)
