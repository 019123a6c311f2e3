"""The configuration of `prefixcache serve`: `cache:`, `engine:` and `kv_events:`.

Owns `KVEventsConfig` (the `kv_events:` section: where and how the replica publishes its
KV events, vLLM 0.33's `KVEventsConfig` field names) and `ServeConfig` (the three
sections), validated once at load by `prefixcache.config.from_mapping`, so a mistake
names the file, the key path and what is allowed. Example (configs/serve.yaml)::

    cache:  {backend: hash, block_size: 16, num_blocks: 1024}
    engine: {model: smollm2, max_num_seqs: 16}
    kv_events:
      enabled: false              # true: publish on ZeroMQ as vLLM does
      endpoint: "tcp://*:5557"    # PUB: a wildcard, ipc:// or inproc:// binds; else connects
      replay_endpoint: null       # ROUTER for replay requests (always binds)
      topic: ""
      buffer_steps: 10000         # batches kept for replay

Must never: open a socket, build an engine or import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.config import ConfigError, from_mapping, load_yaml
from prefixcache.engine.config import ServingConfig, check_sections, parse_serving_config

__all__ = ["KVEventsConfig", "ServeConfig", "SECTIONS", "parse_serve_config", "load_serve_config", "is_serve_mapping"]

SECTIONS = ("cache", "engine", "kv_events")
_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _check_endpoint(name: str, value: str) -> None:
    if not isinstance(value, str) or not value.startswith(_SCHEMES) or len(value) <= len(value.split("//")[0]) + 2:
        raise ConfigError(name, f"must be a ZeroMQ endpoint starting with {', '.join(_SCHEMES)}, got {value!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    """The `kv_events:` section (vLLM 0.33's `KVEventsConfig`, plus two of ours).

    enabled:          publish KV events (vLLM `enable_kv_cache_events`); false: the
                      engine does not even record them
    endpoint:         PUB address; bound when it holds a wildcard (`tcp://*:5557`,
                      `tcp://127.0.0.1:*` for a free port), `::`, or is ipc:// or
                      inproc://, else connected (a subscriber that binds), as vLLM does
    replay_endpoint:  ROUTER address answering replay requests (bound), or null
    topic:            the first frame of every message
    buffer_steps:     batches (engine steps with events) kept for replay
    hwm:              ZeroMQ send high-water mark of the PUB socket, in messages
    max_queue_size:   batches waiting for the publisher thread before the engine waits
    int_block_hashes: true: block hashes as the low 64 bits of the digest, an int
                      (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`); false:
                      the digest bytes
    medium:           the `medium` field of BlockStored / BlockRemoved ("GPU" as vLLM's
                      device tier, whatever device the engine runs on)
    """

    enabled: bool = False
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    int_block_hashes: bool = True
    medium: str = "GPU"

    def __post_init__(self) -> None:
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":*"):  # ":*": two free ports
                raise ConfigError("replay_endpoint", f"must differ from endpoint, both are {self.endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ConfigError("topic", f"must be a string, got {self.topic!r}")


@dataclass(frozen=True)
class ServeConfig:
    """What `prefixcache serve` runs: the engine (`cache:` + `engine:`) and its events."""

    serving: ServingConfig = field(default_factory=ServingConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)


def is_serve_mapping(data: Mapping[str, Any]) -> bool:
    """Whether a YAML file's top level is a serve file (it has a `kv_events:` section)."""
    return "kv_events" in data


def parse_serve_config(data: Any, source: str | None = None) -> ServeConfig:
    """A top-level mapping with `cache:`, `engine:` and optional `kv_events:` -> ServeConfig."""
    check_sections(data, SECTIONS, source)
    try:
        events = from_mapping(KVEventsConfig, data.get("kv_events"), "kv_events")
    except ConfigError as err:
        raise err.within("", source) from None
    sections = {k: v for k, v in data.items() if k != "kv_events"}
    return ServeConfig(parse_serving_config(sections, source, events=events.enabled), events)


def load_serve_config(source: str | Path) -> ServeConfig:
    """The sections of a serve YAML file (an engine file without `kv_events:` is one too)."""
    return parse_serve_config(load_yaml(source), str(source))
