"""A replica process: the engine, its KV event publisher, the engine loop and the HTTP
server, started and stopped together.

Owns `Replica`: built from a `ServeConfig` (`prefixcache serve CONFIG` loads one), it
opens the publisher when `kv_events.enabled` (the engine then records events and hands
them over once per step; otherwise it records none), starts the engine loop, and serves
the FastAPI app (`app.build_app`) with uvicorn, either in the foreground (`serve`, the
CLI: Ctrl-C stops it) or from a thread on a port the OS picks (`start`, what tests and
benchmarks use: `start()` returns the base URL once the socket listens). Shutdown stops
the HTTP server, then the engine loop (aborting what is in flight), then the engine (its
disk tiers persist what it cached: `Engine.close`), then the publisher.

Must never: listen anywhere but the host it is given (tests and benchmarks give
127.0.0.1), or leave a thread or socket behind after `stop`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import uvicorn

from prefixcache.config import ConfigError
from prefixcache.engine.engine import Engine
from prefixcache.engine.loader import LoadedModel, load_model
from prefixcache.hashing import resolve_seed
from prefixcache.serve.app import ReplicaInfo, build_app
from prefixcache.serve.config import ServeConfig, load_serve_config
from prefixcache.serve.connections import default_max_connections, guarded_protocol
from prefixcache.serve.engine_loop import EngineLoop
from prefixcache.serve.metrics import ServingMetrics
from prefixcache.serve.listen import check_serve_addresses
from prefixcache.serve.publisher import ZmqEventPublisher
from prefixcache.serve.sglang_api import add_sglang_routes, kv_events_descriptor, replica_server_info

__all__ = ["Replica", "serve", "summary"]

_log = logging.getLogger(__name__)
_START_TIMEOUT_S = 30.0


class Replica:
    """One serving replica (see the module docstring).

    `model`: an already loaded model to share (tests); by default the one the config
    names. `served_model_name`: the name clients put in `model` (default: `engine.model`).
    `events_host`: where a `tcp://*:PORT` event endpoint binds (`prefixcache serve` gives
    its HTTP host; None: as the endpoint says).
    """

    def __init__(
        self, config: ServeConfig, *, model: LoadedModel | None = None, served_model_name: str | None = None,
        events_host: str | None = None,
    ) -> None:
        self.config = config
        serving = config.serving
        self.publisher = (ZmqEventPublisher(config.kv_events, bind_host=events_host)
                          if config.kv_events.enabled else None)
        try:
            sink = self.publisher.publish if self.publisher is not None else None
            self.engine = Engine(serving, model=model, event_sink=sink)
        except BaseException:
            if self.publisher is not None:
                self.publisher.close()
            raise
        cc, ec = serving.cache, serving.engine
        self.backend = cc.backend if ec.prefix_caching else "none"
        self.model_name = served_model_name or ec.model
        self.metrics = ServingMetrics(
            model_name=self.model_name, backend=self.backend, block_size=cc.block_size, num_blocks=cc.num_blocks
        )
        self.loop = EngineLoop(self.engine, observer=self.metrics)
        tokenizer = self.engine.tokenizer
        self.info = ReplicaInfo(
            model_name=self.model_name,
            model_root=ec.model,
            max_model_len=min(self.engine.model.config.max_position, cc.num_blocks * cc.block_size),
            vocab_size=self.engine.model.config.vocab_size,
            eos_token_id=tokenizer.eos_token_id,
            default_sampling=ec.sampling,
            created=int(time.time()),
        )
        drops = self.publisher.dropped_batches if self.publisher is not None else None
        self.app = build_app(self.loop, self.metrics, self.info, tokenizer, server=config.server,
                             max_num_seqs=ec.max_num_seqs, event_drops=drops)
        self.server_info, self.model_info = self._describe()
        add_sglang_routes(self.app, self.loop.run, self.server_info, self.model_info, self.metrics.reset_cache)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.base_url: str | None = None

    def _describe(self) -> tuple[dict, dict]:
        """The `/server_info` and `/model_info` bodies (`sglang_api`)."""
        cc, ec, events = self.config.serving.cache, self.config.serving.engine, self.config.kv_events
        described = None
        if self.publisher is not None:
            described = kv_events_descriptor(
                endpoint=self.publisher.endpoint, replay_endpoint=self.publisher.replay_endpoint, topic=events.topic,
                block_size=cc.block_size, hash_algorithm=cc.hash.algorithm,
                hash_seed=resolve_seed(cc.hash.algorithm, cc.hash.seed), int_block_hashes=events.int_block_hashes,
                medium=events.medium)
        cache = {"backend": self.backend, "block_size": cc.block_size, "num_blocks": cc.num_blocks,
                 "eviction": cc.eviction, "hash_algorithm": cc.hash.algorithm,
                 "hash_seed": resolve_seed(cc.hash.algorithm, cc.hash.seed)}
        return replica_server_info(
            model_path=ec.model, served_model_name=self.model_name, max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size, eos_token_id=self.info.eos_token_id,
            block_size=cc.block_size, num_blocks=cc.num_blocks, max_running_requests=ec.max_num_seqs,
            max_prefill_tokens=ec.max_num_batched_tokens, prefix_caching=ec.prefix_caching, cache=cache,
            kv_events=described)

    @classmethod
    def from_yaml(cls, path: str | Path, **kwargs: object) -> Replica:
        return cls(load_serve_config(path), **kwargs)  # type: ignore[arg-type]

    def _uvicorn(self, **kwargs: object) -> uvicorn.Server:
        limits = self.config.server
        # uvicorn's own knobs where they do the job (idle keep-alive connections, header
        # size); connections.py for what they do not (a header deadline, a connection cap).
        protocol = guarded_protocol(header_timeout_s=limits.header_timeout_s,
                                    max_connections=limits.max_connections or default_max_connections(),
                                    on_close=self.metrics.refused)
        config = uvicorn.Config(self.app, lifespan="off", timeout_graceful_shutdown=2,  # type: ignore[arg-type]
                                http=protocol, timeout_keep_alive=limits.keep_alive_timeout_s,  # type: ignore[arg-type]
                                h11_max_incomplete_event_size=limits.max_header_bytes, **kwargs)
        return uvicorn.Server(config)

    # -- foreground (the CLI) ------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 8000) -> None:
        """Serve until interrupted (Ctrl-C / SIGTERM), then shut everything down."""
        self.loop.start()
        self._server = self._uvicorn(host=host, port=port, log_level="info")
        try:
            self._server.run()
        finally:
            self._shutdown_engine()

    # -- background (tests, benchmarks) ------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve from a thread; returns the base URL (`http://HOST:PORT`) once it listens.
        `port=0`: a free port the OS picks."""
        if self._thread is not None:
            raise RuntimeError("this replica is already started")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self.loop.start()
        self._server = self._uvicorn(log_level="warning", access_log=False)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="uvicorn",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {host}:{sock.getsockname()[1]}")
            time.sleep(0.01)
        bound = sock.getsockname()
        self.base_url = f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}"
        return self.base_url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the HTTP server, the engine loop and the publisher (each bounded by `timeout_s`)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _log.warning("the HTTP server thread did not stop within %.1f s", timeout_s)
            self._thread = None
        self._shutdown_engine(timeout_s)

    def _shutdown_engine(self, timeout_s: float = 10.0) -> None:
        self.app.state.preprocessor.close()
        self.loop.shutdown(timeout_s)
        if not self.loop.alive:  # the engine is ours again: its disk tiers keep what it cached
            self.engine.close()
        if self.publisher is not None:
            self.publisher.close()

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def summary(replica: Replica, url: str) -> str:
    """What `prefixcache serve` prints once its model is loaded (TOKENS unless said)."""
    cc, ec = replica.config.serving.cache, replica.config.serving.engine
    cache = (f"cache {replica.backend}, {cc.num_blocks:,} blocks x {cc.block_size} tokens = "
             f"{cc.num_blocks * cc.block_size:,} tokens, eviction {cc.eviction}, hash {cc.hash.algorithm}"
             if ec.prefix_caching else f"no prefix caching ({cc.num_blocks * cc.block_size:,} tokens of KV)")
    lines = [f"prefixcache serve: model {ec.model} as {replica.model_name!r}; {cache}; "
             f"max_model_len {replica.info.max_model_len:,}; up to {ec.max_num_seqs} requests at once"]
    if replica.publisher is not None:
        lines.append(f"KV events: PUB {replica.publisher.endpoint}, replay {replica.publisher.replay_endpoint or 'off'} "
                     f"(vLLM 0.33's wire format; GET /server_info describes them)")
    else:
        lines.append("KV events: off (kv_events.enabled: false)")
    lines.append(f"OpenAI API at {url}/v1 (also /metrics, /server_info, /get_load, /flush_cache); Ctrl-C stops")
    return "\n".join(lines)


