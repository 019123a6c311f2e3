"""The cluster A/B: one workload replayed by arrival time through N simulated replicas and
one router, for every router and cluster size, next to the reference lines.

Owns the discrete-event replay (`simulate`), the experiment over routers and sizes
(`run_cluster`), and their results (`RunResult`, `ClusterResult`, as JSON and CSV).
Must never: print, plot or parse arguments (`prefixcache.cluster.report` and the CLI
do), or reach into a cache past the `PrefixCache` protocol.

Replay model. Each replica is a real `PrefixCache` (the configured backend, one
replica's capacity) with `service.max_concurrent` slots, a FIFO queue and one prefill
at a time (`ServiceModel`); time is simulated. Requests arrive at
`arrival_s / arrival_speedup`; at arrival the router sees every replica's load
(`Candidates`, kept current as requests come and go) and the request, and the request
joins the chosen replica's queue. A replica starts the head of its queue when a slot is
free, through the protocol:

    admit(i, prompt)             the hit is what the cache reports
    append(i, output)            with commit_outputs: the output's KV is reserved now
    commit(i, P)                 when its prefill is done (the first token)
    commit(i, P + O)             when the request finishes (with commit_outputs)
    release(i)                   when it finishes

If the cache has no room (`admit` or `append` returns None) the request waits for a
running one to finish; a request whose footprint, ceil((P + O) / B) blocks (P without
commit_outputs), exceeds the pool can never run: it counts 0 hits, no TTFT, and is
listed in `rejected`. Completions at a time come before arrivals at that time.

KV events. When the router reads the KV index (`Router.needs_index`), the caches record
events and the simulation feeds each replica's `drain_events()` into a `KVIndex` after
every step, as an event subscriber would; so the router sees evictions as they happen,
and no sooner. Otherwise events are off (they cost time and nobody reads them).

Load. Each replica's row of `Candidates` carries, besides tokens and requests, the two
sums Dynamo's router keeps per worker: prefill tokens (each request's prompt less the
whole blocks the replica's cache held when it was routed, from routing to its first
token, never corrected, as Dynamo's estimate) and active blocks (the distinct full prompt
blocks of its queued and running requests: one copy per request in a `KVIndex`, so a
block they share counts once). That `KVIndex` is `RouterContext.active` (Dynamo's
`ActiveSequences`, which `kv_events` reads for the prompt blocks already active). Every
router sees the same columns, whichever it reads.

Reference lines, on the same workload: round robin (always one of the routers), and one
shared cache of N x capacity with N x max_concurrent slots and N prefill engines, which
every request reaches: the hit ceiling for routers over N replicas (a router that makes
requests wait longer can see a little more: a next turn that waits finds its previous
turn done).

Measured per run: per-request hit tokens (cluster token hit ratio: whole run, last 50%),
TTFT (arrival to first token, SECONDS: p50, p99), each replica's busy time (prefill +
decode SECONDS it served; imbalance = max / mean), requests per replica, router time per request
(choose + on_request_routed, the prompt's hashing included, MICROSECONDS), KV events
ingested, wall time.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache import build_cache
from prefixcache.ab import Progress, describe_workload, percentile, write_csv
from prefixcache.cluster.config import ClusterConfig, RouterSpec
from prefixcache.cluster.kv_index import KVIndex
from prefixcache.cluster.prompt_hashes import PromptHasher, PromptHashes
from prefixcache.cluster.registry import resolve_router_spec
from prefixcache.cluster.router import Candidates, Router, RouterContext, RoutingRequest, pick_replica
from prefixcache.cluster.service_model import ServiceModel
from prefixcache.config import CacheConfig
from prefixcache.protocol import PrefixCache
from prefixcache.workloads import HitCounts, Workload
from prefixcache.workloads.metrics import HitRatios

__all__ = ["RunResult", "ClusterResult", "SHARED", "simulate", "simulate_shared", "run_cluster"]

SHARED = "shared"
"""The series name and kind of the shared-cache reference line."""

_PROGRESS_EVERY = 64  # requests between progress calls

# Event kinds, in the order they run at one instant: a slot frees before the next arrival.
_PREFILLED, _FINISHED = 0, 1


@dataclass(frozen=True)
class RunResult(HitRatios):
    """One router (or the shared cache) at one cluster size. TOKENS and SECONDS unless named.

    kind:        "router", or "shared" for the shared-cache reference line
    hits:        per-request hit tokens, arrival order (0 for rejected requests)
    ttft_s:      TTFT of every request that ran, SECONDS, arrival order
    replica_of:  the replica each request went to (-1: rejected before it could run)
    busy_s:      per simulated replica, SECONDS of prefill + decode it served (the shared
                 cache is one replica)
    route_us:    per request, MICROSECONDS in the router's calls
    """

    label: str
    kind: str
    router: str
    num_replicas: int
    hits: HitCounts
    ttft_s: tuple[float, ...]
    replica_of: tuple[int, ...]
    busy_s: tuple[float, ...]
    route_us: tuple[float, ...]
    rejected: tuple[int, ...]
    events: int
    wall_s: float

    @property
    def ttft_p50_s(self) -> float:
        return percentile(self.ttft_s, 50)

    @property
    def ttft_p99_s(self) -> float:
        return percentile(self.ttft_s, 99)

    @property
    def imbalance(self) -> float:
        """max / mean busy time over replicas (1.0: perfectly even)."""
        mean = sum(self.busy_s) / len(self.busy_s)
        return max(self.busy_s) / mean if mean > 0 else 1.0

    @property
    def requests_per_replica(self) -> tuple[int, ...]:
        """Requests each simulated replica ran (the shared cache is one replica)."""
        counts = [0] * len(self.busy_s)
        for r in self.replica_of:
            if r >= 0:
                counts[r] += 1
        return tuple(counts)

    @property
    def route_us_mean(self) -> float:
        return sum(self.route_us) / len(self.route_us) if self.route_us else 0.0

    def summary(self) -> dict[str, Any]:
        """One row: what the table, the CSV and the plots show."""
        return {
            "series": self.label, "kind": self.kind, "router": self.router, "replicas": self.num_replicas,
            "hit_ratio": self.hit_ratio, "last_half_hit_ratio": self.last_half_hit_ratio,
            "ttft_p50_s": self.ttft_p50_s, "ttft_p99_s": self.ttft_p99_s, "imbalance": self.imbalance,
            "requests_per_replica": list(self.requests_per_replica), "busy_s": list(self.busy_s),
            "route_us_mean": self.route_us_mean, "route_us_p99": percentile(self.route_us, 99),
            "rejected": len(self.rejected), "events": self.events, "wall_s": self.wall_s,
        }


@dataclass(frozen=True)
class ClusterResult:
    """Every run of a cluster experiment on one workload."""

    workload: Mapping[str, Any]
    config: Mapping[str, Any]
    reference: str  # the round-robin reference line's label
    runs: tuple[RunResult, ...]

    def run(self, label: str, num_replicas: int) -> RunResult:
        for r in self.runs:
            if r.label == label and r.num_replicas == num_replicas:
                return r
        raise KeyError(f"no run {label!r} at {num_replicas} replicas")

    @property
    def replica_counts(self) -> tuple[int, ...]:
        return tuple(sorted({r.num_replicas for r in self.runs}))

    @property
    def labels(self) -> tuple[str, ...]:
        """Series names, routers first (in config order), the shared cache last."""
        seen = dict.fromkeys(r.label for r in self.runs if r.kind == "router")
        return (*seen, *(dict.fromkeys(r.label for r in self.runs if r.kind == SHARED)))

    def rows(self) -> list[dict[str, Any]]:
        """One summary row per run, by cluster size then series."""
        order = {label: i for i, label in enumerate(self.labels)}
        runs = sorted(self.runs, key=lambda r: (r.num_replicas, order[r.label]))
        return [r.summary() for r in runs]

    def to_dict(self) -> dict[str, Any]:
        return {"workload": dict(self.workload), "config": dict(self.config), "reference": self.reference,
                "runs": self.rows()}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def write_csv(self, path: str | Path) -> None:
        """A row per run; per-replica lists joined by spaces."""
        rows = [{k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in row.items()} for row in self.rows()]
        write_csv(path, rows)


class _Replica:
    """One simulated replica: its cache, its queue and running requests. Its load lives in
    row `rid` of the simulation's `Candidates`, updated as requests come and go."""

    __slots__ = ("rid", "cache", "num_blocks", "slots", "queue", "running", "busy_s", "prefill_free_at")

    def __init__(self, rid: int, cache: PrefixCache, slots: int, prefill_engines: int) -> None:
        self.rid, self.cache, self.slots = rid, cache, slots
        self.num_blocks = cache.config.num_blocks
        self.queue: deque[int] = deque()
        self.running: set[int] = set()
        self.busy_s = 0.0
        # When each prefill engine is next free (a heap): one per replica; the shared
        # cache stands for N replicas and has N.
        self.prefill_free_at = [0.0] * prefill_engines

    def next_prefill(self, now: float, duration: float) -> float:
        """Book `duration` SECONDS on the first free prefill engine; the first token's time."""
        begin = max(now, heapq.heappop(self.prefill_free_at))
        heapq.heappush(self.prefill_free_at, begin + duration)
        return begin + duration


