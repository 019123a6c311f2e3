"""Config dataclasses are plain data: built directly, they check their own fields only;
what they name (a backend, an eviction policy, a router and its options) is resolved
and checked by the loaders, `prefixcache validate` and the build step, naming the key."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import yaml

import prefixcache
from prefixcache.ab_config import ABConfig, WorkloadSpec, parse_ab_config
from prefixcache.cli import main
from prefixcache.cluster.config import ClusterConfig, RouterSpec, parse_cluster_config
from prefixcache.cluster.registry import resolve_router_spec
from prefixcache.config import CacheConfig, ConfigError, HashConfig, SecurityWarning
from prefixcache.engine.config import ServingConfig, parse_serving_config
from prefixcache.serve.cluster_config import (
    RayClusterConfig,
    parse_cluster_serve_config,
)
from prefixcache.serve.config import ServeConfig, parse_serve_config

UNKNOWN = CacheConfig(
    backend="no_such_backend", eviction="no_such_policy", options={"no_such_option": 1}
)


def test_dataclasses_built_directly_resolve_nothing():
    arm = ABConfig(WorkloadSpec("shared_prefix"), {"a": UNKNOWN}, 4096)
    assert (
        arm.arms["a"].backend == "no_such_backend"
        and arm.arms["a"].num_blocks == 4096 // 16
    )
    spec = RouterSpec("no_such_router", {"no_such_option": 1})
    assert spec.options == {"no_such_option": 1}
    cluster = ClusterConfig(WorkloadSpec("shared_prefix"), UNKNOWN, 4096, {"x": spec})
    assert cluster.cache.backend == "no_such_backend" and cluster.routers["x"] is spec
    # The round-robin reference line is still added: that is the dataclass's own rule.
    assert set(cluster.routers) == {"round_robin", "x"}
    assert (
        ServingConfig(UNKNOWN).cache is UNKNOWN
        and ServeConfig(ServingConfig(UNKNOWN)).serving.cache is UNKNOWN
    )
    assert (
        RayClusterConfig(router="no_such_router", options={"no_such_option": 1}).router
        == "no_such_router"
    )


def test_dataclasses_still_check_their_own_fields():
    with pytest.raises(ConfigError, match="^arms: needs at least one arm"):
        ABConfig(WorkloadSpec("shared_prefix"), {}, 4096)
    with pytest.raises(ConfigError, match="^replicas: needs at least one cluster size"):
        ClusterConfig(WorkloadSpec("shared_prefix"), UNKNOWN, 4096, {}, replicas=())
    with pytest.raises(ConfigError, match="^options: must be a mapping, got list"):
        RouterSpec("round_robin", [])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^port: must be an integer in"):
        RayClusterConfig(router="no_such_router", port=0)


AB = {"workload": {"generator": "shared_prefix"}, "capacity_tokens": 4096}
CLUSTER = {
    "workload": {"generator": "shared_prefix"},
    "cache": {"backend": "hash"},
    "capacity_tokens": 4096,
    "routers": {"round_robin": {}},
}
ENGINE = {"cache": {"block_size": 4}, "engine": {"model": "tiny"}}

# (loader, mapping, the error's path and the start of its message)
CASES = [
    (
        parse_ab_config,
        {**AB, "arms": {"a": {"backend": "no_such_backend"}}},
        "arms.a.backend",
        "unknown backend 'no_such_backend'",
    ),
    (
        parse_ab_config,
        {**AB, "arms": {"a": {"eviction": "no_such_policy"}}},
        "arms.a.eviction",
        "unknown eviction policy 'no_such_policy'",
    ),
    (
        parse_ab_config,
        {**AB, "arms": {"a": {"backend": "radix", "options": {"x": 1}}}},
        "arms.a.options.x",
        "unknown option for backend radix",
    ),
    (
        parse_cluster_config,
        {**CLUSTER, "cache": {"backend": "no_such_backend"}},
        "cache.backend",
        "unknown backend 'no_such_backend'",
    ),
    (
        parse_cluster_config,
        {**CLUSTER, "routers": {"kv": {"router": "no_such_router"}}},
        "routers.kv.router",
        "unknown router 'no_such_router'",
    ),
    (
        parse_cluster_config,
        {**CLUSTER, "routers": {"kv_events": {"options": {"x": 1}}}},
        "routers.kv_events.options.x",
        "unknown key; allowed keys: overlap_score_weight",
    ),
    (
        parse_serving_config,
        {**ENGINE, "cache": {"backend": "no_such_backend"}},
        "cache.backend",
        "unknown backend 'no_such_backend'",
    ),
    (
        parse_serve_config,
        {**ENGINE, "cache": {"eviction": "no_such_policy"}, "kv_events": {}},
        "cache.eviction",
        "unknown eviction policy 'no_such_policy'",
    ),
    (
        parse_cluster_serve_config,
        {**ENGINE, "cluster": {"router": "no_such_router"}},
        "cluster.router",
        "unknown router 'no_such_router'",
    ),
    (
        parse_cluster_serve_config,
        {**ENGINE, "cluster": {"router": "kv_events", "options": {"x": 1}}},
        "cluster.options.x",
        "unknown key; allowed keys: overlap_score_weight",
    ),
]


@pytest.mark.parametrize(
    ("loader", "data", "path", "message"),
    CASES,
    ids=[f"{c[0].__name__}-{c[2]}" for c in CASES],
)
def test_loaders_and_validate_report_what_a_dataclass_names(
    tmp_path, capsys, loader, data, path, message
):
    with pytest.raises(ConfigError) as info:
        loader(data, "f.yaml")
    assert info.value.source == "f.yaml" and info.value.path == path
    assert info.value.message.startswith(message)
    file = tmp_path / "f.yaml"
    file.write_text(yaml.safe_dump(data))
    assert main(["validate", str(file)]) == 2
    out, err = capsys.readouterr()
    assert (
        out == ""
        and err.startswith(f"error: {file}: {path}: {message}")
        and err.count("\n") == 1
    )


def test_a_router_spec_is_resolved_by_the_registry():
    resolved = resolve_router_spec(
        "kv_events", RouterSpec("kv_events", {"temperature": 0.5}).options
    )
    assert resolved.router == "kv_events" and resolved.parsed.temperature == 0.5
    assert resolved.option_values()["temperature"] == 0.5 and resolved.cls.needs_index
    with pytest.raises(ConfigError, match="^router: unknown router 'no_such_router'"):
        resolve_router_spec("no_such_router")
    with pytest.raises(ConfigError, match="^options.x: unknown key"):
        resolve_router_spec("kv_events", {"x": 1})


def test_load_cache_checks_once_so_a_warning_shows_once(tmp_path):
    path = tmp_path / "cache.yaml"
    path.write_text(
        textwrap.dedent("""\
        cache:
          backend: hash
          block_size: 4
          num_blocks: 8
          hash: {algorithm: xxhash}
          options: {verify_hits: never}
        """)
    )
    trusting = CacheConfig(
        block_size=4,
        num_blocks=8,
        hash=HashConfig("xxhash"),
        options={"verify_hits": "never"},
    )
    for build in (
        lambda: prefixcache.load_cache(path),
        lambda: prefixcache.build_cache(trusting),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = build()
        assert cache.block_size == 4
        security = [
            str(w.message) for w in caught if issubclass(w.category, SecurityWarning)
        ]
        assert len(security) == 1 and security[0].startswith(
            "options.verify_hits: never trusts xxhash"
        ), security
