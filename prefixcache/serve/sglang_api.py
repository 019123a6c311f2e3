"""SGLang's native endpoints on a replica: what SGLang's router and benchmark read.

Owns `add_sglang_routes`, which adds to a replica's app the routes SGLang 0.5.23's
`http_server.py` serves and `sglang-router` 0.3.2 calls on every worker it registers:

- `GET /server_info` (and the deprecated `/get_server_info`): the start-up configuration
  in SGLang's names (`model_path`, `served_model_name`, `tp_size`, `dp_size`,
  `page_size`, `context_length`, `max_total_num_tokens`, `max_running_requests`, ...),
  whence the router takes the model name it lists and routes by, plus `kv_events`, the
  event stream's descriptor in SGLang's shape (`describe_kv_events_publisher`:
  `publisher`, `endpoint_host`, `endpoint_port_base`, `topic`, `block_size`, `dp_size`,
  `replay_endpoint_port_base`) and ours beside it (the full endpoints, the hash
  algorithm and seed a consumer must hash prompts with, the wire's hash form and
  medium), and `prefixcache` (backend, pool, eviction);
- `GET /model_info` (and `/get_model_info`): `model_path`, `served_model_name`,
  `tokenizer_path`, `is_generation`, ..., and `vocab_size` (which `prefixcache bench`
  reads; SGLang's gRPC model info has it, its HTTP one not);
- `GET /get_load`: one `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}` per data
  parallel rank (we have rank 0), SGLang's `GetLoadReqOutput` list that the router sums
  `num_tokens` of (its power-of-two policy); `num_tokens` = the tokens of the blocks
  running requests hold, plus the prompt tokens of waiting ones, as SGLang's scheduler
  counts used KV slots plus its waiting queue's inputs;
- `GET /v1/loads`: SGLang 0.5.23's successor of `/get_load`, its core fields;
- `GET|POST /flush_cache[?timeout=S]`: SGLang's flush: 200 "Cache flushed." when the
  prefix cache was dropped, else 400 with the reason (requests hold blocks), retrying
  for up to `timeout` SECONDS first, as SGLang's `flush_cache(timeout_s)` waits for idle.

Must never: touch the engine outside its thread (every read runs through the engine
loop), or claim a capability the replica does not have (one rank, no disaggregation,
no tensor parallelism).
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import PlainTextResponse

import prefixcache
from prefixcache.engine.engine import Engine

__all__ = ["add_sglang_routes", "kv_events_descriptor", "engine_load"]

RunInEngine = Callable[[Callable[[Engine], Any]], Awaitable[Any]]
"""`EngineLoop.run`: `fn(engine)` in the engine's thread, awaited."""

_FLUSH_POLL_S = 0.05


def kv_events_descriptor(*, endpoint: str, replay_endpoint: str | None, topic: str, block_size: int,
                         hash_algorithm: str, hash_seed: str, int_block_hashes: bool, medium: str) -> dict[str, Any]:
    """The `kv_events` entry of `/server_info` for a publisher bound at `endpoint`
    (`replay_endpoint`): SGLang's descriptor fields, then ours (module docstring)."""
    host, port = _tcp_host_port(endpoint)
    described: dict[str, Any] = {"publisher": "zmq", "endpoint_host": host, "endpoint_port_base": port,
                                 "topic": topic, "block_size": block_size, "dp_size": 1}
    if replay_endpoint is not None and _tcp_host_port(replay_endpoint)[1] is not None:
        described["replay_endpoint_port_base"] = _tcp_host_port(replay_endpoint)[1]
    described.update(endpoint=endpoint, replay_endpoint=replay_endpoint, format="vllm", hash_algorithm=hash_algorithm,
                     hash_seed=hash_seed, int_block_hashes=int_block_hashes, medium=medium)
    return described


def _tcp_host_port(endpoint: str) -> tuple[str | None, int | None]:
    if not endpoint.startswith("tcp://"):
        return None, None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else None


def engine_load(engine: Engine) -> dict[str, int]:
    """Rank 0's load (engine thread): running and waiting requests, and TOKENS: the pool
    blocks running requests hold (times the block size) plus waiting requests' tokens."""
    scheduler = engine.scheduler
    held = {b for seq in scheduler.running for b in engine.cache.block_table(seq.request_id)}
    used = len(held) * engine.config.cache.block_size
    waiting_tokens = sum(len(seq.tokens) for seq in scheduler.waiting)
    return {"num_running_reqs": len(scheduler.running), "num_waiting_reqs": len(scheduler.waiting),
            "num_used_tokens": used, "num_tokens": used + waiting_tokens}


