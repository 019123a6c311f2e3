"""The cluster A/B: one workload replayed by arrival time through N simulated replicas and
one router, for every router and cluster size, next to the reference lines.

Owns the discrete-event replay (`simulate`, `simulate_shared`) and the experiment over
routers and sizes (`run_cluster`). Must never: print, plot or parse arguments
(`prefixcache.cluster.report` and the CLI do), schedule inside a replica
(`prefixcache.cluster.replica` does), or reach into a cache past the `PrefixCache`
protocol.

Replay. Each replica is a `SimEngine`: vLLM V1's scheduler (continuous batching, chunked
prefill) over a real `PrefixCache` of one replica's capacity, its steps timed by the
`ServiceModel`; time is simulated. Requests arrive at `arrival_s / arrival_speedup`; at
arrival the router sees every replica's load (`Candidates`, kept current as requests
come and go) and the request, and the request joins the chosen replica's queue, to be
admitted at that engine's next step boundary. Engine events at a time come before
arrivals at that time.

KV events. When the router reads the KV index (`Router.needs_index`), the caches record
events and the replay feeds each replica's `drain_events()` into a `KVIndex` after every
step, as a subscriber would: the router sees a block once the step computing it is over,
and sees evictions. Otherwise events are off (recording them costs more than the rest of
a request's replay, and nobody reads them).

Load. Each replica's row of `Candidates`: tokens queued and running, requests (all, and
queued), the KV blocks its running requests hold (the distinct blocks of their block
tables at admission: vLLM's KV-cache usage, which a radix cache's own references would
blur in the pool's pinned count),
and the two sums Dynamo's router keeps per worker: prefill tokens (each request's prompt
less the whole blocks the index showed on that replica when it was routed, from routing
to its first token, never corrected, as Dynamo's estimate; without an index, the whole
prompt until its admission, then the admission's miss) and active blocks (the
distinct full prompt blocks of its queued and running requests: one copy per request in
a `KVIndex`, so a block they share counts once). That `KVIndex` is `RouterContext.active`
(Dynamo's `ActiveSequences`). Every router sees the same columns, whichever it reads, and
hears `on_first_token` and `on_request_completed` as they happen.

Reference lines, on the same workload: round robin (always one of the routers), and the
shared cache: N engines (N x the compute) over ONE cache of N x capacity (and N x each
lower tier) and one queue,
each request taken by the first engine with room: the hit ceiling for routers over N
replicas, and the TTFT of a cluster whose every replica holds every prefix.

Measured per run (`prefixcache.cluster.results.RunResult`): per request its hit, TTFT,
queueing delay and TPOT (goodput against the config's SLO), per replica its busy seconds,
prompt tokens computed, requests and hit ratio; router time per request (choose +
on_request_routed, the prompt's hashing included, MICROSECONDS), KV events, wall time.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import math
import random
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefixcache import build_cache
from prefixcache.ab import Progress, describe_workload
from prefixcache.cluster.config import ClusterConfig, RouterSpec
from prefixcache.cluster.kv_index import KVIndex
from prefixcache.cluster.prompt_hashes import PromptHasher
from prefixcache.cluster.registry import resolve_router_spec
from prefixcache.cluster.replica import Listener, SimEngine
from prefixcache.cluster.results import SHARED, ClusterResult, RunResult
from prefixcache.cluster.router import Candidates, Router, RouterContext, RoutingRequest, pick_replica
from prefixcache.protocol import PrefixCache
from prefixcache.workloads import HitCounts, Workload

__all__ = ["RunResult", "ClusterResult", "SHARED", "simulate", "simulate_shared", "run_cluster"]

_PROGRESS_EVERY = 64  # requests between progress calls


class _Replay:
    """The state of one replay: engines, their caches, the event heap, the index, the
    load columns, what is measured. `shared`: one cache and one queue for every engine."""

    def __init__(self, workload: Workload, config: ClusterConfig, num_engines: int, *, shared: bool,
                 with_index: bool = False) -> None:
        self.workload, self.config, self.shared = workload, config, shared
        self.service = config.service
        self.speedup = config.arrival_speedup
        n = len(workload)
        self.prompt_lens = [len(r.prompt) for r in workload.requests]
        self.output_lens = [len(r.output) for r in workload.requests]
        self.hits = [0] * n
        self.ttft = [math.nan] * n
        self.queue = [math.nan] * n
        self.tpot = [math.nan] * n
        self.finish = [math.nan] * n
        self.first = [math.nan] * n
        self.expected_prefill = [0] * n
        self.replica_of = [-1] * n
        self.rejected: list[int] = []
        self.prompts: dict[int, array] = {}  # token ids of requests in flight (a trace is too big for all)
        self.requests: dict[int, RoutingRequest] = {}  # requests in flight, for the router's hooks
        self.router: Router | None = None
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0
        cache_config = config.cache.replace(enable_events=with_index)
        if shared:  # every replica's pool and lower tiers in one
            tiers = tuple(dataclasses.replace(t, num_blocks=t.num_blocks * num_engines) for t in cache_config.tiers)
            cache_config = cache_config.replace(num_blocks=config.cache.num_blocks * num_engines, tiers=tiers)
            cache = build_cache(cache_config)
            caches = [cache] * num_engines
            queue: deque[int] = deque()
            queues = [queue] * num_engines
        else:
            caches = [build_cache(cache_config) for _ in range(num_engines)]
            queues = [deque() for _ in range(num_engines)]
        self.caches: list[PrefixCache] = caches
        listener = Listener(self._admitted, self._first_token, self._finished, self._rejected, self._wake, self._freed)
        self.engines = [SimEngine(e, caches[e], queues[e], self.service, workload, listener,
                                  commit_outputs=config.commit_outputs, prompt=self.prompt,
                                  cache_when_scheduled=config.cache_when_scheduled)
                        for e in range(num_engines)]
        self.loads = Candidates(range(num_engines))
        self.index: KVIndex | None = None
        self.active = KVIndex()  # Dynamo's ActiveSequences
        if with_index:
            self.index = KVIndex(lower_media=tuple(t.event_medium for t in cache_config.tiers))  # per-tier residency
            for e in range(num_engines):
                self.index.add_replica(e)
        if not shared:
            for e in range(num_engines):
                self.active.add_replica(e)
        self.active_digests: dict[int, list[bytes]] = {}
        self.tables: dict[int, list[int]] = {}  # block tables of running requests, at admission
        self.held: list[Counter[int]] = [Counter() for _ in range(num_engines)]  # block -> running requests holding it

    # -- per request ------------------------------------------------------------------
    def arrival(self, i: int) -> float:
        return self.workload.requests[i].arrival_s / self.speedup

    def prompt(self, i: int) -> array:
        """Request i's prompt token ids as one int32 buffer (what a cache and the hasher
        take without converting), expanded on first use and kept while it is in flight."""
        prompt = self.prompts.get(i)
        if prompt is None:
            prompt = self.prompts[i] = self.workload.requests[i].prompt.to_array(4)
        return prompt

    def route(self, i: int, request: RoutingRequest, rid: int) -> None:
        """Request i (routed to replica rid) joins its queue and its load."""
        p, o, loads = self.prompt_lens[i], self.output_lens[i], self.loads
        self.replica_of[i] = rid
        self.requests[i] = request
        hashes = request.hashes
        cached = self.index.longest_prefix(hashes).get(rid, 0) if self.index is not None and len(hashes) else 0
        self.expected_prefill[i] = max(p - cached * self.config.block_size, 0)
        loads.queued_tokens[rid] += p + o
        loads.num_requests[rid] += 1
        loads.queued_requests[rid] += 1
        loads.prefill_tokens[rid] += self.expected_prefill[i]
        if len(hashes):
            digests = self.active_digests[i] = hashes.digests()
            self.active.store(rid, digests)
            loads.active_blocks[rid] = self.active.blocks(rid)
        engine = self.engines[rid]
        engine.queue.append(i)
        engine.poke(self.now)
        self.feed(engine)

    def enqueue_shared(self, i: int) -> None:
        """Request i joins the shared queue; an idle engine takes it now, else every
        engine looks at its next step boundary."""
        self.replica_of[i] = 0
        engines = self.engines
        engines[0].queue.append(i)
        idle = [e for e in engines if not e.busy]
        for engine in idle or engines:
            engine.poke(self.now)
            if not engine.queue:
                break

    # -- what the engines report -----------------------------------------------------------
    def _admitted(self, engine: SimEngine, i: int, hit: int, now: float) -> None:
        self.hits[i] = hit
        self.queue[i] = now - self.arrival(i)
        if self.shared:
            self.replica_of[i] = engine.eid
            return
        rid, loads = engine.eid, self.loads
        if self.index is None:  # no estimate at routing: the admission's miss from now on
            miss = self.prompt_lens[i] - hit
            loads.prefill_tokens[rid] += miss - self.expected_prefill[i]
            self.expected_prefill[i] = miss
        footprint = self.prompt_lens[i] + self.output_lens[i]
        loads.queued_tokens[rid] -= footprint
        loads.running_tokens[rid] += footprint
        loads.queued_requests[rid] -= 1
        table = self.tables[i] = list(engine.cache.block_table(i))
        held = self.held[rid]
        held.update(table)
        loads.kv_blocks[rid] = len(held)

    def _first_token(self, engine: SimEngine, i: int, now: float) -> None:
        self.first[i] = now
        self.ttft[i] = now - self.arrival(i)
        if self.shared:
            return
        self.loads.prefill_tokens[engine.eid] -= self.expected_prefill[i]
        if self.router is not None:
            self.router.on_first_token(self.requests[i], engine.eid)

    def _finished(self, engine: SimEngine, i: int, now: float) -> None:
        self.finish[i] = now
        if self.output_lens[i] >= 2:
            self.tpot[i] = (now - self.first[i]) / (self.output_lens[i] - 1)
        self.prompts.pop(i, None)
        if self.shared:
            return
        rid, loads = engine.eid, self.loads
        loads.running_tokens[rid] -= self.prompt_lens[i] + self.output_lens[i]
        held = self.held[rid]
        held.subtract(self.tables.pop(i))
        for block in [b for b, n in held.items() if n <= 0]:
            del held[block]
        loads.kv_blocks[rid] = len(held)
        self.leave(rid, i)

    def _rejected(self, engine: SimEngine, i: int, now: float) -> None:
        self.rejected.append(i)
        self.replica_of[i] = -1
        self.prompts.pop(i, None)
        if self.shared:
            return
        rid, loads = engine.eid, self.loads
        loads.queued_tokens[rid] -= self.prompt_lens[i] + self.output_lens[i]
        loads.queued_requests[rid] -= 1
        loads.prefill_tokens[rid] -= self.expected_prefill[i]
        self.leave(rid, i)

    def leave(self, rid: int, i: int) -> None:
        """Request i has left replica rid (finished or rejected): out of its request count
        and active blocks, and the router hears it."""
        self.loads.num_requests[rid] -= 1
        self.deactivate(rid, i)
        request = self.requests.pop(i)
        if self.router is not None:
            self.router.on_request_completed(request, rid)

    def _wake(self, engine: SimEngine, at: float) -> None:
        heapq.heappush(self.heap, (at, self.seq, engine.eid, engine.version))
        self.seq += 1

    def _freed(self, engine: SimEngine, now: float) -> None:
        if self.shared:  # room in the shared cache: an engine waiting on it may start
            for other in self.engines:
                if other is not engine and not other.busy and other.queue:
                    other.poke(now)

    def deactivate(self, rid: int, i: int) -> None:
        """Request i's prompt blocks leave replica rid's active blocks."""
        digests = self.active_digests.pop(i, None)
        if digests is not None:
            self.active.remove(rid, digests)
            self.loads.active_blocks[rid] = self.active.blocks(rid)

    def feed(self, engine: SimEngine) -> None:
        """The replica's new KV events into the index, as a subscriber would."""
        if self.index is not None:
            events = engine.cache.drain_events()
            if events:
                self.events += len(events)
                self.index.apply(engine.eid, events)

    # -- time -----------------------------------------------------------------------------
    def advance(self, until: float) -> None:
        """Run every engine event at or before `until`."""
        heap, engines = self.heap, self.engines
        while heap and heap[0][0] <= until:
            at, _, eid, version = heapq.heappop(heap)
            engine = engines[eid]
            if version != engine.version or not engine.busy:
                continue  # a segment that was cut short
            self.now = at
            engine.end_segment()
            self.feed(engine)
            if not self.shared and not engine.busy and engine.queue:
                i = engine.queue[0]
                raise RuntimeError(
                    f"replica {eid}: request {i} ({self.prompt_lens[i]} + {self.output_lens[i]} tokens) fits the "
                    f"pool of {engine.num_blocks} blocks but the cache refused it with nothing running")

    def finish_run(self) -> None:
        self.advance(math.inf)
        for engine in self.engines:
            if engine.queue or engine.running:
                raise RuntimeError(f"replica {engine.eid} ended the replay with requests left: {list(engine.queue)}")
        for cache in {id(c): c for c in self.caches}.values():
            cache.check_invariants()
        if self.index is not None:
            self.index.check_invariants()
        self.active.check_invariants()
        loads = self.loads
        if self.active.num_pairs or any(loads.prefill_tokens) or any(loads.active_blocks) or any(loads.kv_blocks) \
                or any(loads.num_requests):
            raise RuntimeError(f"the replay ended with load left: {list(loads)}")

    def result(self, label: str, kind: str, router: str, route_us: list[float], wall_s: float) -> RunResult:
        finished = [f for f in self.finish if not math.isnan(f)]
        start = self.arrival(0) if len(self.workload) else 0.0
        return RunResult(
            label, kind, router, len(self.engines), HitCounts(self.hits, self.prompt_lens),
            tuple(self.ttft), tuple(self.queue), tuple(self.tpot), tuple(self.finish), tuple(self.replica_of),
            tuple(e.busy_s for e in self.engines), tuple(e.prefilled for e in self.engines), tuple(route_us),
            tuple(self.rejected), self.events, (max(finished) - start) if finished else 0.0, wall_s,
            self.config.slo,
        )


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """The cyclic collector off while a replay runs (router time is measured, and a full
    collection walks every request of the workload; nothing the replay makes is part of a
    cycle), as `prefixcache.ab`'s replay does."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def simulate(
    workload: Workload,
    config: ClusterConfig,
    label: str,
    spec: RouterSpec,
    num_replicas: int,
    *,
    progress: Progress | None = None,
) -> RunResult:
    """Replay `workload` through `num_replicas` replicas routed by `spec` (module
    docstring); ConfigError (path `router` or `options.<key>`) for a spec that does not
    resolve (`resolve_router_spec`)."""
    t0 = time.perf_counter()
    resolved = resolve_router_spec(spec.router, spec.options)
    replay = _Replay(workload, config, num_replicas, shared=False, with_index=resolved.cls.needs_index)
    context = RouterContext(config.block_size, config.capacity_tokens, replay.index, random.Random(config.seed),
                            lambda: replay.now, replay.active, config.service)
    router = replay.router = resolved.build(context)
    for rid in range(num_replicas):
        router.on_replica_added(rid)
    hasher = PromptHasher.of(config.cache)
    n = len(workload)
    route_us = [0.0] * n
    clock = time.perf_counter_ns
    loads = replay.loads
    with _no_cyclic_gc():
        for i, r in enumerate(workload.requests):
            at = replay.arrival(i)
            replay.advance(at)
            replay.now = at
            request = RoutingRequest(i, replay.prompt(i), namespace=r.namespace, num_output_tokens=len(r.output),
                                     hasher=hasher)
            t = clock()
            rid = loads.replicas[pick_replica(router.choose_replicas(loads, request), loads)]
            router.on_request_routed(request, rid)
            route_us[i] = (clock() - t) / 1000.0
            replay.route(i, request, rid)
            if progress is not None and (i + 1) % _PROGRESS_EVERY == 0:
                progress(f"{label} N={num_replicas}", i + 1, n)
        replay.finish_run()
    if progress is not None:
        progress(f"{label} N={num_replicas}", n, n)
    return replay.result(label, "router", spec.router, route_us, time.perf_counter() - t0)


def simulate_shared(
    workload: Workload, config: ClusterConfig, num_replicas: int, *, progress: Progress | None = None
) -> RunResult:
    """The shared-cache reference line: `num_replicas` engines over one cache of
    num_replicas x capacity and one queue (module docstring)."""
    t0 = time.perf_counter()
    replay = _Replay(workload, config, num_replicas, shared=True)
    n = len(workload)
    with _no_cyclic_gc():
        for i in range(n):
            at = replay.arrival(i)
            replay.advance(at)
            replay.now = at
            replay.enqueue_shared(i)
            if progress is not None and (i + 1) % _PROGRESS_EVERY == 0:
                progress(f"{SHARED} N={num_replicas}", i + 1, n)
        replay.finish_run()
    if progress is not None:
        progress(f"{SHARED} N={num_replicas}", n, n)
    return replay.result(SHARED, SHARED, SHARED, [], time.perf_counter() - t0)


def run_cluster(config: ClusterConfig, workload: Workload | None = None, *,
                progress: Progress | None = None,
                on_run: Callable[[ClusterResult], None] | None = None) -> ClusterResult:
    """Every router at every cluster size, and the shared cache at every size. `on_run`
    sees the result so far (the runs finished) after each run."""
    if workload is None:
        workload = config.workload.build()
    described, plain = describe_workload(workload, [config.block_size]), config.plain()
    runs: list[RunResult] = []

    def finished(run: RunResult) -> None:
        runs.append(run)
        if on_run is not None:
            on_run(ClusterResult(described, plain, config.reference_label, tuple(runs)))

    for n in config.replicas:
        for label, spec in config.routers.items():
            finished(simulate(workload, config, label, spec, n, progress=progress))
        finished(simulate_shared(workload, config, n, progress=progress))
    return ClusterResult(described, plain, config.reference_label, tuple(runs))
