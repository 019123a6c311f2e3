"""Every replica's KV event stream, fed to the cluster KV index from one thread.

Owns `EventFeed`. For each replica it is told about (`add(replica, endpoint, ...)`) it
connects a ZeroMQ SUB socket to the replica's publisher and keeps an `EventSubscriber`
fed through `accept` (the sequencing and replay of `prefixcache.event_subscriber`); one
thread polls every SUB socket and hands each replica's batches on strictly in sequence
order to `on_batch(replica, events)` (a `KVIndex.apply`):

- a hole in a stream is filled through the replica's replay socket before the batch
  after it is handed on;
- right after subscribing, and whenever a stream has been quiet for `resync_s`
  SECONDS, the feed asks the replay socket for everything from the next sequence
  number on: what the replica published before the SUB socket joined (ZeroMQ's slow
  joiner), and a last message that was lost with no later one to reveal the hole;
- what replay cannot give back (the publisher's buffer has moved on) is reported with
  `on_lost(replica, gap)` before the next batch: the index then forgets what it knew
  of the replica (`KVIndex.clear`), since it can no longer tell which blocks it holds,
  and the events that follow rebuild it. A payload that does not decode counts the same.

`remove(replica)` stops handing on that replica's batches at once: a batch being handed
on finishes first (one lock covers each hand-over), and nothing of the replica is
handed on after `remove` returns, so its caller may drop the replica from the index
right after. The feed's thread then closes the replica's sockets.

Must never: interpret events (the index does), hold routing policy, touch a ZeroMQ
socket outside its own thread (they are not thread-safe), or wait without a timeout.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import zmq

from prefixcache.event_subscriber import EventSubscriber, Gap, SequencedBatch
from prefixcache.event_wire import WireFormatError, decode_seq
from prefixcache.events import KVEvent

__all__ = ["EventFeed", "StreamStats"]

_log = logging.getLogger(__name__)

Replica = Hashable
OnBatch = Callable[[Replica, Sequence[KVEvent]], None]
OnLost = Callable[[Replica, Gap], None]


@dataclass
class StreamStats:
    """One replica's stream as the feed saw it (BATCHES unless a name says otherwise).

    batches:  handed on (`replayed` of them came through the replay socket)
    gaps:     holes in the sequence, filled or not; `lost`: batches replay could not
              give back (or that did not decode)
    next_seq: the sequence number expected next
    """

    batches: int = 0
    replayed: int = 0
    gaps: int = 0
    lost: int = 0
    next_seq: int = 0


@dataclass
class _Stream:
    replica: Replica
    endpoint: str
    replay_endpoint: str | None
    topic: str
    stats: StreamStats = field(default_factory=StreamStats)
    sub_socket: zmq.Socket | None = None
    subscriber: EventSubscriber | None = None
    quiet_since: float = 0.0


class EventFeed:
    """Replicas' KV event streams into `on_batch`, in order, from one thread (see the
    module docstring). `resync_s` and `replay_timeout_s` are SECONDS; `poll_s` is how
    long the thread waits for a message before it looks at its commands again."""

    def __init__(
        self,
        on_batch: OnBatch,
        *,
        on_lost: OnLost | None = None,
        resync_s: float = 1.0,
        replay_timeout_s: float = 1.0,
        poll_s: float = 0.05,
        context: zmq.Context | None = None,
    ) -> None:
        for name, value in (("resync_s", resync_s), ("replay_timeout_s", replay_timeout_s), ("poll_s", poll_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 SECONDS, got {value!r}")
        self._on_batch = on_batch
        self._on_lost = on_lost
        self._resync_s = resync_s
        self._replay_timeout_s = replay_timeout_s
        self._poll_ms = max(1, int(poll_s * 1000))
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._live: dict[Replica, _Stream] = {}  # under _lock: what may still be handed on
        self._commands: queue.SimpleQueue[tuple[str, _Stream]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-feed", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------
    def add(self, replica: Replica, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "") -> None:
        """Follow `replica`'s stream: its publisher's PUB `endpoint` (to connect to), its
        ROUTER `replay_endpoint` (None: holes are lost) and `topic`, from sequence 0.
        ValueError if the replica is followed already."""
        stream = _Stream(replica, endpoint, replay_endpoint, topic)
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the event feed is closed")
            if replica in self._live:
                raise ValueError(f"replica {replica!r} is followed already")
            self._live[replica] = stream
        self._commands.put(("add", stream))

    def remove(self, replica: Replica) -> bool:
        """Stop following `replica`: nothing of it is handed on once this returns.
        False if it was not followed."""
        with self._lock:
            stream = self._live.pop(replica, None)
        if stream is None:
            return False
        self._commands.put(("remove", stream))
        return True

    @property
    def alive(self) -> bool:
        """Whether the feed's thread runs (it stops only at `close`, or on a bug: logged)."""
        return self._thread.is_alive()

    @property
    def replicas(self) -> tuple[Replica, ...]:
        with self._lock:
            return tuple(self._live)

    def stats(self) -> dict[Replica, StreamStats]:
        """A copy of each followed replica's `StreamStats`."""
        with self._lock:
            return {r: StreamStats(**vars(s.stats)) for r, s in self._live.items()}

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread and close every socket (within `timeout_s` SECONDS)."""
        with self._lock:
            self._closed.set()
            self._live.clear()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            _log.warning("the KV event feed's thread did not stop within %.1f s", timeout_s)

    def __enter__(self) -> EventFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the feed's thread --------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket, _Stream] = {}
        try:
            while not self._closed.is_set():
                self._run_commands(poller, by_socket)
                if not by_socket:  # zmq's poll returns at once with no socket: it would spin
                    self._closed.wait(self._poll_ms / 1000)
                    continue
                for sock, _ in poller.poll(self._poll_ms):
                    stream = by_socket.get(sock)
                    if stream is not None:
                        self._drain(stream)
                now = time.monotonic()
                for stream in list(by_socket.values()):
                    if now - stream.quiet_since >= self._resync_s:
                        self._resync(stream)
        except Exception:  # noqa: BLE001 - a bug here must be seen, not silently end the feed
            _log.exception("the KV event feed stopped")
        finally:
            for stream in by_socket.values():
                _close(stream)

    def _run_commands(self, poller: zmq.Poller, by_socket: dict[zmq.Socket, _Stream]) -> None:
        while True:
            try:
                command, stream = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "remove":
                if stream.sub_socket is not None:
                    poller.unregister(stream.sub_socket)
                    by_socket.pop(stream.sub_socket, None)
                _close(stream)
                continue
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, stream.topic.encode("utf-8"))
            sock.connect(stream.endpoint)
            stream.sub_socket = sock
            stream.subscriber = EventSubscriber(
                None, replay_endpoint=stream.replay_endpoint, replica=str(stream.replica), start_seq=0,
                replay_timeout_s=self._replay_timeout_s, context=self._ctx,
            )
            poller.register(sock, zmq.POLLIN)
            by_socket[sock] = stream
            self._resync(stream)  # what the replica published before this socket joined

    def _drain(self, stream: _Stream) -> None:
        """Every message waiting on the stream's SUB socket, handed on in order."""
        sock, sub = stream.sub_socket, stream.subscriber
        assert sock is not None and sub is not None
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart()
            stream.quiet_since = time.monotonic()
            seq = None
            try:
                if len(frames) != 3:
                    raise WireFormatError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
                seq = decode_seq(frames[1])
                batches = sub.accept(seq, frames[2])
            except WireFormatError as err:
                self._undecodable(stream, err, seq)
                continue
            self._hand_on(stream, batches)

    def _resync(self, stream: _Stream) -> None:
        stream.quiet_since = time.monotonic()
        sub = stream.subscriber
        if sub is None or stream.replay_endpoint is None:
            return
        try:
            batches = sub.replay_from(sub.next_seq if sub.next_seq is not None else 0)
        except WireFormatError as err:
            self._undecodable(stream, err, None)
            return
        self._hand_on(stream, batches)

    def _undecodable(self, stream: _Stream, err: WireFormatError, seq: int | None) -> None:
        """A message that does not decode (sequence number `seq`, None if unknown): what
        it carried is lost, and with it what the index can tell of the replica."""
        sub = stream.subscriber
        assert sub is not None
        first = sub.next_seq or 0
        if seq is not None and seq >= first:
            sub.next_seq = seq + 1  # the batches before it came back by replay, or are lost with it
        last = max(first, seq if seq is not None else first)
        _log.warning("KV events of replica %r: %s", stream.replica, err)
        self._hand_on(stream, [], lost=Gap(first, last, 0))

    def _hand_on(self, stream: _Stream, batches: list[SequencedBatch], *, lost: Gap | None = None) -> None:
        with self._lock:
            if self._live.get(stream.replica) is not stream:  # removed meanwhile
                return
            stats = stream.stats
            if lost is not None:
                self._lose(stream, lost)
            for b in batches:
                gap = b.gap_before
                if gap is not None:
                    stats.gaps += 1
                    if gap.lost:
                        self._lose(stream, gap)
                stats.batches += 1
                stats.replayed += b.replayed
                try:
                    self._on_batch(stream.replica, b.batch.events)
                except Exception:  # noqa: BLE001 - one replica's bad batch must not stop every stream
                    _log.exception("KV events of replica %r: a batch could not be applied", stream.replica)
                    self._lose(stream, Gap(b.seq, b.seq, 0))
            assert stream.subscriber is not None
            stats.next_seq = stream.subscriber.next_seq or 0

    def _lose(self, stream: _Stream, gap: Gap) -> None:
        stream.stats.lost += gap.lost
        _log.warning("KV events of replica %r: %d batch(es) lost (seq %d..%d)", stream.replica, gap.lost,
                     gap.first, gap.last)
        if self._on_lost is not None:
            self._on_lost(stream.replica, gap)


def _close(stream: _Stream) -> None:
    if stream.sub_socket is not None:
        stream.sub_socket.close(linger=0)
        stream.sub_socket = None
    if stream.subscriber is not None:
        stream.subscriber.close()
        stream.subscriber = None
