"""`prefixcache cluster serve` as the README gives it, in a process of its own: the
shipped default (two tiny replicas, CPUs sized to this machine) becomes ready within 4
minutes, serves and counts requests on the ingress's `/metrics`, and stops on the first
Ctrl-C (exit 130) or SIGTERM (exit 0), Ray included: no process it started is left.

The proxy listens on a free loopback port (`--port`); everything else is the shipped file.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

# ray_app, not ray: it sets Ray's local-only switch, which Ray reads at its first import in
# this process (test_ray_cluster starts a cluster here later).
pytest.importorskip("prefixcache.serve.ray_app", reason="the `cluster` extra (ray[serve]) is not installed")
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.ray

READY_S = 240.0  # the bound for the shipped config on a 2-core machine
STOP_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`prefixcache cluster serve` in a process of its own; its output read by a thread."""

    def __init__(self, port: int) -> None:
        cmd = [sys.executable, "-m", "prefixcache.cli", "cluster", "serve", "--port", str(port)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for_line(self, prefix: str, timeout_s: float) -> tuple[str, float]:
        """The first output line starting with `prefix`, and when it was seen (monotonic)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line, time.monotonic()
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no line starting {prefix!r} within {timeout_s} s:\n{self.output()[-3000:]}")

    def wait(self, timeout_s: float) -> int:
        code = self.proc.wait(timeout_s)
        self._reader.join(10)
        return code

    def output(self) -> str:
        return "".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def descendants(proc: subprocess.Popen) -> set[tuple[int, float]]:
    out = set()
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            out.add((child.pid, child.create_time()))
        except psutil.Error:
            pass
    return out


def alive(processes: set[tuple[int, float]]) -> list[str]:
    left = []
    for pid, created in processes:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.name()} ({pid})")
        except psutil.Error:
            pass
    return left


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no sample {name} {labels}")


def test_the_shipped_cluster_is_ready_in_time_serves_counts_and_stops_on_the_first_ctrl_c():
    port = free_port()
    began = time.monotonic()
    server = Server(port)
    try:
        line, _ = server.wait_for_line("starting a local Ray cluster: ", 60)
        assert f"{len(os.sched_getaffinity(0))} logical CPUs" in line  # sized to this machine
        _, ready = server.wait_for_line("serving 2 replicas (kv_events) at ", READY_S)
        assert ready - began <= READY_S
        url = f"http://127.0.0.1:{port}"
        started = descendants(server.proc)
        prompt = "The same system prompt for both requests, long enough to fill blocks. " * 4
        usage = [httpx.post(f"{url}/v1/completions", json={"prompt": prompt + q, "max_tokens": 4}, timeout=60)
                 .json()["usage"] for q in ("first?", "second?")]
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert metric(text, "vllm:request_success_total", finished_reason="length", engine="ingress") == 2
        assert metric(text, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
        assert metric(text, "vllm:prefix_cache_hits_total") == sum(u["prompt_tokens_details"]["cached_tokens"]
                                                                    for u in usage)
        assert metric(text, "vllm:time_to_first_token_seconds_count") == 2
        assert httpx.head(f"{url}/metrics", timeout=30).status_code == 200
        stopped = time.monotonic()
        server.proc.send_signal(signal.SIGINT)  # once
        assert server.wait(STOP_S) == 130 and server.output().rstrip().endswith("interrupted"), server.output()[-2000:]
        assert time.monotonic() - stopped < STOP_S
        time.sleep(1)
        assert alive(started) == [], "processes left after Ctrl-C"
    finally:
        server.kill()


def test_sigterm_while_the_cluster_starts_stops_it_and_leaves_no_ray_process():
    server = Server(free_port())
    started: set[tuple[int, float]] = set()
    try:
        server.wait_for_line("starting a local Ray cluster: ", 60)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # Ray's own processes are up: the raylet among them
            started |= descendants(server.proc)
            if any("raylet" in name for name in alive(started)):
                break
            time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(STOP_S) == 0 and "Traceback" not in server.output(), server.output()[-2000:]
        time.sleep(1)
        assert alive(started) == [], "processes left after SIGTERM"
    finally:
        server.kill()
