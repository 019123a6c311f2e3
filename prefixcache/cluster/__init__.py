"""prefixcache.cluster: prefix-cache-aware routing across replicas.

Layer: above the experiment layer (it replays `prefixcache.workloads` through real
`PrefixCache` replicas), below the CLI. It owns

    kv_index        KVIndex: block hash -> replicas holding it, fed by KV events
    prompt_hashes   a request's chained block hashes under the replicas' hash config
    router          the Router interface (Ray Serve's RequestRouter shape) and its inputs
    registry        routers by name, entry point or "module:Class"; a router spec resolved
    routers/        the built-in routers: round_robin, power_of_two, approx_tree,
                    prefix_affinity, kv_events, weighted_scorers, estimated_ttft
    routed_prefixes a router-side predicted cache (the approximate trees)
    replica         one simulated engine: vLLM's scheduler over a real cache, timed by
                    prefixcache.service_model (shared with the engine's `engine.pace`)
    results         what a run measured: hits, TTFT, queueing, TPOT, goodput, load
    config          the cluster experiment file (cluster.yaml)
    simulate        the cluster A/B by arrival time
    sweep           the A/B over arrival rate, fleet size, slots and capacity
    report          its tables and plots

Must never: import the CLI or the serving layer; talk to replicas except through what a
replica exposes (its KV events, its load), and in simulation through the protocol.
"""

from __future__ import annotations

from prefixcache.cluster.kv_index import KVIndex, ReplicaId, block_hash_int
from prefixcache.cluster.prompt_hashes import PromptHasher, PromptHashes
from prefixcache.cluster.registry import (
    ResolvedRouter,
    available_routers,
    register_router,
    resolve_router,
    resolve_router_spec,
)
from prefixcache.cluster.router import (
    Candidates,
    Ranked,
    ReplicaLoad,
    Router,
    RouterContext,
    RoutingRequest,
    pick_replica,
)

__all__ = [
    "KVIndex",
    "ReplicaId",
    "block_hash_int",
    "PromptHasher",
    "PromptHashes",
    "Router",
    "RouterContext",
    "RoutingRequest",
    "ReplicaLoad",
    "Candidates",
    "Ranked",
    "pick_replica",
    "register_router",
    "resolve_router",
    "resolve_router_spec",
    "ResolvedRouter",
    "available_routers",
]