def serve(config_path: str | Path, *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, config: ServeConfig | None = None) -> int:
    """`prefixcache serve`: load the config (or take `config`, already loaded from
    `config_path`, e.g. with command-line overrides) and the model, serve until interrupted.
    The listening addresses are checked before the model loads; a `tcp://*:PORT` event
    endpoint binds the HTTP host only (`publisher.bind_address`)."""
    if config is None:
        config = load_serve_config(config_path)
    check_serve_addresses(config, host, port, str(config_path))
    ec = config.serving.engine
    try:  # the config names a model that exists; this is whether it loads
        model = load_model(ec.model, seed=ec.seed, chat_template=ec.chat_template)
    except (OSError, ValueError) as err:
        raise ConfigError("engine.model", f"cannot load {ec.model!r}: {err}", str(config_path)) from None
    try:
        replica = Replica(config, model=model, served_model_name=served_model_name, events_host=host)
    except OSError as err:  # the KV event endpoints cannot be opened
        raise ConfigError("kv_events", str(err), str(config_path)) from None
    except ConfigError as err:  # the engine's own checks (its memory) name the key, not the file
        raise err.within("", err.source or str(config_path)) from None
    shown = f"[{host}]" if ":" in host else host
    print(summary(replica, f"http://{shown}:{port}"), flush=True)
    replica.serve(host, port)
    return 0
