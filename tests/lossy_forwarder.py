"""`LossyForwarder`: a KV event stream passed on with chosen messages dropped, as a network
would drop them (the event feed's tests, and the Ray cluster's lossy replicas)."""

from __future__ import annotations

import threading

import zmq

from prefixcache.event_wire import decode_seq

__all__ = ["LossyForwarder"]


class LossyForwarder:
    """SUB from a replica's PUB, PUB to the feed on a free loopback port, dropping the
    messages whose sequence numbers are in `drop`."""

    def __init__(self, upstream: str, drop: set[int]) -> None:
        ctx = zmq.Context.instance()
        self.drop = drop
        self.dropped: list[int] = []
        self.forwarded = 0
        self.last_seq = -1
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(20):
                frames = self._sub.recv_multipart()
                seq = self.last_seq = decode_seq(frames[1])
                if seq in self.drop:
                    self.dropped.append(seq)
                else:
                    self._pub.send_multipart(frames)
                    self.forwarded += 1

    def close(self, timeout_s: float = 60.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._sub.close(linger=0)
        self._pub.close(linger=0)
