"""`prefixcache serve` as a new user and the tools around it meet it: the start-up summary,
a busy port found before the model loads, KV events bound on the HTTP host, `HEAD
/metrics`, and what `/server_info` tells a router or an indexer about the event stream."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
zmq = pytest.importorskip("zmq")
psutil = pytest.importorskip("psutil")

from prefixcache.cli import main  # noqa: E402
from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.event_subscriber import EventSubscriber  # noqa: E402
from prefixcache.hashing import resolve_seed  # noqa: E402
from prefixcache.serve.server import Replica  # noqa: E402
from serve_cases import serve_config  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_prints_a_summary_binds_events_on_its_host_and_stops_on_ctrl_c():
    port = free_port()
    cmd = [sys.executable, "-m", "prefixcache.cli", "serve", "--port", str(port), "--set", "engine.model=tiny",
           "--set", "kv_events.enabled=true", "--set", "kv_events.endpoint=tcp://*:*",
           "--set", "kv_events.replay_endpoint=tcp://*:*"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = [proc.stdout.readline() for _ in range(3)]  # printed before the server starts
        assert lines[0].startswith("prefixcache serve: model tiny as 'tiny'; cache hash, 1,024 blocks x 16 tokens = "
                                   "16,384 tokens"), lines
        assert "max_model_len 4,096" in lines[0]
        assert lines[1].startswith("KV events: PUB tcp://127.0.0.1:") and "replay tcp://127.0.0.1:" in lines[1]
        assert lines[2].startswith(f"OpenAI API at http://127.0.0.1:{port}/v1")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the server did not come up"
            time.sleep(0.1)
        head = httpx.head(url + "/metrics", timeout=10)  # aiperf probes the page with HEAD first
        assert head.status_code == 200 and head.headers["content-type"].startswith("text/plain") and not head.content
        listening = {c.laddr.ip for c in psutil.Process(proc.pid).net_connections("inet") if c.status == "LISTEN"}
        assert listening == {"127.0.0.1"}, listening  # HTTP, PUB and replay: none on every interface
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and err.rstrip().endswith("interrupted") and "Traceback" not in err, err
    finally:
        proc.kill()
        proc.wait(10)


def test_a_busy_port_is_one_line_before_the_model_loads(capsys, monkeypatch):
    import prefixcache.engine.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model loaded before the port check"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--set", "engine.model=tiny", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --port: 127.0.0.1:{port} cannot be listened on") and err.count("\n") == 1
        code = main(["serve", "--set", "engine.model=tiny", "--port", str(free_port()), "--set", "kv_events.enabled=true",
                     "--set", f"kv_events.endpoint=tcp://*:{port}"])
        assert code == 2
        assert f"kv_events.endpoint: 127.0.0.1:{port} cannot be listened on" in capsys.readouterr().err


def test_server_info_describes_the_event_stream_so_a_subscriber_can_follow_it():
    tiny = load_model("tiny")
    replica = Replica(serve_config(events=True), model=tiny, served_model_name="served")
    url = replica.start()
    try:
        info = httpx.get(url + "/server_info", timeout=30).json()
        assert info == httpx.get(url + "/get_server_info", timeout=30).json() | {"startup_time": info["startup_time"]}
        assert (info["served_model_name"], info["model_path"], info["page_size"], info["dp_size"]) == ("served", "tiny", 4, 1)
        assert info["max_total_num_tokens"] == 256 * 4 and info["vocab_size"] == 320
        events = info["kv_events"]
        assert events["endpoint"] == replica.publisher.endpoint and events["replay_endpoint"] == replica.publisher.replay_endpoint
        assert events["publisher"] == "zmq" and events["endpoint_host"] == "127.0.0.1"
        assert f"tcp://127.0.0.1:{events['endpoint_port_base']}" == events["endpoint"]
        assert events["block_size"] == 4 and events["hash_algorithm"] == "sha256_cbor"
        assert events["hash_seed"] == resolve_seed("sha256_cbor") and events["int_block_hashes"] is True
        model = httpx.get(url + "/model_info", timeout=30).json()
        assert model["served_model_name"] == "served" and model["vocab_size"] == 320 and model["is_generation"]

        # A subscriber that knows nothing but /server_info receives the replica's events.
        httpx.post(url + "/v1/completions", json={"prompt": "an event for the reader " * 4, "max_tokens": 1},
                   timeout=30).raise_for_status()
        with EventSubscriber(events["endpoint"], replay_endpoint=events["replay_endpoint"], replica="r0",
                             start_seq=0) as sub:
            deadline = time.monotonic() + 30
            got = sub.replay_from(0)
            while not got and time.monotonic() < deadline:
                got = sub.poll(timeout_s=0.2) or sub.replay_from(0)
            assert any(type(e).__name__ == "BlockStored" for b in got for e in b.batch.events), got
    finally:
        replica.stop()


def test_the_subscriber_snippet_of_docs_serving_runs_as_written(tmp_path):
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    section = page[page.index("### The subscriber"):]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)[:1]
    script = tmp_path / "follow_events.py"
    script.write_text(snippet)
    replica = Replica(serve_config(events=True), model=load_model("tiny"))
    url = replica.start()
    try:
        for i in range(2):
            httpx.post(url + "/v1/completions", json={"prompt": f"blocks to follow {i} " * 8, "max_tokens": 1},
                       timeout=30).raise_for_status()
        cached = replica.loop.call(lambda e: e.cache.pool.num_cached).result(30)  # keyed blocks of `hash`
        done = subprocess.run([sys.executable, str(script), url, "2"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        blocks = int(re.fullmatch(r"r0 holds (\d+) blocks \(block_size 4, sha256_cbor\)\n", done.stdout)[1])
        assert blocks == cached > 0
    finally:
        replica.stop()
