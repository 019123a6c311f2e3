"""`estimated_ttft`: the precise router. Each request goes to the replica where its first
token is estimated to come soonest, charged for the delay its prefill adds for others
there: the KV index (fed by the replicas' own events) says what each replica holds, the
load columns what each is busy with, and the replicas' service model what that costs.

For a prompt of P TOKENS and a candidate w holding o_w of its leading blocks (block size
B), the hit is h_w = min(o_w B, floor((P - 1) / B) B) and n_w = P - h_w tokens are left
to prefill, from position h_w. The replica has `prefill_tokens_w` prompt tokens of other
requests ahead of it (the requests routed there whose first token is not out: Dynamo's
prefill load), and b_w = `num_requests_w` - `queued_requests_w` requests running, each
taking one token of every step. With the service model's rates (`ServiceModel.token_s`,
`pair_s`, `weights_s`, `overhead_s`, `max_num_batched_tokens`), X = prefill_tokens_w
+ n_w, steps = X / (budget - b_w):

    ttft_w = steps x overhead + max(token_s (X + b_w steps) + pair_s (n_w h_w + n_w (n_w + 1) / 2),
                                    steps x weights_s)
    own_w  = token_s n_w + pair_s (n_w h_w + n_w (n_w + 1) / 2)
    cost_w = ttft_w + load_weight x own_w + decode_weight x b_w x min(own_w, decode_cap_s)

the lowest cost wins (ties at random). `ttft_w` is `ServiceModel.prefill_s` of the
replica's prefill queue and this prompt; `own_w` is its own prefill, which delays
everyone queued behind it by as much (`load_weight`: a miss weighs more than the delay it
suffers itself) and lengthens the steps of each request decoding there by as much in all
(`decode_weight`: a long miss weighs most where many decode, whose inter-token latency it
would break). All are SECONDS, so the cost compares a cache hit with a queue in the units
a user feels, where Dynamo's cost trades blocks of cache against blocks of load one for
one. load_weight 0 and decode_weight 0: the greedy lowest-estimated-TTFT choice.
`decode_cap_s` (none by default) bounds the seconds of its own prefill the decode charge
counts, so the longest prompts go where their first token comes soonest. `stick_s` (0 by
default) keeps a request with the replicas holding the longest run of its prompt its cache
can use, the cheapest of them, while that costs at most `stick_s` SECONDS more than the
cheapest replica (SGLang's cache-aware rule, the imbalance in seconds): a move is a miss
now and a prefix cached twice, which one request's cost does not see. `stick_ttft_s`
(none by default) keeps it there only while its estimated TTFT there (`ttft_w`, or with a
lower-tier run the TTFT with the load) is at most that many SECONDS: affinity that never
makes a request wait past what its first token can afford, where a long prompt's wait
would land it in the TTFT tail. Both move the choice, not the costs.

The defaults (1.0, 0.1) are measured, not derived: on the Mooncake conversation trace
(docs/cluster.md) the decode charge buys goodput at the knee (fewer requests over the
inter-token objective) for a few percent of TTFT p99 (the long prompts it moves wait a
little longer); `decode_weight: 0` keeps the p99.

In flight. With `in_flight` on, o_w is the larger of what the index shows on w and what
the requests routed to w and not finished hold (`RouterContext.active`, the active
sequences the cluster keeps): a prompt routed a moment ago is being prefilled there, and
its blocks will be cached before this request's turn comes, but its `BlockStored` has not
arrived yet (on a real cluster, a step and a message later). The prefill queue is read
the same way: the cluster counts each queued request's prompt less what the INDEX showed
when it was routed (Dynamo's estimate), so a request this router sent after an in-flight
prefix counts whole there; the router remembers the TOKENS it credited to each such
request and takes them off that replica's `prefill_tokens` until the request's first
token (or its end). Without both, a burst of one prefix looks like a queue of misses on
the replica computing it, and the router scatters the burst. On by default; off: the
index alone, as Dynamo's and llm-d's precise routers read it. Where the cluster keeps no
active sequences the option changes nothing.

Lower tiers. Where the replicas keep lower tiers (`cache.tiers`: the index keeps their
residency, `KVIndex(lower_media=...)`), a replica may hold a longer run of the prompt's
blocks on the device and on CPU or STORAGE together (`tiered_prefix`): its cache would
load those and compute the rest. The cost is then also taken with that run as the hit,
plus the load (`ServiceModel.load_s` of each medium's blocks, at the medium's bandwidth
where it is slower than the host link, and its latency once), which delays this request,
those queued behind it and every request decoding there as its prefill would
(x (1 + load_weight + decode_weight x b_w); `decode_cap_s` bounds the prefill's decode
charge, not the load's); each replica costs the lower of the two, as its cache loads only
what pays, and `stick_s` reads that run as what the replica holds. Bandwidth and latency per medium: the options, else the
`cache.tiers` defaults (CPU 25 GB/s and 10 us, STORAGE 2 GB/s and 100 us).

Computed natively over the load columns (csrc/ttft_cost.h), like `kv_events` (with lower
tiers the second cost is a second native call, and the choice is made in Python). Where
the cluster passes no service model (`RouterContext.service` None), the defaults
(`ServiceModel()`: an 8B model on one H100) set the rates: only their ratios matter to
the choice.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable
from dataclasses import dataclass

from prefixcache._C import estimated_ttft_choice, estimated_ttft_costs, estimated_ttft_lowest
from prefixcache.cluster.registry import register_router
from prefixcache.cluster.router import Candidates, Ranked, ReplicaId, Router, RouterContext, RoutingRequest
from prefixcache.service_model import ServiceModel
from prefixcache.config import ConfigError
from prefixcache.tier_config import DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US, EVENT_MEDIUM

__all__ = ["EstimatedTTFTRouter", "EstimatedTTFTOptions"]

_MEDIUM_DEFAULT = {EVENT_MEDIUM[m]: (DEFAULT_BANDWIDTH_GBPS[m], DEFAULT_LATENCY_US[m]) for m in EVENT_MEDIUM}
"""Per event medium: the `cache.tiers` defaults, (GB/s, microseconds)."""

_MAX_CHOSEN = 4096
"""Requests chosen for and not yet routed that the router remembers (a cluster may choose
for a request and never route it: a cancelled call)."""


@dataclass(frozen=True)
class EstimatedTTFTOptions:
    """load_weight: the charge for the delay a request's prefill adds for those queued behind it
    decode_weight: the charge for the delay it adds for each request decoding there
    (both 0: the greedy lowest-estimated-TTFT choice)
    decode_cap_s: the most of its own prefill SECONDS the decode charge counts (None: all)
    stick_s: SECONDS of cost a request may give up to stay with the replica holding its
    longest cached run (0: always the lowest cost)
    stick_ttft_s: the most estimated TTFT, SECONDS, a request staying there may have
    (None: no bound)
    in_flight: also count as cached the prompt blocks of requests in flight on a replica,
    which its events have not reported yet (module docstring)
    tier_bandwidth_gbps / tier_latency_us: per event medium (CPU, STORAGE), what loading a
    lower-tier block costs; unset ones take the `cache.tiers` defaults"""

    load_weight: float = 1.0
    decode_weight: float = 0.1
    decode_cap_s: float | None = None
    stick_s: float = 0.0
    stick_ttft_s: float | None = None
    in_flight: bool = True
    tier_bandwidth_gbps: dict[str, float] | None = None
    tier_latency_us: dict[str, float] | None = None

    def __post_init__(self) -> None:
        nullable = ("decode_cap_s", "stick_ttft_s")
        for name in ("load_weight", "decode_weight", *nullable, "stick_s"):
            value = getattr(self, name)
            if name in nullable and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(name, f"must be a finite number >= 0{' or null' if name in nullable else ''}, "
                                        f"got {value!r}")  # fmt: skip
        if not isinstance(self.in_flight, bool):
            raise ConfigError("in_flight", f"must be true or false, got {self.in_flight!r}")
        for name, low in (("tier_bandwidth_gbps", 0.0), ("tier_latency_us", -1.0)):
            for medium, value in (getattr(self, name) or {}).items():
                if medium not in EVENT_MEDIUM.values():
                    raise ConfigError(f"{name}.{medium}", f"allowed values: {', '.join(EVENT_MEDIUM.values())}")
                if not isinstance(value, (int, float)) or not low < value < float("inf"):
                    raise ConfigError(f"{name}.{medium}", f"must be a finite number {'> 0' if low == 0 else '>= 0'}, "
                                                          f"got {value!r}")  # fmt: skip


@register_router("estimated_ttft")
class EstimatedTTFTRouter(Router):
    """The lowest estimated TTFT plus the charge for the work it adds (module docstring)."""

    Options = EstimatedTTFTOptions
    needs_index = True

    def __init__(self, context: RouterContext, options: EstimatedTTFTOptions | None = None) -> None:
        super().__init__(context, options)
        self.index = context.index
        service = self._service = context.service if context.service is not None else ServiceModel()
        o = self.options
        cap = float("inf") if o.decode_cap_s is None else o.decode_cap_s
        self._model = (service.token_s, service.pair_s, service.weights_s, service.overhead_s,
                       service.max_num_batched_tokens, o.load_weight, o.decode_weight, cap)  # fmt: skip
        self._stick_ttft_s = float("inf") if o.stick_ttft_s is None else o.stick_ttft_s
        self._media = tuple(self.index.lower_media) if self.index is not None else ()
        self._media_gbps = [(o.tier_bandwidth_gbps or {}).get(m, _MEDIUM_DEFAULT[m][0]) for m in self._media]
        self._media_latency_s = [(o.tier_latency_us or {}).get(m, _MEDIUM_DEFAULT[m][1]) * 1e-6 for m in self._media]
        self._in_flight = self.options.in_flight and context.active is not None
        # in_flight: per request chosen for, the BLOCKS of its prompt the index and the active
        # sequences showed on each replica; per request routed, the TOKENS credited (its
        # replica's prefill_tokens count them, this router does not), and their sum per replica.
        self._chosen: dict[Hashable, tuple[dict[ReplicaId, int], dict[ReplicaId, int]]] = {}
        self._credit: dict[Hashable, tuple[ReplicaId, int]] = {}
        self._credited: dict[ReplicaId, int] = {}

    def costs(self, candidates: Candidates, request: RoutingRequest) -> list[float]:
        """Each candidate's cost in SECONDS, in candidate order (the module docstring)."""
        return self._tiered(self._arguments(candidates, request)[0], candidates, request)[0]

    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        arguments, seen = self._arguments(candidates, request)
        if seen is not None:  # kept for on_request_routed, which credits what the index missed
            if len(self._chosen) >= _MAX_CHOSEN:
                self._chosen.pop(next(iter(self._chosen)))
            self._chosen[request.request_id] = seen
        stick, within = self.options.stick_s, self._stick_ttft_s
        if self._media and len(request.hashes):
            costs, runs, ttfts = self._tiered(arguments, candidates, request)
            chosen = estimated_ttft_choice(costs, runs, request.num_prompt_tokens, self.context.block_size, stick,
                                           ttfts, within)
        else:
            chosen = estimated_ttft_lowest(*arguments, stick, within)
        return [[chosen[0] if len(chosen) == 1 else self.context.rng.choice(chosen)]]

    def _tiered(self, arguments: tuple, candidates: Candidates,
                request: RoutingRequest) -> tuple[list[float], dict, list[float]]:
        """The costs of the native call's `arguments` (the device's hits), each lowered to
        the cost with the replica's run on every medium as its hit plus the loads, where
        that is lower (module docstring); each candidate's BLOCKS of the prompt on its
        device and lower tiers together; and the estimated TTFT each cost stands for."""
        costs, ttfts = estimated_ttft_costs(*arguments, with_ttft=True)
        if not self._media or not len(request.hashes):
            return costs, dict(arguments[3] or {}), ttfts
        bs, device = self.context.block_size, arguments[3] or {}
        runs, loads = dict(device), {}
        for i, counts in candidates.by_position(self.index.tiered_prefix(request.hashes)).items():
            run = sum(counts)
            if run <= device.get(i, 0):
                continue
            runs[i] = run
            loads[i] = sum(self._service.load_s(n * bs, gbps, latency)
                           for n, gbps, latency in zip(counts[1:], self._media_gbps, self._media_latency_s) if n)  # fmt: skip
        if not loads:
            return costs, runs, ttfts
        with_loads, loaded_ttfts = estimated_ttft_costs(*arguments[:3], runs, *arguments[4:], with_ttft=True)
        o = self.options
        for i, load in loads.items():
            running = candidates.num_requests[i] - candidates.queued_requests[i]
            loaded = with_loads[i] + load * (1 + o.load_weight + o.decode_weight * running)
            if loaded < costs[i]:
                costs[i], ttfts[i] = loaded, loaded_ttfts[i] + load
        return costs, runs, ttfts

    def on_request_routed(self, request: RoutingRequest, replica: ReplicaId) -> None:
        chosen = self._chosen.pop(request.request_id, None)
        if chosen is None:
            return
        indexed, active = chosen
        prompt, block = request.num_prompt_tokens, self.context.block_size
        seen = indexed.get(replica, 0)
        credit = max(prompt - seen * block, 0) - max(prompt - max(seen, active.get(replica, 0)) * block, 0)
        self._uncredit(request)  # routed again (a retry): its old credit goes, whatever the new one
        if credit > 0:
            self._credit[request.request_id] = (replica, credit)
            self._credited[replica] = self._credited.get(replica, 0) + credit

    def on_first_token(self, request: RoutingRequest, replica: ReplicaId) -> None:
        self._uncredit(request)

    def on_request_completed(self, request: RoutingRequest, replica: ReplicaId) -> None:
        self._uncredit(request)

    def on_replica_removed(self, replica: ReplicaId) -> None:
        self._credited.pop(replica, None)
        for rid in [rid for rid, (r, _) in self._credit.items() if r == replica]:
            del self._credit[rid]

    def _uncredit(self, request: RoutingRequest) -> None:
        credit = self._credit.pop(request.request_id, None)
        if credit is not None:
            replica, tokens = credit
            left = self._credited.get(replica, 0) - tokens
            if left > 0:
                self._credited[replica] = left
            else:
                self._credited.pop(replica, None)

    def _arguments(self, candidates: Candidates, request: RoutingRequest) -> tuple[tuple, tuple | None]:
        """The native cost's arguments: the load columns (prefill TOKENS less what this
        router credited), each candidate's cached BLOCKS of the prompt (by position), the
        prompt's TOKENS and the model; and with in_flight, the BLOCKS the index and the
        active sequences showed per replica (None without)."""
        hashes = request.hashes
        overlaps = seen = None
        prefill = candidates.prefill_tokens
        if len(hashes):
            indexed = self.index.longest_prefix(hashes)
            overlaps = candidates.by_position(indexed)
            if self._in_flight:
                active = self.context.active.longest_prefix(hashes)
                for i, blocks in candidates.by_position(active).items():
                    if blocks > overlaps.get(i, 0):
                        overlaps[i] = blocks
                seen = (indexed, active)
        if self._credited:
            prefill = array("q", prefill)
            for replica, tokens in self._credited.items():
                i = candidates.get_row(replica)
                if i is not None:
                    prefill[i] = max(prefill[i] - tokens, 0)
        return (prefill, candidates.num_requests, candidates.queued_requests, overlaps,
                request.num_prompt_tokens, self.context.block_size, *self._model), seen
