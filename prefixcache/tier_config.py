"""The schema of `cache.tiers` and `cache.cost_model`: the memory hierarchy below the
device pool, as frozen dataclasses that check their own fields.

Owns `TierConfig` (one lower tier: `medium`, `num_blocks`, `write`, `eviction`, `path`
and the optional keys below), `CostModel` (what a load and a recompute cost) and the
defaults both document. `prefixcache.config.CacheConfig` holds them; what they name
(an eviction policy, a disk path on this machine) is checked by
`prefixcache.config_checks`, and `prefixcache.tiers` builds the hierarchy.

Must never: touch the file system, resolve a policy, or import anything of prefixcache
but `errors`.

    cache:
      num_blocks: 1953                # the device tier
      tiers:
        - {medium: CPU, num_blocks: 3906}                                   # on_evict, the cache's eviction
        - {medium: DISK, num_blocks: 60000, path: /nvme/kv.tier, min_hits: 2}
      cost_model: {kv_bytes_per_token: 131072, prefill_tokens_per_s: 20000}

The key names `medium`, `num_blocks`, `write`, `eviction` and `path` are fixed (tools
outside the project write them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prefixcache.errors import ConfigError, short_repr

__all__ = [
    "TierConfig",
    "CostModel",
    "MEDIA",
    "WRITE_POLICIES",
    "EVENT_MEDIUM",
    "DEFAULT_BANDWIDTH_GBPS",
    "DEFAULT_LATENCY_US",
    "DEFAULT_KV_BYTES_PER_TOKEN",
    "DEFAULT_PREFILL_TOKENS_PER_S",
    "SELECTIVE_MIN_HITS",
]

MEDIA = ("CPU", "DISK")
WRITE_POLICIES = ("on_evict", "write_through", "selective")
EVENT_MEDIUM = {"CPU": "CPU", "DISK": "STORAGE"}
"""The `medium` a tier's KV events carry: vLLM's names (`MEDIUM_CPU`, `MEDIUM_STORAGE`)."""

DEFAULT_BANDWIDTH_GBPS = {"CPU": 25.0, "DISK": 2.0}
"""GB/s (10^9 bytes a second) a load reads at: host memory over PCIe Gen4 x16 (about 25
GB/s in practice), one NVMe drive's random 64 KiB-to-MiB reads (about 2 GB/s)."""
DEFAULT_LATENCY_US = {"CPU": 10.0, "DISK": 100.0}
"""MICROSECONDS an admission's loads from a tier wait before the first byte (once per
tier per admission: a request's loads are one batch, as vLLM's and LMCache's are)."""
DEFAULT_KV_BYTES_PER_TOKEN = 131072
"""BYTES of KV per token: Llama-3-8B in bf16 (32 layers x 8 KV heads x 128 x K and V x 2
bytes). The engine uses its own model's figure when `kv_bytes_per_token` is unset."""
DEFAULT_PREFILL_TOKENS_PER_S = 20000.0
"""TOKENS a second a prefill computes: an 8B model on one H100, mid-length prompts."""
SELECTIVE_MIN_HITS = 2
"""Hits before a `selective` tier copies a block: SGLang 0.5.23's write_through_selective threshold."""

REUSE_TRACKER_BLOCKS = 4
"""A reuse tracker's default size, in hashes per block of its tier: on the Mooncake
conversation trace a disk tier with store_threshold 2 loses 0.007 of hit ratio against
write_through at 4x, 0.012 at 2x and 0.026 at 1x (docs/tiers.md, "Disk")."""

Medium = Literal["CPU", "DISK"]
WritePolicy = Literal["on_evict", "write_through", "selective"]


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(name, f"must be a number > 0, got {short_repr(value)}")


