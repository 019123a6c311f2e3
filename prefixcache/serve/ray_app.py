"""`prefixcache cluster serve`: the Ray Serve application, on a local Ray cluster.

Owns `build_application` (N `EngineReplica`s as one deployment, `engine`, whose request
router is the configured one, behind one `ClusterIngress`, `ingress`), `ray_router_config`
(that router as Ray Serve's `RequestRouterConfig`), `ClusterServer` (a local Ray cluster,
Ray Serve's HTTP proxy and the application, started and stopped together: what tests
and benchmarks use) and `serve_cluster` (the CLI: one `ClusterServer` until Ctrl-C).

The routers:
- a `prefixcache.cluster` router runs as `PrefixCacheRequestRouter`, given the router
  spec and the replicas' hash config (block size, algorithm, the seed the config file
  resolved), so its prompt hashes are the chains the replicas' events carry;
- `ray_power_of_two` is Ray Serve's default router (no `RequestRouterConfig`);
- `ray_prefix_cache_affinity` is Ray Serve LLM's `PrefixCacheAffinityRouter`, imported
  from `ray.llm._internal...prefix_aware_router` (the public `ray.serve.llm` path pulls
  pyarrow); it matches the `prompt` text of `EngineCall`.

The local cluster: `ray.init(address="local")` starts a new one (never joins a running
cluster), with `include_dashboard=False` and `num_cpus` logical CPUs, every Ray process
listening on 127.0.0.1 only: Ray 2.60 replaces a node address of 127.0.0.1 by the
machine's own and binds its gRPC servers on every interface, unless its "local Ray only"
switch is set (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read when Ray is first imported:
this module sets it before importing Ray, and `ClusterServer.start` refuses a Ray
imported without it). Ray Serve's proxy listens on the file's host and port (127.0.0.1
by default). Every replica binds its KV event sockets on 127.0.0.1 (`cluster_config`).

Must never: join a Ray cluster it did not start, listen beyond this machine (but for a
proxy host the file names), or leave a cluster running after `stop`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

LOCAL_RAY_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for a single-machine cluster: its node address is then 127.0.0.1, and
so is every address its processes listen on."""
os.environ.setdefault(LOCAL_RAY_ONLY, "0")  # before Ray reads its constants (at its first import)

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray._private import ray_constants  # noqa: E402
from ray.serve.config import HTTPOptions, RequestRouterConfig  # noqa: E402

from prefixcache.cluster.ray_router import PrefixCacheRequestRouter  # noqa: E402
from prefixcache.config import to_plain  # noqa: E402
from prefixcache.serve.cluster_config import (  # noqa: E402
    ClusterServeConfig,
    check_proxy_address_free,
    cluster_layout,
    load_cluster_serve_config,
)
from prefixcache.serve.ray_ingress import ClusterIngress  # noqa: E402
from prefixcache.serve.ray_replica import EngineReplica  # noqa: E402

__all__ = ["APP_NAME", "ENGINE_DEPLOYMENT", "INGRESS_DEPLOYMENT", "build_application", "ray_router_config",
           "ClusterServer", "serve_cluster"]

_log = logging.getLogger(__name__)

APP_NAME = "prefixcache"
ENGINE_DEPLOYMENT = "engine"
INGRESS_DEPLOYMENT = "ingress"
_INGRESS_MAX_ONGOING = 10_000  # it only awaits its replicas: Ray's default (5) would queue requests before routing
# A replica being stopped finishes what it runs, checking every 0.5 s (Ray's 2 s makes every redeploy 2 s slower).
_SHUTDOWN = {"graceful_shutdown_wait_loop_s": 0.5, "graceful_shutdown_timeout_s": 10.0}


