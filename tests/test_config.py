"""YAML -> CacheConfig: each invalid field gets its own precise message naming file and key."""

from __future__ import annotations

import textwrap

import pytest

import prefixcache
from prefixcache.config import CacheConfig, ConfigError, HashConfig
from prefixcache.config_checks import check_cache_config, load_config


def write(tmp_path, text: str):
    path = tmp_path / "cache.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def load_error(tmp_path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message


def test_full_config_loads(tmp_path):
    path = write(
        tmp_path,
        """
        cache:
          backend: hash
          block_size: 1
          num_blocks: 128
          hash: {algorithm: xxhash, seed: abc}
          eviction: lfu
          enable_events: false
          options: {verify_hits: always}
        """,
    )
    config = load_config(path)
    assert config == CacheConfig(
        backend="hash",
        block_size=1,
        num_blocks=128,
        hash=HashConfig("xxhash", "abc"),
        eviction="lfu",
        enable_events=False,
        options={"verify_hits": "always"},
    )
    with pytest.raises(Exception):
        config.block_size = 2  # frozen
    with pytest.raises(TypeError):
        config.options["verify_hits"] = "never"  # read-only view


def test_defaults(tmp_path):
    config = load_config(write(tmp_path, "cache: {}\n"))
    assert (config.backend, config.block_size, config.num_blocks) == ("hash", 16, 4096)
    assert config.hash == HashConfig("sha256_cbor", None) and config.eviction == "lru"


@pytest.mark.parametrize(
    "body, expected",
    [
        ("cache: {blocksize: 16}", "cache.blocksize: unknown key; allowed keys: backend, block_size"),
        ("cache: {block_size: 0}", "cache.block_size: must be an integer >= 1, got 0"),
        ("cache: {block_size: -3}", "cache.block_size: must be an integer >= 1, got -3"),
        ("cache: {block_size: sixteen}", "cache.block_size: must be an integer, got str 'sixteen'"),
        ("cache: {block_size: 1.5}", "cache.block_size: must be an integer, got float 1.5"),
        ("cache: {block_size: true}", "cache.block_size: must be an integer, got bool True"),
        ("cache: {num_blocks: 0}", "cache.num_blocks: must be an integer >= 1, got 0"),
        ("cache: {backend: lsm}", "cache.backend: unknown backend 'lsm'; known: hash, radix"),
        ("cache: {backend: 'nosuchmodule_xyz:Cls'}", "cache.backend: backend 'nosuchmodule_xyz:Cls': cannot import module"),
        ("cache: {backend: 'prefixcache.config:Nope'}", "has no attribute 'Nope'"),
        ("cache: {backend: 'prefixcache.config:CacheConfig'}", "not a PrefixCache subclass"),
        ("cache: {backend: 7}", "cache.backend: must be a string, got int 7"),
        (
            "cache: {hash: {algorithm: md5}}",
            "cache.hash.algorithm: 'md5' is not allowed; allowed values: sha256_cbor, sha256, xxhash, xxhash_cbor",
        ),
        ("cache: {hash: {algo: sha256}}", "cache.hash.algo: unknown key; allowed keys: algorithm, seed"),
        ("cache: {hash: {seed: 5}}", "cache.hash.seed: must be a string, got int 5"),
        ("cache: {hash: sha256}", "cache.hash: must be a mapping, got str 'sha256'"),
        ("cache: {eviction: random}", "cache.eviction: unknown eviction policy 'random'; known: chain, fifo, filo, gslru, lfu, lru"),
        ("cache: {enable_events: 1}", "cache.enable_events: must be true or false, got 1"),
        ("cache: {options: [1]}", "cache.options: must be a mapping"),
        ("cache: [1, 2]", "cache: must be a mapping, got list"),
        ("engine: {}", "cache: missing required section; top-level keys found: engine"),
        ("cach: {block_size: 4}\nengine: {}",
         "cache: missing required section; did you mean 'cache'? (found 'cach'); top-level keys found: cach, engine"),
        ("cache: {blocksize: 16}", "unknown key; allowed keys: backend, block_size"),
        # Backend options are checked at load against the class the backend name resolves to.
        ("cache: {backend: hash, options: {verify_hit: never}}",
         "cache.options.verify_hit: unknown option for backend hash; allowed: no_tail_cliff, retention, state_cap, state_granule, state_interval, verify_hits"),
        ("cache: {backend: hash, options: {verify_hits: maybe}}",
         "cache.options.verify_hits: 'maybe' is not allowed for backend hash; allowed values: auto, always, never"),
        ("cache: {backend: hash, options: {verify_hits: true}}",
         "cache.options.verify_hits: True is not allowed for backend hash; allowed values: auto, always, never"),
        ("cache: {backend: radix, options: {verify_hits: never}}",
         "cache.options.verify_hits: unknown option for backend radix; allowed: chunked_prefill_size, mamba_chunk, mamba_track_interval, no_tail_cliff, state_cap"),
        ("cache: {backend: 'min_match:MinMatchRadix', options: {min_tokens: '3'}}",
         "cache.options.min_tokens: must be int (default 256), got '3'"),
        ("cache: {backend: 'min_match:MinMatchRadix', options: {min_token: 3}}",
         "cache.options.min_token: unknown option for backend min_match:MinMatchRadix; allowed: chunked_prefill_size, mamba_chunk, mamba_track_interval, min_tokens, no_tail_cliff, state_cap"),
        ("- 1\n- 2", "top level must be a mapping, got list"),
        ("cache: {block_size: [", "invalid YAML"),
    ],
)
def test_each_bad_field_has_its_message(tmp_path, body, expected):
    assert expected in load_error(tmp_path, body)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml")


