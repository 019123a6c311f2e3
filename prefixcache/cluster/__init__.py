"""prefixcache.cluster: prefix-cache-aware routing across replicas.

Layer: above the experiment layer, below the CLI. It owns

    kv_index        KVIndex: block hash -> replicas holding it, fed by KV events
    prompt_hashes   a request's chained block hashes under the replicas' hash config

Must never: import the CLI or the serving layer; talk to replicas except through what a
replica exposes (its KV events, its load), and in simulation through the protocol.
"""

from __future__ import annotations

from prefixcache.cluster.kv_index import KVIndex, ReplicaId, block_hash_int
from prefixcache.cluster.prompt_hashes import PromptHasher, PromptHashes

__all__ = ["KVIndex", "ReplicaId", "block_hash_int", "PromptHasher", "PromptHashes"]