def add_sglang_routes(app: FastAPI, run_in_engine: RunInEngine, server_info: Mapping[str, Any],
                      model_info: Mapping[str, Any], reset_cache: Callable[[Engine], bool]) -> None:
    """The routes of the module docstring on `app`. `server_info` / `model_info`: the
    static bodies (`replica_server_info` builds them); `reset_cache(engine)` drops the
    prefix cache, False while requests hold blocks (engine thread)."""
    started = time.time()
    pool_tokens = int(server_info["max_total_num_tokens"])
    max_running = int(server_info["max_running_requests"])

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        load = await run_in_engine(engine_load)
        state = {"num_running_reqs": load["num_running_reqs"], "num_waiting_reqs": load["num_waiting_reqs"],
                 "token_usage": load["num_used_tokens"] / pool_tokens}
        return {**server_info, "startup_time": started, "internal_states": [state]}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        return dict(model_info)

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        load = await run_in_engine(engine_load)
        return [{"dp_rank": 0, "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
                 "num_waiting_reqs": load["num_waiting_reqs"], "num_tokens": load["num_tokens"]}]

    @app.get("/v1/loads")
    async def get_loads() -> dict[str, Any]:
        load = await run_in_engine(engine_load)
        core = {"timestamp": time.time(), "dp_rank": 0, "num_running_reqs": load["num_running_reqs"],
                "num_waiting_reqs": load["num_waiting_reqs"], "num_used_tokens": load["num_used_tokens"],
                "num_total_tokens": load["num_tokens"], "max_total_num_tokens": pool_tokens,
                "max_running_requests": max_running, "token_usage": load["num_used_tokens"] / pool_tokens}
        return {"timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "version": prefixcache.__version__, "accelerator": None, "num_accelerators": 0, "loads": [core]}

    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> PlainTextResponse:
        deadline = time.monotonic() + timeout
        while not await run_in_engine(reset_cache):
            if time.monotonic() >= deadline:
                return PlainTextResponse("Flush cache failed: requests are running or waiting and hold cached "
                                         "blocks; try again when the replica is idle.\n", status_code=400)
            await asyncio.sleep(_FLUSH_POLL_S)
        return PlainTextResponse("Cache flushed.\n")

    app.get("/flush_cache")(flush_cache)  # a route per method: each its own operationId
    app.post("/flush_cache")(flush_cache)


def replica_server_info(*, model_path: str, served_model_name: str, max_model_len: int, vocab_size: int,
                        eos_token_id: int, block_size: int,
                        num_blocks: int, max_running_requests: int, max_prefill_tokens: int,
                        prefix_caching: bool, cache: Mapping[str, Any],
                        kv_events: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The static `/server_info` and `/model_info` bodies of one replica (TOKENS but
    `num_blocks`): SGLang's names for what we have, ours under `prefixcache`."""
    server = {
        "model_path": model_path, "tokenizer_path": None, "served_model_name": served_model_name,
        "is_generation": True, "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size, "eos_token_ids": [eos_token_id],
        "tp_size": 1, "pp_size": 1, "dp_size": 1, "load_balance_method": "round_robin", "disaggregation_mode": "null",
        "page_size": block_size, "context_length": max_model_len, "max_req_input_len": max_model_len - 1,
        "max_total_num_tokens": block_size * num_blocks, "max_running_requests": max_running_requests,
        "max_prefill_tokens": max_prefill_tokens, "chunked_prefill_size": max_prefill_tokens,
        "disable_radix_cache": not prefix_caching, "kv_events": None if kv_events is None else dict(kv_events),
        "version": prefixcache.__version__, "frontend": "prefixcache",
        "prefixcache": {"cache": dict(cache), "num_blocks": num_blocks},
    }
    model = {key: server[key] for key in ("model_path", "tokenizer_path", "served_model_name", "is_generation",
                                          "model_type", "architectures", "vocab_size", "eos_token_ids",
                                          "context_length")}
    load_format = "dummy" if model_path == "tiny" else "gguf"  # SGLang's "dummy": random weights, as tiny's
    model.update(preferred_sampling_params=None, weight_version="default", load_format=load_format,
                 disaggregation_mode="null", has_image_understanding=False, has_audio_understanding=False)
    return server, model
