"""The conformance kit (prefixcache.testing) over every registered backend, both example
plugins, eviction policies of both strategies, and proof that it can fail."""

from __future__ import annotations

import pytest

import prefixcache.testing as kit
from prefixcache import registry
from prefixcache.backends.hash import HashCache
from prefixcache.config import HashConfig
from prefixcache.eviction import EvictionPolicy


class OldestCreatedFirst(EvictionPolicy):
    """A Python policy (no native order): the backends call it once per candidate."""

    def priority(self, candidate):
        return (candidate.creation_time, -candidate.use_count)


# (id, backend spec, config): every registered backend as it ships, the examples through
# their "module:Class" paths (tests/conftest.py puts examples/ on sys.path), and the
# eviction policies that change what each strategy evicts.
SUBJECTS = [
    *[(name, name, {}) for name in registry.available_backends()],
    ("min_match-hash", "min_match:MinMatchHash", {"options": {"min_tokens": 3}}),
    ("min_match-radix", "min_match:MinMatchRadix", {"options": {"min_tokens": 3}}),
    ("partial_block", "partial_block:PartialBlockHash", {}),
    ("hash-lfu", "hash", {"eviction": "lfu"}),
    ("hash-gslru", "hash", {"eviction": "gslru"}),
    ("hash-python-policy", "hash", {"eviction": f"{__name__}:OldestCreatedFirst"}),
    ("radix-gslru", "radix", {"eviction": "gslru"}),
    # Hit verification (xxhash) together with policy eviction and with partial hits.
    ("hash-xxhash-gslru", "hash", {"eviction": "gslru", "hash": HashConfig("xxhash")}),
    ("partial_block-xxhash", "partial_block:PartialBlockHash", {"hash": HashConfig("xxhash_cbor")}),
    ("radix-python-policy", "radix", {"eviction": f"{__name__}:OldestCreatedFirst"}),
]
IDS = [s[0] for s in SUBJECTS]


@pytest.mark.parametrize(("name", "backend", "config"), SUBJECTS, ids=IDS)
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("check", kit.RULE_CHECKS, ids=lambda c: c.__name__)
def test_rules(name, backend, config, block_size, check):
    check(kit._factory(backend, **config), block_size)


for _id, _backend, _config in SUBJECTS:
    for _bs in (1, 3):
        globals()[f"TestConformance_{_id.replace('-', '_')}_bs{_bs}"] = kit.conformance_test_case(
            _backend, block_size=_bs, max_examples=30, **_config
        )


class IgnoresNamespace(HashCache):
    """Broken on purpose: every request hashes as namespace None."""

    def admit(self, request_id, tokens, *, namespace=None):
        return super().admit(request_id, tokens)

    def match(self, tokens, *, namespace=None):
        return super().match(tokens)


class LeaksOnRefusal(HashCache):
    """Broken on purpose: a refused admission keeps the blocks it took."""

    def admit(self, request_id, tokens, *, namespace=None):
        adm = super().admit(request_id, tokens, namespace=namespace)
        if adm is None:
            self.pool.allocate(min(1, self.pool.num_free))
        return adm


class LiesInMatch(HashCache):
    """Broken on purpose: match() claims one more block than is cached."""

    def match(self, tokens, *, namespace=None):
        m = super().match(tokens, namespace=namespace)
        return type(m)(m.num_tokens + self.block_size, m.block_ids + (0,))


class CopiesWithoutPartialHits(HashCache):
    """Broken on purpose: returns a copy although the class declares no partial hits."""

    def admit(self, request_id, tokens, *, namespace=None, priority=0):
        adm = super().admit(request_id, tokens, namespace=namespace)
        if adm is not None and adm.num_cached_tokens:
            return type(adm)(adm.block_table, adm.num_cached_tokens, ((adm.block_table[0], adm.block_table[-1], 1),))
        return adm


from partial_block import PartialBlockHash  # noqa: E402  (examples/ is on sys.path: conftest)


class OvercopiesPartial(PartialBlockHash):
    """Broken on purpose: a partial hit claims one token more than the source holds."""

    def partial_hit(self, tokens, namespace, digests, num_hit_blocks, limit):
        found = super().partial_hit(tokens, namespace, digests, num_hit_blocks, limit)
        if found is not None and found[1] + 1 < min(limit + 1, self.block_size):
            return found[0], found[1] + 1
        return found


