"""The built-in routers, one module each; importing this package registers them all.

    round_robin      each request to the next replica in turn (the baseline)
    power_of_two     the less loaded of two random replicas (Ray Serve's default)
    approx_tree      SGLang's cache-aware router: a predicted cache per replica from the
                     requests it routed, balance thresholds, LRU trimming
    prefix_affinity  Ray Serve LLM's PrefixCacheAffinityRouter: imbalance threshold,
                     the 10% match-rate rule, else the replica with the least cached
    kv_events        NVIDIA Dynamo's KV router: overlap from the event-fed KV index,
                     cost = weight x prefill blocks + decode blocks, softmax temperature
    weighted_scorers llm-d's precise prefix + KV utilization + queue scorers (2 / 1 / 1)
    estimated_ttft   the precise router: the lowest estimated TTFT from the event-fed
                     index, the load columns and the service model, plus a charge for
                     the prefill work a request adds
"""

from prefixcache.cluster.routers.approx_tree import ApproxTreeRouter
from prefixcache.cluster.routers.estimated_ttft import EstimatedTTFTRouter
from prefixcache.cluster.routers.kv_events import KVEventsRouter
from prefixcache.cluster.routers.power_of_two import PowerOfTwoRouter
from prefixcache.cluster.routers.prefix_affinity import PrefixAffinityRouter
from prefixcache.cluster.routers.round_robin import RoundRobinRouter
from prefixcache.cluster.routers.weighted_scorers import WeightedScorersRouter

__all__ = ["RoundRobinRouter", "PowerOfTwoRouter", "ApproxTreeRouter", "PrefixAffinityRouter", "KVEventsRouter",
           "WeightedScorersRouter", "EstimatedTTFTRouter"]
