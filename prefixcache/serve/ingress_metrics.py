"""Prometheus metrics of the cluster's ingress: what `prefixcache cluster serve` served,
as its clients saw it, under vLLM 0.33's names.

Owns `IngressMetrics`: a registry of its own, fed by the ingress's `RoutedEngine` as
each request is submitted, streams and ends, and rendered by the ingress's `GET
/metrics`. Every series carries vLLM's labels `model_name` and `engine` ("ingress", so a
dashboard never mixes it with a replica's "0"); ours add `router`.

- `vllm:request_success` (`finished_reason`), `vllm:prompt_tokens`,
  `vllm:generation_tokens`, counters, of finished requests;
- `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (TOKENS), counters: the prompt
  tokens and the cached tokens (`usage.prompt_tokens_details.cached_tokens`) of finished
  requests, whatever replica served them: the cluster's hit ratio is hits / queries;
- `vllm:num_requests_running`, gauge: requests in flight through the ingress;
- `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds`, histograms (vLLM 0.33's buckets) from the HTTP
  arrival at the ingress, routing and Ray's hops included;
- `prefixcache:cluster_resubmitted`, `prefixcache:cluster_failed`, counters: requests sent
  again after their replica failed before streaming, and requests that ended in a 503.

Each replica's own metrics (its cache's stats, its queue) stay in its process; this is
the cluster's front door, not their sum.

Must never: register into the global registry, or block (it runs on the ingress's loop).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from prefixcache.engine.engine import RequestOutput
from prefixcache.serve.metrics import FINISH_REASONS, ITL_BUCKETS, LATENCY_BUCKETS, TTFT_BUCKETS

__all__ = ["IngressMetrics"]


class IngressMetrics:
    """The ingress's metrics (see the module docstring). Times in SECONDS on
    `time.perf_counter`, the clock `GenerationRequest.arrival_s` is on."""

    def __init__(self, *, model_name: str, router: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, base = self.registry, ["model_name", "engine"]
        b, o = (model_name, "ingress"), (model_name, "ingress", router)
        ours = base + ["router"]
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", base,
            registry=r).labels(*b)
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", base,
            registry=r).labels(*b)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", base,
                                     registry=r).labels(*b)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", base,
                                         registry=r).labels(*b)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          base + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(*b, reason) for reason in FINISH_REASONS}
        self.running = Gauge("vllm:num_requests_running", "Number of requests in flight through the ingress.", base,
                             registry=r).labels(*b)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", base,
                              buckets=TTFT_BUCKETS, registry=r).labels(*b)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", base,
                             buckets=ITL_BUCKETS, registry=r).labels(*b)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", base,
                             buckets=LATENCY_BUCKETS, registry=r).labels(*b)
        self.resubmitted = Counter("prefixcache:cluster_resubmitted",
                                   "Requests sent again after their replica failed before streaming.", ours,
                                   registry=r).labels(*o)
        self.failed = Counter("prefixcache:cluster_failed", "Requests that ended in a 503 for their replica's failure.",
                              ours, registry=r).labels(*o)
        self._last: dict[str, float] = {}  # request id -> its last token's time (or its arrival)
        self._arrival: dict[str, float] = {}
        self._lock = threading.Lock()

    def on_submit(self, request_id: str, arrival_s: float | None) -> None:
        now = time.perf_counter()
        with self._lock:
            self._arrival[request_id] = now if arrival_s is None else arrival_s
            self.running.inc()

    def on_tokens(self, request_id: str) -> None:
        """A streamed item with tokens (the first: TTFT; each later one: an ITL sample)."""
        now = time.perf_counter()
        with self._lock:
            if request_id not in self._arrival:
                return
            last = self._last.get(request_id)
            if last is None:
                self.ttft.observe(now - self._arrival[request_id])
            else:
                self.itl.observe(now - last)
            self._last[request_id] = now

    def on_finished(self, request_id: str, output: RequestOutput) -> None:
        now = time.perf_counter()
        m = output.metrics
        with self._lock:
            arrival = self._arrival.pop(request_id, None)
            if arrival is None:
                return
            if self._last.pop(request_id, None) is None:
                self.ttft.observe(now - arrival)  # its only tokens came with the end
            self.running.dec()
            self.e2e.observe(now - arrival)
            self.prompt_tokens.inc(m.prompt_tokens)
            self.generation_tokens.inc(len(output.token_ids))
            self.prefix_cache_queries.inc(m.prompt_tokens)
            self.prefix_cache_hits.inc(m.cached_tokens)
            self.request_success.get(output.finish_reason, self.request_success["stop"]).inc()

    def on_ended(self, request_id: str, *, failed: bool) -> None:
        """The request ended without finishing: its client went away, or it failed."""
        with self._lock:
            if self._arrival.pop(request_id, None) is not None:
                self.running.dec()
            self._last.pop(request_id, None)
            if failed:
                self.failed.inc()

    def on_resubmitted(self) -> None:
        self.resubmitted.inc()

    def render(self) -> bytes:
        with self._lock:
            return generate_latest(self.registry)
