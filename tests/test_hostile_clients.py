"""The hostile-client suite: one client cannot hurt the others (issue 27, docs/security.md
"The server under hostile clients").

Each case runs a real replica of the tiny model on 127.0.0.1 and, while the hostile
client does its worst, checks that the others are served: `/health` polled every 100 ms
must answer 200 within 1 s every time, a bystander's stream must finish whole, and a
request after the attack must be served. Cases: a poisoned request among live streams
(a tiny temperature, a forward pass that fails for one request), lone surrogates, an
oversized body and a body that never ends, a chat template that renders for a second,
a slow-socket flood past the open-file limit (a server process of its own), overload
past the queue, and a paused KV event subscriber. Bounded: every wait has a deadline,
and the whole file runs in well under a minute.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import statistics
import sys
import threading
import time
from collections.abc import Iterator

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
zmq = pytest.importorskip("zmq")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.event_subscriber import EventSubscriber  # noqa: E402
from serve_cases import DEADLINE_S, idle, in_engine, running, wait_until  # noqa: E402

# The freezes these tests guard held /health for 18-20 s; an answering server takes
# milliseconds. The bound (1 s) holds for the median probe; a single probe may take
# a second or two on a 2-core machine under a load of 15, so the slowest gets 3 s.
HEALTH_MEDIAN_WITHIN_S = 1.0
HEALTH_WITHIN_S = 3.0
POISON = 2  # a token id no other request of the suite holds


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


class _Others:
    """What the other clients saw while a hostile one acted (see `others_are_served`)."""

    def __init__(self) -> None:
        self.health_s: list[float] = []
        self.health_failures: list[str] = []
        self.bystander: str | None = None


@contextlib.contextmanager
def others_are_served(base_url: str, *, bystander: bool = True, fresh_connections: bool = False) -> Iterator[_Others]:
    """While the block runs: `/health` every 100 ms (a new connection each time with
    `fresh_connections`), and a bystander's streamed completion; after it, both must
    have been served (every `/health` 200, the median within 1 s and the slowest within
    3 s) and one more request is. A block shorter than the poller's start (building its
    client takes longer than a request on a busy machine) ends, then waits for /health's
    first answer, so there is always one to judge."""
    others, stop, polling = _Others(), threading.Event(), threading.Event()

    def poll_health() -> None:
        # One client (building one costs more than a request on a busy machine); with
        # fresh_connections it keeps none alive, so every request opens a connection.
        limits = httpx.Limits(max_keepalive_connections=0) if fresh_connections else httpx.Limits()
        with httpx.Client(base_url=base_url, timeout=10, limits=limits) as client:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = client.get("/health")
                    if r.status_code != 200:
                        others.health_failures.append(f"status {r.status_code}")
                except httpx.HTTPError as err:
                    others.health_failures.append(repr(err))
                others.health_s.append(time.perf_counter() - t0)
                polling.set()
                stop.wait(0.1)

    def stream() -> None:
        body = {"prompt": [40 + i for i in range(30)], "max_tokens": 24, "ignore_eos": True, "stream": True}
        try:
            r = httpx.post(base_url + "/v1/completions", json=body, timeout=DEADLINE_S)
            done = r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text
            others.bystander = "ok" if r.status_code == 200 and done else f"{r.status_code}: {r.text[-200:]}"
        except httpx.HTTPError as err:
            others.bystander = repr(err)

    threads = [threading.Thread(target=poll_health, daemon=True)]
    if bystander:
        threads.append(threading.Thread(target=stream, daemon=True))
    for t in threads:
        t.start()
    try:
        yield others
    finally:
        polling.wait(DEADLINE_S)
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
    assert not others.health_failures, others.health_failures
    assert others.health_s, f"/health did not answer within {DEADLINE_S} s"
    assert max(others.health_s) < HEALTH_WITHIN_S, f"/health took {max(others.health_s):.2f} s"
    median = statistics.median(others.health_s)
    assert median < HEALTH_MEDIAN_WITHIN_S, f"/health took {median:.2f} s (median of {len(others.health_s)})"
    if bystander:
        assert others.bystander == "ok", others.bystander
    after = httpx.post(base_url + "/v1/completions", json={"prompt": "after", "max_tokens": 2}, timeout=DEADLINE_S)
    assert after.status_code == 200, after.text


def metric(replica, name: str, **labels: str) -> float:
    text = httpx.get(replica.base_url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


@pytest.mark.filterwarnings("ignore:a temperature below 0.01 is raised")
def test_a_poisoned_request_among_live_streams_fails_alone(tiny):
    """A temperature of 1e-300 divided the logits into nan and failed the whole batch (8 of
    8 streams got a 500). Now it is clamped as vLLM clamps it and served; and a request
    whose forward pass fails (injected) ends alone with a 500, the streams going on."""
    for backend in ("hash", "radix"):
        with running(tiny, backend) as replica:
            forward = replica.engine.model.forward

            def fails_for_poison(plan):  # the engine thread calls this
                if POISON in plan.token_ids.tolist():
                    raise RuntimeError("injected fault in this request's forward pass")
                return forward(plan)

            replica.engine.model.forward = fails_for_poison
            results: dict[int, str] = {}

            def stream(i: int) -> None:
                body = {"prompt": [50 + i] * 20, "max_tokens": 30, "ignore_eos": True, "stream": True}
                r = httpx.post(replica.base_url + "/v1/completions", json=body, timeout=DEADLINE_S)
                results[i] = "ok" if r.status_code == 200 and '"error"' not in r.text else r.text[-300:]

            with others_are_served(replica.base_url):
                streams = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
                for t in streams:
                    t.start()
                wait_until(lambda: in_engine(replica, lambda e: len(e.scheduler.running)) >= 3, "streams running")
                for temperature in (1e-300, 5e-324):
                    tiny_t = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S, json={
                        "prompt": [5, 6, 7], "max_tokens": 4, "temperature": temperature})
                    assert tiny_t.status_code == 200, tiny_t.text
                faulty = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S,
                                    json={"prompt": [POISON] * 8, "max_tokens": 4})
                faulty_stream = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S,
                                           json={"prompt": [POISON] * 9, "max_tokens": 4, "stream": True})
                for t in streams:
                    t.join(DEADLINE_S)
            assert results == {i: "ok" for i in range(6)}, results
            error = faulty.json()["error"]
            assert faulty.status_code == 500 and error["type"] == "InternalServerError"
            assert "injected" in error["message"]
            assert '"InternalServerError"' in faulty_stream.text and faulty_stream.text.endswith("data: [DONE]\n\n")
            assert metric(replica, "vllm:request_success_total", finished_reason="error") == 2
            idle(replica)
            in_engine(replica, lambda e: e.check_invariants())


def test_lone_surrogates_get_a_400_naming_the_field(tiny):
    with running(tiny, "hash") as replica, others_are_served(replica.base_url):
        for raw, param in ((b'{"prompt": "a\\ud800b"}', "prompt"), (b'{"prompt": ["\\ud800"]}', "prompt[0]"),
                           (b'{"model": "\\ud800", "prompt": "x"}', "model")):
            r = httpx.post(replica.base_url + "/v1/completions", content=raw,
                           headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_oversized_body_or_one_that_never_ends_is_refused_without_reading_it(tiny):
    server = {"max_body_bytes": 64 * 1024, "body_timeout_s": 0.5}
    with running(tiny, "hash", server=server) as replica, others_are_served(replica.base_url):
        base = replica.base_url
        big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
        r = httpx.post(base + "/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413 and r.headers["connection"] == "close"

        def chunks() -> Iterator[bytes]:  # no Content-Length: refused once 64 KiB arrived
            for _ in range(64):
                yield b" " * 16384

        r = httpx.post(base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        # A text longer than the context could hold in tokens: refused before tokenizing.
        r = httpx.post(base + "/v1/completions", json={"prompt": "y" * 60_000})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_text"
        # Headers that promise a body that never comes: a 408 after body_timeout_s.
        with socket.create_connection(_address(base), timeout=DEADLINE_S) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 100\r\n\r\n{\"prompt\"")
            assert b" 408 " in _read_until_closed(s).split(b"\r\n", 1)[0]
        assert metric(replica, "prefixcache:refusals_total", reason="body_too_large") == 2
        assert metric(replica, "prefixcache:refusals_total", reason="body_timeout") == 1


def test_a_slow_chat_template_renders_off_the_event_loop_within_its_deadline():
    """A chat template (a config's, under --no-import: untrusted) rendered on the event
    loop froze every request while it ran, and nested loops froze the server for good."""
    slow = ("{% for i in range(100000) %}{% for j in range(40) %}{% endfor %}{% endfor %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    spin = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    with running(load_model("tiny", chat_template=slow), "hash", server={"chat_template_timeout_s": 1.5}) as replica:
        with others_are_served(replica.base_url):
            r = httpx.post(replica.base_url + "/v1/chat/completions", timeout=DEADLINE_S,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code in (200, 400), r.text  # rendered, or cut at its deadline on a slow machine
    with running(load_model("tiny", chat_template=spin), "hash", server={"chat_template_timeout_s": 0.5}) as replica:
        with others_are_served(replica.base_url):
            t0 = time.perf_counter()
            r = httpx.post(replica.base_url + "/v1/chat/completions", timeout=DEADLINE_S,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert time.perf_counter() - t0 < 5.0
        assert r.status_code == 400 and "took more than 0.5 s" in r.json()["error"]["message"]


def test_overload_past_the_queue_gets_503_with_retry_after_and_is_counted(tiny):
    server = {"max_queued_requests": 2, "retry_after_s": 3}
    with running(tiny, "hash", max_num_seqs=2, server=server) as replica:
        with others_are_served(replica.base_url) as others:
            # The bystander first (it must be served), then twelve at once.
            wait_until(lambda: others.bystander is not None or in_engine(replica, lambda e: e.has_unfinished()),
                       "the bystander to be inside")
            statuses: list[tuple[int, str | None]] = []
            start = threading.Barrier(12)

            def ask(i: int) -> None:
                start.wait(DEADLINE_S)
                r = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S,
                               json={"prompt": [60 + i] * 10, "max_tokens": 150, "ignore_eos": True})
                statuses.append((r.status_code, r.headers.get("retry-after")))

            crowd = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
            for t in crowd:
                t.start()
            for t in crowd:
                t.join(DEADLINE_S)
        refused = [s for s in statuses if s[0] == 503]
        # 2 running + 2 waiting: 4 places, one of them the bystander's if it is still inside.
        assert len(statuses) == 12 and len(refused) in (8, 9), statuses
        assert all(s == (503, "3") for s in refused) and all(s[0] in (200, 503) for s in statuses)
        assert metric(replica, "prefixcache:refusals_total", reason="queue_full") == len(refused)
        # A request's choices count at the gate: more than it ever takes is a 400 naming n;
        # as many as it takes fit once the crowd has left, and leave nothing counted.
        wait_until(lambda: not in_engine(replica, lambda e: e.has_unfinished()), "the crowd to leave")
        body = {"prompt": [60] * 10, "max_tokens": 2}
        too_many = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S, json={**body, "n": 5})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
        for _ in range(2):  # the second fits only if the first released all four places
            four = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S, json={**body, "n": 4})
            assert four.status_code == 200 and len(four.json()["choices"]) == 4
        busy = threading.Thread(target=httpx.post, args=(replica.base_url + "/v1/completions",),
                                kwargs={"timeout": DEADLINE_S, "json": {"prompt": [61] * 10, "max_tokens": 150,
                                                                        "ignore_eos": True}})
        busy.start()
        wait_until(lambda: in_engine(replica, lambda e: e.has_unfinished()), "a request to be inside")
        crowded = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S, json={**body, "n": 4})
        assert crowded.status_code == 503 and crowded.headers["retry-after"] == "3"  # 1 + 4 > 4 places, for now
        busy.join(DEADLINE_S)


def test_a_paused_subscriber_is_counted_and_the_others_still_get_every_batch(tiny):
    events = {"hwm": 1, "buffer_steps": 100_000}
    with running(tiny, "hash", block_size=1, num_blocks=1024, events=events) as replica:
        pub = replica.publisher
        # A small kernel send buffer for the connections to come: left to autotuning (up to 4 MB
        # here) it absorbed nearly all of this test's events (2-4 of ~230 batches dropped), and
        # some runs dropped none.
        pub._pub.setsockopt(zmq.SNDBUF, 8192)
        paused = zmq.Context.instance().socket(zmq.SUB)  # subscribes, then never reads
        paused.setsockopt(zmq.RCVHWM, 1)
        paused.setsockopt(zmq.RCVBUF, 1024)
        paused.setsockopt(zmq.SUBSCRIBE, b"")
        paused.setsockopt(zmq.LINGER, 0)
        paused.connect(pub.endpoint)
        live = EventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0, probe_interval_s=0.2)
        got: list[int] = []
        stop = threading.Event()

        def consume() -> None:
            while not stop.is_set():
                got.extend(b.seq for b in live.poll(0.05))

        reader = threading.Thread(target=consume, daemon=True)
        try:
            time.sleep(0.3)  # both subscriptions reach the publisher
            reader.start()
            with others_are_served(replica.base_url):
                # block 1, each prompt's 640 blocks new: hundreds of events a request, more than the
                # kernel's socket buffers hold for the paused subscriber (100-token prompts fit, now
                # and then, and nothing was dropped)
                # Kernel buffers of any size fill in the end: more requests until one batch was
                # dropped (12 drop some on most runs), bounded in count.
                for i in range(48):
                    r = httpx.post(replica.base_url + "/v1/completions", timeout=DEADLINE_S,
                                   json={"prompt": [i % 300] * 40 + list(range(300)) * 2, "max_tokens": 20})
                    assert r.status_code == 200
                    if i >= 11 and pub.flush() and pub.dropped_batches()["hwm"]:
                        break
            assert pub.flush()
            published = pub.num_published
            dropped = pub.dropped_batches()["hwm"]
            assert dropped > 0  # the paused subscriber's queue filled: every batch past it counted
            assert metric(replica, "prefixcache:kv_event_batches_dropped_total", reason="hwm") == dropped
            # The live subscriber gets every batch, the dropped ones through replay (a tail it
            # missed through its probe, with no new batch to reveal the gap) ...
            wait_until(lambda: len(got) >= published, f"the live subscriber to have all {published} batches", 10)
            assert got == list(range(published)) and not [g for g in live.gaps if g.lost]
            # ... and it probes once the stream has been quiet for its probe interval (whether or
            # not the tail was dropped: asserting at once raced that interval)
            wait_until(lambda: live.probes > 0, "the live subscriber to probe the quiet stream", 10)
        finally:
            stop.set()
            reader.join(DEADLINE_S)
            live.close()
            paused.close(linger=0)


def test_idle_and_slow_connections_are_closed_after_the_header_deadline(tiny):
    with running(tiny, "hash", server={"header_timeout_s": 0.5, "keep_alive_timeout_s": 0.3}) as replica:
        host, port = _address(replica.base_url)
        silent = [socket.create_connection((host, port), timeout=DEADLINE_S) for _ in range(5)]
        trickle = [socket.create_connection((host, port), timeout=DEADLINE_S) for _ in range(5)]
        with others_are_served(replica.base_url):
            for s in trickle:
                s.sendall(b"GET /health HTTP/1.1\r\n")
            for _ in range(3):  # a header line now and then never completes the request in time
                time.sleep(0.2)
                for s in trickle:
                    with contextlib.suppress(OSError):
                        s.sendall(b"x-slow: 1\r\n")
        for s in silent:
            assert _read_until_closed(s) == b""  # closed without a word
        for s in trickle:
            assert _read_until_closed(s).startswith(b"HTTP/1.1 408")
        for s in silent + trickle:
            s.close()
        assert metric(replica, "prefixcache:refusals_total", reason="header_timeout") == 10


@pytest.fixture(scope="module")
def server_process(tmp_path_factory):
    """`prefixcache --no-import serve` in a process of its own, with an open-file limit of
    128 (it holds 16 when idle), a 2 s header deadline and a chat template that loops for
    good (120 s allowed): the slow-socket flood runs against it, then SIGTERM stops it
    (the last test)."""
    config = ("cache: {backend: hash, block_size: 4, num_blocks: 256}\n"
              "engine:\n  model: tiny\n  num_threads: 1\n  chat_template: >-\n"
              "    {% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}\n"
              "server: {header_timeout_s: 2, chat_template_timeout_s: 120}\n")
    with _serve_process(tmp_path_factory.mktemp("serve"), config, fd_limit=128) as server:
        yield server


def test_a_slow_socket_flood_past_the_open_file_limit_does_not_lock_out_the_others(server_process):
    """160 sockets that never finish their headers, against a server process whose
    open-file limit is 128: it could not accept /health at all (it waited in the backlog
    until the flood left). Now it keeps a slot free by closing the oldest connection that
    has not asked yet (its cap: 64 connections), and the header deadline closes the rest."""
    _, base, port = server_process
    flood: list[socket.socket] = []
    try:
        with others_are_served(base, fresh_connections=True):
            for _ in range(160):
                s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
                s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
                flood.append(s)
            time.sleep(1.5)
        closed = 0
        deadline = time.monotonic() + 10
        for s in flood:  # each was displaced by a newer one, or its header deadline passed
            s.settimeout(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                _read_until_closed(s)
                closed += 1
        assert closed == len(flood)
    finally:
        for s in flood:
            s.close()


def test_sigterm_stops_the_server_while_a_chat_template_renders(server_process):
    """A config's chat template with nested loops froze the event loop on the first chat
    request, and SIGTERM could not stop the process (SIGKILL was needed). Rendering now
    runs in a daemon worker thread: the server shuts down at once, mid-render."""
    proc, base, _ = server_process

    def chat() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(base + "/v1/chat/completions", timeout=30,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    threading.Thread(target=chat, daemon=True).start()
    time.sleep(1.0)  # rendering
    assert _healthy(base)  # the event loop is free while it renders
    proc.send_signal(signal.SIGTERM)
    t0 = time.perf_counter()
    proc.wait(15)
    assert time.perf_counter() - t0 < 10


@contextlib.contextmanager
def _serve_process(tmp_path, config: str, *, fd_limit: int | None = None):
    """`prefixcache serve` in a process of its own on a free loopback port, started and
    healthy; killed if it is still running at the end."""
    path = tmp_path / "serve.yaml"
    path.write_text(config)
    port = _free_port()

    def limit_fds() -> None:
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    code = "import sys; from prefixcache.cli import main; sys.exit(main(sys.argv[1:]))"
    log = tmp_path / "serve.log"  # a file, not a pipe nobody reads: a full pipe would stop the server
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", code, "--no-import", "serve", str(path), "--port", str(port)],
                                preexec_fn=limit_fds, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(base) or proc.poll() is not None, "the server to start", 90)
        assert proc.poll() is None, log.read_text()[-2000:]
        yield proc, base, port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(15)


# -- helpers --------------------------------------------------------------------------------


def _address(base_url: str) -> tuple[str, int]:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by the
    socket's timeout)."""
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
