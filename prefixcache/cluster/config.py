"""The cluster experiment file (`cluster.yaml`): its schema as frozen dataclasses, and its loader.

Owns `ClusterConfig` (one workload, the replicas' cache and capacity, the replica
counts to try, the service model, the routers) and `RouterSpec` (a router by name with
its options), parsed by `prefixcache.config.from_mapping`, so every mistake is a
`ConfigError` naming the file, the key path and what is allowed. The dataclasses check
their own fields only; `parse_cluster_config` then checks what they name: the cache
(`prefixcache.config_checks.check_cache_config`) and every router, resolved with its
options checked against its class's `Options` (`prefixcache.cluster.registry`). Must
never: run a simulation or build a cache (`prefixcache.cluster.simulate` does both).

    workload:                        # as in ab.yaml: a generator, or a Mooncake trace
      generator: multi_turn
      params: {seed: 0, request_rate: 40}
    cache: {backend: hash, block_size: 16}    # every replica's cache, without num_blocks
                                     # (enable_events is set by the simulation)
    capacity_tokens: 16384           # ONE replica's pool, in TOKENS (null: what the
                                     # service model's device leaves for KV)
    replicas: [2, 4, 8]              # cluster sizes N to simulate
    service: {model: llama-3.1-8b, device: h100, max_num_seqs: 1024, max_num_batched_tokens: 8192}
    slo: {ttft_s: 2.0, itl_s: 0.025} # what a good request stays within (goodput)
    commit_outputs: true             # outputs take cache room, as in a real engine
    cache_when_scheduled: false      # true: a scheduled chunk is hittable in its own step (vLLM)
    arrival_speedup: 1.0             # arrival times are divided by this
    seed: 0                          # every router's random source
    routers:                         # label -> {router: name (default: the label), options: {...}}
      round_robin: {}
      power_of_two: {}
      approx_tree: {options: {cache_threshold: 0.3}}
      kv_events: {options: {overlap_score_weight: 1.0}}

`round_robin` is a reference line of every report: it is added when no label names it.
The other reference, N engines over one shared cache of N x capacity_tokens (the hit
ceiling for any router), is simulated for every N.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.ab_config import ARM_NAME, MooncakeSpec, WorkloadSpec, _check_trace_exists
from prefixcache.cluster.registry import resolve_router_spec
from prefixcache.cluster.results import SLO
from prefixcache.service_model import ServiceModel
from prefixcache.config import CacheConfig, ConfigError, from_mapping, load_yaml, to_plain
from prefixcache.config_checks import check_cache_config

__all__ = ["ClusterConfig", "RouterSpec", "REFERENCE_ROUTER", "load_cluster_config", "parse_cluster_config",
           "check_cluster_config", "is_cluster_mapping"]

REFERENCE_ROUTER = "round_robin"


@dataclass(frozen=True)
class RouterSpec:
    """One router arm: `router` is a registered name, an entry-point name or
    "package.module:ClassName"; `options` are its class's `Options` keys. Plain data:
    `prefixcache.cluster.registry.resolve_router_spec` finds the class and parses the
    options."""

    router: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.options, Mapping):
            raise ConfigError("options", f"must be a mapping, got {type(self.options).__name__}")
        object.__setattr__(self, "options", types.MappingProxyType(dict(self.options)))


@dataclass(frozen=True)
class ClusterConfig:
    """One cluster experiment (see the module docstring). TOKENS unless a name says otherwise."""

    workload: WorkloadSpec
    cache: CacheConfig
    capacity_tokens: int | None = None
    routers: Mapping[str, RouterSpec] = field(default_factory=dict)
    replicas: tuple[int, ...] = (2, 4, 8)
    service: ServiceModel = field(default_factory=ServiceModel)
    slo: SLO = field(default_factory=SLO)
    commit_outputs: bool = True
    cache_when_scheduled: bool = False
    arrival_speedup: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.capacity_tokens is None:
            try:
                object.__setattr__(self, "capacity_tokens", self.service.capacity_tokens())
            except ConfigError as err:
                raise err.within("service") from None
        if self.capacity_tokens < self.cache.block_size:
            raise ConfigError(
                "capacity_tokens",
                f"must be at least one block ({self.cache.block_size} TOKENS), got {self.capacity_tokens!r}",
            )
        if not self.replicas:
            raise ConfigError("replicas", "needs at least one cluster size, e.g. [2, 4, 8]")
        for i, n in enumerate(self.replicas):
            if n < 1:
                raise ConfigError(f"replicas[{i}]", f"must be an integer >= 1, got {n!r}")
        if len(set(self.replicas)) != len(self.replicas):
            raise ConfigError("replicas", f"lists a cluster size twice: {list(self.replicas)}")
        if not self.arrival_speedup > 0 or self.arrival_speedup == float("inf"):
            raise ConfigError("arrival_speedup", f"must be a finite number > 0, got {self.arrival_speedup!r}")
        spec = self.workload.mooncake
        if spec is not None and not spec.outputs:
            raise ConfigError(
                "workload.mooncake.outputs",
                "the service model needs every request's output length: keep outputs true "
                "(set commit_outputs: false to keep outputs out of the caches)",
            )
        for name in self.routers:
            if not isinstance(name, str) or not ARM_NAME.fullmatch(name):
                raise ConfigError(f"routers.{name}", "a router label is letters, digits and _ . : / + - (e.g. 'kv/2')")
        routers = dict(self.routers)
        if not any(s.router == REFERENCE_ROUTER for s in routers.values()):
            routers = {REFERENCE_ROUTER: RouterSpec(REFERENCE_ROUTER), **routers}
        cache = self.cache.replace(num_blocks=self.capacity_tokens // self.cache.block_size)
        object.__setattr__(self, "cache", cache)
        object.__setattr__(self, "routers", types.MappingProxyType(routers))

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def reference_label(self) -> str:
        """The label of the round-robin reference line."""
        return next(label for label, s in self.routers.items() if s.router == REFERENCE_ROUTER)

    def plain(self) -> dict[str, Any]:
        """The config as plain dicts and lists (for YAML and JSON), every router's
        options resolved to their values."""
        out = to_plain(self)
        out["routers"] = {
            label: {"router": s.router, "options": resolve_router_spec(s.router, s.options).option_values()}
            for label, s in self.routers.items()
        }
        return out

    def with_trace(self, path: str | Path) -> ClusterConfig:
        """The same experiment on the Mooncake trace at `path` (the file's other trace
        settings kept when its workload is a trace already)."""
        spec = self.workload.mooncake or MooncakeSpec()
        return dataclasses.replace(self, workload=WorkloadSpec(mooncake=dataclasses.replace(spec, path=str(path))))

    def with_replicas(self, replicas: tuple[int, ...]) -> ClusterConfig:
        """The same experiment at other cluster sizes."""
        return dataclasses.replace(self, replicas=tuple(replicas))

    def with_point(self, *, arrival_speedup: float | None = None, max_num_seqs: int | None = None,
                   capacity_tokens: int | None = None) -> ClusterConfig:
        """The same experiment at another operating point: arrival rate (speed-up), slots
        per replica, TOKENS of cache per replica (None: keep the config's)."""
        service = self.service if max_num_seqs is None else dataclasses.replace(self.service, max_num_seqs=max_num_seqs)
        return dataclasses.replace(
            self, service=service,
            arrival_speedup=self.arrival_speedup if arrival_speedup is None else arrival_speedup,
            capacity_tokens=self.capacity_tokens if capacity_tokens is None else capacity_tokens,
        )


def check_cluster_config(config: ClusterConfig) -> None:
    """ConfigError (path `cache.<key>`, `routers.<label>.router` or
    `routers.<label>.options.<key>`) unless the cache names what resolves
    (`check_cache_config`) and every router resolves with options its class takes."""
    try:
        check_cache_config(config.cache)
    except ConfigError as err:
        raise err.within("cache") from None
    for label, spec in config.routers.items():
        try:
            resolve_router_spec(spec.router, spec.options)
        except ConfigError as err:
            raise err.within(f"routers.{label}") from None


def is_cluster_mapping(data: Mapping[str, Any]) -> bool:
    """Whether a YAML file's top level is a cluster experiment."""
    return "routers" in data or "replicas" in data


def parse_cluster_config(data: Any, source: str | None = None, *, check_trace: bool = True) -> ClusterConfig:
    """A cluster mapping -> ClusterConfig; errors carry `source` (the file) and the key
    path. `check_trace=False` skips the trace file check (a caller replacing the trace)."""
    try:
        if not isinstance(data, Mapping):
            raise ConfigError("", f"top level must be a mapping, got {type(data).__name__}")
        cache = data.get("cache")
        if isinstance(cache, Mapping) and "num_blocks" in cache:
            raise ConfigError(
                "cache.num_blocks",
                "set one replica's pool with capacity_tokens (TOKENS); num_blocks = capacity_tokens // block_size",
            )
        routers = data.get("routers")
        if isinstance(routers, Mapping):
            # A label is its router's name unless it says otherwise: `kv_events: {}`.
            data = {**data, "routers": {
                label: ({"router": label, **spec} if isinstance(spec, Mapping) and "router" not in spec
                        else {"router": label} if spec is None else spec)
                for label, spec in routers.items()
            }}
        elif routers is None:
            raise ConfigError("routers", "missing required key: label -> {router: name, options: {...}}")
        config = from_mapping(ClusterConfig, data)
        check_cluster_config(config)
        if check_trace:
            _check_trace_exists(config.workload.mooncake)
        return config
    except ConfigError as err:
        raise err.within("", source) from None


def load_cluster_config(source: str | Path, *, trace: str | Path | None = None) -> ClusterConfig:
    """The cluster experiment in a YAML file, validated; with `trace`, on that Mooncake
    trace instead of the file's workload (then the file's own trace path need not exist)."""
    config = parse_cluster_config(load_yaml(source), str(source), check_trace=trace is None)
    if trace is None:
        return config
    config = config.with_trace(trace)
    _check_trace_exists(config.workload.mooncake)
    return config