class UnpinsCopySource(PartialBlockHash):
    """Broken on purpose: lets the copy source go before the engine has copied it."""

    def admit(self, request_id, tokens, *, namespace=None, priority=0):
        adm = super().admit(request_id, tokens, namespace=namespace)
        request = self._requests.get(request_id) if adm is not None else None
        if request is not None and request.copy_source is not None:
            self.pool.free([request.copy_source])
            request.copy_source = None
        return adm


class TakesBoolTokens(HashCache):
    """Broken on purpose: an appended bool is taken as the int it subclasses."""

    def append(self, request_id, tokens):
        if isinstance(tokens, list):
            tokens = [int(t) if isinstance(t, bool) else t for t in tokens]
        return super().append(request_id, tokens)


class SaysValueErrorForAFloatCount(HashCache):
    """Broken on purpose: evict(1.5) is a ValueError (a wrong type is a TypeError)."""

    def evict(self, num_blocks):
        if isinstance(num_blocks, float):
            raise ValueError("num_blocks must be an int >= 0")
        return super().evict(num_blocks)


class LosesTheRefusedStepsCommit(HashCache):
    """Broken on purpose: commit_and_append whose append is refused drops its commit."""

    def commit_and_append(self, request_id, num_computed_tokens, tokens):
        blocks = self.append(request_id, tokens)
        if blocks is None:
            return None
        self.commit(request_id, num_computed_tokens)
        return blocks


@pytest.mark.parametrize(
    "broken",
    [
        IgnoresNamespace,
        LosesTheRefusedStepsCommit,
        LeaksOnRefusal,
        LiesInMatch,
        CopiesWithoutPartialHits,
        OvercopiesPartial,
        UnpinsCopySource,
        TakesBoolTokens,
        SaysValueErrorForAFloatCount,
    ],
)
def test_kit_catches_broken_backends(broken):
    with pytest.raises(AssertionError):
        kit.check_backend(broken, block_sizes=(4,), max_examples=60)


def test_commit_and_append_rule_catches_a_lost_commit_and_passes_a_policy_that_refuses_short_hits():
    with pytest.raises(AssertionError, match="match after a refused step"):
        kit.rule_commit_and_append_is_both_calls(kit._factory(LosesTheRefusedStepsCommit), 4)
    # A matching policy may refuse hits shorter than it wants: the rule compares with commit().
    kit.check_backend("min_match:MinMatchHash", options={"min_tokens": 64}, block_sizes=(4,), max_examples=20)


def test_bad_token_rule_catches_the_offence_itself():
    make = kit._factory(TakesBoolTokens)
    with pytest.raises(AssertionError, match=r"append of \[True, 1\]: expected TypeError naming 'tokens\[0\]'"):
        kit.rule_bad_tokens_are_refused(make, 4)
    with pytest.raises(AssertionError, match=r"evict\(1.5\): expected TypeError naming 'num_blocks', got ValueError"):
        kit.rule_bad_tokens_are_refused(kit._factory(SaysValueErrorForAFloatCount), 4)


def test_check_backend_one_line_passes_for_hash(capfd):
    kit.check_backend(HashCache, block_sizes=(2,), max_examples=10)
    assert "hash" in registry.available_backends()
    assert capfd.readouterr() == ("", "")  # no unittest "Ran 1 test ... OK" on success


class FailsItsInvariantsOnceUsed(HashCache):
    """Broken on purpose: its own invariant check fails once a request was admitted."""

    def check_invariants(self):
        super().check_invariants()
        assert self.stats().requests == 0, "broken on purpose"


def test_check_backend_state_machine_failure_shows_the_failing_steps(monkeypatch, capfd):
    monkeypatch.setattr(kit, "RULE_CHECKS", ())  # so that the state machine is what finds it
    with pytest.raises(AssertionError) as info:
        kit.check_backend(FailsItsInvariantsOnceUsed, block_sizes=(4,), max_examples=20)
    message = str(info.value)
    assert message.startswith("conformance state machine failed at block_size=4:")
    assert "broken on purpose" in message
    assert message.splitlines()[0].endswith("broken on purpose")  # the violation first
    assert "state = Conformance()" in message and "state.start(warm=" in message  # the steps, replayable
    assert capfd.readouterr().err == ""
