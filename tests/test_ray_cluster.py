"""`prefixcache cluster serve` for real: a local Ray cluster, two tiny replicas, the
`kv_events` router as Ray Serve's request router, the OpenAI client at the ingress.

One cluster for the module (Ray and two replicas take most of this file's time). The
tests read what the router sees through the ingress's `GET /cluster/state`: per replica
its requests routed, its blocks in the KV index and its event stream's counters.

Every replica is a `LossyEngineReplica`: its KV events reach the router through a
forwarder in the replica's process that drops the messages numbered `DROPPED`, so the
router's index is only right if its event feed heals those holes through the replica's
replay socket; every routing and cache-hit assertion below depends on that.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import sys
import time

import pytest

# Before Ray itself: ray_app sets Ray's local-only switch, which Ray reads at its first import.
ray_app = pytest.importorskip("prefixcache.serve.ray_app", reason="the `cluster` extra (ray[serve]) is not installed")
import ray  # noqa: E402

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")  # a dependency of ray

import lossy_forwarder  # noqa: E402
from lossy_forwarder import LossyForwarder  # noqa: E402
from prefixcache.cluster.ray_router import METADATA_KEY  # noqa: E402
from prefixcache.loadgen.runner import served_vocab_size  # noqa: E402
from prefixcache.service_model import ServiceModel  # noqa: E402
from prefixcache.config import from_mapping  # noqa: E402
from prefixcache.serve.cluster_config import parse_cluster_serve_config  # noqa: E402
from prefixcache.serve.ray_app import APP_NAME, ENGINE_DEPLOYMENT, ClusterServer  # noqa: E402
from prefixcache.serve.ray_replica import EngineReplica  # noqa: E402

pytestmark = pytest.mark.ray

BLOCK = 4
DEADLINE_S = 60.0
VOCAB = 256  # byte ids of the tiny model's tokenizer: every prompt is also text
DROPPED = frozenset({1, 2, 4})  # each replica's event messages its router never receives


class LossyEngineReplica(EngineReplica):
    """An engine replica that tells routers to subscribe to a `LossyForwarder` of its
    events, which drops the messages numbered `DROPPED` (replay stays the replica's own)."""

    def record_replica_metadata(self) -> dict:
        metadata = super().record_replica_metadata()
        if getattr(self, "_forwarder", None) is None:
            self._forwarder = LossyForwarder(metadata[METADATA_KEY]["endpoint"], drop=set(DROPPED))
        metadata[METADATA_KEY]["endpoint"] = self._forwarder.endpoint
        return metadata


# Ray workers cannot import this module or the forwarder's: the class goes to them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(lossy_forwarder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_config_data(router: str = "kv_events", **options):
    return {
        "cache": {"backend": "hash", "block_size": BLOCK, "num_blocks": 512},  # max_model_len 2,048
        "engine": {"model": "tiny", "num_threads": 1, "max_num_seqs": 1},  # the 2nd request on a replica waits
        "cluster": {"replicas": 2, "router": router, "options": options, "num_cpus": 4, "replica_cpus": 1.0,
                    "health_check_period_s": 0.5, "stall_timeout_s": 30.0, "port": free_port()},
    }


def cluster_config(router: str = "kv_events", **options):
    return parse_cluster_serve_config(cluster_config_data(router, **options))


@pytest.fixture(scope="module")
def cluster():
    server = ClusterServer(cluster_config(), log_to_driver=False, replica_class=LossyEngineReplica)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def state(cluster) -> dict:
    body = httpx.get(f"{cluster.base_url}/cluster/state", timeout=DEADLINE_S).json()
    (router,) = body["routers"]
    return {**router, "ingress": body["ingress"]}


def wait_for(check, what: str, timeout_s: float = DEADLINE_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def head(seed: int, n: int = 24) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def complete(cluster, prompt: list[int], max_tokens: int = 2) -> dict:
    response = httpx.post(f"{cluster.base_url}/v1/completions", timeout=DEADLINE_S,
                          json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json()


def routed_to(before: dict, after: dict) -> list[str]:
    """The replicas whose routed count grew between two states."""
    return [r for r, row in after["replicas"].items() if row["routed"] > before["replicas"].get(r, {"routed": 0})["routed"]]


def routed_since(cluster, before: dict) -> list[str]:
    """`routed_to(before, now)` once the router has counted the request. Ray Serve calls
    the router's on_request_routed after the replica's acceptance reaches it, which a
    loaded machine may deliver after the response itself: the count can lag the reply."""
    seen: list[dict] = []

    def grown() -> list[str]:
        seen[:] = [state(cluster)]
        return routed_to(before, seen[0])

    try:
        return wait_for(grown, "the router's count of the request")
    except AssertionError as err:
        raise AssertionError(f"{err}; before: {before}; after: {seen[0]}") from None


def cache_on_one_replica(cluster, prompt: list[int]) -> str:
    """Serve `prompt`; the replica it went to, once its blocks are in the index."""
    before = state(cluster)
    complete(cluster, prompt)
    (replica,) = routed_since(cluster, before)
    grown = len(prompt) // BLOCK
    wait_for(lambda: state(cluster)["replicas"][replica]["blocks"] >= before["replicas"][replica]["blocks"] + grown,
             "the request's blocks in the index")
    return replica


def test_the_openai_client_talks_to_the_ingress(cluster):
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)
    (model,) = [m.id for m in client.models.list().data]
    assert model == "tiny"
    out = client.completions.create(model=model, prompt=head(1), max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    # Stop strings travel to the replica's engine with the request (greedy: any replica agrees).
    free = client.completions.create(model=model, prompt=head(50), max_tokens=12, extra_body={"ignore_eos": True})
    text = free.choices[0].text
    stop = text[len(text) // 2 :][:2]
    cut = client.completions.create(model=model, prompt=head(50), max_tokens=12, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (text[: text.index(stop)], "stop")
    # Logprobs ride the replica's stream items through Ray: one per token, streamed or not.
    chunks = list(client.completions.create(model=model, prompt="hello there, cluster", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}, logprobs=1,
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-2].choices[0].finish_reason == "length"
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks[:-1]) == 4
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant"
    assert [len(e.top_logprobs) for e in chat.choices[0].logprobs.content] == [2] * chat.usage.completion_tokens
    # n choices: each a request of its own through the router, answered as one; in flight
    # together, each is assigned a replica at once (none waits out the stall timeout and is
    # sent again: Ray Serve tells calls apart by an id each call must have of its own).
    sent_again = state(cluster)["ingress"]["resubmitted"]
    for seed in range(3):
        two = client.completions.create(model=model, prompt=head(20 + seed), max_tokens=3, n=2, seed=3,
                                        temperature=1.0, extra_body={"ignore_eos": True})
        assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 6
    assert state(cluster)["ingress"]["resubmitted"] == sent_again
    # The serving layer's error bodies, through the ingress.
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt=[1, 2], max_tokens=1)
    assert err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=[1, 10**6], max_tokens=1)
    assert err.value.body["param"] == "prompt" and "out of vocabulary" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt=[1] * 2048, max_tokens=1)
    assert err.value.body["param"] == "input_tokens"
    with pytest.raises(openai.BadRequestError) as err:  # refused by the replica's engine: its field crosses Ray
        client.completions.create(model=model, prompt=[1, 2], max_tokens=4, extra_body={
            "min_tokens": 2, "allowed_token_ids": [65], "stop_token_ids": [65]})
    assert err.value.body["param"] == "allowed_token_ids"


def test_the_ingress_reports_the_replicas_model_as_a_replica_does(cluster):
    """`GET /model_info` (SGLang's) at the ingress: what `prefixcache bench` reads to keep
    its token ids in the vocabulary, so it runs against `cluster serve` without flags."""
    body = httpx.get(f"{cluster.base_url}/model_info", timeout=DEADLINE_S).json()
    assert body["served_model_name"] == "tiny" and body["vocab_size"] == 320
    async def probe() -> int | None:
        async with httpx.AsyncClient() as client:
            return await served_vocab_size(client, cluster.base_url, DEADLINE_S)

    assert asyncio.run(probe()) == 320
    assert httpx.get(f"{cluster.base_url}/get_model_info", timeout=DEADLINE_S).json() == body


def test_the_cluster_listens_on_loopback_but_for_ray_serves_own_replica_servers(cluster):
    processes = psutil.Process().children(recursive=True)  # GCS, raylet and every worker: this driver's
    names = {p.pid: p.name().partition(".")[0] for p in processes}  # an actor's title names the method it runs
    wide = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in names and not ipaddress(conn.laddr.ip).is_loopback:
            wide.append(names[conn.pid])
    # Ray Serve 2.60 starts each replica's inter-deployment gRPC server on [::]:0, which no
    # option moves (ray/serve/_private/replica.py); every other socket is on 127.0.0.1.
    assert sorted(wide) == ["ray::ServeReplica:prefixcache:engine"] * 2 + ["ray::ServeReplica:prefixcache:ingress"]


def ipaddress(text: str):
    import ipaddress as ip

    address = ip.ip_address(text)
    return address.ipv4_mapped or address if isinstance(address, ip.IPv6Address) else address


def test_requests_that_share_a_prefix_go_to_the_replica_that_caches_it(cluster):
    shared = head(2)
    holder = [cache_on_one_replica(cluster, shared + [7])]  # its blocks reach the index through its events
    for tail in range(5):
        before = state(cluster)
        out = complete(cluster, shared + [9, tail])
        assert routed_since(cluster, before) == holder
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shared)  # 6 whole blocks
    streams = state(cluster)["replicas"][holder[0]]["stream"]
    assert streams["lost"] == 0 and streams["batches"] > 0


