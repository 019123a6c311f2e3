"""benchmarks/cluster_mooncake.py: its arm selection (--routers, --kv-weights x
--kv-temperatures, --set), its sweep and its target lines, on a small generated Mooncake
trace."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from prefixcache.workloads import synthetic_records, write_records

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "cluster_mooncake.py"


@pytest.fixture()
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_cluster_mooncake", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cluster_mooncake", module)
    monkeypatch.syspath_prepend(str(BENCH.parent))
    spec.loader.exec_module(module)
    return module


def test_the_arms_are_the_kept_routers_and_a_kv_events_arm_per_weight_and_temperature(bench, tmp_path, monkeypatch,
                                                                                     capsys):
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(16, seed=7, max_gap_ms=1000))
    out = tmp_path / "out"
    monkeypatch.setattr(bench, "plot_cluster", lambda result, path: path.write_bytes(b""))  # the CLI tests plot
    monkeypatch.setattr(sys, "argv", ["cluster_mooncake.py", "--trace", str(trace), "--replicas", "2",
                                      "--target-replicas", "2", "--routers", "round_robin", "kv_events",
                                      "--kv-weights", "1", "4", "--kv-temperatures", "0", "0.5", "--out", str(out)])
    assert bench.main() == 0
    runs = json.loads((out / "cluster_trace.json").read_text())["runs"]
    assert {r["series"] for r in runs} == {"round_robin", "kv_events/w1", "kv_events/w1/t0.5", "kv_events/w4",
                                           "kv_events/w4/t0.5", "shared"}
    assert "targets: none checked (no arm estimated_ttft)" in capsys.readouterr().out


def test_an_unknown_router_label_is_refused_with_the_config_arms(bench, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(5, seed=7))
    monkeypatch.setattr(sys, "argv", ["cluster_mooncake.py", "--trace", str(trace), "--routers", "nope"])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "--routers: nope not in" in capsys.readouterr().err


def test_several_seeds_run_the_sweep_once_each_give_each_router_s_ranges_and_count_the_seeds_that_met_each_target(
        bench, tmp_path, monkeypatch, capsys):
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(24, seed=7, max_gap_ms=1000))
    out = tmp_path / "out"
    monkeypatch.setattr(bench, "plot_cluster", lambda result, path: None)
    seeds, sweep = [], bench.sweep
    monkeypatch.setattr(bench, "sweep", lambda config, *a, **kw: seeds.append(config.seed) or sweep(config, *a, **kw))
    monkeypatch.setattr(sys, "argv", ["cluster_mooncake.py", "--trace", str(trace), "--replicas", "2",
                                      "--target-replicas", "2", "--routers", "power_of_two", "estimated_ttft",
                                      "--seed", "3", "4", "--out", str(out)])
    assert bench.main() == 0
    text = capsys.readouterr().out
    assert seeds == [3, 4] and text.count("targets:") == 2 and "# seed 4" in text
    for seed in (3, 4):
        assert json.loads((out / f"seed_{seed}" / "cluster_trace.json").read_text())["runs"]
    summary = text[text.index("targets over seeds 3, 4"):]
    counts = re.findall(r"^    (.+): (\d) of 2$", summary, re.M)
    assert [name for name, _ in counts] == ["best goodput", "best TTFT p50", "best TTFT p99",
                                            "TTFT p50 against the shared cache", "hit ratio against the shared cache"]
    # each count is the seeds whose own target line passed
    for name, met in counts:
        assert int(met) == sum(f"  {name}:" in line and "[PASS" in line for line in text.splitlines())
    # each router's range over the seeds, from the seeds' own files
    table = text[text.index("over seeds 3, 4, "):text.index("targets over seeds")].splitlines()
    runs = {seed: {r["series"]: r for r in json.loads((out / f"seed_{seed}" / "cluster_trace.json").read_text())["runs"]}
            for seed in (3, 4)}
    rows = {line.split(" | ")[0][2:]: line.strip("| ").split(" | ")[1:] for line in table if line.startswith("| ")
            and not line.startswith("| router") and not line.startswith("|---")}
    assert set(rows) == {"round_robin", "power_of_two", "estimated_ttft"}  # round robin: the reference line
    for label, (share, goodput, p50, p99, queue) in rows.items():
        def spread(values):
            low, high = f"{min(values):.3f}", f"{max(values):.3f}"
            return low if low == high else f"{low}-{high}"
        of = lambda key: [runs[seed][label][key] for seed in (3, 4)]  # noqa: E731
        assert share == spread([runs[seed][label]["hit_ratio"] / runs[seed]["shared"]["hit_ratio"] for seed in (3, 4)])
        assert goodput == spread(of("goodput")) and p50 == spread(of("ttft_p50_s"))
        assert queue == spread(of("queue_p99_s"))
        assert p99 == f"{spread(of('ttft_p99_s'))} ({sum(of('ttft_p99_s')) / 2:.3f})"  # the median of two: their mean


def test_a_sweep_over_rates_and_capacities_writes_its_files_and_checks_every_point(bench, tmp_path, monkeypatch,
                                                                                  capsys):
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(24, seed=7, max_gap_ms=1000))
    out = tmp_path / "out"
    drawn = []
    monkeypatch.setattr(bench, "plot_sweep", lambda result, path: drawn.append(path.name))
    monkeypatch.setattr(bench, "plot_capacity", lambda result, path: drawn.append(path.name))
    seeds, sweep = [], bench.sweep
    monkeypatch.setattr(bench, "sweep", lambda config, *a, **kw: seeds.append(config.seed) or sweep(config, *a, **kw))
    monkeypatch.setattr(sys, "argv", ["cluster_mooncake.py", "--trace", str(trace), "--replicas", "2",
                                      "--target-replicas", "2", "--routers", "approx_tree", "estimated_ttft",
                                      "--set", "estimated_ttft.load_weight=2", "--seed", "3", "--rates", "1", "4",
                                      "--capacity", "20000", "100000", "--churn-capacity", "20000",
                                      "--out", str(out)])
    assert bench.main() == 0
    text = capsys.readouterr().out
    data = json.loads((out / "sweep_trace.json").read_text())
    assert drawn == ["sweep_trace.png", "sweep_trace_capacity.png"]
    assert seeds == [3]
    assert {(r["capacity_tokens"], r["arrival_speedup"]) for r in data["runs"]} == {
        (20000, 1.0), (20000, 4.0), (100000, 1.0), (100000, 4.0)}
    assert {r["series"] for r in data["runs"]} == {"round_robin", "approx_tree", "estimated_ttft", "shared"}
    assert "Cluster A/B on trace" in text and "4x the trace's rate" in text
    # the targets at every point; the approximate-router one only where caches churn
    assert text.count("targets:") == 4 and text.count("against approx_tree") == 2
    assert text.count("the shared cache's") == 4 * 2  # the p50 and the hit ratio
    # saved sweeps' runs together again, nothing run: here the sweep split by capacity
    parts = []
    for capacity in (20000, 100000):
        part = tmp_path / f"part_{capacity}.json"
        part.write_text(json.dumps({**data, "runs": [r for r in data["runs"] if r["capacity_tokens"] == capacity]}))
        parts.append(str(part))
    again = tmp_path / "again"
    monkeypatch.setattr(sys, "argv", ["cluster_mooncake.py", "--replot", *parts, "--out", str(again)])
    assert bench.main() == 0
    name = data["workload"]["name"]
    assert drawn[2:] == [f"sweep_{name}.png", f"sweep_{name}_capacity.png"]
    assert json.loads((again / f"sweep_{name}.json").read_text()) == data
    assert (again / f"sweep_{name}.csv").read_text().count("\n") == len(data["runs"]) + 1
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "slo": {"ttft_s": 1.0, "itl_s": 0.025}}))
    monkeypatch.setattr(sys, "argv", ["cluster_mooncake.py", "--replot", parts[0], str(other)])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2 and "another workload or SLO" in capsys.readouterr().err
    for bad, why in ((tmp_path / "missing.json", "No such file"), (out / "sweep_trace.csv", "Expecting value"),
                     (tmp_path / "point.json", None)):
        if why is None:  # a single point's file, as cluster_<trace>.json has it
            bad.write_text(json.dumps({**data, "runs": [{"series": "shared"}]}))
            why = "is not a saved sweep"
        monkeypatch.setattr(sys, "argv", ["cluster_mooncake.py", "--replot", str(bad)])
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert exit_info.value.code == 2 and why in capsys.readouterr().err