class _Simulation:
    """The state of one replay: replicas, the event heap, the index, what is measured."""

    def __init__(self, workload: Workload, cache: CacheConfig, service: ServiceModel, num_replicas: int, *,
                 commit_outputs: bool, speedup: float, with_index: bool, slots: int, prefill_engines: int = 1) -> None:
        self.workload, self.service, self.commit_outputs, self.speedup = workload, service, commit_outputs, speedup
        self.block_size = cache.block_size
        cache = cache.replace(enable_events=with_index)
        self.replicas = [_Replica(i, build_cache(cache), slots, prefill_engines) for i in range(num_replicas)]
        self.loads = Candidates(range(num_replicas))
        self.index: KVIndex | None = None
        if with_index:
            self.index = KVIndex(lower_media=tuple(t.event_medium for t in cache.tiers))  # per-tier residency
            for i in range(num_replicas):
                self.index.add_replica(i)
        # Dynamo's active sequences (its router's `ActiveSequences`): per replica, the
        # full prompt blocks of the requests routed there and not finished, one copy per
        # request, so a block several of them share counts once in `active_blocks`.
        self.active = KVIndex()
        for i in range(num_replicas):
            self.active.add_replica(i)
        self.active_hashes: dict[int, list[bytes]] = {}  # of requests in flight
        self.routing = -1  # the request being routed, while its replica first tries to start it
        n = len(workload)
        self.prompt_lens = [len(r.prompt) for r in workload.requests]
        self.prompts: dict[int, list[int]] = {}  # token ids of requests in flight (a trace is too big for all)
        self.hits = [0] * n
        self.expected_prefill = [0] * n  # uncached prompt TOKENS as the replica's cache stood at routing
        self.ttft: list[float | None] = [None] * n
        self.replica_of = [-1] * n
        self.rejected: list[int] = []
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.events = 0

    # -- per request -----------------------------------------------------------------
    def footprint_tokens(self, i: int) -> int:
        r = self.workload.requests[i]
        return len(r.prompt) + (len(r.output) if self.commit_outputs else 0)

    def prompt(self, i: int) -> list[int]:
        """Request i's prompt token ids, expanded on first use and kept while it is in flight."""
        prompt = self.prompts.get(i)
        if prompt is None:
            prompt = self.prompts[i] = self.workload.requests[i].prompt.tolist()
        return prompt

    def enqueue(self, i: int, rid: int, hashes: PromptHashes | None = None) -> None:
        """Request i joins replica rid's queue; `hashes` (its prompt's full blocks) join the
        replica's active blocks until it finishes."""
        r, loads = self.workload.requests[i], self.loads
        self.replica_of[i] = rid
        rep = self.replicas[rid]
        rep.queue.append(i)
        loads.queued_tokens[rid] += len(r.prompt) + len(r.output)
        loads.num_requests[rid] += 1
        if hashes is not None and len(hashes):
            digests = self.active_hashes[i] = hashes.digests()
            self.active.store(rid, digests)
            loads.active_blocks[rid] = self.active.blocks(rid)
        # Its prefill load, until its first token, is Dynamo's estimate at routing: the
        # prompt less the blocks the replica holds, never corrected after (start()).
        self.expected_prefill[i] = len(r.prompt)
        loads.prefill_tokens[rid] += len(r.prompt)
        self.routing = i
        self.start(rep)
        self.routing = -1
        if self.ttft[i] is None and self.replica_of[i] == rid:  # it waits: a pure look-up
            expected = len(r.prompt) - rep.cache.match(self.prompt(i), namespace=r.namespace).num_tokens
            loads.prefill_tokens[rid] += expected - len(r.prompt)
            self.expected_prefill[i] = expected

    def push(self, at: float, kind: int, i: int, rid: int) -> None:
        heapq.heappush(self.heap, (at, self.seq, kind, i, rid))
        self.seq += 1

    def start(self, rep: _Replica) -> None:
        """Start queued requests while slots are free and the cache has room."""
        cache, bs = rep.cache, self.block_size
        while len(rep.running) < rep.slots and rep.queue:
            i = rep.queue[0]
            r = self.workload.requests[i]
            prompt_len, output_len = len(r.prompt), len(r.output)
            if -(-self.footprint_tokens(i) // bs) > rep.num_blocks:
                rep.queue.popleft()
                self.unqueue(rep, i)
                self.rejected.append(i)
                self.replica_of[i] = -1
                self.prompts.pop(i, None)
                continue
            admission = cache.admit(i, self.prompt(i), namespace=r.namespace)
            if admission is not None and self.commit_outputs and output_len:
                if cache.append(i, r.output.tolist()) is None:
                    cache.release(i)
                    admission = None
            if admission is None:
                if not rep.running:
                    raise RuntimeError(
                        f"replica {rep.rid}: request {i} ({prompt_len} + {output_len} tokens) fits the pool of "
                        f"{rep.num_blocks} blocks but the cache refused it with nothing running"
                    )
                break  # wait for a running request to finish
            rep.queue.popleft()
            hit = admission.num_cached_tokens
            self.hits[i] = hit
            uncached = prompt_len - hit
            prefill = self.service.prefill_s(uncached)
            decode = self.service.decode_s(output_len)
            first_token = rep.next_prefill(self.now, prefill)
            self.ttft[i] = first_token - self.arrival(i)
            rep.busy_s += prefill + decode
            rep.running.add(i)
            loads = self.loads
            loads.queued_tokens[rep.rid] -= prompt_len + output_len
            loads.running_tokens[rep.rid] += prompt_len + output_len
            if i == self.routing:
                # Admitted as it is routed: the estimate is the admission's miss, unless
                # the len - 1 cap left a cached last block out of the hit.
                expected = uncached
                if hit == prompt_len - bs and prompt_len % bs == 0:
                    expected = prompt_len - cache.match(self.prompt(i), namespace=r.namespace).num_tokens
                loads.prefill_tokens[rep.rid] += expected - self.expected_prefill[i]
                self.expected_prefill[i] = expected
            self.push(first_token, _PREFILLED, i, rep.rid)
            self.push(first_token + decode, _FINISHED, i, rep.rid)
        self.feed(rep)

    def unqueue(self, rep: _Replica, i: int) -> None:
        r, loads = self.workload.requests[i], self.loads
        loads.queued_tokens[rep.rid] -= len(r.prompt) + len(r.output)
        loads.num_requests[rep.rid] -= 1
        loads.prefill_tokens[rep.rid] -= self.expected_prefill[i]
        self.deactivate(rep.rid, i)

    def deactivate(self, rid: int, i: int) -> None:
        """Request i's prompt blocks leave replica rid's active blocks."""
        digests = self.active_hashes.pop(i, None)
        if digests is not None:
            self.active.remove(rid, digests)
            self.loads.active_blocks[rid] = self.active.blocks(rid)

    def step(self, kind: int, i: int, rid: int) -> None:
        rep = self.replicas[rid]
        r = self.workload.requests[i]
        prompt_len, output_len = len(r.prompt), len(r.output)
        loads = self.loads
        if kind == _PREFILLED:
            rep.cache.commit(i, prompt_len)
            loads.prefill_tokens[rid] -= self.expected_prefill[i]
            self.feed(rep)
            return
        if self.commit_outputs and output_len:
            rep.cache.commit(i, prompt_len + output_len)
        rep.cache.release(i)
        rep.running.discard(i)
        self.prompts.pop(i, None)
        loads.running_tokens[rid] -= prompt_len + output_len
        loads.num_requests[rid] -= 1
        self.deactivate(rid, i)
        self.start(rep)  # feeds the index too

    def feed(self, rep: _Replica) -> None:
        """The replica's new KV events into the index, as a subscriber would."""
        if self.index is not None:
            events = rep.cache.drain_events()
            if events:
                self.events += len(events)
                self.index.apply(rep.rid, events)

    def arrival(self, i: int) -> float:
        return self.workload.requests[i].arrival_s / self.speedup

    def advance(self, until: float) -> None:
        """Run every completion at or before `until`."""
        heap = self.heap
        while heap and heap[0][0] <= until:
            at, _, kind, i, rid = heapq.heappop(heap)
            self.now = at
            self.step(kind, i, rid)

    def finish(self) -> None:
        self.advance(math.inf)
        for rep in self.replicas:
            if rep.queue or rep.running:
                raise RuntimeError(f"replica {rep.rid} ended the replay with requests left: {list(rep.queue)}")
            rep.cache.check_invariants()
        if self.index is not None:
            self.index.check_invariants()
        self.active.check_invariants()
        if self.active.num_pairs or any(self.loads.prefill_tokens) or any(self.loads.active_blocks):
            raise RuntimeError(f"the replay ended with load left: {list(self.loads)}")

    def result(self, label: str, kind: str, router: str, route_us: Sequence[float], wall_s: float) -> RunResult:
        return RunResult(
            label, kind, router, len(self.replicas), HitCounts(self.hits, self.prompt_lens),
            tuple(t for t in self.ttft if t is not None), tuple(self.replica_of),
            tuple(rep.busy_s for rep in self.replicas), tuple(route_us), tuple(self.rejected), self.events, wall_s,
        )


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
    sim = _Simulation(workload, config.cache, config.service, num_replicas, commit_outputs=config.commit_outputs,
                      speedup=config.arrival_speedup, with_index=resolved.cls.needs_index,
                      slots=config.service.max_concurrent)
    context = RouterContext(config.block_size, config.capacity_tokens, sim.index, random.Random(config.seed),
                            lambda: sim.now, sim.active)
    router: Router = resolved.build(context)
    for rid in range(num_replicas):
        router.on_replica_added(rid)
    hasher = PromptHasher.of(config.cache)
    n = len(workload)
    route_us = [0.0] * n
    clock = time.perf_counter_ns
    for i, r in enumerate(workload.requests):
        at = sim.arrival(i)
        sim.advance(at)
        sim.now = at
        request = RoutingRequest(i, sim.prompt(i), namespace=r.namespace, num_output_tokens=len(r.output),
                                 hasher=hasher)
        t = clock()
        rid = sim.loads.replicas[pick_replica(router.choose_replicas(sim.loads, request), sim.loads)]
        router.on_request_routed(request, rid)
        route_us[i] = (clock() - t) / 1000.0
        sim.enqueue(i, rid, request.hashes)
        if progress is not None and (i + 1) % _PROGRESS_EVERY == 0:
            progress(f"{label} N={num_replicas}", i + 1, n)
    sim.finish()
    if progress is not None:
        progress(f"{label} N={num_replicas}", n, n)
    return sim.result(label, "router", spec.router, route_us, time.perf_counter() - t0)


def simulate_shared(
    workload: Workload, config: ClusterConfig, num_replicas: int, *, progress: Progress | None = None
) -> RunResult:
    """The shared-cache reference line: one cache of num_replicas x capacity with
    num_replicas x max_concurrent slots and num_replicas prefill engines, which every
    request reaches."""
    t0 = time.perf_counter()
    cache = config.cache.replace(num_blocks=config.cache.num_blocks * num_replicas)
    sim = _Simulation(workload, cache, config.service, 1, commit_outputs=config.commit_outputs,
                      speedup=config.arrival_speedup, with_index=False,
                      slots=config.service.max_concurrent * num_replicas, prefill_engines=num_replicas)
    n = len(workload)
    for i in range(n):
        at = sim.arrival(i)
        sim.advance(at)
        sim.now = at
        sim.enqueue(i, 0)
        if progress is not None and (i + 1) % _PROGRESS_EVERY == 0:
            progress(f"{SHARED} N={num_replicas}", i + 1, n)
    sim.finish()
    if progress is not None:
        progress(f"{SHARED} N={num_replicas}", n, n)
    result = sim.result(SHARED, SHARED, SHARED, (), time.perf_counter() - t0)
    return dataclasses.replace(result, num_replicas=num_replicas)


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