def test_an_event_gap_is_healed_through_replay(cluster):
    # Each request is about one event message: serve until each replica has published past
    # the dropped ones (bounded).
    for seed in range(10, 40):
        rows = state(cluster)["replicas"]
        if all(r["stream"]["next_seq"] > max(DROPPED) + 1 for r in rows.values()):
            break
        complete(cluster, head(seed) + [seed])
    else:
        raise AssertionError(f"the replicas did not publish past {sorted(DROPPED)}: {rows}")
    for name, row in rows.items():
        stream = row["stream"]
        # Every dropped message came back through replay (a hole the next message revealed,
        # or the resync of a quiet stream); none was given up as lost.
        assert stream["replayed"] >= len(DROPPED) and stream["lost"] == 0, (name, stream)
    # The healed index still routes a shared head to its holder, where it hits.
    shared = head(6)
    holder = cache_on_one_replica(cluster, shared + [3])
    before = state(cluster)
    out = complete(cluster, shared + [4])
    assert routed_since(cluster, before) == [holder]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(shared)


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion, read to its end: its text chunks, its finish reason, or the
    error it ended with (an SSE error chunk, or an error body)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": json.loads(await response.aread())["error"]}
        out: dict = {"status": 200, "tokens": 0, "finish": None, "error": None, "done": False}
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
            elif chunk["choices"]:
                out["finish"] = chunk["choices"][0]["finish_reason"] or out["finish"]
            else:
                out["tokens"] = chunk["usage"]["completion_tokens"]
        return out


