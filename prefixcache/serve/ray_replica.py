"""One engine replica of `prefixcache cluster serve`: a Ray Serve deployment class.

Owns `EngineReplica` (what the deployment runs N of), `EngineCall` (what the ingress
sends it) and `Admitted` (the first item of every call's stream).

An `EngineReplica` is the serving layer's `Replica` without its HTTP server: the engine
in its `EngineLoop` thread and the KV event publisher, whose PUB and replay sockets bind
free ports on 127.0.0.1 (`tcp://127.0.0.1:*`, each replica its own: the `cluster serve`
file says so, `cluster_config`). It tells routers
where they are, and which hash chain its events carry, in its Ray Serve replica metadata
(`record_replica_metadata`, a `ReplicaStream`), and answers:

- `generate(call)`: an async generator over the request's stream: `Admitted` once the
  engine has taken the request (the engine's refusal, a `ValueError`, is raised before
  it), then the engine loop's `Tokens` items and one `Finished` or `Failed`. A call
  cancelled by its caller (the client went away) is aborted, so its blocks are released;
- `info()`: the `ReplicaInfo` the ingress checks requests with;
- `model_info()`: the replica's `GET /model_info` body (`sglang_api`), which the ingress
  serves as its own;
- `check_health()`: Ray Serve's health check; fails once the engine loop has stopped.

Must never: listen anywhere but 127.0.0.1, run the engine outside its loop thread, or
end a call's stream without a `Finished` or `Failed` unless the call was cancelled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from prefixcache.cluster.ray_router import ReplicaStream
from prefixcache.engine.engine import GenerationRequest
from prefixcache.hashing import resolve_seed
from prefixcache.serve.app import ReplicaInfo
from prefixcache.serve.config import parse_serve_config
from prefixcache.serve.engine_loop import Failed, Finished, StreamItem
from prefixcache.serve.server import Replica

__all__ = ["EngineReplica", "EngineCall", "Admitted"]


@dataclass(frozen=True)
class EngineCall:
    """One request as the ingress hands it to a replica: the checked `generation` (its
    prompt as token ids) and `prompt`, the prompt's text (what a router that matches text
    reads: Ray Serve LLM's `PrefixCacheAffinityRouter` looks for a `prompt` attribute).
    `prompt_token_ids`, `namespace`, `max_tokens` and `request_id` are what the project's
    routers read (`prefixcache.cluster.ray_router.RoutedCall`)."""

    generation: GenerationRequest
    prompt: str

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.generation.prompt)  # type: ignore[arg-type]

    @property
    def namespace(self) -> str | None:
        return self.generation.namespace

    @property
    def max_tokens(self) -> int | None:
        return self.generation.max_tokens

    @property
    def request_id(self) -> str | None:
        return self.generation.request_id


@dataclass(frozen=True)
class Admitted:
    """The engine took request `request_id` (a prompt of `prompt_tokens` TOKENS)."""

    request_id: str
    prompt_tokens: int


class EngineReplica:
    """A Ray Serve replica over one engine (module docstring). `serve_config`: a serve
    file's mapping (`ClusterServeConfig.replica_data`: events on, loopback ports);
    `served_model_name`: what requests name as `model`."""

    def __init__(self, serve_config: Mapping[str, Any], served_model_name: str | None = None) -> None:
        self._replica = Replica(parse_serve_config(serve_config), served_model_name=served_model_name)
        self._replica.loop.start()

    def record_replica_metadata(self) -> dict[str, Any]:
        """Ray Serve's hook: what routers read in `RunningReplica.replica_metadata`."""
        publisher = self._replica.publisher
        assert publisher is not None
        cache = self._replica.config.serving.cache
        stream = ReplicaStream(
            endpoint=publisher.endpoint, replay_endpoint=publisher.replay_endpoint,
            topic=self._replica.config.kv_events.topic, block_size=cache.block_size,
            hash_algorithm=cache.hash.algorithm, hash_seed=resolve_seed(cache.hash.algorithm, cache.hash.seed),
        )
        return stream.to_metadata()

    async def info(self) -> ReplicaInfo:
        return self._replica.info

    async def model_info(self) -> dict[str, Any]:
        return dict(self._replica.model_info)

    async def generate(self, call: EngineCall) -> AsyncIterator[Admitted | StreamItem]:
        loop = self._replica.loop
        # The replica's own clock starts the request's metrics (the ingress's is another process's).
        stream = await loop.submit(dataclasses.replace(call.generation, arrival_s=None))
        yield Admitted(stream.request_id, stream.prompt_tokens)
        ended = False
        try:
            async for item in stream:
                ended = isinstance(item, (Finished, Failed))
                yield item
                if ended:
                    return
        finally:
            if not ended:  # cancelled by the caller: release its blocks
                loop.abort(stream.request_id)

    def check_health(self) -> None:
        if not self._replica.loop.alive:
            raise RuntimeError("the engine loop has stopped")

    def __del__(self) -> None:
        replica = getattr(self, "_replica", None)
        if replica is not None:
            replica.stop()