def ray_router_config(config: ClusterServeConfig) -> RequestRouterConfig | None:
    """The replicas' request router (module docstring); None for Ray Serve's default."""
    cluster = config.cluster
    if cluster.router == "ray_power_of_two":
        return None
    if cluster.router == "ray_prefix_cache_affinity":
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter,
        )

        return RequestRouterConfig(request_router_class=PrefixCacheAffinityRouter,
                                   request_router_kwargs=dict(cluster.options))
    cache = config.serve.serving.cache
    kwargs = {
        "router": cluster.router, "options": dict(cluster.options), "block_size": cache.block_size,
        "hash_algorithm": cache.hash.algorithm, "hash_seed": cache.hash.seed,
        "capacity_tokens": cache.num_blocks * cache.block_size,
    }
    if cluster.service is not None:
        kwargs["service"] = to_plain(cluster.service)
    if cache.tiers:
        kwargs["lower_media"] = [t.event_medium for t in cache.tiers]
    return RequestRouterConfig(request_router_class=PrefixCacheRequestRouter, request_router_kwargs=kwargs)


def build_application(config: ClusterServeConfig, *, replica_class: type = EngineReplica) -> serve.Application:
    """The ingress over N engine replicas (module docstring). `replica_class`: an
    `EngineReplica` subclass in its place (tests inject faults with one)."""
    if not (isinstance(replica_class, type) and issubclass(replica_class, EngineReplica)):
        raise TypeError(f"replica_class must be EngineReplica or a subclass, got {replica_class!r}")
    cluster = config.cluster
    layout = cluster_layout(cluster)
    engine = config.serve.serving.engine
    router_config = ray_router_config(config)
    # Ray's default router: no option at all (Ray 2.60 refuses request_router_config=None).
    router_option = {} if router_config is None else {"request_router_config": router_config}
    replicas = serve.deployment(replica_class).options(
        name=ENGINE_DEPLOYMENT,
        num_replicas=cluster.replicas,
        max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options={"num_cpus": layout.replica_cpus},
        health_check_period_s=cluster.health_check_period_s,
        **_SHUTDOWN,
        **router_option,
    )
    ingress = serve.deployment(serve.ingress()(ClusterIngress)).options(
        name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=_INGRESS_MAX_ONGOING,
        ray_actor_options={"num_cpus": layout.ingress_cpus}, **_SHUTDOWN,
    )
    options = {"max_attempts": cluster.max_attempts, "stall_timeout_s": cluster.stall_timeout_s}
    served = cluster.served_model_name or engine.model
    return ingress.bind(replicas.bind(dict(config.replica_data), served), engine.model, engine.chat_template, options,
                        cluster.router)


class ClusterServer:
    """A local Ray cluster, Ray Serve's proxy and the application (module docstring).
    `start()` returns the base URL (`http://HOST:PORT`) once every replica is up; `stop()`
    shuts Ray Serve and Ray down, then ends any process Ray started that outlived them."""

    def __init__(self, config: ClusterServeConfig, *, log_to_driver: bool = True,
                 replica_class: type = EngineReplica) -> None:
        self.config = config
        self.replica_class = replica_class
        self._log_to_driver = log_to_driver
        self.base_url: str | None = None
        self._started_ray = False
        self._before: set[tuple[int, float]] = set()  # (pid, start time) of children not Ray's

    def start(self, *, on_ray_started: Callable[[], None] | None = None) -> str:
        """Start Ray, then Ray Serve and the application; `on_ray_started()` runs in
        between (`ray.init` installs signal handlers of its own: the CLI puts its back)."""
        if ray.is_initialized():
            raise RuntimeError("Ray is initialized in this process already; ClusterServer starts its own cluster")
        if ray_constants.ENABLE_RAY_CLUSTER:
            raise RuntimeError(f"Ray was imported before prefixcache.serve.ray_app, without {LOCAL_RAY_ONLY}=0: its "
                               "processes would listen on every interface. Set it in the environment, or import "
                               "prefixcache.serve.ray_app first")
        cluster = self.config.cluster
        self._before = _children()
        self._started_ray = True
        try:
            ray.init(address="local", num_cpus=cluster_layout(cluster).num_cpus, include_dashboard=False,
                     log_to_driver=self._log_to_driver)
            if on_ray_started is not None:
                on_ray_started()
            serve.start(http_options=HTTPOptions(host=cluster.host, port=cluster.port))
            self.deploy(self.config, replica_class=self.replica_class)
        except BaseException:
            self.stop()
            raise
        host = cluster.host if ":" not in cluster.host else f"[{cluster.host}]"
        self.base_url = f"http://{host}:{cluster.port}"
        return self.base_url

    def deploy(self, config: ClusterServeConfig, *, replica_class: type | None = None) -> None:
        """Run `config`'s application in place of the current one (same cluster and proxy:
        the benchmark switches routers this way; the replicas start afresh), with
        `replica_class` from now on where given."""
        replica_class = replica_class or self.replica_class
        application = build_application(config, replica_class=replica_class)
        if serve.status().applications.get(APP_NAME) is not None:
            serve.delete(APP_NAME)
        serve.run(application, name=APP_NAME, route_prefix="/")
        self.config, self.replica_class = config, replica_class

    def stop(self) -> None:
        """Shut Ray Serve and the Ray cluster down, then end what Ray started and left
        running (its agents outlive a raylet that stopped before them)."""
        if not self._started_ray:
            return
        started = _children() - self._before
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            self._started_ray = False
            _end(started, _LEFTOVER_GRACE_S)

    def __enter__(self) -> ClusterServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


