"""The extension points end to end: the example plugins loaded through YAML by
"module:Class" path, an installed package found by its entry point, backend options,
and the hooks' contracts. (tests/conftest.py puts examples/ on sys.path.)"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prefixcache
import prefixcache.testing as kit
from prefixcache import CacheConfig, ConfigError, registry
from prefixcache.backends.hash import HashCache
from prefixcache.backends.radix import RadixCache

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cache.yaml"
    path.write_text(text)
    return path


def serve(cache, request_id, tokens):
    """admit, commit the whole prompt, release; returns the admission."""
    adm = cache.admit(request_id, tokens)
    assert adm is not None
    cache.commit(request_id, len(tokens))
    cache.release(request_id)
    return adm


# ------------------------------------------------------------------------- min_match


@pytest.mark.parametrize("cls", ["MinMatchHash", "MinMatchRadix"])
def test_min_match_through_yaml_ignores_short_hits(tmp_path, cls):
    path = write_yaml(
        tmp_path,
        f'cache: {{backend: "min_match:{cls}", block_size: 16, num_blocks: 64, options: {{min_tokens: 48}}}}\n',
    )
    cache = prefixcache.load_cache(path)
    assert type(cache).__name__ == cls and cache.options["min_tokens"] == 48
    base = list(range(1000, 1100))  # 100 tokens: 6 full blocks cached
    serve(cache, "warm", base)
    short = base[:40] + list(range(5000, 5030))  # shares 2 blocks = 32 tokens < 48
    long = base[:70] + list(range(6000, 6030))  # shares 4 blocks = 64 tokens
    assert cache.match(short).num_tokens == 0 and cache.match(long).num_tokens == 64
    assert serve(cache, "short", short).num_cached_tokens == 0
    assert serve(cache, "long", long).num_cached_tokens == 64
    cache.check_invariants()


def test_min_match_shipped_yaml_loads():
    cache = prefixcache.load_cache(EXAMPLES / "min_match.yaml")
    assert isinstance(cache, HashCache) and cache.options["min_tokens"] == 64


def test_min_match_radix_locks_only_the_part_it_keeps():
    cache = prefixcache.build_cache(
        CacheConfig(backend="min_match:MinMatchRadix", block_size=4, num_blocks=32, options={"min_tokens": 12})
    )
    serve(cache, "warm", list(range(20)))
    adm = cache.admit("r", list(range(8)) + [99, 98, 97])  # 8 cached tokens < 12: none used
    assert adm.num_cached_tokens == 0
    assert cache.tree.protected_size == 0  # nothing of the tree is locked for it
    cache.release("r")
    cache.check_invariants()


def test_options_are_validated_by_the_class():
    def build(options):
        return prefixcache.build_cache(CacheConfig(backend="min_match:MinMatchHash", block_size=4, num_blocks=8,
                                                   options=options))

    with pytest.raises(ConfigError, match=r"options.min_toks: unknown option for backend min_match:MinMatchHash; "
                                          r"allowed: min_tokens, no_tail_cliff, retention, state_cap, state_granule, state_interval, verify_hits; "
                                          r"did you mean 'min_tokens'\?$"):
        build({"min_toks": 3})
    with pytest.raises(ConfigError, match=r"options.min_tokens: must be int \(default 256\), got '3'"):
        build({"min_tokens": "3"})
    with pytest.raises(ConfigError, match=r"options.min_tokens: must be >= 0, got -1"):
        build({"min_tokens": -1})
    with pytest.raises(ConfigError, match=r"options.x: unknown option for backend radix; allowed: chunked_prefill_size, mamba_chunk, mamba_track_interval, no_tail_cliff, state_cap"):
        prefixcache.build_cache(CacheConfig(backend="radix", block_size=4, num_blocks=8, options={"x": 1}))
    with pytest.raises(ConfigError, match=r"options.verify_hits: 'maybe' is not allowed for backend "
                                          r"min_match:MinMatchHash; allowed values: auto, always, never"):
        build({"verify_hits": "maybe"})  # the base class's choices hold for subclasses
    # A class built directly with another backend's config checks again, under its own name.
    hash_config = CacheConfig(backend="hash", block_size=4, num_blocks=8, options={"verify_hits": "never"})
    with pytest.raises(ConfigError, match=r"options.verify_hits: unknown option for backend RadixCache; allowed: chunked_prefill_size, mamba_chunk, mamba_track_interval, no_tail_cliff, state_cap"):
        RadixCache(prefixcache.BlockPool(8), hash_config)


@pytest.mark.parametrize("base", [HashCache, RadixCache])
@pytest.mark.parametrize("bad", [3, -4, 100, True])
def test_a_broken_usable_hit_is_reported(base, bad):
    class Broken(base):
        broken = False

        def usable_hit(self, tokens, num_tokens, namespace=None):
            return bad if self.broken else num_tokens

    cache = Broken(prefixcache.BlockPool(16), CacheConfig(block_size=4, num_blocks=16))
    serve(cache, "warm", list(range(9)))
    cache.broken = True
    with pytest.raises(ValueError, match=r"Broken.usable_hit returned .*: must be a multiple of block_size 4 in \[0, 8\]"):
        cache.match(list(range(9)))
    with pytest.raises(ValueError, match="usable_hit returned"):
        cache.admit("r", list(range(9)))
    cache.check_invariants()


# --------------------------------------------------------------------- partial_block


def test_partial_block_through_yaml_copies_the_matching_head():
    cache = prefixcache.load_cache(EXAMPLES / "partial_block.yaml")
    assert type(cache).__name__ == "PartialBlockHash" and type(cache).partial_hits
    first = list(range(40))  # blocks [0:16], [16:32] cached; [32:40] is a partial tail
    table_a = serve(cache, "a", first).block_table
    probe = first[:26] + list(range(500, 510))  # block 1 matches for 10 tokens
    m = cache.match(probe[:-1])
    assert (m.num_tokens, m.block_ids) == (26, (table_a[0], table_a[1]))
    adm = cache.admit("b", probe)
    assert adm.num_cached_tokens == 26
    assert adm.block_table[0] == table_a[0] and adm.block_table[1] != table_a[1]
    assert adm.copies == ((table_a[1], adm.block_table[1], 10),)
    assert cache.pool.ref_count(table_a[1]) == 1  # the source is pinned until b's first commit
    cache.check_invariants()
    cache.commit("b", 30)
    assert cache.pool.ref_count(table_a[1]) == 0 and cache.pool.key(table_a[1]) is not None
    cache.release("b")
    cache.check_invariants()
    assert cache.stats().hits == 26


def test_partial_block_never_copies_across_namespaces_or_from_evicted_blocks():
    cache = prefixcache.build_cache(CacheConfig(backend="partial_block:PartialBlockHash", block_size=4, num_blocks=6))
    serve(cache, "a", list(range(9)))  # two full blocks cached
    assert cache.match([0, 1, 2, 3, 4, 5, 77], namespace="t").num_tokens == 0
    assert cache.match([0, 1, 2, 3, 4, 5, 77]).num_tokens == 6
    cache.evict(6)
    assert cache.match([0, 1, 2, 3, 4, 5, 77]).num_tokens == 0


# ------------------------------------------------------------ installed entry point


def test_installed_package_registers_a_backend_by_entry_point(tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(EXAMPLES / "prefixcache-example-backend", src)  # builds leave nothing in the tree
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--target", str(target), str(src)],
        check=True,
    )
    assert "hash-histogram" not in registry.available_backends()
    monkeypatch.syspath_prepend(str(target))
    importlib.invalidate_caches()
    assert "hash-histogram" in registry.available_backends()
    path = write_yaml(tmp_path, "cache: {backend: hash-histogram, block_size: 4, num_blocks: 16}\n")
    cache = prefixcache.load_cache(path)
    assert type(cache).__name__ == "HitHistogramHash"
    serve(cache, "a", list(range(13)))
    serve(cache, "b", list(range(13)))
    assert cache.hit_histogram() == {0: 1, 3: 1}
    kit.check_backend("hash-histogram", block_sizes=(2,), max_examples=10)


PLUGIN = '''
from prefixcache import register_eviction_policy
from prefixcache.eviction import EvictionPolicy


@register_eviction_policy("{name}")
class OldestFirst(EvictionPolicy):
    def priority(self, c):
        return (c.creation_time, -c.use_count)
'''


def test_a_plugin_beside_the_user_works_from_the_cli_without_pythonpath(tmp_path, monkeypatch, capsys):
    """A `module:Class` in the working directory or beside the config imports (the console
    script, unlike `python -m`, does not put the working directory on sys.path), and
    `--import MODULE` makes a name registered with the decorator usable in a config."""
    import sys

    from prefixcache import registry
    from prefixcache.cli import main

    monkeypatch.setattr(registry, "_eviction_policies", dict(registry._eviction_policies))  # the names go after
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("fd_cwd_policy", "fd_beside_policy", "fd_named_policy"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    work, configs = tmp_path / "work", tmp_path / "configs"
    work.mkdir()
    configs.mkdir()
    (work / "fd_cwd_policy.py").write_text(PLUGIN.format(name="fd-cwd"))
    (configs / "fd_beside_policy.py").write_text(PLUGIN.format(name="fd-beside"))
    (work / "fd_named_policy.py").write_text(PLUGIN.format(name="fd-named"))
    monkeypatch.chdir(work)
    for spec, folder in (("fd_cwd_policy:OldestFirst", work), ("fd_beside_policy:OldestFirst", configs)):
        path = folder / "cache.yaml" if folder == configs else configs / "from_cwd.yaml"
        path.write_text(f"cache: {{backend: hash, block_size: 4, num_blocks: 8, eviction: '{spec}'}}\n")
        assert main(["validate", str(path)]) == 0, capsys.readouterr().err
        assert f"eviction: {spec}" in capsys.readouterr().out
    named = configs / "named.yaml"
    named.write_text("cache: {backend: hash, block_size: 4, num_blocks: 8, eviction: fd-named}\n")
    assert main(["validate", str(named)]) == 2
    assert "unknown eviction policy 'fd-named'" in capsys.readouterr().err
    assert main(["--import", "fd_named_policy", "validate", str(named)]) == 0
    assert main(["validate", "--import", "fd_named_policy", str(named), "--set", "cache.eviction=fd-named"]) == 0
    capsys.readouterr()
    assert main(["--import", "no_such_plugin_module", "validate", str(named)]) == 2
    assert capsys.readouterr().err.startswith("error: --import: 'no_such_plugin_module': ModuleNotFoundError")
    monkeypatch.setenv("PREFIXCACHE_NO_IMPORT", "1")
    assert main(["--import", "fd_named_policy", "validate", str(named)]) == 2
    assert capsys.readouterr().err == "error: --import: imports are off (PREFIXCACHE_NO_IMPORT=1 or --no-import)\n"