def test_a_killed_replica_leaves_the_index_its_requests_end_cleanly_and_routing_recovers(cluster):
    shared = head(3)
    victim = cache_on_one_replica(cluster, shared + [1])
    counted = state(cluster)["ingress"]  # the ingress counts since it started: this test reads what it adds
    # Long enough that two stay in flight there for seconds, so the poll below (every 0.1 s, an HTTP
    # round trip each) cannot miss them on a fast machine; 1 runs at once, the rest wait.
    max_tokens, n = 240, 6

    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            url = f"{cluster.base_url}/v1/completions"
            tasks = [asyncio.create_task(_stream(client, url, shared + [i, i], max_tokens)) for i in range(n)]
            # Kill the replica holding the head while a request runs there and another waits there.
            await asyncio.to_thread(wait_for, lambda: state(cluster)["replicas"][victim]["in_flight"] >= 2,
                                    "requests in flight on the victim")
            actor = ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#{victim}", namespace="serve")
            ray.kill(actor, no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

    results = asyncio.run(run())
    # Every request is accounted for: a whole completion, or an OpenAI-style error, never a hang.
    assert len(results) == n
    for r in results:
        if r["status"] == 200 and r["error"] is None:
            assert r["finish"] == "length" and r["tokens"] == max_tokens and r["done"], r
        else:
            error = r["error"]
            assert error["code"] == 503 and error["type"] == "Service Unavailable" and error["message"], r
            assert r["status"] == 503 or r["done"], r
    after = state(cluster)
    # The dead replica left the router: out of the candidates and of the index, blocks and all.
    assert victim not in after["replicas"] and victim in after["departed"]
    assert after["ingress"]["in_flight"] == 0
    # Routing recovers at once (Ray Serve's replacement may join later): a new head goes to a
    # live replica, and hits there the next time.
    again = head(4)
    holder = cache_on_one_replica(cluster, again + [1])
    assert holder != victim
    before = state(cluster)
    out = complete(cluster, again + [2])
    assert routed_since(cluster, before) == [holder]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(again)
    # Those that had not streamed a token were sent again; those that had, got a 503. (A
    # request sent again can still end with a 503: on a loaded host one may stall, be sent
    # again to the victim and be streaming there when it dies, so the counts bound, not pair.)
    completed = sum(1 for r in results if r["error"] is None)
    resubmitted = after["ingress"]["resubmitted"] - counted["resubmitted"]
    assert 1 <= resubmitted <= n and after["ingress"]["failed"] - counted["failed"] == n - completed
    print(f"killed replica: {completed}/{n} completed ({resubmitted} sent again), "
          f"{n - completed} ended with a 503")


def test_ray_s_own_routers_are_configured_from_the_file_without_vllm():
    # Live, it runs in benchmarks/bench_ray_cluster.py (a deployment of its own costs this
    # file ~40 s on a 2-core machine).
    config = cluster_config("ray_prefix_cache_affinity", imbalanced_threshold=5, match_rate_threshold=0.2)
    router_config = ray_app.ray_router_config(config)
    assert "PrefixCacheAffinityRouter" in str(router_config.request_router_class)
    assert router_config.request_router_kwargs == {"imbalanced_threshold": 5, "match_rate_threshold": 0.2}
    assert ray_app.ray_router_config(cluster_config("ray_power_of_two")) is None  # Ray Serve's default
    # the replicas' service model reaches the routers that estimate time, as the adapter reads it
    timed = cluster_config_data("estimated_ttft")
    timed["cluster"]["service"] = {"device": "h200"}
    service = ray_app.ray_router_config(parse_cluster_serve_config(timed)).request_router_kwargs["service"]
    assert from_mapping(ServiceModel, service) == ServiceModel(device="h200")
    assert "service" not in ray_app.ray_router_config(cluster_config("estimated_ttft")).request_router_kwargs
    # replicas with lower tiers: the adapter's index keeps their residency, as the simulation's does
    tiered = cluster_config_data("estimated_ttft")
    tiered["cache"]["tiers"] = [{"medium": "CPU", "num_blocks": 64}]
    kwargs = ray_app.ray_router_config(parse_cluster_serve_config(tiered)).request_router_kwargs
    assert kwargs["lower_media"] == ["CPU"]  # the adapter's index keeps them: tests/test_ray_router.py
    assert "lower_media" not in ray_app.ray_router_config(cluster_config("estimated_ttft")).request_router_kwargs
    for router in ("ray_power_of_two", "ray_prefix_cache_affinity", "prefix_affinity"):
        ray_app.build_application(cluster_config(router))  # Ray's own checks of the deployment options
    assert "vllm" not in sys.modules
