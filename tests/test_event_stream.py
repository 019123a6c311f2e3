"""The KV event stream end to end: publisher -> ZeroMQ -> subscriber, gaps and replay.

Every socket is on 127.0.0.1 with a port the OS picks (`tcp://127.0.0.1:*`), and every
wait is a bounded poll.
"""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixcache.event_subscriber import EventSubscriber, Gap  # noqa: E402
from prefixcache.event_wire import END_SEQ, decode_seq, encode_seq  # noqa: E402
from prefixcache.events import BlockRemoved  # noqa: E402
from prefixcache.serve.config import KVEventsConfig  # noqa: E402
from prefixcache.serve.publisher import ZmqEventPublisher, is_bind_endpoint  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:*"
DEADLINE_S = 10.0


def publisher(**kw) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(enabled=True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, **kw))


def batch(i: int) -> list:
    return [BlockRemoved((i,), group_idx=0)]


def wait_published(pub: ZmqEventPublisher, n: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while pub.num_published < n:
        assert time.monotonic() < deadline, f"publisher sent {pub.num_published} of {n} batches"
        time.sleep(0.005)


def collect(sub: EventSubscriber, n: int) -> list:
    got, deadline = [], time.monotonic() + DEADLINE_S
    while len(got) < n and time.monotonic() < deadline:
        got += sub.poll(0.2)
    return got


def connected(pub: ZmqEventPublisher, **kw) -> EventSubscriber:
    """A subscriber whose subscription has reached the publisher (a probe batch arrived),
    so what is published next is not lost to ZeroMQ's slow-joiner window."""
    sub = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, **kw)
    deadline = time.monotonic() + DEADLINE_S
    while True:
        pub.publish(batch(-1))
        if sub.poll(0.05):
            return sub
        assert time.monotonic() < deadline, "the subscription never reached the publisher"


def test_endpoints_bind_or_connect_as_vllms_do():
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("tcp://127.0.0.1:*")
    assert is_bind_endpoint("ipc:///tmp/kv") and is_bind_endpoint("inproc://kv") and is_bind_endpoint("tcp://[::]:1")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")
    with publisher() as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        assert pub.replay_endpoint != pub.endpoint


def test_batches_arrive_in_order_with_their_sequence_numbers():
    with publisher(topic="kv@r0") as pub, connected(pub, replica="r0", topic="kv@") as sub:
        first = sub.next_seq
        for i in range(20):
            pub.publish(batch(i))
        got = collect(sub, 20)
    assert [b.seq for b in got] == list(range(first, first + 20))
    assert [b.batch.events[0].block_hashes[0] for b in got] == list(range(20))
    assert {b.replica for b in got} == {"r0"} and not any(b.replayed or b.gap_before for b in got)
    assert sub.gaps == [] and got[0].batch.data_parallel_rank == 0 and got[0].batch.ts > 1e9


def test_a_late_subscriber_recovers_the_head_through_replay():
    with publisher() as pub:
        for i in range(5):
            pub.publish(batch(i))
        wait_published(pub, 5)
        with EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0) as sub:
            got = sub.replay_from(0)  # catch up explicitly, then follow the stream
            deadline = time.monotonic() + DEADLINE_S
            while len(got) < 8 and time.monotonic() < deadline:
                pub.publish(batch(len(got)))
                got += sub.poll(0.05)
    seqs = [b.seq for b in got]
    assert seqs == list(range(len(seqs))) and len(seqs) >= 8
    assert all(b.replayed for b in got[:5])


def test_a_dropped_batch_is_recovered_through_replay():
    """A consumer running its own socket loop loses message 3; `accept` sees the hole at
    message 4 and fills it from the replay socket before handing 4 on."""
    with publisher() as pub:
        raw = zmq.Context.instance().socket(zmq.SUB)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(pub.endpoint)
        sub = EventSubscriber(None, replay_endpoint=pub.replay_endpoint, start_seq=0)
        try:
            frames, deadline = [], time.monotonic() + DEADLINE_S
            while not frames:  # the probe: until the subscription is live
                pub.publish(batch(-1))
                if raw.poll(50):
                    frames.append(raw.recv_multipart())
                assert time.monotonic() < deadline
            sub.replay_from(0)  # the probes
            start = sub.next_seq
            for i in range(6):
                pub.publish(batch(i))
            got = []
            while len(got) < 6 and time.monotonic() < deadline:
                if raw.poll(200):
                    topic, seq, payload = raw.recv_multipart()
                    if decode_seq(seq) < start:
                        continue  # a late probe
                    if decode_seq(seq) == start + 3:
                        continue  # the drop
                    got += sub.accept(decode_seq(seq), payload)
        finally:
            raw.close(linger=0)
            sub.close()
    assert [b.seq - start for b in got] == [0, 1, 2, 3, 4, 5]
    assert [b.replayed for b in got] == [False, False, False, True, False, False]
    assert got[3].gap_before == Gap(start + 3, start + 3, recovered=1) and got[3].gap_before.lost == 0
    assert sub.gaps == [Gap(start + 3, start + 3, 1)]


