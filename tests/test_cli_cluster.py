"""`prefixcache cluster` and `validate` on cluster files, end to end: the shipped embedded
config, a Mooncake trace given with --trace, and the errors a user sees."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import yaml

from prefixcache.cli import _shipped, main
from prefixcache.config import ConfigError
from prefixcache.registry import NO_IMPORT_ENV
from prefixcache.workloads import synthetic_records, write_records

CONFIGS = Path(__file__).parent.parent / "configs"


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_cluster_runs_the_shipped_config_and_writes_table_json_csv_png(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["cluster", str(CONFIGS / "cluster.yaml"), "--out", str(out), "--replicas", "4"]) == 0
    text = capsys.readouterr().out
    assert "Cluster A/B on multi_turn: 288 requests" in text
    for series in ("round_robin", "power_of_two", "approx_tree", "prefix_affinity", "kv_events", "shared"):
        assert series in text
    data = json.loads((out / "cluster.json").read_text())
    assert [r["replicas"] for r in data["runs"]] == [4] * 6
    shared = {r["replicas"]: r["hit_ratio"] for r in data["runs"] if r["kind"] == "shared"}
    kv = {r["replicas"]: r["hit_ratio"] for r in data["runs"] if r["series"] == "kv_events"}
    rr = {r["replicas"]: r["hit_ratio"] for r in data["runs"] if r["series"] == "round_robin"}
    assert rr[4] < kv[4] <= shared[4]
    assert len((out / "cluster.csv").read_text().splitlines()) == 7
    assert is_png(out / "cluster.png")


def test_cluster_on_a_mooncake_trace(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(60, seed=3, max_gap_ms=2000))
    out = tmp_path / "out"
    args = ["cluster", str(CONFIGS / "cluster_mooncake.yaml"), "--trace", str(trace), "--replicas", "2",
            "--out", str(out)]
    assert main(args) == 0
    assert "Cluster A/B on trace: 60 requests" in capsys.readouterr().out
    runs = json.loads((out / "cluster.json").read_text())["runs"]
    assert {r["series"] for r in runs} == {"round_robin", "power_of_two", "approx_tree", "prefix_affinity",
                                           "kv_events", "kv_events/w16", "shared"}


def test_cluster_errors_name_the_file_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "cluster.yaml").read_text().replace("kv_events: {}", "kv_events: {options: {tmp: 1}}"))
    assert main(["cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: routers.kv_events.options.tmp: unknown key; allowed keys: overlap_score_weight, temperature" in err
    assert main(["cluster", str(CONFIGS / "cluster_mooncake.yaml")]) == 2
    assert "workload.mooncake.path: no trace given: set it, or pass --trace PATH" in capsys.readouterr().err
    assert main(["cluster", str(CONFIGS / "cluster.yaml"), "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "--trace: no such file" in capsys.readouterr().err


def test_validate_reads_cluster_files(capsys):
    assert main(["validate", str(CONFIGS / "cluster_mooncake.yaml")]) == 0
    text = capsys.readouterr().out
    assert "valid cluster experiment" in text and "overlap_score_weight: 1.0" in text and "num_blocks: 5859" in text


SERVE_FILE = """\
cache: {backend: hash, block_size: 4, num_blocks: 64}
engine: {model: tiny}
"""


def test_cluster_serve_refuses_a_bad_file_in_one_line_before_starting_ray(tmp_path, capsys, monkeypatch):
    cases = {
        "cluster: {replicas: 2, routr: kv_events}\n": "cluster.routr: unknown key",
        "cluster: {router: kv_event}\n": "cluster.router: ",
        "cluster: {router: ray_prefix_cache_affinity, options: {imbalance: 3}}\n":
            "cluster.options.imbalance: is not an option of ray_prefix_cache_affinity (it takes imbalanced_threshold",
        "cluster: {router: ray_power_of_two, options: {x: 1}}\n": "cluster.options.x: is not an option of "
                                                                  "ray_power_of_two (it takes none)",
        "cluster: {replicas: 0}\n": "cluster.replicas: must be an integer >= 1, got 0",
        "cluster: {port: 0}\n": "cluster.port: must be an integer in [1, 65535], got 0",
        "kv_events: {endpoint: 'tcp://*:5557'}\ncluster: {}\n": "kv_events.endpoint: is set per replica",
        "cluster: []\n": "cluster",
    }
    for i, (tail, expected) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(SERVE_FILE + tail)
        assert main(["cluster", "serve", str(path)]) == 2, tail
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: ") and err.count("\n") == 1 and expected in err, (tail, err)
    good = tmp_path / "good.yaml"
    good.write_text(SERVE_FILE + "cluster: {}\n")
    monkeypatch.setenv(NO_IMPORT_ENV, "")  # so that what main() sets for --no-import is undone after the test
    assert main(["--no-import", "cluster", "serve", str(good), "--port", "70000"]) == 2
    assert capsys.readouterr().err == "error: --port: must be an integer in [1, 65535], got 70000\n"
    assert main(["cluster", "serve", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["cluster", "serve", str(good), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cluster.port: 127.0.0.1:{port} cannot be listened on") and err.count("\n") == 1


def test_cluster_serve_bad_input_is_one_line_and_exit_2_in_a_fresh_process(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text(SERVE_FILE + "cluster: {router: nope}\n")
    done = subprocess.run([sys.executable, "-m", "prefixcache.cli", "cluster", "serve", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: {path}: cluster.router: ")


def test_cluster_serve_sizes_cpus_to_the_machine_and_refuses_a_layout_ray_cannot_schedule(tmp_path, capsys,
                                                                                          monkeypatch):
    from prefixcache.serve import cluster_config
    from prefixcache.serve.cluster_config import cluster_layout, parse_cluster_serve_config

    monkeypatch.setattr(cluster_config, "machine_cpus", lambda: 2)  # the 2-core machine of a new user
    monkeypatch.setattr(cluster_config, "check_proxy_address_free",
                        lambda config: pytest.fail("a layout Ray cannot schedule got past the file's checks"))
    shipped = parse_cluster_serve_config(yaml.safe_load(_shipped("cluster_serve.yaml", "").read_text()))
    layout = cluster_layout(shipped.cluster)
    assert (layout.num_cpus, layout.replica_cpus, layout.ingress_cpus) == (2, 0.75, 0.5)  # 2 x 0.75 + 0.5 = 2
    path = tmp_path / "fixed.yaml"
    path.write_text(SERVE_FILE + "cluster: {replicas: 2, replica_cpus: 1.0}\n")
    assert main(["cluster", "serve", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: cluster.replica_cpus: 2 replicas x 1 CPUs + the ingress's 0.5 = 2.5 logical "
                          "CPUs, more than the cluster's 2 (num_cpus: null, this machine's 2): Ray would never "
                          "schedule them all") and "here: 0.75 each" in err and err.count("\n") == 1
    assert main(["validate", str(path)]) == 2 and "cluster.replica_cpus" in capsys.readouterr().err
    assert main(["cluster", "serve", "--set", "cluster.num_cpus=3", "--set", "cluster.replica_cpus=1.5"]) == 2
    err = capsys.readouterr().err
    assert "cluster.replica_cpus: 2 replicas x 1.5 CPUs" in err and "(num_cpus: 3)" in err and err.count("\n") == 1
    ok = parse_cluster_serve_config(yaml.safe_load(SERVE_FILE + "cluster: {replicas: 3, num_cpus: 1}\n"))
    assert cluster_layout(ok.cluster).replica_cpus == round(0.5 / 3, 4)


def test_cluster_serve_has_a_default_config_and_takes_set(capsys, monkeypatch):
    import prefixcache.serve.cluster_config as cluster_config

    seen = {}

    def stop_here(config):  # what would reach Ray: the shipped file with the override applied
        seen["config"] = config
        raise ConfigError("", "stopped before Ray")

    monkeypatch.setattr(cluster_config, "check_proxy_address_free", stop_here)
    assert main(["cluster", "serve", "--set", "cluster.replicas=3", "--set", "cache.backend=radix"]) == 2
    assert capsys.readouterr().err == "error: stopped before Ray\n"
    config = seen["config"]
    assert (config.cluster.replicas, config.serve.serving.cache.backend, config.serve.serving.engine.model) == (
        3, "radix", "tiny")
    assert main(["cluster", "serve", "--set", "cluster.replicass=3"]) == 2
    err = capsys.readouterr().err
    assert "cluster_serve.yaml (with command-line overrides): cluster.replicass: unknown key" in err
