"""SGLang's own router (`sglang-router` 0.3.2, the `peers` extra) in front of two
`prefixcache serve` replicas, all on 127.0.0.1: what the router reads from a replica is
what SGLang 0.5.23's server answers (`prefixcache.serve.sglang_api`).

Checked through the router itself: it lists the served model by name (from
`/server_info`), reads each replica's load (`/get_load`: not -1), fans `/flush_cache` out
to both replicas (each cache then empty), and its `cache_aware` policy sends prompts that
share a prefix to one replica, where they hit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("sglang_router", reason="the `peers` extra (sglang-router==0.3.2) is not installed")
psutil = pytest.importorskip("psutil")

from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.serve.server import Replica  # noqa: E402
from serve_cases import idle, serve_config, wait_until  # noqa: E402

START_S = 90.0
NAME = "tiny-served"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def router(urls: list[str], policy: str):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy", policy,
           "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--log-level", "warn"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the router exited: {proc.stdout.read().decode(errors='replace')[-2000:]}")
            try:
                workers = httpx.get(f"{base}/workers", timeout=5).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                return False
            return len(workers) == len(urls) and all(w["is_healthy"] for w in workers)

        wait_until(ready, "the router to register both replicas", START_S)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def replicas():
    tiny = load_model("tiny")
    # Served under a name of their own: the router must list that one, not engine.model.
    pair = [Replica(serve_config(block_size=4, num_blocks=512), model=tiny, served_model_name=NAME) for _ in "ab"]
    try:
        for r in pair:
            r.start()
        yield pair
    finally:
        for r in pair:
            r.stop()


def served_requests(replica) -> int:
    """Requests the replica finished, from its own /metrics."""
    total = 0.0
    for line in httpx.get(replica.base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def complete(base: str, prompt, max_tokens: int = 2) -> dict:
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_the_router_lists_the_model_reads_loads_and_flushes_both(replicas):
    a, b = replicas
    with router([a.base_url, b.base_url], "power_of_two") as (base, proc):
        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [NAME]
        workers = httpx.get(f"{base}/workers", timeout=30).json()["workers"]
        assert {w["model_id"] for w in workers} == {NAME}
        complete(base, "hello from the router")

        # A long stream holds blocks on replica a: the router reads a's load (its KV tokens), b's 0 (not -1).
        def loads() -> dict[str, int]:
            return {w["worker"]: w["load"] for w in httpx.get(f"{base}/get_loads", timeout=30).json()["workers"]}

        assert loads() == {a.base_url: 0, b.base_url: 0}
        body = {"model": NAME, "prompt": "x" * 200, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{a.base_url}/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            busy = loads()
            assert busy[a.base_url] >= 200 and busy[b.base_url] == 0, busy
        idle(a)

        # Both caches hold a prefix; the router's flush reaches both: the prefix misses after it.
        prompt = "A system prompt that both replicas cache. " * 4
        for r in (a, b):
            complete(r.base_url, prompt)
            assert complete(r.base_url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        flushed = httpx.post(f"{base}/flush_cache", timeout=60).json()
        assert flushed["workers_flushed"] == 2 and flushed["status"] == "success", flushed
        for r in (a, b):
            assert complete(r.base_url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        listening = {c.laddr.ip for c in psutil.Process(proc.pid).net_connections("inet") if c.status == "LISTEN"}
        assert listening == {"127.0.0.1"}, listening


def test_cache_aware_routing_keeps_a_shared_prefix_on_one_replica(replicas):
    a, b = replicas
    with router([a.base_url, b.base_url], "cache_aware") as (base, _):
        before = {r.base_url: served_requests(r) for r in (a, b)}
        head = "You are a careful assistant; answer in one line. Context follows. " * 3
        hits = [complete(base, head + f"Question {i}: what is {i} + {i}?")["usage"]["prompt_tokens_details"]
                ["cached_tokens"] for i in range(6)]
        grown = {url: served_requests(r) - before[url] for url, r in ((a.base_url, a), (b.base_url, b))}
        assert sorted(grown.values()) == [0, 6], grown  # every request of the prefix on one replica
        assert hits[0] == 0 and all(h >= len(head) // 4 * 4 - 4 for h in hits[1:]), hits
