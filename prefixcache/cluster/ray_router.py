"""The project's routers as a Ray Serve `RequestRouter`: a thin adapter, no routing policy.

Owns `PrefixCacheRequestRouter`, the class a Ray Serve deployment names in its
`RequestRouterConfig` (`request_router_class`), with `request_router_kwargs` going to
`initialize_state`: a router spec (`router`, `options`: any `prefixcache.cluster`
router, as in cluster.yaml) and the replicas' hash config (`block_size`, `hash_algorithm`,
`hash_seed`: the chain their KV events carry). It also owns `ReplicaStream`, what each
replica publishes in its Ray Serve replica metadata (`record_replica_metadata`): where its
KV events are and which hash chain they use.

What the adapter does, and nothing else:

- `initialize_state`: builds the router (`resolve_router_spec`), a `PromptHasher` of the
  replicas' hash config, and, for a router that reads it (`needs_index`), a `KVIndex`
  and an `EventFeed` with `on_batch=index.apply` (a stream with an unrecoverable gap
  clears that replica in the index);
- `update_replicas` / `on_replica_actor_died`: a replica that joins is added to the
  index, its stream followed (from its metadata), and the router told; one that leaves
  or dies is unfollowed, dropped from the index with every block it held, its requests
  dropped from the load, and the router told;
- `choose_replicas`: the pending request's call (the first argument with
  `prompt_token_ids`: `RoutedCall`) becomes a `RoutingRequest` (prompt token ids,
  namespace, max_tokens as the expected output), the candidates a `Candidates` of the
  adapter's own in-flight accounting, and the router's ranked positions are mapped back
  to Ray's replicas. Ray then takes, in the first group with a replica that has room,
  the one with the shortest queue (its `pick_replica`). A call without token ids (a
  replica's info) is offered to every candidate;
- `on_request_routed` / `on_request_completed`: the request joins / leaves its
  replica's load, and the router hears where it went and when it left
  (`Router.on_request_routed`, `Router.on_request_completed`). Ray runs completion
  callbacks from another thread, so a short request may end before its routing is
  reported: it then counts as routed and loads nothing;
- `first_token(request_id)`: the ingress, which streams the request, says its first
  token is out (from any thread: it is handed to the router's event loop); the request's
  prefill leaves the replica's prefill load, as Dynamo's `mark_prefill_completed`, and
  the router hears `on_first_token`.

Load, as this adapter counts it: every request routed and not completed, per replica.
`running_tokens` = prompt + max_tokens, `num_requests`, `prefill_tokens` = the prompt
tokens the index did not hold on the replica when the request was routed (the whole
prompt without an index), until its first token, `kv_blocks` = the blocks of prompt +
max_tokens of those requests (an estimate of the replica's KV usage: its pool is not
visible here), `active_blocks` = the distinct full prompt blocks of those requests (no
output blocks). The last are Dynamo's `ActiveSequences`, kept as the cluster simulation
keeps them: a `KVIndex` with one copy of each request's prompt blocks, which routers read
as `RouterContext.active` (so `kv_events` charges a replica only for the prompt blocks
not already active there). `queued_tokens` and `queued_requests` stay 0 (Ray's replica
queue is not visible here). `RouterContext.service` is the `service` given (a mapping of
`ServiceModel` keys), else None (a router that reads it takes the defaults).

Threads: Ray calls every hook on the router's event loop; the feed applies events from
its own thread (index calls hold the GIL; the feed's lock orders a removal after any
batch in flight). Each adapter registers itself in `prefixcache.cluster.live_routers`,
where the cluster's ingress, in the same process, finds it to report its `state()`.
Ray Serve ships this module to the handle's process by value (it cloudpickles a
router's module whole), so it keeps no module-level state of its own.

Must never: decide where a request goes (the router does), touch a replica except
through its event stream, or block the event loop (the feed has its own thread).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixcache.cluster.event_feed import EventFeed
from prefixcache.cluster.kv_index import KVIndex
from prefixcache.cluster.live_routers import register
from prefixcache.cluster.prompt_hashes import PromptHasher
from prefixcache.cluster.registry import resolve_router_spec
from prefixcache.cluster.router import Candidates, Router, RouterContext, RoutingRequest
from prefixcache.service_model import ServiceModel
from prefixcache.config import HashConfig, from_mapping
from prefixcache.hashing import resolve_seed
from prefixcache.isolation import Namespace

__all__ = ["PrefixCacheRequestRouter", "ReplicaStream", "RoutedCall", "METADATA_KEY"]

_log = logging.getLogger(__name__)

METADATA_KEY = "prefixcache"
"""The key of `ReplicaStream` in a replica's Ray Serve replica metadata."""

