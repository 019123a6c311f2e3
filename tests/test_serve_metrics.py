"""`GET /metrics`: the Prometheus text format, vLLM's names, numbers that agree with stats()."""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")

from prefixcache.engine.loader import load_model  # noqa: E402
from serve_cases import idle, in_engine, running  # noqa: E402

LABELS = {"model_name": "tiny", "engine": "0"}


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: (name, labels) -> value."""
    response = httpx.get(base_url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(response.text) for s in family.samples}


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({**LABELS, **labels}.items())))]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_counters_agree_with_the_caches_stats_across_a_reset(tiny, backend):
    with running(tiny, backend, num_blocks=40) as replica, httpx.Client(base_url=replica.base_url, timeout=30) as http:
        head = list(range(10, 50))
        usage = []
        for i in range(6):  # shared heads through a 40-block pool: hits and evictions
            body = {"prompt": head + list(range(100 + 24 * i, 124 + 24 * i)), "max_tokens": 4, "ignore_eos": True}
            usage.append(http.post("/v1/completions", json=body).json()["usage"])
        idle(replica)
        stats = in_engine(replica, lambda e: e.cache.stats())
        m = scrape(replica.base_url)
        assert value(m, "vllm:prefix_cache_queries_total") == stats.queries > 0
        assert value(m, "vllm:prefix_cache_hits_total") == stats.hits == sum(
            u["prompt_tokens_details"]["cached_tokens"] for u in usage) > 0
        assert value(m, "prefixcache:evictions_total", backend=backend) == stats.evictions > 0
        assert value(m, "prefixcache:cache_rejections_total", backend=backend) == stats.rejected
        assert value(m, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
        assert value(m, "vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usage) == 24
        assert value(m, "vllm:request_success_total", finished_reason="length") == 6
        for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
            assert value(m, hist + "_count") == 6 and value(m, hist + "_bucket", le="+Inf") == 6
        assert value(m, "vllm:inter_token_latency_seconds_count") == 6 * 3
        assert value(m, "vllm:num_requests_running") == 0 == value(m, "vllm:num_requests_waiting")
        assert value(m, "vllm:kv_cache_usage_perc") == 0.0
        assert value(m, "prefixcache:backend_info", backend=backend, block_size="4", num_blocks="40") == 1

        assert http.post("/reset_prefix_cache").json() == {"success": True}
        http.post("/v1/completions", json={"prompt": head + [99], "max_tokens": 2})
        idle(replica)
        after = in_engine(replica, lambda e: e.cache.stats())
        m2 = scrape(replica.base_url)
        assert after.queries == len(head) + 1  # the cache counts from zero after a reset ...
        assert value(m2, "vllm:prefix_cache_queries_total") == stats.queries + after.queries  # ... a counter never does
        assert value(m2, "vllm:prefix_cache_hits_total") == stats.hits + after.hits


def test_gauges_show_requests_in_flight(tiny):
    """While requests run, the gauges read at scrape time say so."""
    with running(tiny, "hash", num_blocks=64, max_num_seqs=1) as replica, \
            httpx.Client(base_url=replica.base_url, timeout=30) as http:
        body = {"prompt": list(range(30)), "max_tokens": 200, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as first, \
                http.stream("POST", "/v1/completions", json={**body, "prompt": list(range(100, 120))}) as second:
            lines = first.iter_lines()  # held: a dropped iterator closes its connection (an abort)
            next(lines)
            m = scrape(replica.base_url)
            assert value(m, "vllm:num_requests_running") == 1 and value(m, "vllm:num_requests_waiting") == 1
            assert 0 < value(m, "vllm:kv_cache_usage_perc") <= 1
        idle(replica)
        assert value(scrape(replica.base_url), "vllm:request_success_total", finished_reason="abort") == 2


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_a_lower_tier_has_its_counters_and_they_agree_with_stats(tiny, backend):
    cpu = {"medium": "CPU", "num_blocks": 64}
    with running(tiny, backend, num_blocks=24, cache={"tiers": [cpu]}) as replica, \
            httpx.Client(base_url=replica.base_url, timeout=30) as http:
        first = list(range(10, 50))
        for prompt in (first, list(range(100, 140)), list(range(200, 240)), first):  # first: demoted, loaded back
            http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        idle(replica)
        tier = in_engine(replica, lambda e: e.cache.stats()).tiers[0]
        m = scrape(replica.base_url)
        labels = {"backend": backend, "tier": "0", "medium": "CPU"}
        assert tier.loads > 0 and tier.stores > 0
        for field in ("hit_tokens", "loaded_tokens", "loads", "stores", "evictions", "refused", "errors", "filtered",
                      "bytes_written"):
            assert value(m, f"prefixcache:tier_{field}_total", **labels) == getattr(tier, field), field
        assert value(m, "prefixcache:tier_used_blocks", **labels) == tier.used_blocks > 0
