"""The file of `prefixcache cluster serve`: every replica's engine, and the Ray Serve
cluster around them.

Owns `ClusterServeConfig`: the serve file's sections (`cache:`, `engine:`, `kv_events:`,
each replica's, as `prefixcache serve` reads them) plus `cluster:` (`RayClusterConfig`),
validated once at load, so a mistake names the file, the key path and what is allowed.
`RayClusterConfig` checks its own fields; the loader checks the router it names
(`check_ray_cluster_config`).
Example (configs/cluster_serve.yaml)::

    cache:  {backend: hash, block_size: 16, num_blocks: 1024}
    engine: {model: tiny, num_threads: 1}
    cluster:
      replicas: 2
      router: kv_events        # a prefixcache router, or ray_power_of_two / ray_prefix_cache_affinity
      options: {}
      port: 8000

Each replica publishes its KV events on free loopback ports of its own, so `kv_events:`
takes no `enabled`, `endpoint` or `replay_endpoint` here (the other keys: topic,
buffer_steps, hwm, ...). The hash seed (`cache.hash.seed`) is resolved when the file is
loaded, as one replica would resolve it (`prefixcache.hashing.resolve_seed`), and the
result given to every replica and to the router, so all of them hash alike, even with
xxhash's per-process random seed.

Must never: start Ray, build an engine or import torch.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.cluster.registry import resolve_router_spec
from prefixcache.service_model import ServiceModel
from prefixcache.config import ConfigError, from_mapping, load_yaml, to_plain
from prefixcache.engine.config import check_sections
from prefixcache.hashing import resolve_seed
from prefixcache.serve.config import SECTIONS as SERVE_SECTIONS
from prefixcache.serve.config import ServeConfig, parse_serve_config
from prefixcache.serve.listen import check_listen_address

__all__ = ["RayClusterConfig", "ClusterServeConfig", "ClusterLayout", "cluster_layout", "machine_cpus", "INGRESS_CPUS",
           "RAY_ROUTERS", "parse_cluster_serve_config",
           "check_ray_cluster_config", "load_cluster_serve_config", "with_proxy_address", "check_proxy_address_free",
           "is_cluster_serve_mapping"]

SECTIONS = (*SERVE_SECTIONS, "cluster")
RAY_ROUTERS = ("ray_power_of_two", "ray_prefix_cache_affinity")
"""Ray Serve's own routers, the baselines: its default `PowerOfTwoChoicesRequestRouter`,
and Ray Serve LLM's `PrefixCacheAffinityRouter` (which matches prompts as text)."""
RAY_ROUTER_OPTIONS = {
    "ray_power_of_two": (),
    "ray_prefix_cache_affinity": ("imbalanced_threshold", "match_rate_threshold", "do_eviction",
                                  "eviction_threshold_chars", "eviction_target_chars", "eviction_interval_secs"),
}
"""The options each of Ray's routers takes (`PrefixCacheAffinityRouter.initialize_state`'s
keywords in Ray 2.60, but its `tree_actor`), checked at load so a typo is a one-line error,
not a failed deployment."""
_SET_PER_REPLICA = ("enabled", "endpoint", "replay_endpoint")
_ANY_LOOPBACK_PORT = "tcp://127.0.0.1:*"


