"""The conformance kit (prefixcache.testing) over every built-in backend, and proof it can fail."""

from __future__ import annotations

import pytest

import prefixcache.testing as kit
from prefixcache import registry
from prefixcache.backends.hash import HashCache

BUILTINS = ["hash", "radix"]


@pytest.mark.parametrize("backend", BUILTINS)
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("check", kit.RULE_CHECKS, ids=lambda c: c.__name__)
def test_rules(backend, block_size, check):
    check(kit._factory(backend), block_size)


for _name in BUILTINS:
    for _bs in (1, 3):
        globals()[f"TestConformance_{_name}_bs{_bs}"] = kit.conformance_test_case(_name, block_size=_bs)


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


@pytest.mark.parametrize("broken", [IgnoresNamespace, LeaksOnRefusal, LiesInMatch])
def test_kit_catches_broken_backends(broken):
    with pytest.raises(AssertionError):
        kit.check_backend(broken, block_sizes=(2,), max_examples=30)


def test_check_backend_one_line_passes_for_hash():
    kit.check_backend(HashCache, block_sizes=(2,), max_examples=10)
    assert "hash" in registry.available_backends()