_LEFTOVER_GRACE_S = 5.0


def _children() -> set[tuple[int, float]]:
    """(pid, start time) of every process below this one (psutil: Ray's own dependency)."""
    import psutil

    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            out.add((child.pid, child.create_time()))
        except psutil.Error:
            pass
    return out


def _end(processes: set[tuple[int, float]], grace_s: float) -> None:
    """Wait up to `grace_s` for `processes` to exit, then SIGTERM, then SIGKILL what is left
    (a pid reused since is left alone: its start time differs)."""
    import psutil

    alive = []
    for pid, created in processes:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                alive.append(proc)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not alive:
            return
        _log.warning("ending %d process(es) Ray left running: %s", len(alive), ", ".join(_name(p) for p in alive))
        for proc in alive:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=grace_s)


def _name(proc) -> str:  # noqa: ANN001 - a psutil.Process
    try:
        return f"{proc.name()} ({proc.pid})"
    except Exception:  # noqa: BLE001 - gone meanwhile
        return str(proc.pid)


class _Terminated(Exception):
    """SIGTERM arrived: stop as on Ctrl-C, and exit 0 (a service manager's stop)."""


def serve_cluster(config: ClusterServeConfig | str | Path) -> int:
    """`prefixcache cluster serve`: serve `config` (or the file at that path) until
    interrupted. The first Ctrl-C (KeyboardInterrupt, exit 130) or SIGTERM (exit 0) stops
    everything, Ray included, whether the cluster is up or still starting; a second one
    while it stops only says it is stopping."""
    if not isinstance(config, ClusterServeConfig):
        config = load_cluster_serve_config(config)
    check_proxy_address_free(config)
    cluster = config.cluster
    layout = cluster_layout(cluster)
    server = ClusterServer(config)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping:
            print("stopping already (Ray included); please wait", file=sys.stderr, flush=True)
            return
        stopping = True
        raise KeyboardInterrupt if signum == signal.SIGINT else _Terminated()

    def install() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)

    install()
    print(f"starting a local Ray cluster: {layout.num_cpus} logical CPUs, {cluster.replicas} replicas x "
          f"{layout.replica_cpus:g} + the ingress {layout.ingress_cpus:g}; router {cluster.router}; Ctrl-C stops",
          flush=True)
    started = time.monotonic()
    try:
        url = server.start(on_ray_started=install)
        print(f"serving {cluster.replicas} replicas ({cluster.router}) at {url}/v1 after {time.monotonic() - started:.0f} s "
              f"(also {url}/metrics, {url}/cluster/state); Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except _Terminated:
        return 0
    except SystemExit as err:  # SIGTERM while ray.init ran: Ray's driver handler is sys.exit(SIGTERM)
        if err.code != signal.SIGTERM:
            raise
        return 0
    finally:
        stopping = True
        print("stopping: Ray Serve, the replicas and Ray", file=sys.stderr, flush=True)
        server.stop()