class RoutedCall(Protocol):
    """What the adapter reads of a call: its prompt as token ids, its cache namespace
    (vLLM's `cache_salt`), its output budget in TOKENS and, where it has one, the request
    id the ingress reports its first token by (`first_token`)."""

    prompt_token_ids: Sequence[int]
    namespace: Namespace
    max_tokens: int | None


@dataclass(frozen=True)
class ReplicaStream:
    """Where a replica's KV events are and the hash chain they carry (TOKENS per block),
    as it reports them in its replica metadata under `METADATA_KEY`."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    block_size: int
    hash_algorithm: str
    hash_seed: str

    def to_metadata(self) -> dict[str, Any]:
        return {METADATA_KEY: asdict(self)}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ReplicaStream | None:
        """The stream a replica's metadata describes; None if it describes none."""
        fields = metadata.get(METADATA_KEY)
        if not isinstance(fields, Mapping):
            return None
        try:
            return cls(**fields)
        except TypeError:
            return None


@dataclass
class _InFlight:
    replica: str
    tokens: int
    prefill_tokens: int  # until its first token; 0 after
    digests: list[bytes]  # its full prompt blocks, in the active sequences while it runs
    request: RoutingRequest
    request_id: str | None  # the ingress's id for it (what `first_token` names)


@dataclass
class _Load:
    tokens: int = 0
    requests: int = 0
    prefill_tokens: int = 0
    routed: int = 0  # requests routed here, ever
    first_tokens: int = 0  # first tokens reported for requests routed here