@dataclass(frozen=True)
class RayClusterConfig:
    """The `cluster:` section. SECONDS unless a name says otherwise.

    replicas:              engine replicas (the deployment's num_replicas)
    router:                a prefixcache router (round_robin, power_of_two, approx_tree,
                           prefix_affinity, kv_events, an entry point or "module:Class"),
                           run as a Ray Serve request router; or one of Ray's own:
                           ray_power_of_two, ray_prefix_cache_affinity
    options:               the router's options (Ray's routers: their initialize_state
                           keywords, e.g. imbalanced_threshold)
    max_ongoing_requests:  requests a replica is sent at once (Ray Serve's limit)
    replica_cpus:          Ray logical CPUs each replica reserves (null: an equal share of
                           what the ingress's `INGRESS_CPUS` leave; `cluster_layout`)
    health_check_period_s: how often Ray Serve checks each replica (a dead one is replaced)
    max_attempts:          calls a request may take when replicas die before it streams
    stall_timeout_s:       a replica silent this long on a request counts as failed
    num_cpus:              the local Ray cluster's logical CPUs (null: this machine's)
    host, port:            where Ray Serve's HTTP proxy listens
    served_model_name:     what requests name as `model` (null: engine.model)
    service:               the replicas' service model (`ServiceModel` keys) for the
                           routers that estimate time (estimated_ttft); null: the
                           replicas' own `engine.pace` when they are paced, else an 8B
                           model on one H100, the router's default
    """

    replicas: int = 2
    router: str = "kv_events"
    options: Mapping[str, Any] = field(default_factory=dict)
    max_ongoing_requests: int = 64
    replica_cpus: float | None = None
    health_check_period_s: float = 1.0
    max_attempts: int = 3
    stall_timeout_s: float = 300.0
    num_cpus: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    service: ServiceModel | None = None

    def __post_init__(self) -> None:
        for name in ("replicas", "max_ongoing_requests", "max_attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        for name in ("replica_cpus", "health_check_period_s", "stall_timeout_s"):
            value = getattr(self, name)
            if value is None and name == "replica_cpus":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(name, f"must be a number > 0{' or null' if name == 'replica_cpus' else ''}, "
                                  f"got {value!r}")
        if self.num_cpus is not None and (isinstance(self.num_cpus, bool) or not isinstance(self.num_cpus, int)
                                          or self.num_cpus < 1):
            raise ConfigError("num_cpus", f"must be an integer >= 1 or null, got {self.num_cpus!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 1 <= self.port <= 65535:
            raise ConfigError("port", f"must be an integer in [1, 65535], got {self.port!r}")
        if not isinstance(self.options, Mapping):
            raise ConfigError("options", f"must be a mapping, got {type(self.options).__name__}")
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))
        if self.service is not None and self.is_ray_router:
            raise ConfigError("service", f"{self.router} does not read a service model (only the prefixcache "
                                         f"routers do); remove it or pick one of those")

    @property
    def is_ray_router(self) -> bool:
        return self.router in RAY_ROUTERS


@dataclass(frozen=True)
class ClusterServeConfig:
    """What `prefixcache cluster serve` runs: `serve` (one replica's engine and events, its
    hash seed resolved, its event sockets on free loopback ports), `replica_data` (the
    same as the mapping each replica parses), and `cluster`."""

    serve: ServeConfig
    replica_data: Mapping[str, Any]
    cluster: RayClusterConfig

    def plain(self) -> dict[str, Any]:
        """The resolved file as plain data (for `prefixcache validate`)."""
        serving = to_plain(self.serve.serving)
        return {**serving, "kv_events": to_plain(self.serve.kv_events), "cluster": to_plain(self.cluster)}


INGRESS_CPUS = 0.5
"""Ray logical CPUs the ingress reserves (it tokenizes and awaits its replicas)."""


@dataclass(frozen=True)
class ClusterLayout:
    """The local Ray cluster's logical CPUs and what each deployment reserves of them."""

    num_cpus: int
    replica_cpus: float
    ingress_cpus: float


def machine_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; os.cpu_count() elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cluster_layout(cluster: RayClusterConfig) -> ClusterLayout:
    """The CPUs of `cluster` on this machine: `num_cpus` (null: `machine_cpus()`), the
    ingress's `INGRESS_CPUS`, and `replica_cpus` (null: an equal share of the rest).
    ConfigError at `replica_cpus` (or `num_cpus`, relative to `cluster:`) when Ray could
    never schedule them all: it would wait for resources forever, warning every 30 s."""
    num_cpus = cluster.num_cpus if cluster.num_cpus is not None else machine_cpus()
    where = f"num_cpus: {num_cpus}" if cluster.num_cpus is not None else f"num_cpus: null, this machine's {num_cpus}"
    if num_cpus <= INGRESS_CPUS:
        raise ConfigError("num_cpus", f"{num_cpus} logical CPU(s) leave nothing for the replicas once the ingress "
                          f"takes {INGRESS_CPUS}")
    if cluster.replica_cpus is None:
        return ClusterLayout(num_cpus, round((num_cpus - INGRESS_CPUS) / cluster.replicas, 4), INGRESS_CPUS)
    needed = cluster.replicas * cluster.replica_cpus + INGRESS_CPUS
    if needed > num_cpus:
        share = round((num_cpus - INGRESS_CPUS) / cluster.replicas, 4)
        raise ConfigError("replica_cpus", f"{cluster.replicas} replicas x {cluster.replica_cpus:g} CPUs + the "
                          f"ingress's {INGRESS_CPUS:g} = {needed:g} logical CPUs, more than the cluster's {num_cpus} "
                          f"({where}): Ray would never schedule them all. Leave replica_cpus null (here: {share:g} "
                          f"each), lower it to at most {share:g}, or raise num_cpus")
    return ClusterLayout(num_cpus, cluster.replica_cpus, INGRESS_CPUS)