@dataclass(frozen=True)
class TierConfig:
    """One tier below the device pool (TOKENS unless a name says blocks).

    medium:         CPU (host memory) or DISK (a file of blocks)
    num_blocks:     BLOCKS of the cache's block_size the tier holds
    write:          how blocks enter it: on_evict (a block evicted from the tier above
                    moves down: exclusive, capacities add up; the default), write_through
                    (a copy of every block the device computes, when it is computed),
                    selective (a copy of a device block once it has `min_hits` hits)
    eviction:       its eviction policy by name (null: the cache's `eviction`)
    path:           DISK only: the file that holds the blocks (created if missing)
    min_hits:       hits a block needs to enter the tier (null: 2 for selective, as
                    SGLang's write_through_selective; 0 otherwise). On a DISK tier below
                    another it is Dynamo KVBM's disk frequency filter
    store_threshold: requests that must have used a block (computed or hit it) before
                    it enters the tier, counted across its evictions (vLLM's offloading
                    store_threshold; 0 or 1: no filter)
    reuse_tracker_size: with store_threshold >= 2, the block hashes whose uses are
                    remembered, least recently used forgotten first (null:
                    `REUSE_TRACKER_BLOCKS` x num_blocks)
    bandwidth_gbps: GB/s a load from it reads at (null: `DEFAULT_BANDWIDTH_GBPS`)
    latency_us:     MICROSECONDS before an admission's first byte from it (null:
                    `DEFAULT_LATENCY_US`)
    """

    medium: Medium
    num_blocks: int
    write: WritePolicy = "on_evict"
    eviction: str | None = None
    path: str | None = None
    min_hits: int | None = None
    store_threshold: int = 0
    reuse_tracker_size: int | None = None
    bandwidth_gbps: float | None = None
    latency_us: float | None = None

    def __post_init__(self) -> None:
        if self.medium not in MEDIA:
            raise ConfigError("medium", f"{short_repr(self.medium)} is not allowed; allowed values: {', '.join(MEDIA)}")
        if isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int) or self.num_blocks < 1:
            raise ConfigError("num_blocks", f"must be an integer >= 1 (BLOCKS), got {short_repr(self.num_blocks)}")
        if self.write not in WRITE_POLICIES:
            raise ConfigError(
                "write", f"{short_repr(self.write)} is not allowed; allowed values: {', '.join(WRITE_POLICIES)}"
            )
        if self.eviction is not None and (not isinstance(self.eviction, str) or not self.eviction):
            raise ConfigError("eviction", f"must be a policy name or null, got {short_repr(self.eviction)}")
        if self.medium == "DISK":
            if not isinstance(self.path, str) or not self.path:
                raise ConfigError("path", "a DISK tier needs the path of its file")
            if "\0" in self.path:
                raise ConfigError("path", "must not contain a NUL byte")
        elif self.path is not None:
            raise ConfigError("path", f"only a DISK tier has a path (this tier is {self.medium})")
        if self.min_hits is not None:
            if isinstance(self.min_hits, bool) or not isinstance(self.min_hits, int) or self.min_hits < 0:
                raise ConfigError("min_hits", f"must be an integer >= 0 or null, got {short_repr(self.min_hits)}")
            if self.write == "write_through" and self.min_hits:
                raise ConfigError("min_hits", "write_through copies every block; copying after hits is write: selective")
            if self.write == "selective" and self.min_hits < 1:
                raise ConfigError("min_hits", "a selective tier copies after at least 1 hit")
        if isinstance(self.store_threshold, bool) or not isinstance(self.store_threshold, int) or self.store_threshold < 0:
            raise ConfigError("store_threshold", f"must be an integer >= 0, got {short_repr(self.store_threshold)}")
        size = self.reuse_tracker_size
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ConfigError("reuse_tracker_size", f"must be an integer >= 1 or null, got {short_repr(size)}")
            if self.store_threshold < 2:
                raise ConfigError("reuse_tracker_size", "only a tier with store_threshold >= 2 tracks reuse")
        _positive("bandwidth_gbps", self.bandwidth_gbps)
        if self.latency_us is not None and not 0 <= self.latency_us < float("inf"):
            raise ConfigError("latency_us", f"must be a finite number >= 0, got {short_repr(self.latency_us)}")

    @property
    def event_medium(self) -> str:
        """The `medium` this tier's KV events carry (vLLM's CPU / STORAGE)."""
        return EVENT_MEDIUM[self.medium]

    @property
    def hits_to_enter(self) -> int:
        """`min_hits` resolved: the hits a block needs to enter."""
        if self.min_hits is not None:
            return self.min_hits
        return SELECTIVE_MIN_HITS if self.write == "selective" else 0

    @property
    def reuse_slots(self) -> int:
        """Block hashes the reuse tracker remembers (0: the tier tracks none)."""
        if self.store_threshold < 2:
            return 0
        if self.reuse_tracker_size is not None:
            return self.reuse_tracker_size
        return REUSE_TRACKER_BLOCKS * self.num_blocks

    @property
    def gbps(self) -> float:
        return self.bandwidth_gbps if self.bandwidth_gbps is not None else DEFAULT_BANDWIDTH_GBPS[self.medium]

    @property
    def latency_s(self) -> float:
        """Latency in SECONDS."""
        return (self.latency_us if self.latency_us is not None else DEFAULT_LATENCY_US[self.medium]) * 1e-6


@dataclass(frozen=True)
class CostModel:
    """What loading a lower-tier hit and recomputing it cost, per deployment.

    kv_bytes_per_token:   BYTES of KV per token (null: the engine's model, else
                          `DEFAULT_KV_BYTES_PER_TOKEN`)
    prefill_tokens_per_s: TOKENS a second the prefill computes (`DEFAULT_PREFILL_TOKENS_PER_S`)

    An admission loads the prefix of its lower-tier hit that minimises (modelled) load
    time plus the time to compute the rest of the prompt (`prefixcache.tiers`).
    """

    kv_bytes_per_token: int | None = None
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S

    def __post_init__(self) -> None:
        value = self.kv_bytes_per_token
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError("kv_bytes_per_token", f"must be an integer >= 1 (BYTES) or null, got {short_repr(value)}")
        rate = self.prefill_tokens_per_s
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0 or rate != rate or rate == float("inf"):
            raise ConfigError("prefill_tokens_per_s", f"must be a finite number > 0, got {short_repr(rate)}")

    @property
    def bytes_per_token(self) -> int:
        """`kv_bytes_per_token`, or its default."""
        return self.kv_bytes_per_token if self.kv_bytes_per_token is not None else DEFAULT_KV_BYTES_PER_TOKEN
