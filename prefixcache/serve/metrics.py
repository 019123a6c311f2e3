"""Prometheus metrics of a replica, under vLLM 0.33's names where vLLM has one.

Owns `ServingMetrics`: one `prometheus_client.CollectorRegistry` of its own (never the
process-global one), filled from inside the engine thread (it is the engine loop's
`StepObserver`) and rendered by `GET /metrics` in the Prometheus text format.

Every metric carries vLLM's labels `model_name` and `engine` ("0"); ours (prefix
`prefixcache:`) add `backend`. In the text format a counter `x` reads `x_total`, as
prometheus_client and vLLM write it.

- `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (TOKENS), counters: the
  cache's `stats().queries` / `.hits`, summed across resets.
- `vllm:prompt_tokens`, `vllm:generation_tokens`, counters: prompt tokens of requests
  that produced their first token; tokens sampled.
- `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (blocks held by running requests / pool blocks, 0..1), gauges, read at scrape time.
- `vllm:num_preemptions`, `vllm:request_success` (`finished_reason` label), counters.
- `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:request_time_per_output_token_seconds`, `vllm:e2e_request_latency_seconds`,
  histograms with vLLM 0.33's default buckets (arrival = when the HTTP request came in).
- `prefixcache:evictions` (BLOCKS), `prefixcache:cache_rejections`,
  `prefixcache:kv_events_dropped`, counters from `stats()`; `prefixcache:backend_info`
  (value 1, labels `backend`, `block_size`, `num_blocks`).
- `prefixcache:refusals` (label `reason`), counter: requests and connections the server
  refused to protect the others (`refused`, from the event loop): queue_full (503),
  body_too_large (413), body_timeout / header_timeout (408), connection_shed,
  connection_refused.
- `prefixcache:kv_event_batches_dropped` (label `reason`), counter: KV event batches
  the publisher could not deliver (`sync_publisher`, read at scrape time): hwm (a
  subscriber's queue was full), replay (asked for after the replay buffer let it go).
- With lower tiers (`cache.tiers`), per tier (labels `tier`, its index below the device,
  and `medium`, as its KV events name it: CPU, STORAGE), counters from `stats().tiers`:
  `prefixcache:tier_hit_tokens`, `prefixcache:tier_loaded_tokens` (TOKENS),
  `prefixcache:tier_loads`, `prefixcache:tier_stores`, `prefixcache:tier_evictions`,
  `prefixcache:tier_refused`, `prefixcache:tier_errors`, `prefixcache:tier_filtered`
  (BLOCKS), `prefixcache:tier_bytes_written` (BYTES); and the gauge
  `prefixcache:tier_used_blocks`.

Must never: call the engine or the cache from outside the engine thread (the scrape
handler asks the engine loop to run `sync_gauges`), or register into the global registry.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from prefixcache.engine.engine import Engine, StepOutput
from prefixcache.stats import CacheStats, TierStats

__all__ = ["ServingMetrics", "CONTENT_TYPE_LATEST", "TTFT_BUCKETS", "ITL_BUCKETS", "LATENCY_BUCKETS", "REFUSALS",
           "BATCH_DROPS", "FINISH_REASONS"]

# vLLM 0.33's default buckets (vllm/v1/metrics/buckets.py), SECONDS.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
# vLLM's FinishReason values we produce, each with a zero series from the start.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# Why the server refused a request or a connection (`prefixcache:refusals`).
REFUSALS = ("queue_full", "body_too_large", "body_timeout", "header_timeout", "connection_shed", "connection_refused")
# Why the publisher could not deliver a batch (`prefixcache:kv_event_batches_dropped`).
BATCH_DROPS = ("hwm", "replay")
# A lower tier's counters (`TierStats` fields) and their help, as `prefixcache:tier_<field>`.
TIER_COUNTERS = {
    "hit_tokens": "Prompt tokens admissions found in this tier (TOKENS).",
    "loaded_tokens": "Prompt tokens loaded from this tier to the device (TOKENS).",
    "loads": "Blocks loaded from this tier to the device (BLOCKS).",
    "stores": "Blocks written into this tier (BLOCKS).",
    "evictions": "Blocks this tier dropped or moved down to make room (BLOCKS).",
    "refused": "Stores this tier refused: no slot, or a failed write (BLOCKS).",
    "errors": "Blocks found bad when read from this tier (BLOCKS).",
    "filtered": "Blocks this tier's admission filter kept out (BLOCKS).",
    "bytes_written": "KV written into this tier (BYTES).",
}


@dataclass
class _Live:
    """One request's timing, in `time.perf_counter()` SECONDS."""

    arrival_s: float
    prompt_tokens: int
    first_s: float | None = None
    last_s: float | None = None
    tokens: int = 0


