"""`prefixcache bench`: the schedule it sends, and real runs against a replica on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math
import statistics

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from prefixcache.cli import main  # noqa: E402
from prefixcache.config import ConfigError  # noqa: E402
from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.loadgen.options import BenchOptions, parse_workload_args  # noqa: E402
from prefixcache.loadgen.runner import run_bench  # noqa: E402
from prefixcache.loadgen.schedule import build_schedule, map_tokens  # noqa: E402
from prefixcache.loadgen.summary import summarize  # noqa: E402
from prefixcache.workloads import shared_prefix, synthetic_records, write_records  # noqa: E402
from serve_cases import idle, in_engine, running  # noqa: E402

SMALL = {"num_groups": 2, "prompts_per_group": 4, "system_prompt_len": 64, "question_len": 12, "output_len": 4}


def options(**kw) -> BenchOptions:
    return BenchOptions(**{"base_url": "http://127.0.0.1:1", "workload_args": SMALL, "vocab_size": 320, **kw})


@pytest.fixture(scope="module")
def replica():
    with running(load_model("tiny"), "hash", num_blocks=512, max_num_seqs=4) as r:
        yield r


# -- the schedule (no server) ----------------------------------------------------------


def test_poisson_arrivals_at_the_rate_asked_and_seeded():
    reqs, _ = build_schedule(options(workload_args={**SMALL, "num_groups": 50}, request_rate=20.0, seed=3))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert len(reqs) == 200 and reqs[0].arrival_s == 0 and min(gaps) >= 0
    assert 0.04 < statistics.mean(gaps) < 0.06  # 1/20 s, over 199 exponential gaps
    again, _ = build_schedule(options(workload_args={**SMALL, "num_groups": 50}, request_rate=20.0, seed=3))
    assert [r.arrival_s for r in again] == [r.arrival_s for r in reqs]
    burst, _ = build_schedule(options())
    assert {r.arrival_s for r in burst} == {0.0}  # rate inf: all at once


def test_prompts_keep_their_sharing_inside_the_vocabulary():
    reqs, workload = build_schedule(options(num_requests=5, max_output_tokens=3))
    expected = shared_prefix(seed=0, **SMALL).requests
    assert len(reqs) == 5 and all(r.max_tokens == 3 for r in reqs)
    for r, w in zip(reqs, expected):
        assert len(r.prompt) == len(w.prompt) and all(0 <= t < 320 for t in r.prompt)
    heads = {}
    for r, w in zip(reqs, expected):  # equal workload heads -> equal sent heads, and only those
        heads.setdefault(tuple(w.prompt.tolist()[:64]), set()).add(r.prompt[:64])
    assert all(len(sent) == 1 for sent in heads.values()) and len({s.pop() for s in heads.values()}) == len(heads)
    ids = list(range(512 * 6))  # Mooncake blocks 0..5: `id % 320` would make blocks 0 and 5 equal
    mapped = map_tokens(ids, 320)
    assert mapped[:512] != mapped[5 * 512:] and map_tokens([7, 7], 320)[0] == map_tokens([7], 320)[0]


def test_a_trace_replays_by_its_timestamps_scaled(tmp_path):
    path = tmp_path / "trace.jsonl"
    records = synthetic_records(6, seed=1, max_gap_ms=50, max_output=8)
    write_records(path, records)
    reqs, _ = build_schedule(options(trace=str(path), time_scale=0.5, max_input_tokens=40, vocab_size=49152))
    t0 = records[0].timestamp_ms
    assert [r.arrival_s for r in reqs] == pytest.approx([(rec.timestamp_ms - t0) / 1000 * 0.5 for rec in records])
    assert [len(r.prompt) for r in reqs] == [min(40, rec.input_length) for rec in records]
    assert [r.max_tokens for r in reqs] == [max(1, rec.output_length) for rec in records]


@pytest.mark.parametrize("bad, flag", [
    (dict(base_url="localhost:8000"), "--base-url"), (dict(request_rate=0), "--request-rate"),
    (dict(time_scale=-1.0), "--time-scale"), (dict(duration_s=math.inf), "--duration"),
    (dict(max_concurrency=0), "--max-concurrency"), (dict(vocab_size=0), "--vocab-size"),
])
def test_bad_options_name_the_flag(bad, flag):
    with pytest.raises(ConfigError, match=flag):
        options(**bad)


def test_workload_args_and_their_errors():
    assert parse_workload_args(["a=1", "b=0.5", "c=x", "d=true"]) == {"a": 1, "b": 0.5, "c": "x", "d": True}
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_workload_args(["oops"])
    with pytest.raises(ConfigError, match="--workload"):
        build_schedule(options(workload="nope"))
    with pytest.raises(ConfigError, match="--workload"):
        build_schedule(options(workload_args={"bogus": 1}))


# -- runs against a replica ------------------------------------------------------------------


def test_a_run_measures_latency_and_the_servers_hit_ratio(replica):
    opts = options(base_url=replica.base_url + "/v1", request_rate=50.0, max_concurrency=3)
    schedule, workload = build_schedule(opts)
    run = asyncio.run(run_bench(opts, schedule))
    summary = summarize(run.results, run.planned, run.duration_s)
    assert run.model == "tiny" and run.stopped_by is None
    assert (summary.completed, summary.failed, summary.not_sent) == (8, 0, 0)
    assert summary.output_tokens == 8 * 4  # ignore_eos: exactly max_tokens each
    assert summary.hit_ratio == pytest.approx(workload.analytic_hit_ratio(4))  # the server's cache, measured
    assert summary.ttft.count == 8 and summary.itl.count == 8 * 3 and summary.tpot.count == 8
    assert 0 < summary.ttft.median <= summary.e2e.median and summary.e2e.p99 >= summary.e2e.p90


def test_the_command_writes_a_table_and_json_with_metadata(replica, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "--base-url", replica.base_url, "--vocab-size", "320", "--workload-arg", "num_groups=1",
                 "--workload-arg", "prompts_per_group=3", "--workload-arg", "system_prompt_len=32",
                 "--workload-arg", "question_len=8", "--workload-arg", "output_len=2", "--request-rate", "100",
                 "--seed", "5", "--out", str(out), "--progress-every", "1"])
    printed = capsys.readouterr().out
    assert code == 0 and "3/3 requests finished" in printed and "server prefix hit ratio" in printed and "TTFT" in printed
    doc = json.loads(out.read_text())
    meta = doc["metadata"]
    assert {"prefixcache_version", "git_commit", "date", "host", "cpu", "command", "options", "seed"} <= set(meta)
    assert meta["seed"] == 5 and meta["options"]["request_rate"] == 100.0 and meta["command"][:2] == ["prefixcache", "bench"]
    assert doc["summary"]["completed"] == 3 and len(doc["requests"]) == 3
    assert all(r["error"] is None and r["cached_tokens"] is not None for r in doc["requests"])


def test_the_duration_limit_stops_the_run_and_keeps_what_finished(replica):
    """Long requests, one at a time, for 1.5 s: the first finishes, the rest are cut off,
    the one in flight is aborted on the server (its blocks released)."""
    opts = options(base_url=replica.base_url, max_concurrency=1, duration_s=1.5,
                   workload_args={**SMALL, "output_len": 1}, max_output_tokens=None)
    schedule, _ = build_schedule(opts)
    schedule[1:] = [type(r)(r.index, r.arrival_s, r.prompt, 2000, r.namespace) for r in schedule[1:]]
    run = asyncio.run(run_bench(opts, schedule))
    summary = summarize(run.results, run.planned, run.duration_s)
    assert run.stopped_by == "duration" and 1.5 <= run.duration_s < 10
    assert summary.completed >= 1 and summary.not_sent >= 1 and summary.completed + summary.not_sent == 8
    idle(replica)
    assert in_engine(replica, lambda e: e.cache.pool.num_pinned) == 0


def test_stop_ends_the_run_like_ctrl_c(replica):
    opts = options(base_url=replica.base_url, max_concurrency=1)
    schedule, _ = build_schedule(opts)

    async def go():
        stop = asyncio.Event()
        return await run_bench(opts, schedule, stop=stop, progress=lambda result, n, total: stop.set())

    run = asyncio.run(go())
    assert run.stopped_by == "interrupted" and 1 <= len(run.results) < 8 and all(r.ok for r in run.results)


def test_a_server_that_refuses_is_reported_per_request(replica):
    opts = options(base_url=replica.base_url, model="not-served", num_requests=2)
    schedule, _ = build_schedule(opts)
    run = asyncio.run(run_bench(opts, schedule))
    assert [r.error.split(":")[0] for r in run.results] == ["HTTP 404"] * 2
    assert "does not exist" in run.results[0].error
    with pytest.raises(RuntimeError, match="cannot list the models"):
        asyncio.run(run_bench(options(base_url="http://127.0.0.1:9"), schedule))


def test_ctrl_c_stops_the_command_and_writes_what_finished(replica, tmp_path):
    """`prefixcache bench` in a process of its own; SIGINT after its first finished request."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "interrupted.json"
    cmd = [sys.executable, "-m", "prefixcache.cli", "bench", "--base-url", replica.base_url, "--vocab-size", "320",
           "--workload-arg", "num_groups=1", "--workload-arg", "prompts_per_group=20", "--workload-arg",
           "system_prompt_len=64", "--workload-arg", "question_len=8", "--workload-arg", "output_len=60",
           "--max-concurrency", "1", "--progress-every", "1", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:  # bounded: the process ends by itself within the workload
            if "requests finished" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, rest  # as docs/cli.md says of every command
    doc = json.loads(out.read_text())
    assert doc["metadata"]["stopped_by"] == "interrupted" and "stopped: interrupted" in rest
    kept = doc["summary"]["completed"]
    assert rest.rstrip().splitlines()[-1] == f"interrupted: kept {kept} finished request(s) in {out}"
    assert 1 <= doc["summary"]["completed"] < 20 and doc["summary"]["not_sent"] >= 1 and doc["summary"]["failed"] == 0
    idle(replica)
    assert in_engine(replica, lambda e: e.cache.pool.num_pinned) == 0  # the request in flight was aborted


def test_the_first_run_against_a_default_server_serves_every_request_from_the_cache(tmp_path, capsys):
    """`bench --base-url URL --num-requests 40` against `serve --set engine.model=tiny`: no
    vocabulary given (the server's is read: 320, not 32,000), the default workload fits
    the default pool, so every request is served and the JSON's hit ratio is >= 0.5."""
    from prefixcache.cli import _shipped
    from prefixcache.overrides import apply_overrides, parse_override
    from prefixcache.serve.config import parse_serve_config
    from prefixcache.serve.server import Replica
    import yaml

    data = apply_overrides(yaml.safe_load(_shipped("serve.yaml", "").read_text()), [parse_override("engine.model=tiny")])
    with Replica(parse_serve_config(data), model=load_model("tiny")) as server:
        url = server.start()
        out = tmp_path / "new" / "run.json"
        assert main(["bench", "--base-url", url, "--num-requests", "40", "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        flat = "".join(printed.split())  # rich wraps the header line at the terminal's width
        assert "ids<320" in flat and f"created{out.parent}for--out" in flat
        summary = json.loads(out.read_text())["summary"]
        assert (summary["completed"], summary["failed"]) == (40, 0)
        assert summary["hit_ratio"] >= 0.5, summary["hit_ratio"]


def test_out_is_checked_before_anything_is_sent(tmp_path, capsys, monkeypatch):
    import prefixcache.loadgen.cli as bench_cli

    monkeypatch.setattr(bench_cli, "probe_server", lambda *a: pytest.fail("the server was asked before --out was checked"))
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out: {str(tmp_path)!r} is a folder")
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--out", str(blocker / "x.json")]) == 2
    assert "error: --out: cannot create folder" in capsys.readouterr().err


def test_an_unreachable_server_is_one_line_before_anything_is_sent(capsys):
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--timeout", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --base-url: cannot list the models of http://127.0.0.1:1") and err.count("\n") == 1