def check_ray_cluster_config(cluster: RayClusterConfig) -> None:
    """ConfigError (path `router` or `options.<key>`, relative to the `cluster:` section)
    unless `router` is one of Ray's routers given options it takes, or a prefixcache
    router that resolves with options its class takes (`resolve_router_spec`)."""
    if cluster.router in RAY_ROUTERS:
        allowed = RAY_ROUTER_OPTIONS[cluster.router]
        for key in cluster.options:
            if key not in allowed:
                hint = f"it takes {', '.join(allowed)}" if allowed else "it takes none"
                raise ConfigError(f"options.{key}", f"is not an option of {cluster.router} ({hint})")
        return
    try:
        resolve_router_spec(cluster.router, cluster.options)
    except ConfigError as err:
        raise ConfigError(err.path, f"{err.message} (or one of Ray's: {', '.join(RAY_ROUTERS)})") from None


def is_cluster_serve_mapping(data: Mapping[str, Any]) -> bool:
    """Whether a YAML file's top level is a `cluster serve` file (it has `cluster:`)."""
    return "cluster" in data


def parse_cluster_serve_config(data: Any, source: str | None = None) -> ClusterServeConfig:
    """A top-level mapping with `cache:`, `engine:`, optional `kv_events:` and `cluster:`."""
    check_sections(data, SECTIONS, source)
    try:
        cluster = from_mapping(RayClusterConfig, data.get("cluster"), "cluster")
        try:
            check_ray_cluster_config(cluster)
            cluster_layout(cluster)
        except ConfigError as err:
            raise err.within("cluster") from None
        events = data.get("kv_events") or {}
        if not isinstance(events, Mapping):
            raise ConfigError("kv_events", f"must be a mapping, got {type(events).__name__}")
        for key in _SET_PER_REPLICA:
            if key in events:
                raise ConfigError(f"kv_events.{key}", "is set per replica by cluster serve (events on, free "
                                  "loopback ports); leave it out")
    except ConfigError as err:
        raise err.within("", source) from None
    replica = {k: v for k, v in data.items() if k != "cluster"}
    per_replica = {**events, "enabled": True, "endpoint": _ANY_LOOPBACK_PORT, "replay_endpoint": _ANY_LOOPBACK_PORT}
    cache = parse_serve_config({**replica, "kv_events": per_replica}, source).serving.cache
    cache_data = dict(replica.get("cache") or {})
    cache_data["hash"] = {**dict(cache_data.get("hash") or {}), "seed": resolve_seed(cache.hash.algorithm, cache.hash.seed)}
    replica["cache"] = cache_data
    replica["kv_events"] = per_replica
    serve_config = parse_serve_config(replica, source)
    pace = serve_config.serving.engine.pace
    if cluster.service is None and pace is not None and not cluster.is_ray_router:
        # The router estimates with the model that times the replicas it routes to.
        cluster = dataclasses.replace(cluster, service=pace)
    return ClusterServeConfig(serve_config, types.MappingProxyType(replica), cluster)


def load_cluster_serve_config(source: str | Path) -> ClusterServeConfig:
    """The `cluster serve` file at `source`, validated."""
    return parse_cluster_serve_config(load_yaml(source), str(source))


def with_proxy_address(config: ClusterServeConfig, *, host: str | None = None,
                       port: int | None = None) -> ClusterServeConfig:
    """`config` with Ray Serve's proxy at `host` / `port` where given (the CLI's --host,
    --port); a ConfigError names the flag."""
    changes: dict[str, Any] = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if not changes:
        return config
    try:
        return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, **changes))
    except ConfigError as err:
        raise ConfigError(f"--{err.path}", err.message) from None


def check_proxy_address_free(config: ClusterServeConfig) -> None:
    """A ConfigError now if nothing can listen on `cluster.host:port` (in use, or a host
    not of this machine), rather than Ray Serve's proxy failing once Ray is up."""
    check_listen_address(config.cluster.host, config.cluster.port, "cluster.port")
