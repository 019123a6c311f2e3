"""Backends and eviction policies found by registered name, 'module:Class' and entry point."""

from __future__ import annotations

import sys
import textwrap

import pytest

import prefixcache
from prefixcache import registry
from prefixcache.config import CacheConfig, ConfigError
from prefixcache.eviction import EvictionPolicy
from prefixcache.protocol import Match, PrefixCache


class EchoCache(PrefixCache):
    """The smallest PrefixCache: caches nothing (registry plumbing only)."""

    def match(self, tokens, *, namespace=None):
        return Match(0, ())

    def admit(self, request_id, tokens, *, namespace=None):
        return None

    def append(self, request_id, tokens):
        return None

    def commit(self, request_id, num_computed_tokens):
        pass

    def release(self, request_id):
        raise KeyError(request_id)

    def block_table(self, request_id):
        raise KeyError(request_id)

    def evict(self, num_blocks):
        return 0

    def reset(self):
        return True

    def stats(self):
        return prefixcache.CacheStats()

    def drain_events(self):
        return []

    def check_invariants(self):
        self.pool.check_invariants()


@pytest.fixture
def clean_registry(monkeypatch):
    monkeypatch.setattr(registry, "_backends", dict(registry._backends))
    monkeypatch.setattr(registry, "_eviction_policies", dict(registry._eviction_policies))


def test_register_by_name(clean_registry):
    registry.register_backend("echo")(EchoCache)
    assert "echo" in prefixcache.available_backends()
    cache = prefixcache.build_cache(CacheConfig(backend="echo", num_blocks=8))
    assert isinstance(cache, EchoCache) and cache.pool.num_blocks == 8
    assert EchoCache.name == "echo"


def test_module_class_path():
    cache = prefixcache.build_cache(CacheConfig(backend=f"{__name__}:EchoCache", num_blocks=4))
    assert type(cache).__name__ == "EchoCache"


def test_unknown_name_lists_known():
    with pytest.raises(ConfigError) as info:
        registry.resolve_backend("nope")
    assert "known: " in str(info.value) and "hash" in str(info.value) and "radix" in str(info.value)


def test_register_rejects_non_backends():
    with pytest.raises(TypeError):
        registry.register_backend("x")(int)
    with pytest.raises(ValueError):
        registry.register_backend("a:b")
    with pytest.raises(TypeError):
        registry.register_eviction_policy("x")(int)


def test_pool_size_must_match_config():
    with pytest.raises(ValueError, match="pool has 4 blocks but config.num_blocks is 8"):
        EchoCache(prefixcache.BlockPool(4), CacheConfig(num_blocks=8))


def test_entry_points(tmp_path, monkeypatch, clean_registry):
    plugin = tmp_path / "plugin_pkg_xyz"
    plugin.mkdir()
    (plugin / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            from {__name__} import EchoCache
            from prefixcache.eviction import EvictionPolicy

            class Plugged(EchoCache):
                pass

            class Oldest(EvictionPolicy):
                def priority(self, c):
                    return c.creation_time
            """
        )
    )
    dist = tmp_path / "plugin_pkg_xyz-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-pkg-xyz\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[prefixcache.backends]\nplugged = plugin_pkg_xyz:Plugged\n"
        "[prefixcache.eviction_policies]\noldest = plugin_pkg_xyz:Oldest\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "plugged" in prefixcache.available_backends()
    assert "oldest" in prefixcache.available_eviction_policies()
    cache = prefixcache.build_cache(CacheConfig(backend="plugged", eviction="oldest", num_blocks=2))
    assert type(cache).__name__ == "Plugged"
    assert issubclass(registry.resolve_eviction_policy("oldest"), EvictionPolicy)
    sys.modules.pop("plugin_pkg_xyz", None)


def test_a_built_in_or_registered_name_is_checked_without_reading_entry_points(monkeypatch, clean_registry):
    """Reading every installed package's entry points costs milliseconds a config: a name
    already known does not need them; an unknown one still looks there."""

    def entry_points(**_):
        raise AssertionError("entry points read")

    registry.register_backend("echo_known")(type("KnownEcho", (EchoCache,), {}))
    monkeypatch.setattr(registry, "entry_points", entry_points)
    for name in ("hash", "radix", "echo_known"):
        registry.check_backend_name(name)
    with pytest.raises(AssertionError, match="entry points read"):
        registry.check_backend_name("not_a_backend")


def test_builtin_eviction_policies_order_candidates():
    from types import SimpleNamespace as C

    a = C(last_access_time=5, creation_time=1, hit_count=3, priority=0)
    b = C(last_access_time=2, creation_time=4, hit_count=3, priority=1)
    pick = {}
    for name in ["lru", "lfu", "fifo", "mru", "filo", "priority"]:
        policy = registry.resolve_eviction_policy(name)()
        pick[name] = min([("a", a), ("b", b)], key=lambda kv: policy.priority(kv[1]))[0]
    assert pick == {"lru": "b", "lfu": "b", "fifo": "a", "mru": "a", "filo": "b", "priority": "a"}
