"""The configuration of `prefixcache serve`: `cache:`, `engine:`, `kv_events:` and `server:`.

Owns `KVEventsConfig` (the `kv_events:` section: where and how the replica publishes its
KV events, vLLM 0.33's `KVEventsConfig` field names), `ServerConfig` (the `server:`
section: the limits that keep one client from hurting the others) and `ServeConfig` (the
four sections), validated once at load by `prefixcache.config.from_mapping`, so a mistake
names the file, the key path and what is allowed. Example (configs/serve.yaml)::

    cache:  {backend: hash, block_size: 16, num_blocks: 1024}
    engine: {model: smollm2, max_num_seqs: 16}
    kv_events:
      enabled: false              # true: publish on ZeroMQ as vLLM does
      endpoint: "tcp://*:5557"    # PUB: a wildcard, ipc:// or inproc:// binds; else connects
      replay_endpoint: null       # ROUTER for replay requests (always binds)
      topic: ""
      buffer_steps: 10000         # batches kept for replay
    server:                       # every limit has a default (docs/serving.md "Limits")
      max_queued_requests: 64     # waiting past engine.max_num_seqs: more get a 503 + Retry-After

Must never: open a socket, build an engine or import torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache.config import ConfigError, from_mapping, load_yaml
from prefixcache.engine.config import ServingConfig, check_sections, parse_serving_config

__all__ = ["KVEventsConfig", "ServerConfig", "ServeConfig", "SECTIONS", "parse_serve_config", "load_serve_config",
           "is_serve_mapping"]

SECTIONS = ("cache", "engine", "kv_events", "server")
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


def _check_number(name: str, value: Any, lo: float, *, integer: bool = False, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value < float("inf"):
        what = "an integer" if integer else "a finite number"
        raise ConfigError(name, f"must be {what} >= {lo:g}{' or null' if allow_none else ''}, got {value!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The `server:` section: what keeps one client from stalling or starving the others
    (docs/serving.md "Limits", docs/security.md "The server under hostile clients").
    SECONDS and BYTES as the names say.

    max_queued_requests:     requests that may wait for a running slot (past
                             `engine.max_num_seqs`, counted from when the request
                             arrives, its tokenizing included); one more is answered
                             503 with `Retry-After` at once, before its body is parsed
                             (Ray Serve's `max_queued_requests`; SGLang's flag of that name)
    retry_after_s:           the `Retry-After` of that 503, whole SECONDS
    max_body_bytes:          a request body past this is answered 413 (from its
                             Content-Length before it is read, else once that much came)
    max_header_bytes:        request line + headers past this: 400 (h11's
                             `max_incomplete_event_size`; vLLM sets 4 MiB)
    header_timeout_s:        a connection must send a whole request line and headers
                             within this of opening (or of its previous response);
                             else it is closed (a 408 if it had started)
    body_timeout_s:          a request's body must arrive whole within this of its
                             headers; else 408
    keep_alive_timeout_s:    an idle keep-alive connection is closed after this
                             (uvicorn's `timeout_keep_alive`; vLLM's default 5)
    max_connections:         open connections at most; at the limit a new one displaces
                             the oldest connection that has not sent a whole request (a
                             slow or idle one), or is closed with a 503 if every one is
                             busy. null: 3/4 of the open-file limit (`ulimit -n`), at
                             most that limit - 64, so the server never runs out of
                             descriptors to accept with
    chat_template_timeout_s: how long rendering one chat may take (a ChatTemplateError, 400)
    preprocess_threads:      threads that parse, check and tokenize requests, off the
                             event loop
    trust_request_chat_template: a chat may bring its own `chat_template` (vLLM's
                             `--trust-request-chat-template`; off: such a chat is vLLM's
                             400). It renders in the same sandbox, within the same time
                             and size bounds, as the model's own
    """

    max_queued_requests: int = 64
    retry_after_s: int = 1
    max_body_bytes: int = 8 * 1024 * 1024
    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int | None = None
    chat_template_timeout_s: float = 2.0
    preprocess_threads: int = 2
    trust_request_chat_template: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.trust_request_chat_template, bool):
            raise ConfigError("trust_request_chat_template",
                              f"must be true or false, got {self.trust_request_chat_template!r}")
        _check_number("max_queued_requests", self.max_queued_requests, 0, integer=True)
        _check_number("retry_after_s", self.retry_after_s, 0, integer=True)
        _check_number("max_body_bytes", self.max_body_bytes, 1, integer=True)
        _check_number("max_header_bytes", self.max_header_bytes, 1024, integer=True)
        _check_number("max_connections", self.max_connections, 2, integer=True, allow_none=True)
        _check_number("preprocess_threads", self.preprocess_threads, 1, integer=True)
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "chat_template_timeout_s"):
            value = getattr(self, name)
            _check_number(name, value, 0)
            if value <= 0:
                raise ConfigError(name, f"must be a number of SECONDS > 0, got {value!r}")


@dataclass(frozen=True)
class ServeConfig:
    """What `prefixcache serve` runs: the engine (`cache:` + `engine:`), its events and
    the HTTP server's limits."""

    serving: ServingConfig = field(default_factory=ServingConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


def is_serve_mapping(data: Mapping[str, Any]) -> bool:
    """Whether a YAML file's top level is a serve file (it has a `kv_events:` or a
    `server:` section)."""
    return "kv_events" in data or "server" in data


def parse_serve_config(data: Any, source: str | None = None) -> ServeConfig:
    """A top-level mapping with `cache:`, `engine:`, optional `kv_events:` and `server:`
    -> ServeConfig."""
    check_sections(data, SECTIONS, source)
    try:
        events = from_mapping(KVEventsConfig, data.get("kv_events"), "kv_events")
        server = from_mapping(ServerConfig, data.get("server"), "server")
    except ConfigError as err:
        raise err.within("", source) from None
    sections = {k: v for k, v in data.items() if k not in ("kv_events", "server")}
    return ServeConfig(parse_serving_config(sections, source, events=events.enabled), events, server)


def load_serve_config(source: str | Path) -> ServeConfig:
    """The sections of a serve YAML file (an engine file without `kv_events:` is one too)."""
    return parse_serve_config(load_yaml(source), str(source))
