"""The A/B experiment file (`ab.yaml`): its schema as frozen dataclasses, and its loader.

Owns `ABConfig` (one workload, the pool capacity every arm shares, the arms),
`WorkloadSpec` (a generator by name with its parameters, or a Mooncake trace) and
`MooncakeSpec`, parsed by `prefixcache.config.from_mapping`, so every mistake is a
`ConfigError` naming the file, the key path and what is allowed. Must never: run a
replay or build a cache (`prefixcache.ab` does both).

    workload:
      generator: multi_turn          # a name in prefixcache.workloads.GENERATORS ...
      params: {seed: 0}              # ... and its keyword arguments
      # mooncake: {path: null, limit: null, outputs: true}   # ... or a Mooncake trace
    capacity_tokens: 32768           # pool size in TOKENS, the same for every arm
    max_concurrent: 1                # requests live at once during the replay
    sweep_capacities: [8192, 32768]  # TOKENS; what `prefixcache sweep` tries by default
    arms:                            # name -> a `cache:` section without num_blocks
      hash/16: {backend: hash, block_size: 16}
      radix/1: {backend: radix, block_size: 1}

Loading checks everything but the generator's parameter values (`WorkloadSpec.build`
does, when the workload is made): arms' backends and their options (`check_ab_config`,
once the dataclasses, which check their own fields only, are made), that a trace
path names a file, that every arm's pool fits the native pool (`capacity_tokens //
block_size` blocks, for each sweep capacity too), and, without generating anything,
that a generator makes at most `MAX_REQUESTS` requests. `ABConfig.build_workload`
makes the workload and checks that its token ids fit every arm's backend (the radix
tree stores int32 ids), naming the trace line or the arm.

Capacity is given once, in TOKENS, because arms may differ in block size: an arm of
block size B gets `num_blocks = capacity_tokens // B` blocks, so every arm holds the
same number of tokens (exactly, when capacity_tokens is a multiple of every B; else
each arm gets the whole blocks that fit). Setting `num_blocks` in an arm is an error.
An arm with lower tiers (`tiers: [{medium: CPU, num_blocks: ...}]`, docs/tiers.md) holds
the same capacity in all: its tiers' blocks count toward it and the device pool gets the
rest, so a tiered arm and a flat one compare at equal total capacity (`with_split` sets
the device / host division for `prefixcache sweep --device-tokens --host-tokens`).

KV events: an arm records them only when it says `enable_events: true` (the A/B then
counts them by type); by default it records none, since nothing else reads them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache import limits, registry
from prefixcache.config import CacheConfig, ConfigError, from_mapping, key_text, load_yaml
from prefixcache.config_checks import check_cache_config
from prefixcache.workloads import GENERATORS, Workload, generate, read_mooncake
from prefixcache.workloads.catalog import num_requests, too_many_requests
from prefixcache.workloads.checks import MAX_REQUESTS
from prefixcache.workloads.mooncake import MOONCAKE_BLOCK_SIZE

__all__ = ["ABConfig", "WorkloadSpec", "MooncakeSpec", "load_ab_config", "parse_ab_config", "check_ab_config",
           "is_ab_mapping", "parse_tokens"]

ARM_NAME = re.compile(r"[A-Za-z0-9_.:/+-]+")


@dataclass(frozen=True)
class MooncakeSpec:
    """A Mooncake JSONL trace to replay.

    path:       the trace; null = given on the command line (`--trace PATH`)
    limit:      replay only the first `limit` records (null: all)
    outputs:    commit each request's output too (fresh tokens that take cache room, as
                in a real engine); false replays prompts only, as the Mooncake paper and
                kvcache-simulator do
    block_size: TOKENS per `hash_ids` block in the trace (512 in the published traces;
                not the cache's block size)
    """

    path: str | None = None
    limit: int | None = None
    outputs: bool = True
    block_size: int = MOONCAKE_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError("limit", f"must be an integer >= 1 or null, got {self.limit!r}")
        if self.block_size < 1:
            raise ConfigError("block_size", f"must be an integer >= 1, got {self.block_size!r}")


@dataclass(frozen=True)
class WorkloadSpec:
    """Where the requests come from: exactly one of `generator` (with `params`) or `mooncake`.

    generator: a name in `prefixcache.workloads.GENERATORS`
    params:    that generator's keyword arguments (seed included); defaults otherwise
    mooncake:  a Mooncake trace (see MooncakeSpec)
    """

    generator: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    mooncake: MooncakeSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", types.MappingProxyType(dict(self.params)))
        if (self.generator is None) == (self.mooncake is None):
            raise ConfigError(
                "", "give exactly one of 'generator' (a name: " + ", ".join(GENERATORS)
                + ") or 'mooncake' (a trace: {path: ...})"
            )
        if self.mooncake is not None:
            if self.params:
                raise ConfigError("params", "parameters are for a generator; a trace takes none")
            return
        if self.generator not in GENERATORS:
            raise ConfigError(
                "generator", f"unknown generator {self.generator!r}; allowed values: {', '.join(GENERATORS)}"
            )
        allowed = inspect.signature(GENERATORS[self.generator].make).parameters
        for key in self.params:
            if key not in allowed:
                raise ConfigError(
                    f"params.{key_text(key)}",
                    f"unknown parameter of generator {self.generator!r}; allowed keys: {', '.join(allowed)}",
                )
        count = num_requests(self.generator, **self.params)
        if count is not None and count > MAX_REQUESTS:
            raise ConfigError("params", too_many_requests(self.generator, count))

    def build(self, *, max_token_id: int | None = None) -> Workload:
        """The workload: generated, or read from the trace. A bad parameter value, a
        missing trace path, an unreadable trace or (with `max_token_id`) a trace block
        whose token ids pass it is a ConfigError under `workload`."""
        if self.generator is not None:
            try:
                return generate(self.generator, **self.params)
            except (TypeError, ValueError) as err:
                raise ConfigError("workload.params", str(err)) from None
        spec = self.mooncake
        assert spec is not None  # __post_init__: exactly one of the two
        if spec.path is None:
            raise ConfigError("workload.mooncake.path", "no trace given: set it, or pass --trace PATH")
        try:
            return read_mooncake(spec.path, block_size=spec.block_size, limit=spec.limit, outputs=spec.outputs,
                                 max_token_id=max_token_id)
        except OSError as err:
            raise ConfigError("workload.mooncake.path", f"cannot read trace {spec.path!r}: {err.strerror}") from None
        except ValueError as err:
            raise ConfigError("workload.mooncake.path", str(err)) from None


@dataclass(frozen=True)
class ABConfig:
    """One A/B experiment (see the module docstring).

    workload:         the requests (WorkloadSpec)
    arms:             arm name -> CacheConfig; `num_blocks` is set from capacity_tokens
    capacity_tokens:  pool size in TOKENS shared by every arm (and by Belady)
    max_concurrent:   requests live at once (1 = strictly one after another, the model
                      the bounds use; see `prefixcache.ab`)
    sweep_capacities: default capacities, in TOKENS, for `prefixcache sweep`
    """

    workload: WorkloadSpec
    arms: Mapping[str, CacheConfig]
    capacity_tokens: int
    max_concurrent: int = 1
    sweep_capacities: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.capacity_tokens < 1:
            raise ConfigError("capacity_tokens", f"must be an integer >= 1, got {self.capacity_tokens!r}")
        if self.max_concurrent < 1:
            raise ConfigError("max_concurrent", f"must be an integer >= 1, got {self.max_concurrent!r}")
        for i, capacity in enumerate(self.sweep_capacities):
            if capacity < 1:
                raise ConfigError(f"sweep_capacities[{i}]", f"must be an integer >= 1 (TOKENS), got {capacity!r}")
        if not self.arms:
            raise ConfigError("arms", "needs at least one arm: name -> {backend: ..., block_size: ...}")
        arms = {}
        for name, cache in self.arms.items():
            if not isinstance(name, str) or not ARM_NAME.fullmatch(name):
                raise ConfigError(
                    f"arms.{key_text(name)}", "an arm name is letters, digits and _ . : / + - (e.g. 'radix/16')"
                )
            if cache.block_size > self.capacity_tokens:
                raise ConfigError(
                    f"arms.{name}.block_size",
                    f"{cache.block_size} TOKENS is more than capacity_tokens={self.capacity_tokens}: "
                    "the pool would have no block",
                )
            for key, capacity in (("capacity_tokens", self.capacity_tokens),
                                  *((f"sweep_capacities[{i}]", c) for i, c in enumerate(self.sweep_capacities))):
                if capacity // cache.block_size > limits.MAX_NUM_BLOCKS:
                    raise ConfigError(
                        key, f"{capacity} TOKENS is {capacity // cache.block_size} blocks of arm {name!r} (block_size "
                        f"{cache.block_size}); a pool holds at most {limits.MAX_NUM_BLOCKS} blocks"
                    )
            arms[name] = cache.replace(num_blocks=self._device_blocks(name, cache, self.capacity_tokens))
            for i, capacity in enumerate(self.sweep_capacities):
                self._device_blocks(name, cache, capacity, f"sweep_capacities[{i}]")
        object.__setattr__(self, "arms", types.MappingProxyType(arms))

    @staticmethod
    def _device_blocks(name: str, cache: CacheConfig, capacity_tokens: int, key: str = "capacity_tokens") -> int:
        """The device pool of arm `name` at `capacity_tokens` in all: its lower tiers
        (`cache.tiers`, BLOCKS each) count toward the capacity, the device gets the rest.
        ConfigError if the tiers leave it no block."""
        total = capacity_tokens // cache.block_size
        lower = sum(t.num_blocks for t in cache.tiers)
        if cache.tiers and total - lower < 1:
            raise ConfigError(
                f"arms.{name}.tiers", f"the tiers hold {lower} blocks; {key}={capacity_tokens} is {total} blocks of "
                f"{cache.block_size} in all, which leaves the device none"
            )
        return total - lower

    def token_limit(self) -> tuple[int, str] | None:
        """The largest token id every arm's backend stores, and the arm that sets it
        (None: every arm takes any int)."""
        tightest = None
        for name, cache in self.arms.items():
            bounds = registry.backend_class(cache.backend).token_id_range
            if bounds is not None and (tightest is None or bounds[1] < tightest[0]):
                tightest = (bounds[1], name)
        return tightest

    def build_workload(self) -> Workload:
        """The workload (`WorkloadSpec.build`), checked to fit every arm: a token id past
        what an arm's backend stores is a ConfigError naming the trace line, or the arm."""
        tightest = self.token_limit()
        try:
            workload = self.workload.build(max_token_id=tightest[0] if tightest else None)
        except ConfigError as err:
            if tightest is None or "the largest the caches store" not in err.message:
                raise
            arm = self.arms[tightest[1]]
            raise ConfigError(err.path, f"{err.message} (arm {tightest[1]!r}: backend {arm.backend})") from None
        if tightest is not None:
            highest = max((stop - 1 for r in workload.requests for runs in (r.prompt.runs, r.output.runs)
                           for _, stop in runs), default=-1)
            if highest > tightest[0]:
                name = tightest[1]
                raise ConfigError(
                    "workload", f"token ids reach {highest}; arm {name!r} (backend {self.arms[name].backend}) "
                    f"stores ids up to {tightest[0]}"
                )
        return workload

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """The distinct block sizes of the arms, in TOKENS, ascending."""
        return tuple(sorted({c.block_size for c in self.arms.values()}))

    def sweep_capacities_or_default(self) -> tuple[int, ...]:
        """`sweep_capacities`, or capacity_tokens times 1/16, 1/8, ... 4 (TOKENS, at
        least the largest block size)."""
        if self.sweep_capacities:
            return self.sweep_capacities
        floor = max(self.block_sizes)
        return tuple(sorted({max(self.capacity_tokens * 2**k // 16, floor) for k in range(7)}))

    def with_capacity(self, capacity_tokens: int) -> ABConfig:
        """The same experiment at another pool size (TOKENS)."""
        return dataclasses.replace(self, capacity_tokens=capacity_tokens)

    def with_split(self, device_tokens: int, host_tokens: int) -> ABConfig:
        """The same experiment at `device_tokens + host_tokens` TOKENS in all: an arm with
        tiers holds `host_tokens` in its first tier and the rest on the device (its other
        tiers as they are); an arm without tiers holds all of it on the device."""
        arms = {}
        for name, cache in self.arms.items():
            if cache.tiers:
                first = dataclasses.replace(cache.tiers[0], num_blocks=max(1, host_tokens // cache.block_size))
                cache = cache.replace(tiers=(first, *cache.tiers[1:]))
            arms[name] = cache
        return dataclasses.replace(self, capacity_tokens=device_tokens + host_tokens, arms=arms, sweep_capacities=())

    def with_trace(self, path: str | Path) -> ABConfig:
        """The same arms on the Mooncake trace at `path` (the file's other trace
        settings kept when its workload is a trace already)."""
        spec = self.workload.mooncake or MooncakeSpec()
        return dataclasses.replace(self, workload=WorkloadSpec(mooncake=dataclasses.replace(spec, path=str(path))))


def parse_tokens(text: str) -> int:
    """A count of TOKENS written as an int or like 3e6; ValueError otherwise."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"a capacity in TOKENS must be a number like 32768 or 3e6, got {text!r}") from None
    if not value.is_integer() or value < 1:
        raise ValueError(f"a capacity in TOKENS must be a whole number >= 1, got {text!r}")
    return int(value)


def is_ab_mapping(data: Mapping[str, Any]) -> bool:
    """Whether a YAML file's top level is an A/B experiment (rather than a `cache:` file)."""
    return "arms" in data or "workload" in data


def parse_ab_config(data: Any, source: str | None = None, *, check_trace: bool = True) -> ABConfig:
    """An A/B mapping -> ABConfig; errors carry `source` (the file) and the key path.
    `check_trace=False` skips the trace file check (a caller replacing the trace)."""
    try:
        arms = data.get("arms") if isinstance(data, Mapping) else None
        for name, arm in (arms.items() if isinstance(arms, Mapping) else ()):
            if isinstance(arm, Mapping) and "num_blocks" in arm:
                raise ConfigError(
                    f"arms.{name}.num_blocks",
                    "set the pool size once with capacity_tokens (TOKENS); each arm gets "
                    "capacity_tokens // block_size blocks",
                )
        if isinstance(arms, Mapping):  # events off unless an arm asks for them (module docstring)
            quiet = {n: {"enable_events": False, **a} if isinstance(a, Mapping) else a for n, a in arms.items()}
            data = {**data, "arms": quiet}
        config = from_mapping(ABConfig, data)
        check_ab_config(config)
        if check_trace:
            _check_trace_exists(config.workload.mooncake)
        return config
    except ConfigError as err:
        raise err.within("", source) from None


def check_ab_config(config: ABConfig) -> None:
    """ConfigError (path `arms.<name>.<key>`) unless every arm names a backend and an
    eviction policy that resolve and options that suit its backend (`check_cache_config`)."""
    for name, cache in config.arms.items():
        try:
            check_cache_config(cache)
        except ConfigError as err:
            raise err.within(f"arms.{name}") from None


def _check_trace_exists(spec: MooncakeSpec | None) -> None:
    """ConfigError (`workload.mooncake.path`) for a trace path that is not a file, so a
    typo shows at load time rather than when the replay starts."""
    if spec is None or spec.path is None or Path(spec.path).is_file():
        return
    where = "" if Path(spec.path).is_absolute() else " (a relative path is read from the current directory)"
    raise ConfigError("workload.mooncake.path", f"no such file {spec.path!r}{where}")


def load_ab_config(source: str | Path, *, trace: str | Path | None = None) -> ABConfig:
    """The A/B experiment in a YAML file, validated; with `trace`, on that Mooncake trace
    instead of the file's workload (then the file's own trace path need not exist)."""
    config = parse_ab_config(load_yaml(source), str(source), check_trace=trace is None)
    if trace is None:
        return config
    config = config.with_trace(trace)
    _check_trace_exists(config.workload.mooncake)
    return config