def test_what_the_bounded_buffer_no_longer_holds_is_reported_lost():
    with publisher(buffer_steps=3) as pub:
        for i in range(10):
            pub.publish(batch(i))
        wait_published(pub, 10)
        with EventSubscriber(None, replay_endpoint=pub.replay_endpoint, start_seq=0) as sub:
            got = sub.replay_from(0)
    assert [b.seq for b in got] == [7, 8, 9]
    assert got[0].gap_before == Gap(0, 6, recovered=0) and got[0].gap_before.lost == 7


def test_without_a_replay_socket_a_gap_is_lost_and_said_so():
    sub = EventSubscriber(None, start_seq=0)
    from prefixcache.event_wire import encode_batch

    payload = encode_batch(batch(0), ts=1.0)
    assert sub.accept(0, payload)[0].gap_before is None
    [after] = sub.accept(4, payload)
    assert after.gap_before == Gap(1, 3, 0) and after.gap_before.lost == 3
    assert sub.accept(2, payload) == [] and sub.duplicates == 1  # behind what was handed on
    with pytest.raises(RuntimeError, match="no endpoint"):
        sub.poll(0.0)
    with pytest.raises(RuntimeError, match="no replay_endpoint"):
        sub.replay_from(0)


def test_the_replay_socket_reads_a_start_of_any_length_as_vllm_does_and_ignores_malformed_requests():
    """vLLM 0.33's `_service_replay`: a request of 3 frames is answered, its start read as
    a big-endian int of whatever length (empty: 0); any other shape is ignored. (Ours
    stayed silent on a start that was not 8 bytes, and the client timed out.)"""

    def replay(dealer, *frames) -> list[int]:
        dealer.send_multipart((b"", *frames))
        seqs = []
        while True:
            assert dealer.poll(int(DEADLINE_S * 1000))
            reply = dealer.recv_multipart()
            if reply == [b"", b"", END_SEQ, b""]:
                return seqs
            seqs.append(decode_seq(reply[2]))

    with publisher() as pub:
        pub.publish(batch(0))
        pub.publish(batch(1))
        wait_published(pub, 2)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        try:
            assert replay(dealer, b"") == [0, 1]  # an empty start is 0
            assert replay(dealer, b"\x01") == [1]  # one byte
            assert replay(dealer, b"\x00" * 12 + b"\x01") == [1]  # 13 bytes
            assert replay(dealer, b"short") == []  # a start past everything: the end marker alone
            dealer.send_multipart((b"", b"a", b"b"))  # 4 frames at the ROUTER: ignored, as vLLM does
            assert replay(dealer, encode_seq(0)) == [0, 1]  # the next request is still answered
        finally:
            dealer.close(linger=0)
        assert pub.num_replays == 5


def test_the_medium_the_config_names_is_the_one_published():
    with publisher(medium="CPU", int_block_hashes=False) as pub, connected(pub) as sub:
        pub.publish([BlockRemoved((b"\x01" * 32,), group_idx=0)])
        [got] = collect(sub, 1)
    assert got.batch.events == (BlockRemoved((b"\x01" * 32,), medium="CPU", group_idx=0),)


def test_a_closed_publisher_refuses_more():
    pub = publisher()
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(batch(0))


def test_a_replay_that_times_out_counts_as_lost():
    from prefixcache.event_wire import encode_batch

    silent = zmq.Context.instance().socket(zmq.ROUTER)  # takes requests, never answers
    silent.bind(LOOPBACK)
    try:
        sub = EventSubscriber(None, replay_endpoint=silent.getsockopt_string(zmq.LAST_ENDPOINT), start_seq=0,
                              replay_timeout_s=0.2)
        [after] = sub.accept(2, encode_batch(batch(2), ts=1.0))
        assert after.gap_before == Gap(0, 1, recovered=0) and after.seq == 2
        sub.close()
    finally:
        silent.close(linger=0)