class PrefixCacheRequestRouter(RequestRouter):
    """A `prefixcache.cluster` router behind Ray Serve's `RequestRouter` (module docstring)."""

    def initialize_state(
        self,
        router: str = "kv_events",
        options: Mapping[str, Any] | None = None,
        *,
        block_size: int = 16,
        hash_algorithm: str = "sha256_cbor",
        hash_seed: str | None = None,
        capacity_tokens: int | None = None,
        seed: int = 0,
        resync_s: float = 1.0,
        replay_timeout_s: float = 1.0,
        service: Mapping[str, Any] | None = None,
        lower_media: Sequence[str] = (),
    ) -> None:
        """`router` / `options`: the router spec; the hash config is the replicas' (a
        None seed is resolved here as in a replica: pass the replicas' own); TOKENS per
        block; `capacity_tokens`: one replica's cache (default 1,024 blocks); `service`:
        the replicas' service model as `ServiceModel` keys (None: none known);
        `lower_media`: the event media of the replicas' lower tiers (`cache.tiers`), whose
        residency the index keeps for the routers that read it."""
        spec = resolve_router_spec(router, dict(options or {}))
        service_model = from_mapping(ServiceModel, dict(service), "service") if service is not None else None
        self.spec = spec
        self.hasher = PromptHasher(block_size, HashConfig(hash_algorithm, hash_seed))
        self.hash_config = (block_size, hash_algorithm, resolve_seed(hash_algorithm, hash_seed))
        self.index = KVIndex(lower_media=tuple(lower_media)) if spec.cls.needs_index else None
        self.feed = (EventFeed(self.index.apply, on_lost=self._on_lost, resync_s=resync_s,
                               replay_timeout_s=replay_timeout_s)
                     if self.index is not None else None)
        # Touched only on the router's event loop (Ray's hooks), unlike the index.
        self.active = KVIndex()
        context = RouterContext(block_size, capacity_tokens or 1024 * block_size, self.index, random.Random(seed),
                                time.monotonic, self.active, service_model)
        self.router: Router = spec.build(context)
        self._loads: dict[str, _Load] = {}
        self._in_flight: dict[str, _InFlight] = {}
        self._requests: dict[str, RoutingRequest] = {}  # internal request id -> chosen for, not yet routed
        self._request_ids: dict[str, str] = {}  # the ingress's request id -> internal id, while in flight
        self._routing_loop: asyncio.AbstractEventLoop | None = None
        self._departed: list[str] = []
        self._unaccounted = 0  # requests of ours Ray reported routed that the adapter could not account
        self._completed_early: dict[str, str] = {}  # internal request id -> replica it finished on, before routed
        register(self)

    # -- the replica set ----------------------------------------------------------------
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._loads)
        super().update_replicas(replicas)
        now = {r.replica_id.unique_id: r for r in replicas}
        for uid in before - now.keys():
            self._drop(uid)
        for uid in now.keys() - before:
            self._add(now[uid])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        if replica_id.unique_id in self._loads:
            self._drop(replica_id.unique_id)

    def _add(self, replica: RunningReplica) -> None:
        uid = replica.replica_id.unique_id
        self._loads[uid] = _Load()
        self.active.add_replica(uid)
        if self.index is not None:
            self.index.add_replica(uid)
            stream = ReplicaStream.from_metadata(replica.replica_metadata)
            if stream is None:
                _log.warning("replica %s reports no KV event stream: the index never sees its blocks", uid)
            elif (stream.block_size, stream.hash_algorithm, stream.hash_seed) != self.hash_config:
                _log.error("replica %s hashes blocks with %s, the router with %s: its events cannot match; "
                           "not following them", uid, (stream.block_size, stream.hash_algorithm, stream.hash_seed),
                           self.hash_config)
            else:
                assert self.feed is not None
                self.feed.add(uid, stream.endpoint, replay_endpoint=stream.replay_endpoint, topic=stream.topic)
        self.router.on_replica_added(uid)

    def _drop(self, uid: str) -> None:
        del self._loads[uid]
        for rid in [rid for rid, f in self._in_flight.items() if f.replica == uid]:
            flight = self._in_flight.pop(rid)
            if flight.request_id is not None:
                self._request_ids.pop(flight.request_id, None)
        self.active.remove_replica(uid)
        if self.index is not None:
            assert self.feed is not None
            self.feed.remove(uid)  # nothing of it is applied after this returns
            self.index.remove_replica(uid)
        self._departed.append(uid)
        self.router.on_replica_removed(uid)

    def _on_lost(self, uid: str, gap: object) -> None:
        """From the feed's thread: the index cannot tell what `uid` holds any more."""
        assert self.index is not None
        if uid in self.index:
            self.index.clear(uid)

    # -- routing ------------------------------------------------------------------------
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        call = _routed_call(pending_request)
        if call is None or not candidate_replicas:
            return [candidate_replicas]
        request = self._routing_request(pending_request, call)  # type: ignore[arg-type]
        candidates = self._candidates([r.replica_id.unique_id for r in candidate_replicas])
        ranked = self.router.choose_replicas(candidates, request)
        return [[candidate_replicas[i] for i in group] for group in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        try:
            self._routing_loop = asyncio.get_running_loop()  # where first tokens are applied
        except RuntimeError:
            pass
        rid = pending_request.metadata.internal_request_id
        request = self._requests.pop(rid, None)
        call = _routed_call(pending_request)
        uid = replica_id.unique_id
        load = self._loads.get(uid)
        if request is None or load is None:
            if call is not None:
                # One of our calls without a choice on record, or on a replica the adapter
                # does not know: its load cannot be accounted. Counted, so it shows.
                self._unaccounted += 1
            return
        if self._completed_early.pop(rid, None) == uid:
            # Ray runs a request's completion callback from another thread: a short request
            # can finish on this loop before its acceptance does. It loads nothing now.
            load.routed += 1
            self.router.on_request_routed(request, uid)
            self.router.on_request_completed(request, uid)
            return
        prompt, block = request.num_prompt_tokens, self.hasher.block_size
        tokens = prompt + request.num_output_tokens
        cached = 0
        if self.index is not None and uid in self.index:
            cached = min(self.index.longest_prefix(request.hashes).get(uid, 0) * block, prompt)
        request_id = getattr(call, "request_id", None)
        flight = _InFlight(uid, tokens, prompt - cached, request.hashes.digests(), request,
                           request_id if isinstance(request_id, str) else None)
        old = self._in_flight.pop(rid, None)  # a retried request routed again
        if old is not None:
            self._unload(old)
        self._in_flight[rid] = flight
        if flight.request_id is not None:
            self._request_ids[flight.request_id] = rid
        load.tokens += flight.tokens
        load.requests += 1
        load.prefill_tokens += flight.prefill_tokens
        load.routed += 1
        if flight.digests:
            self.active.store(uid, flight.digests)
        self.router.on_request_routed(request, uid)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        flight = self._in_flight.get(internal_request_id)
        uid = replica_id.unique_id
        # A call sent again (its replica died) keeps its id: only its own replica's completion counts.
        if flight is not None and flight.replica == uid:
            self._requests.pop(internal_request_id, None)
            del self._in_flight[internal_request_id]
            if flight.request_id is not None:
                self._request_ids.pop(flight.request_id, None)
            self._unload(flight)
            self.router.on_request_completed(flight.request, flight.replica)
        elif flight is None and internal_request_id in self._requests:
            # Chosen for and finished, not yet reported routed (see on_request_routed): its
            # routing, when it is reported, loads nothing. Bounded like the choices.
            _put_bounded(self._completed_early, internal_request_id, uid)

    def first_token(self, request_id: str) -> None:
        """The ingress saw request `request_id`'s first token (callable from any thread;
        applied on the event loop Ray routes on, where every other hook runs)."""
        loop = self._routing_loop
        if loop is None:
            return  # nothing was routed yet: the request is not ours
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is loop:
            self._first_token(request_id)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._first_token, request_id)

    def _first_token(self, request_id: str) -> None:
        flight = self._in_flight.get(self._request_ids.pop(request_id, ""))
        if flight is None:  # completed already, or reported before (one first token per request)
            return
        load = self._loads.get(flight.replica)
        if load is not None:
            load.prefill_tokens -= flight.prefill_tokens
            load.first_tokens += 1
        flight.prefill_tokens = 0
        self.router.on_first_token(flight.request, flight.replica)

    def _unload(self, flight: _InFlight) -> None:
        load = self._loads.get(flight.replica)
        if load is not None:
            load.tokens -= flight.tokens
            load.requests -= 1
            load.prefill_tokens -= flight.prefill_tokens
            if flight.digests and flight.replica in self.active:
                self.active.remove(flight.replica, flight.digests)

    def _routing_request(self, pending: PendingRequest, call: RoutedCall) -> RoutingRequest:
        rid = pending.metadata.internal_request_id
        self._completed_early.pop(rid, None)  # a new choice is a new attempt: an earlier one's end is not its
        request = self._requests.get(rid)
        if request is None:  # chosen for once; Ray may ask again (a full replica, backoff)
            request = RoutingRequest(rid, list(call.prompt_token_ids), namespace=call.namespace,
                                     num_output_tokens=call.max_tokens or 0, hasher=self.hasher)
            _put_bounded(self._requests, rid, request)  # requests cancelled before routing leave entries
        return request

    def _candidates(self, uids: list[str]) -> Candidates:
        candidates = Candidates(uids)
        block = self.hasher.block_size
        for i, uid in enumerate(uids):
            load = self._loads.get(uid)
            if load is not None:
                candidates.running_tokens[i] = load.tokens
                candidates.num_requests[i] = load.requests
                candidates.prefill_tokens[i] = load.prefill_tokens
                candidates.active_blocks[i] = self.active.blocks(uid)
                candidates.kv_blocks[i] = -(-load.tokens // block)
        return candidates

    # -- what the ingress reports ----------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What the adapter sees, as plain data: per replica its load, requests routed,
        BLOCKS in the index and its stream's counters; the replicas that left."""
        streams = self.feed.stats() if self.feed is not None else {}
        replicas = {}
        for uid, load in self._loads.items():
            row: dict[str, Any] = {"in_flight": load.requests, "load_tokens": load.tokens, "routed": load.routed,
                                   "prefill_tokens": load.prefill_tokens, "first_tokens": load.first_tokens,
                                   "active_blocks": self.active.blocks(uid)}
            if self.index is not None and uid in self.index:
                row["blocks"] = self.index.blocks(uid)
            if uid in streams:
                row["stream"] = asdict(streams[uid])
            replicas[uid] = row
        out: dict[str, Any] = {"router": self.spec.router, "options": self.spec.option_values(),
                               "deployment": self._deployment_id.name, "replicas": replicas,
                               "departed": list(self._departed), "unaccounted": self._unaccounted}
        if self.index is not None:
            out["index"] = {"num_hashes": self.index.num_hashes, "num_pairs": self.index.num_pairs,
                            "counters": self.index.counters}
        return out

    async def state_from_any_loop(self) -> dict[str, Any]:
        """`state()`, computed on the router's own event loop (where Ray calls its hooks)."""
        async def snapshot() -> dict[str, Any]:
            return self.state()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(snapshot(), self._event_loop))


_MAX_UNROUTED = 10_000


def _put_bounded(table: dict[str, Any], key: str, value: Any) -> None:
    """table[key] = value, dropping the oldest entry first once it holds _MAX_UNROUTED."""
    if len(table) >= _MAX_UNROUTED:
        table.pop(next(iter(table)))
    table[key] = value


def _routed_call(pending: PendingRequest | None) -> RoutedCall | None:
    if pending is None:
        return None
    for arg in pending.args:
        if hasattr(arg, "prompt_token_ids"):
            return arg
    return None
