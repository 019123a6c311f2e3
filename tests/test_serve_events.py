"""A replica's KV event stream rebuilds its cache exactly, for both backends.

A replica with `kv_events` on (PUB and replay on 127.0.0.1) serves requests that share
prefixes through a pool small enough to evict, then resets. A subscriber rebuilds the
multiset of cached block hashes from the stream alone (a hash stored twice is two
copies, each removal takes one, a clear empties it), and at every checkpoint it must
equal the hashes the cache really holds, read from the cache itself in the engine
thread: the `hash` backend's keyed pool blocks, the `radix` tree's pages hashed from
their root paths. One published message is dropped on the way; replay fills the hole.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

httpx = pytest.importorskip("httpx")
zmq = pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from prefixcache.event_subscriber import EventSubscriber  # noqa: E402
from prefixcache.event_wire import decode_seq, external_block_hash  # noqa: E402
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from prefixcache.hashing import block_hashes  # noqa: E402
from prefixcache.engine.loader import load_model  # noqa: E402
from serve_cases import DEADLINE_S, idle, in_engine, running  # noqa: E402

BLOCK = 4
DROPPED = 3  # a message lost on the way: the 4th after the probes' (or the first after it a later one follows)


class CachedHashes:
    """The multiset of block hashes a replica holds, rebuilt from its events alone."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.counts.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert self.counts[h] > 0, f"removed {h}, which was never stored"
                    self.counts[h] -= 1
            elif isinstance(event, AllBlocksCleared):
                self.counts.clear()
        self.counts += Counter()  # drop zero counts


def truth(engine) -> Counter:
    """The hashes the cache holds, from the cache itself (engine thread), in wire form."""
    cache = engine.cache
    if cache.name == "hash":
        keys = (cache.pool.key(b) for b in range(cache.pool.num_blocks))
        return Counter(external_block_hash(k) for k in keys if k is not None)
    tree, out = cache.tree, Counter()
    for namespace in tree.namespaces():
        stack = [(tree.root(namespace), ())]
        while stack:  # every node's pages, each hashed with the whole path to it
            node_id, before = stack.pop()
            node = tree.node(node_id)
            path = before + tuple(node.tokens)
            out.update(external_block_hash(h) for h in block_hashes(path, BLOCK)[len(before) // BLOCK:])
            stack += [(child, path) for child in node.children.values()]
    return out


def prompts(seed: int = 0) -> list[list[int]]:
    """Three shared heads, each continued a few ways; long enough that a 40-block pool evicts."""
    rng = random.Random(seed)
    heads = [[rng.randrange(256) for _ in range(24)] for _ in range(3)]
    return [rng.choice(heads) + [rng.randrange(256) for _ in range(rng.randint(3, 20))] for _ in range(14)]


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_the_stream_rebuilds_the_cached_hashes_under_eviction_and_reset(tiny, backend):
    with running(tiny, backend, block_size=BLOCK, num_blocks=40, events=True) as replica:
        pub = replica.publisher
        raw = zmq.Context.instance().socket(zmq.SUB)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(pub.endpoint)
        sub = EventSubscriber(None, replay_endpoint=pub.replay_endpoint, replica=backend)
        seen = CachedHashes()
        state = {"drop": None, "dropped": False}

        def drain_until(seq: int) -> None:
            """Take messages off our own SUB socket up to `seq`, dropping one on the way."""
            while sub.next_seq <= seq:
                assert raw.poll(int(DEADLINE_S * 1000)), f"no KV event message within {DEADLINE_S} s"
                _, seq_frame, payload = raw.recv_multipart()
                n = decode_seq(seq_frame)
                if n >= state["drop"] and n < seq and not state["dropped"]:  # never the last: a later one reveals it
                    state["dropped"] = True
                    continue
                for b in sub.accept(n, payload):
                    seen.apply(b.batch.events)

        def checkpoint() -> None:
            idle(replica)  # the engine has handed every event to the publisher...
            assert pub.flush(DEADLINE_S)  # ...and the publisher has sent them
            drain_until(pub.num_published - 1)
            assert seen.counts == in_engine(replica, truth)

        with httpx.Client(base_url=replica.base_url, timeout=DEADLINE_S) as http:
            # Probe requests (each caches new blocks) until one's events reach our SUB socket:
            # the subscription is live. What went out before it did comes back by replay.
            for probe in range(1, 100):
                http.post("/v1/completions", json={"prompt": [probe] * 9, "max_tokens": 1})
                if raw.poll(200):
                    break
            else:
                raise AssertionError("the SUB socket never received a message")
            idle(replica)
            assert pub.flush(DEADLINE_S)
            for b in sub.replay_from(0):
                seen.apply(b.batch.events)
            state["drop"] = sub.next_seq + DROPPED
            for i, prompt in enumerate(prompts()):
                response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
                assert response.status_code == 200, response.text
                if i % 3 == 2:
                    checkpoint()
            checkpoint()
            stats = in_engine(replica, lambda e: e.cache.stats())
            assert stats.evictions > 0 and stats.hits > 0  # the pool was tight and the prefixes shared
            assert http.post("/reset_prefix_cache").json() == {"success": True}
            checkpoint()
            assert seen.counts == Counter()
            http.post("/v1/completions", json={"prompt": prompts(1)[0], "max_tokens": 3})
            checkpoint()
        raw.close()
        sub.close()
    assert state["dropped"] and len(sub.gaps) == 1 and sub.gaps[0].recovered == 1  # the hole, filled by replay
