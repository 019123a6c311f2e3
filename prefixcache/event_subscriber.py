"""One replica's KV event stream, consumed: ZeroMQ SUB in, decoded batches out, in order.

Owns `EventSubscriber`, the consumer side of vLLM 0.33's `ZmqEventPublisher` (and of
`prefixcache serve`, which publishes the same stream): it connects a SUB socket to the
publisher, decodes each `(topic, 8-byte big-endian sequence number, msgpack batch)`
message (`prefixcache.event_wire`), hands batches on strictly in sequence order, and
when a sequence number is missing asks the publisher's ROUTER replay socket for the
batches from the first missing one on. What replay cannot give back (the publisher's
buffer is bounded) is reported, never papered over: the batch after such a gap carries
a `Gap` with `lost > 0`, the sign for a consumer that mirrors the replica's cache (a
KV index) to drop what it knows and rebuild.

A subscriber learns that it is behind without waiting for the next batch by a sequence
probe on the replay socket (`probe`, and `poll` every `probe_interval_s` of silence): a
replay request from the next sequence number it expects. Nothing new: only the end
marker comes back. A tail it missed (batches published, then silence) comes back as
replayed batches, and what the buffer no longer holds as a Gap. This is vLLM's own replay
request, so it works against vLLM's publisher too, and the stream itself is unchanged (a
heartbeat message on it would be a batch vLLM's consumers do not expect).

Replay protocol (vLLM 0.33): the client sends `(b"", start_seq as 8 bytes)` from a
DEALER socket; the ROUTER answers with one `(b"", topic, seq, payload)` message per
buffered batch with `seq >= start_seq`, then the end marker `(b"", b"", END_SEQ, b"")`.
Older publishers leave the topic frame out; both shapes are read.

Thread-safety: one subscriber, one thread (ZeroMQ sockets are not thread-safe).

Must never: be imported by `import prefixcache` (it needs pyzmq and msgspec: `pip install
'prefixcache[events]'`), interpret events (a KV index does that), or wait without a
timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

try:
    import zmq
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError("prefixcache.event_subscriber needs pyzmq: pip install 'prefixcache[events]'") from err

from prefixcache.event_wire import END_SEQ, KVEventBatch, WireFormatError, decode_batch, decode_seq, encode_seq

__all__ = ["EventSubscriber", "SequencedBatch", "Gap"]


@dataclass(frozen=True)
class Gap:
    """Sequence numbers `first..last` (inclusive) did not arrive on the SUB socket;
    `recovered` of them came back through replay, `lost` did not."""

    first: int
    last: int
    recovered: int

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    @property
    def lost(self) -> int:
        return self.size - self.recovered


@dataclass(frozen=True)
class SequencedBatch:
    """A decoded batch of one replica, with its sequence number.

    `replayed`: it came through the replay socket. `gap_before`: set on the first batch
    handed on after a gap (the gap and what replay recovered of it), else None."""

    replica: str
    seq: int
    batch: KVEventBatch
    replayed: bool = False
    gap_before: Gap | None = None


class EventSubscriber:
    """Consumer of one publisher (see the module docstring).

    endpoint:        the publisher's PUB address to connect to (`tcp://127.0.0.1:5557`),
                     or None for a subscriber its caller feeds through `accept`
    replay_endpoint: the publisher's ROUTER replay address, or None (gaps are then
                     reported as lost)
    topic:           subscribe to messages whose topic starts with this ("" = all)
    replica:         a name for this stream, copied into every `SequencedBatch`
    start_seq:       the first sequence number expected; None = whatever arrives first
                     (a subscriber that joins late then misses nothing it could know of)
    replay_timeout_s: how long one replay may take, SECONDS, before the rest of the gap
                     is declared lost
    probe_interval_s: with a replay endpoint, `poll` probes (`probe`) when nothing has
                     arrived for this many SECONDS; None: never on its own
    """

    def __init__(
        self,
        endpoint: str | None,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replica: str = "",
        start_seq: int | None = None,
        replay_timeout_s: float = 2.0,
        probe_interval_s: float | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        if start_seq is not None and (isinstance(start_seq, bool) or not isinstance(start_seq, int) or start_seq < 0):
            raise ValueError(f"start_seq must be an int >= 0 or None, got {start_seq!r}")
        if not replay_timeout_s > 0:
            raise ValueError(f"replay_timeout_s must be > 0, got {replay_timeout_s!r}")
        if probe_interval_s is not None and not probe_interval_s > 0:
            raise ValueError(f"probe_interval_s must be > 0 or None, got {probe_interval_s!r}")
        self.probe_interval_s = probe_interval_s
        self.probes = 0  # sequence probes sent
        self._heard = time.monotonic()  # when a message or a probe's answer last came
        self.replica = replica
        self.next_seq: int | None = start_seq
        self.gaps: list[Gap] = []
        self.duplicates = 0  # messages at or below what was already handed on (replay overlap)
        self._replay_timeout_s = replay_timeout_s
        self._ctx = context or zmq.Context.instance()
        self._sub: Any = None
        self._replay: Any = None
        if endpoint is not None:
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
            self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        if replay_endpoint is not None:
            self._replay = self._dealer()

    # -- receiving ------------------------------------------------------------------------
    def poll(self, timeout_s: float) -> list[SequencedBatch]:
        """Batches that arrived within `timeout_s` SECONDS (waiting for the first one at
        most that long, then taking whatever else is already there), in order, gaps
        replayed. Empty if nothing arrived."""
        if self._sub is None:
            raise RuntimeError("this subscriber has no endpoint: feed it with accept()")
        out: list[SequencedBatch] = []
        wait_ms = max(0, int(timeout_s * 1000))
        while self._sub.poll(wait_ms, zmq.POLLIN):
            wait_ms = 0
            frames = self._sub.recv_multipart()
            if len(frames) != 3:
                raise WireFormatError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
            out += self.accept(decode_seq(frames[1]), frames[2])
        if out:
            self._heard = time.monotonic()
        elif (self.probe_interval_s is not None and self._replay is not None and self.next_seq is not None
              and time.monotonic() - self._heard >= self.probe_interval_s):
            out = self.probe()
        return out

    def probe(self) -> list[SequencedBatch]:
        """Ask the replay socket for anything from the next expected sequence number on
        (a sequence probe, see the module docstring): the batches this subscriber missed
        and the publisher still has, in order; a Gap for what it no longer has; nothing
        when it is up to date (or has seen nothing yet)."""
        self._heard = time.monotonic()
        if self.next_seq is None:
            return []
        self.probes += 1
        return self.replay_from(self.next_seq)

    def accept(self, seq: int, payload: bytes) -> list[SequencedBatch]:
        """One published message (its sequence number and payload), as `poll` hands each
        one it receives; exposed for callers that run their own socket loop. Returns the
        batches it lets through, in order: none for a duplicate, several after a gap
        that replay filled."""
        return self._hand_on(seq, payload, replayed=False)

    def replay_from(self, start_seq: int) -> list[SequencedBatch]:
        """Every batch the publisher still buffers from `start_seq` on (an explicit
        catch-up, e.g. right after connecting), handed on in order like the stream:
        what was handed on already is skipped, and a hole before the first one is a Gap."""
        if self._replay is None:
            raise RuntimeError("this subscriber has no replay_endpoint")
        out: list[SequencedBatch] = []
        for seq, payload in self._request_replay(start_seq):
            out += self._hand_on(seq, payload, replayed=True)
        return out

    # -- internals ------------------------------------------------------------------------
    def _dealer(self) -> Any:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        return sock

    def _hand_on(self, seq: int, payload: bytes, *, replayed: bool) -> list[SequencedBatch]:
        if self.next_seq is None:
            self.next_seq = seq
        if seq < self.next_seq:
            self.duplicates += 1
            return []
        gap = None
        out: list[SequencedBatch] = []
        if seq > self.next_seq:
            first = self.next_seq
            # A hole inside a replay is not in the publisher's buffer: asking again is futile.
            out = [] if replayed else self._replay_range(first, seq)
            gap = Gap(first, seq - 1, len(out))
            self.gaps.append(gap)
            if out:
                out[0] = _with_gap(out[0], gap)
        batch = decode_batch(payload)
        out.append(SequencedBatch(self.replica, seq, batch, replayed, gap_before=None if out else gap))
        self.next_seq = seq + 1
        return out

    def _replay_range(self, first: int, stop: int) -> list[SequencedBatch]:
        """Batches first..stop-1 through replay, in order, stopping at the first hole
        (what follows a hole cannot be handed on in order)."""
        if self._replay is None:
            return []
        out = []
        expected = first
        for seq, payload in self._request_replay(first):
            if seq < expected:
                continue
            if seq != expected or seq >= stop:
                break
            out.append(SequencedBatch(self.replica, seq, decode_batch(payload), replayed=True))
            expected += 1
        return out

    def _request_replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Ask the ROUTER for everything from `start_seq` on; collect until the end
        marker or the replay timeout."""
        self._replay.send_multipart((b"", encode_seq(start_seq)))
        deadline = time.monotonic() + self._replay_timeout_s
        got = []
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._replay.poll(left_ms, zmq.POLLIN):
                # Timed out: the rest counts as lost, and a fresh socket keeps this
                # replay's late answers (an end marker among them) out of the next one.
                self._replay.close(linger=0)
                self._replay = self._dealer()
                return got
            frames = self._replay.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the DEALER sees ROUTER's empty delimiter
            if len(frames) == 3:
                frames = frames[1:]  # vLLM 0.33 sends the topic too
            if len(frames) != 2:
                raise WireFormatError(f"a replay message has (topic,) seq, payload frames, got {len(frames)}")
            seq_frame, payload = frames
            if seq_frame == END_SEQ:
                return got
            got.append((decode_seq(seq_frame), payload))

    def close(self) -> None:
        for sock in (self._sub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._replay = None

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _with_gap(batch: SequencedBatch, gap: Gap) -> SequencedBatch:
    return SequencedBatch(batch.replica, batch.seq, batch.batch, batch.replayed, gap)