def test_programmatic_configs_are_validated_too():
    with pytest.raises(ConfigError, match="block_size: must be an integer >= 1"):
        CacheConfig(block_size=0)
    with pytest.raises(ConfigError, match="algorithm: 'md5' is not allowed"):
        HashConfig(algorithm="md5")
    assert CacheConfig().replace(block_size=4).block_size == 4
    with pytest.raises(ConfigError, match="^backend: must be a non-empty string, got ''$"):
        CacheConfig(backend="")
    # A name is checked against what it names when the config is checked or built.
    nope = CacheConfig().replace(backend="nope")
    for check in (check_cache_config, prefixcache.build_cache):
        with pytest.raises(ConfigError, match="^backend: unknown backend 'nope'"):
            check(nope)


def test_shipped_configs_load():
    from pathlib import Path

    from prefixcache.ab_config import is_ab_mapping, load_ab_config
    from prefixcache.cluster.config import is_cluster_mapping, load_cluster_config
    from prefixcache.config import load_yaml

    configs = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
    assert configs, "configs/ holds the shipped YAML files"
    for path in configs:
        data = load_yaml(path)
        if is_cluster_mapping(data):
            load_cluster_config(path)
        else:
            (load_ab_config if is_ab_mapping(data) else load_config)(path)


def test_other_sections_may_share_a_cache_file(tmp_path):
    config = load_config(write(tmp_path, "cache: {block_size: 4}\nworkload: {}\nnotes: anything\n"))
    assert config.block_size == 4


def test_options_are_checked_for_programmatic_configs_and_replace():
    assert CacheConfig(options={"verify_hits": "always"}).options == {"verify_hits": "always"}
    assert check_cache_config(CacheConfig(options={"verify_hits": "always"})) == {"verify_hits": "always", "retention": "sparse", "state_interval": 0, "no_tail_cliff": False, "state_granule": 0, "state_cap": 0}
    for check in (check_cache_config, prefixcache.build_cache):
        with pytest.raises(ConfigError, match="^options.verify_hit: unknown option for backend hash; allowed: no_tail_cliff, retention, state_cap, state_granule, state_interval, verify_hits; did you mean 'verify_hits'\\?$"):
            check(CacheConfig(options={"verify_hit": "always"}))
        with pytest.raises(ConfigError, match="options.verify_hits: unknown option for backend radix; allowed: chunked_prefill_size, mamba_chunk, mamba_track_interval, no_tail_cliff, state_cap"):
            check(CacheConfig(options={"verify_hits": "always"}).replace(backend="radix"))


def test_a_config_object_checks_its_own_fields_only():
    # Making a CacheConfig resolves nothing: no backend module is imported, and a missing
    # hashing library (cbor2, xxhash) cannot fail it. What it names is checked later.
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['cbor2'] = sys.modules['xxhash'] = None\n"
        "from prefixcache.config import CacheConfig\n"
        "from prefixcache.config_checks import check_cache_config\n"
        "from prefixcache.errors import ConfigError\n"
        "config = CacheConfig(backend='not_installed.module:Cache', eviction='nope', options={'x': 1})\n"
        "assert not [m for m in sys.modules if m.startswith('prefixcache.backends')], 'a backend was imported'\n"
        "try:\n"
        "    check_cache_config(config)\n"
        "except ConfigError as err:\n"
        "    assert str(err).startswith('backend: backend ') and 'cannot import module' in str(err), str(err)\n"
        "else:\n"
        "    raise AssertionError('check_cache_config accepted an uninstalled backend')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_checking_options_does_not_import_torch(tmp_path):
    # Resolving the backend class to check its options imports the backend's module:
    # neither that nor the config loaders may pull in torch.
    import subprocess
    import sys

    path = write(tmp_path, "cache: {backend: radix, options: {}}\n")
    code = (
        "import sys\n"
        "from prefixcache.config_checks import load_config\n"
        "from prefixcache.engine.config import parse_serving_config\n"
        f"load_config({str(path)!r})\n"
        "parse_serving_config({'cache': {'backend': 'hash', 'options': {'verify_hits': 'never'}}, 'engine': {}})\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_config_error_survives_pickling_with_its_field():
    """A Ray replica's refusal reaches the ingress pickled: its field must come with it."""
    import pickle

    err = ConfigError("allowed_token_ids", "no token could be drawn", "serve.yaml")
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.path, back.message, back.source, str(back)) == (
        ConfigError, err.path, err.message, err.source, str(err))