class ServingMetrics:
    """The replica's metrics (see the module docstring)."""

    def __init__(self, *, model_name: str, backend: str, block_size: int, num_blocks: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.num_blocks = num_blocks
        base = ["model_name", "engine"]
        ours = base + ["backend"]
        self._base = (model_name, "0")
        self._ours = (model_name, "0", backend)
        r = self.registry

        def counter(name: str, doc: str, labels: list[str] = base) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: list[str] = base) -> Gauge:
            return Gauge(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, base, buckets=buckets, registry=r)

        b = self._base
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.").labels(*b)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.").labels(*b)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*b)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(*b)
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(*b)
        success = counter("vllm:request_success", "Count of successfully processed requests.",
                          base + ["finished_reason"])
        self.request_success = {reason: success.labels(*b, reason) for reason in FINISH_REASONS}
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(*b)
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(*b)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(*b)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS).labels(*b)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS).labels(*b)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS).labels(*b)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LATENCY_BUCKETS).labels(*b)
        o = self._ours
        self.evictions = counter("prefixcache:evictions", "Cached blocks evicted to make room (BLOCKS).", ours).labels(*o)
        self.rejections = counter(
            "prefixcache:cache_rejections", "Admissions or appends the cache refused for lack of room.", ours).labels(*o)
        self.events_dropped = counter(
            "prefixcache:kv_events_dropped", "KV events the cache's bounded log dropped undrained.", ours).labels(*o)
        refusals = counter("prefixcache:refusals", "Requests or connections refused to protect the others.",
                           ours + ["reason"])
        self.refusals = {reason: refusals.labels(*o, reason) for reason in REFUSALS}
        drops = counter("prefixcache:kv_event_batches_dropped",
                        "KV event batches the publisher could not deliver to a subscriber.", ours + ["reason"])
        self.batch_drops = {reason: drops.labels(*o, reason) for reason in BATCH_DROPS}
        self._batch_drops_seen = dict.fromkeys(BATCH_DROPS, 0)
        tier_labels = ours + ["tier", "medium"]
        self._tier_counters = {field: counter(f"prefixcache:tier_{field}", doc, tier_labels)
                               for field, doc in TIER_COUNTERS.items()}
        self._tier_used = gauge("prefixcache:tier_used_blocks", "Blocks this tier holds now (BLOCKS).", tier_labels)
        Gauge("prefixcache:backend_info", "The caching strategy of this replica (value 1).",
              ours + ["block_size", "num_blocks"], registry=r).labels(*o, str(block_size), str(num_blocks)).set(1)
        self._live: dict[str, _Live] = {}
        self._seen = CacheStats()  # the cache's counters at the last sync: increments are the difference
        self._preemptions_seen = 0
        self._lock = threading.Lock()  # sync_cache runs in the engine thread; render in the server's

    # -- StepObserver (the engine thread) ---------------------------------------------------
    def on_add(self, request_id: str, arrival_s: float, prompt_tokens: int) -> None:
        self._live[request_id] = _Live(arrival_s, prompt_tokens)

    def on_abort(self, request_id: str) -> None:
        if self._live.pop(request_id, None) is not None:
            self.request_success["abort"].inc()

    def on_step(self, engine: Engine, out: StepOutput, now_s: float) -> None:
        for rid, _ in out.tokens:
            live = self._live.get(rid)
            if live is None:
                continue
            live.tokens += 1
            self.generation_tokens.inc()
            if live.first_s is None:
                live.first_s = now_s
                self.ttft.observe(now_s - live.arrival_s)
                self.prompt_tokens.inc(live.prompt_tokens)
            else:
                self.itl.observe(now_s - live.last_s)  # type: ignore[operator]
            live.last_s = now_s
        for output in out.finished:
            live = self._live.pop(output.request_id, None)
            if live is None:
                continue
            self.e2e.observe(now_s - live.arrival_s)
            if live.tokens > 1 and live.first_s is not None:
                self.tpot.observe((now_s - live.first_s) / (live.tokens - 1))
            self.request_success.get(output.finish_reason, self.request_success["stop"]).inc()
        self.sync_cache(engine)

    def sync_cache(self, engine: Engine) -> None:
        """Bring the cache-derived counters up to `engine.cache.stats()` (engine thread)."""
        stats = engine.cache.stats()
        with self._lock:
            seen = self._seen
            self.prefix_cache_queries.inc(stats.queries - seen.queries)
            self.prefix_cache_hits.inc(stats.hits - seen.hits)
            self.evictions.inc(stats.evictions - seen.evictions)
            self.rejections.inc(stats.rejected - seen.rejected)
            self.events_dropped.inc(stats.events_dropped - seen.events_dropped)
            for t, tier in enumerate(stats.tiers):
                before = seen.tiers[t] if t < len(seen.tiers) else TierStats(tier.medium)
                labels = (*self._ours, str(t), tier.medium)
                for field, family in self._tier_counters.items():
                    family.labels(*labels).inc(getattr(tier, field) - getattr(before, field))
                self._tier_used.labels(*labels).set(tier.used_blocks)
            self._seen = stats
            preemptions = engine.scheduler.num_preemptions
            self.num_preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions

    def reset_cache(self, engine: Engine) -> bool:
        """`engine.reset_prefix_cache()`, the counters kept whole across it (engine thread)."""
        self.sync_cache(engine)
        done = engine.reset_prefix_cache()
        if done:  # the cache's counters restarted from zero (events_dropped excepted): a new baseline
            with self._lock:
                self._seen = engine.cache.stats()
        return done

    def sync_gauges(self, engine: Engine) -> None:
        """Set the gauges from the engine's state now (engine thread; before a scrape)."""
        self.sync_cache(engine)
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        held = {b for seq in scheduler.running for b in engine.cache.block_table(seq.request_id)}
        self.kv_usage.set(len(held) / self.num_blocks)

    # -- the server (its event loop) -------------------------------------------------------------
    def refused(self, reason: str) -> None:
        """Count one refusal (`REFUSALS`)."""
        self.refusals[reason].inc()

    def sync_publisher(self, dropped: dict[str, int]) -> None:
        """Bring the batch-drop counters up to the publisher's totals by reason."""
        with self._lock:
            for reason, total in dropped.items():
                self.batch_drops[reason].inc(total - self._batch_drops_seen[reason])
                self._batch_drops_seen[reason] = total

    # -- the scrape (any thread) -----------------------------------------------------------------
    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        with self._lock:
            return generate_latest(self.registry)
