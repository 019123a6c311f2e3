"""The Ray Serve request-router adapter, without a Ray cluster: Ray's own `RequestRouter`
machinery around it, replicas that are real caches publishing real KV event streams on
127.0.0.1, and Ray's hooks called as Ray calls them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("prefixcache.serve.ray_app", reason="the `cluster` extra (ray[serve]) is not installed")
pytest.importorskip("zmq")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from prefixcache import CacheConfig, build_cache  # noqa: E402
from prefixcache.cluster import Router  # noqa: E402
from prefixcache.cluster.live_routers import first_token, live_routers  # noqa: E402
from prefixcache.cluster.ray_router import PrefixCacheRequestRouter, ReplicaStream  # noqa: E402
from prefixcache.hashing import resolve_seed  # noqa: E402
from prefixcache.serve.config import KVEventsConfig  # noqa: E402
from prefixcache.serve.publisher import ZmqEventPublisher  # noqa: E402

BLOCK = 4
DEADLINE_S = 30.0
DEPLOYMENT = DeploymentID(name="engine", app_name="test")


@dataclass(frozen=True)
class Call:
    """What the adapter reads of a call (`RoutedCall`)."""

    prompt_token_ids: list[int]
    namespace: str | None = None
    max_tokens: int | None = 8
    request_id: str | None = None


class FakeReplica:
    """What Ray's router machinery reads of a running replica, over a real cache whose
    events a real publisher sends."""

    def __init__(self, uid: str, *, block_size: int = BLOCK) -> None:
        self.replica_id = ReplicaID(uid, DEPLOYMENT)
        self.max_ongoing_requests = 100
        self.cache = build_cache(CacheConfig(block_size=BLOCK, num_blocks=64, enable_events=True))
        self.publisher = ZmqEventPublisher(KVEventsConfig(
            enabled=True, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*"))
        self.replica_metadata = ReplicaStream(
            self.publisher.endpoint, self.publisher.replay_endpoint, "", block_size, "sha256_cbor",
            resolve_seed("sha256_cbor", None)).to_metadata()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0

    def serve(self, rid: str, prompt: list[int]) -> None:
        assert self.cache.admit(rid, prompt) is not None
        self.cache.commit(rid, len(prompt))
        self.cache.release(rid)
        self.publisher.publish(self.cache.drain_events())
        assert self.publisher.flush(DEADLINE_S)

    def close(self) -> None:
        self.publisher.close()


def pending(call: object, rid: str) -> PendingRequest:
    return PendingRequest(args=[call], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid))


async def eventually(check, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def adapter(router: str, **options) -> PrefixCacheRequestRouter:
    out = PrefixCacheRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    out.initialize_state(router=router, options=options, block_size=BLOCK, resync_s=0.2)
    return out


@pytest.fixture
def replicas():
    made = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c", block_size=8)]  # c: another hash config
    yield made
    for r in made:
        r.close()


def test_kv_events_through_the_adapter_follows_the_index_and_the_replica_set(replicas):
    async def scenario() -> None:
        a, b, c = replicas
        router = adapter("kv_events")
        assert router in live_routers()
        router.update_replicas(replicas)
        prompt = list(range(1, 25))  # 6 blocks
        b.serve("warm", prompt)
        await eventually(lambda: router.state()["replicas"]["b"]["blocks"] == 6, "b's blocks in the index")
        state = router.state()
        assert "stream" not in state["replicas"]["c"]  # its chain cannot match: not followed
        assert state["replicas"]["b"]["stream"]["lost"] == 0

        request = pending(Call(prompt + [99, 98], max_tokens=8), "r1")
        assert await router.choose_replicas(replicas, request) == [[b]]
        router.on_request_routed(request, b.replica_id, None)
        row = router.state()["replicas"]["b"]
        assert (row["in_flight"], row["load_tokens"], row["routed"]) == (1, 26 + 8, 1)
        assert router._candidates(["a", "b"]).prefill_tokens.tolist() == [0, 26 - 24]  # uncached when routed
        router.on_request_completed(a.replica_id, "r1")  # another replica's completion: not this one's
        assert router.state()["replicas"]["b"]["in_flight"] == 1
        router.on_request_completed(b.replica_id, "r1")
        assert router.state()["replicas"]["b"]["load_tokens"] == 0

        # A call without token ids (a replica's info) is offered to every candidate, and
        # its routing is not ours to account.
        info = pending(object(), "info")
        assert await router.choose_replicas(replicas, info) == [replicas]
        router.on_request_routed(info, a.replica_id, None)
        assert router.state()["unaccounted"] == 0
        # Ray runs completion callbacks from another thread: a short request can finish
        # before its routing is reported. Counted as routed, it loads nothing.
        quick = pending(Call(prompt + [7], max_tokens=1), "quick")
        assert await router.choose_replicas(replicas, quick) == [[b]]
        router.on_request_completed(b.replica_id, "quick")
        router.on_request_routed(quick, b.replica_id, None)
        row = router.state()["replicas"]["b"]
        assert (row["routed"], row["in_flight"], row["load_tokens"], row["active_blocks"]) == (2, 0, 0, 0)
        # An attempt's end before a new choice for the same request (a rejected attempt,
        # retried) is not the retry's: the retry loads its replica until it completes.
        retried = pending(Call(prompt + [8], max_tokens=1), "retried")
        await router.choose_replicas(replicas, retried)
        router.on_request_completed(b.replica_id, "retried")
        await router.choose_replicas(replicas, retried)
        router.on_request_routed(retried, b.replica_id, None)
        assert router.state()["replicas"]["b"]["in_flight"] == 1
        router.on_request_completed(b.replica_id, "retried")
        assert router.state()["replicas"]["b"]["in_flight"] == 0 and router.state()["unaccounted"] == 0
        # One of ours routed with no choice on record, or to a replica the adapter does not
        # know: nothing to account it to, counted.
        router.on_request_routed(pending(Call(prompt, max_tokens=1), "unasked"), a.replica_id, None)
        router.on_request_routed(pending(Call(prompt, max_tokens=1), "stranger"), ReplicaID("z", DEPLOYMENT), None)
        assert router.state()["unaccounted"] == 2 and router.state()["replicas"]["a"]["routed"] == 0

        # b leaves: its blocks leave the index and its stream is dropped; a dies.
        router.update_replicas([a, c])
        assert "b" not in router.index and router.state()["departed"] == ["b"]
        b.serve("after", list(range(50, 74)))  # nothing of b may be applied any more
        await asyncio.sleep(0.3)
        assert router.feed.alive and router.feed.replicas == ("a",)
        router.on_replica_actor_died(a.replica_id)
        assert router.index.replicas == ("c",) and router.state()["departed"] == ["b", "a"]
        assert await router.choose_replicas([c], request) == [[c]]
        router.feed.close()

    asyncio.run(scenario())


def test_replicas_with_lower_tiers_give_the_index_their_media():
    router = PrefixCacheRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(router="estimated_ttft", block_size=BLOCK, lower_media=["CPU", "STORAGE"])
    assert router.index.lower_media == ("CPU", "STORAGE")
    router.feed.close()
    plain = adapter("estimated_ttft")
    assert plain.index.lower_media == ()
    plain.feed.close()


def test_a_router_without_an_index_builds_none_and_maps_positions_back(replicas):
    async def scenario() -> None:
        router = adapter("round_robin")
        assert router.index is None and router.feed is None
        router.update_replicas(replicas)
        picks = [await router.choose_replicas(replicas, pending(Call([1, 2, 3]), f"r{i}")) for i in range(4)]
        assert picks == [[[replicas[0]]], [[replicas[1]]], [[replicas[2]]], [[replicas[0]]]]
        assert "blocks" not in router.state()["replicas"]["a"]

    asyncio.run(scenario())


class HookRecorder(Router):
    """Sends every request to the first candidate and records the hooks it hears."""

    heard: list[tuple[str, object, str]] = []

    def choose_replicas(self, candidates, request):
        return [[0]]

    def on_first_token(self, request, replica):
        HookRecorder.heard.append(("first", request.request_id, replica))

    def on_request_completed(self, request, replica):
        HookRecorder.heard.append(("done", request.request_id, replica))


def test_the_prefill_load_ends_at_the_first_token_the_ingress_reports(replicas):
    async def scenario() -> None:
        a = replicas[0]
        HookRecorder.heard = []
        router = PrefixCacheRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(router=f"{__name__}:HookRecorder", block_size=BLOCK,
                                service={"device": "h200", "max_num_seqs": 64})
        assert router.router.context.service.max_num_seqs == 64
        router.update_replicas([a])
        request = pending(Call(list(range(1, 31)), max_tokens=8, request_id="cmpl-1"), "r1")
        assert await router.choose_replicas([a], request) == [[a]]
        router.on_request_routed(request, a.replica_id, None)
        assert router._candidates(["a"]).prefill_tokens.tolist() == [30]  # no index: the whole prompt
        assert router._candidates(["a"]).kv_blocks.tolist() == [-(-(30 + 8) // BLOCK)]
        first_token("cmpl-1")  # what the ingress calls when the first Tokens item streams
        await eventually(lambda: router.state()["replicas"]["a"]["prefill_tokens"] == 0, "the first token applied")
        first_token("cmpl-1")  # once only
        first_token("another adapter's request")
        await asyncio.sleep(0.05)
        row = router.state()["replicas"]["a"]
        assert (row["prefill_tokens"], row["first_tokens"], row["in_flight"]) == (0, 1, 1)
        router.on_request_completed(a.replica_id, "r1")
        row = router.state()["replicas"]["a"]
        assert (row["prefill_tokens"], row["in_flight"], row["load_tokens"]) == (0, 0, 0)
        assert HookRecorder.heard == [("first", "r1", "a"), ("done", "r1", "a")]
        # a request that completes without a first token (it failed) leaves no prefill load behind
        other = pending(Call(list(range(1, 31)), request_id="cmpl-2"), "r2")
        await router.choose_replicas([a], other)
        router.on_request_routed(other, a.replica_id, None)
        router.on_request_completed(a.replica_id, "r2")
        assert router.state()["replicas"]["a"]["prefill_tokens"] == 0
        assert HookRecorder.heard[-1] == ("done", "r2", "a")

    asyncio.run(scenario())


def test_a_bad_router_spec_is_refused_when_ray_builds_the_router():
    from prefixcache.config import ConfigError

    with pytest.raises(ConfigError, match="unknown router 'nope'"):
        adapter("nope")
    with pytest.raises(ConfigError, match="overlap_score_weight"):
        adapter("kv_events", overlap_score_weight=-1)
