"""The event feed keeps the cluster KV index equal to a real replica's cache, through lost
messages, a late start and a removal.

A replica (`prefixcache serve`'s, tiny model, `hash`, events on 127.0.0.1) serves prompts
that share heads through a pool small enough to evict. Its PUB stream reaches the feed
through a forwarder the test runs, which drops chosen messages as a network would; the
feed's replay requests go to the replica's own ROUTER. At each checkpoint the index must
hold exactly the block hashes the replica's pool holds, copy for copy.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from prefixcache.cluster import KVIndex, PromptHasher  # noqa: E402
from prefixcache.cluster.event_feed import EventFeed  # noqa: E402
from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.event_wire import external_block_hash  # noqa: E402
from prefixcache.serve.config import parse_serve_config  # noqa: E402
from prefixcache.serve.server import Replica  # noqa: E402
from lossy_forwarder import LossyForwarder  # noqa: E402
from serve_cases import DEADLINE_S, LOOPBACK_ZMQ, idle, in_engine, running, wait_until  # noqa: E402

BLOCK = 4


def pool_hashes(engine) -> Counter:
    """The hashes the replica's `hash` pool holds (engine thread), as they go on the wire."""
    pool = engine.cache.pool
    keys = (pool.key(b) for b in range(pool.num_blocks))
    return Counter(external_block_hash(k) for k in keys if k is not None)


def index_matches(index: KVIndex, replica, truth: Counter) -> bool:
    return (index.copies(replica) == sum(truth.values()) and index.blocks(replica) == len(truth)
            and all(index.copies_of(h, replica) == n for h, n in truth.items()))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(24)] for _ in range(3)]
    return [rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randint(3, 16))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def warm_up(replica, http, forwarder, feed, name) -> int:
    """Probe requests until one reaches the feed over the forwarder: both SUB sockets are
    live (ZeroMQ's slow joiner is behind us). Returns the next sequence number."""
    pub = replica.publisher
    for probe in range(1, 50):
        assert http.post("/v1/completions", json={"prompt": [probe] * 9, "max_tokens": 1}).status_code == 200
        idle(replica)
        assert pub.flush(DEADLINE_S)
        if forwarder.forwarded:
            break
    wait_until(lambda: feed.stats()[name].next_seq == pub.num_published, "the feed to take the probes")
    return pub.num_published


def serve_and_check(replica, http, index, feed, name, requests) -> None:
    for prompt in requests:
        response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert response.status_code == 200, response.text
    idle(replica)
    assert replica.publisher.flush(DEADLINE_S)
    truth = in_engine(replica, pool_hashes)
    wait_until(lambda: index_matches(index, name, truth), f"the index to hold the replica's {len(truth)} blocks")


def test_lost_messages_are_replayed_and_the_index_stays_exact(tiny):
    with running(tiny, "hash", block_size=BLOCK, num_blocks=40, events=True) as replica, \
            httpx.Client(base_url=replica.base_url, timeout=DEADLINE_S) as http:
        pub = replica.publisher
        forwarder = LossyForwarder(pub.endpoint, drop=set())
        index = KVIndex()
        index.add_replica("r0")
        # No resync while quiet: only the hole a later message reveals brings replay in.
        with EventFeed(index.apply, on_lost=lambda r, gap: index.clear(r), resync_s=60) as feed:
            feed.add("r0", forwarder.endpoint, replay_endpoint=pub.replay_endpoint)
            n = warm_up(replica, http, forwarder, feed, "r0")
            before = feed.stats()["r0"]
            forwarder.drop.update({n + 2, n + 5, n + 6})
            served = prompts(14, seed=0)
            serve_and_check(replica, http, index, feed, "r0", served)
            stats = feed.stats()["r0"]
            assert forwarder.dropped == [n + 2, n + 5, n + 6]
            assert stats.gaps - before.gaps == 2 and stats.replayed - before.replayed == 3 and stats.lost == 0
            assert stats.next_seq == pub.num_published
            assert in_engine(replica, lambda e: e.cache.stats()).evictions > 0  # removals went through too
            # The index answers what the replica would hit.
            hasher = PromptHasher.of(replica.config.serving.cache)
            for prompt in served[-4:]:
                probe = prompt + [0]  # one more token: the hit is not capped below the prompt's blocks
                hit = in_engine(replica, lambda e, p=probe: e.cache.match(p).num_tokens)
                assert index.longest_prefix(hasher(probe)).get("r0", 0) * BLOCK == hit
        forwarder.close()


def started(tiny, **kv_events):
    config = parse_serve_config({
        "cache": {"backend": "hash", "block_size": BLOCK, "num_blocks": 256},  # no eviction
        "engine": {"model": "tiny", "num_threads": 1},
        "kv_events": {"enabled": True, "endpoint": LOOPBACK_ZMQ, "replay_endpoint": LOOPBACK_ZMQ, **kv_events},
    })
    replica = Replica(config, model=tiny)
    replica.start()
    return replica


