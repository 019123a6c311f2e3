"""The built-in routers, one module each; importing this package registers them all.

    round_robin      each request to the next replica in turn (the baseline)
    power_of_two     the less loaded of two random replicas (Ray Serve's default)
    approx_tree      SGLang's cache-aware router: a predicted cache per replica from the
                     requests it routed, balance thresholds, LRU trimming
    prefix_affinity  Ray Serve LLM's PrefixCacheAffinityRouter: imbalance threshold,
                     the 10% match-rate rule, else the replica with the least cached
    kv_events        NVIDIA Dynamo's KV router: overlap from the event-fed KV index,
                     cost = weight x prefill blocks + decode blocks, softmax temperature
"""

from prefixcache.cluster.routers.approx_tree import ApproxTreeRouter
from prefixcache.cluster.routers.kv_events import KVEventsRouter
from prefixcache.cluster.routers.power_of_two import PowerOfTwoRouter
from prefixcache.cluster.routers.prefix_affinity import PrefixAffinityRouter
from prefixcache.cluster.routers.round_robin import RoundRobinRouter

__all__ = ["RoundRobinRouter", "PowerOfTwoRouter", "ApproxTreeRouter", "PrefixAffinityRouter", "KVEventsRouter"]
