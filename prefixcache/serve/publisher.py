"""The replica's KV event publisher: ZeroMQ PUB + ROUTER replay, as vLLM 0.33's.

Owns `ZmqEventPublisher`: the engine hands it each step's events (`publish`, in the
engine's thread, never blocking on the network); a publisher thread encodes them as one
`KVEventBatch` (`prefixcache.event_wire`), gives it the next sequence number, sends
`(topic, seq as 8 bytes big-endian, payload)` on the publishing socket, then keeps it in
a bounded replay buffer of `buffer_steps` batches. The same thread answers replay
requests on the ROUTER socket between sends: for a request `(identity, b"", start_seq)`
it sends `(identity, b"", topic, seq, payload)` for every buffered batch with
`seq >= start_seq`, then the end marker `(identity, b"", b"", END_SEQ, b"")`. As vLLM's,
it reads `start_seq` as a big-endian unsigned int of whatever length the frame has
(an empty frame is 0), and ignores (logs) a request that is not 3 frames.

Send before buffer, in one thread: a replay never misses a batch the socket already
sent, so a subscriber that saw seq N and asks for the hole before it always gets
whatever of it is still buffered.

Drops are counted (`dropped_batches`), never silent. vLLM's PUB socket drops a message
for a subscriber whose queue is full (`hwm`) without a trace, and ZeroMQ then stops
offering that subscriber anything until it has read half its queue, so a publisher
cannot count what such a socket drops. Ours is an XPUB (a PUB that SUB sockets connect
to as to vLLM's) with `ZMQ_XPUB_NODROP`: a batch that any subscriber's queue has no room
for is not sent (the send fails at once, EAGAIN: the engine never waits), is counted
("hwm"), and stays in the replay buffer like every batch. So every batch is either sent
to every subscriber or counted; the price is that while one subscriber's queue is full,
the others receive the live stream's batches only through replay (a gap, or the
subscriber's sequence probe, `event_subscriber`), which the buffer serves. A replay
request for batches the buffer no longer holds counts them ("replay"). ZeroMQ heartbeats
(`_HEARTBEAT_*`) close the connection of a subscriber that stops answering altogether (a
stopped or hung process), which then no longer holds the stream.

Endpoints follow vLLM: a PUB endpoint with `*` (`tcp://*:5557`; `tcp://127.0.0.1:*` for
a free loopback port), `::`, `ipc://` or `inproc://` is bound, any other is connected;
the replay endpoint is always bound. Given `bind_host`, a `tcp://*:PORT` endpoint binds
that host only (`bind_address`; `prefixcache serve` gives its HTTP host, so events are
no more exposed than HTTP). `endpoint` / `replay_endpoint` are the addresses actually
bound (a `*` port resolved), for subscribers to connect to.

Must never: block the engine on a subscriber, drop a batch without consuming its
sequence number or without counting it, or publish from more than one thread.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from prefixcache.event_wire import END_SEQ, encode_batch, encode_seq
from prefixcache.events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent
from prefixcache.serve.config import KVEventsConfig

__all__ = ["ZmqEventPublisher", "is_bind_endpoint", "bind_address"]

_log = logging.getLogger(__name__)
_STOP = object()
# Replay requests answered between two batches at most: a client flooding the replay
# socket can slow the stream, never stop it.
_REPLAYS_PER_BATCH = 8
# ZMTP heartbeats (milliseconds): a subscriber whose ZeroMQ stack does not answer a PING
# within the timeout (its process stopped or hung) is disconnected; a live one reconnects.
_HEARTBEAT_IVL_MS = 2000
_HEARTBEAT_TIMEOUT_MS = 6000
# vLLM's engine always stamps its batches with its data-parallel rank; one engine is rank 0.
_DP_RANK = 0


def is_bind_endpoint(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (else it connects), by vLLM's rule."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def bind_address(endpoint: str, host: str | None) -> str:
    """Where a socket binds `endpoint`: a `tcp://*:PORT` endpoint on `host` (the HTTP
    server's: `prefixcache serve` publishes on the interface it serves on) when one is
    given and is not itself a wildcard; any other endpoint as it is."""
    if host is None or host in ("0.0.0.0", "::", "*") or not endpoint.startswith("tcp://*:"):
        return endpoint
    return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint[len('tcp://*:'):]}"


def _ipv6_ready(sock: zmq.Socket, address: str) -> str:
    if address.startswith("tcp://["):  # ZeroMQ binds an IPv6 address only with the option set
        sock.setsockopt(zmq.IPV6, 1)
    return address


class ZmqEventPublisher:
    """PUB + ROUTER publisher with a bounded replay buffer (see the module docstring)."""

    def __init__(self, config: KVEventsConfig, *, context: zmq.Context | None = None,
                 bind_host: str | None = None) -> None:
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_published = 0  # batches sent (the next sequence number)
        self.num_replays = 0  # replay requests answered
        self._dropped = {"hwm": 0, "replay": 0}  # batches not delivered, by reason (dropped_batches)
        self._queued = 0  # batches handed to publish(); the thread counts them off in _handled
        self._handled = 0
        self._handled_cv = threading.Condition()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.setsockopt(zmq.HEARTBEAT_IVL, _HEARTBEAT_IVL_MS)
        self._pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, _HEARTBEAT_TIMEOUT_MS)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if is_bind_endpoint(config.endpoint):
                self._pub.bind(_ipv6_ready(self._pub, bind_address(config.endpoint, bind_host)))
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # Room for a whole replay and its marker, as vLLM sizes it.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self._replay.bind(_ipv6_ready(self._replay, bind_address(config.replay_endpoint, bind_host)))
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise OSError(f"kv_events: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {err}") from None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # -- the engine's side ----------------------------------------------------------------
    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue one step's events as one batch, stamped now (wall clock). Waits only
        if `max_queue_size` batches are already waiting for the publisher thread."""
        if not self._thread.is_alive():
            raise RuntimeError("the KV event publisher is closed")
        if events:
            with self._handled_cv:
                self._queued += 1
            self._queue.put((time.time(), list(events)))

    def dropped_batches(self) -> dict[str, int]:
        """Batches not delivered so far, by reason: "hwm" (not sent live: a subscriber's
        queue was full; kept for replay), "replay" (asked for by a replay request after
        the buffer let it go). Any thread."""
        return dict(self._dropped)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every batch queued so far is sent (at most `timeout_s` SECONDS);
        False if that did not happen in time."""
        with self._handled_cv:
            return self._handled_cv.wait_for(lambda: self._handled >= self._queued, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (within `timeout_s` SECONDS), stop the thread, close the sockets."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.warning("KV event publisher did not stop within %.1f s; closing its sockets anyway", timeout_s)
        else:
            self._close_sockets()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher thread -------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._drain_subscriptions()
            if self._replay is not None:
                answered = 0
                while answered < _REPLAYS_PER_BATCH and self._replay.poll(0, zmq.POLLIN):
                    self._answer_replay()
                    answered += 1
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            ts, events = item  # type: ignore[misc]
            try:
                self._send(ts, events)
            except Exception:  # noqa: BLE001 - a bad event must not kill the stream
                _log.exception("KV event publisher: a batch could not be published")
            with self._handled_cv:
                self._handled += 1
                self._handled_cv.notify_all()

    def _drain_subscriptions(self) -> None:
        """An XPUB hands its (un)subscriptions up; nothing here needs them."""
        while self._pub.poll(0, zmq.POLLIN):
            self._pub.recv(zmq.NOBLOCK)

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        medium = self.config.medium
        if medium != MEDIUM_GPU:
            events = [
                dataclasses.replace(e, medium=medium) if isinstance(e, (BlockStored, BlockRemoved)) else e
                for e in events
            ]
        payload = encode_batch(
            events, ts=ts, data_parallel_rank=_DP_RANK, int_block_hashes=self.config.int_block_hashes
        )
        seq = self._next_seq
        self._next_seq += 1
        frames = (self._topic, encode_seq(seq), payload)
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:  # a subscriber's queue is full: not sent, counted, kept for replay
            self._dropped["hwm"] += 1
        self._buffer.append((seq, payload))
        self.num_published = self._next_seq

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()  # type: ignore[union-attr]
        if len(frames) != 3:  # vLLM's rule; debug, not warning: a client could fill the log
            _log.debug("KV event publisher: ignoring a replay request of %d frames", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")  # any length, as vLLM reads it
        if self._buffer and start_seq < self._buffer[0][0]:
            self._dropped["replay"] += self._buffer[0][0] - start_seq
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", self._topic, encode_seq(seq), payload))  # type: ignore[union-attr]
        self.num_replays += 1  # before the end marker: a client that has it reads the count
        self._replay.send_multipart((identity, b"", b"", END_SEQ, b""))  # type: ignore[union-attr]

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