def test_what_replay_cannot_give_back_clears_the_replica_and_later_events_rebuild_it(tiny):
    replica = started(tiny, buffer_steps=1)  # two messages lost in a row cannot both come back
    try:
        pub = replica.publisher
        forwarder = LossyForwarder(pub.endpoint, drop=set())
        index = KVIndex()
        index.add_replica("r0")
        lost = []
        with httpx.Client(base_url=replica.base_url, timeout=DEADLINE_S) as http, \
                EventFeed(index.apply, on_lost=lambda r, gap: (lost.append(gap), index.clear(r)), resync_s=60) as feed:
            feed.add("r0", forwarder.endpoint, replay_endpoint=pub.replay_endpoint)
            n = warm_up(replica, http, forwarder, feed, "r0")
            lost.clear()  # a probe the forwarder joined too late for is no part of this
            before = feed.stats()["r0"].lost
            forwarder.drop.update({n + 1, n + 2})
            for prompt in prompts(6, seed=1):
                assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
                idle(replica)
                assert pub.flush(DEADLINE_S)
            wait_until(lambda: feed.stats()["r0"].next_seq == pub.num_published, "the feed to catch up")
            assert [(g.first, g.last, g.recovered) for g in lost] == [(n + 1, n + 2, 0)]
            assert feed.stats()["r0"].lost - before == 2
            # The index holds only what came after the loss: never a copy the replica does not hold.
            truth = in_engine(replica, pool_hashes)
            assert 0 < index.copies("r0") < sum(truth.values())
            assert all(index.copies_of(h, "r0") <= n for h, n in truth.items())
            # Once the cache is cleared, the stream alone makes the index exact again.
            assert http.post("/reset_prefix_cache").json() == {"success": True}
            serve_and_check(replica, http, index, feed, "r0", prompts(4, seed=2))
        forwarder.close()
    finally:
        replica.stop()


def test_a_late_subscriber_catches_up_a_lost_last_message_is_resynced_and_a_removal_is_final(tiny):
    with running(tiny, "hash", block_size=BLOCK, num_blocks=64, events=True) as replica, \
            httpx.Client(base_url=replica.base_url, timeout=DEADLINE_S) as http:
        pub = replica.publisher
        for prompt in prompts(5, seed=3):  # served before anyone listens
            assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        idle(replica)
        assert pub.flush(DEADLINE_S) and pub.num_published > 0
        forwarder = LossyForwarder(pub.endpoint, drop=set())
        index = KVIndex()
        index.add_replica("late")
        applied = Counter()

        def apply(r, events):
            applied[r] += 1
            index.apply(r, events)

        with EventFeed(apply, resync_s=0.2) as feed:
            feed.add("late", forwarder.endpoint, replay_endpoint=pub.replay_endpoint)
            with pytest.raises(ValueError, match="followed already"):
                feed.add("late", forwarder.endpoint)
            truth = in_engine(replica, pool_hashes)
            wait_until(lambda: index_matches(index, "late", truth), "the late subscriber to catch up by replay")
            assert feed.stats()["late"].replayed == pub.num_published
            # The next message is lost and nothing follows it: the quiet stream's resync repairs it.
            forwarder.drop.add(pub.num_published)
            serve_and_check(replica, http, index, feed, "late", prompts(1, seed=4))
            assert forwarder.dropped and feed.stats()["late"].gaps == 0
            assert feed.remove("late") and not feed.remove("late")
            index.remove_replica("late")  # safe: nothing of it is applied after remove()
            before, published = applied["late"], pub.num_published
            assert http.post("/v1/completions", json={"prompt": prompts(1, seed=5)[0], "max_tokens": 2}).status_code == 200
            idle(replica)
            assert pub.flush(DEADLINE_S)
            wait_until(lambda: forwarder.last_seq >= published, "the forwarder to pass it on")
            time.sleep(0.3)  # more than a resync period: nothing may arrive
            assert applied["late"] == before
        forwarder.close()


def test_a_feed_that_follows_no_replica_sleeps_instead_of_spinning():
    """zmq's poll returns at once when no socket is registered: a feed left with no
    replica (all removed or dead) must wait, not spin a core and take the GIL from the
    ingress's other threads."""
    with EventFeed(lambda replica, batch: None) as feed:
        feed.add("a", "tcp://127.0.0.1:1")  # nothing listens: the stream stays quiet
        feed.remove("a")
        time.sleep(0.1)  # the remove is applied
        started = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - started < 0.1  # spinning took the whole 0.5 s
        assert feed.alive
