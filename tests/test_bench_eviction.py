"""benchmarks/bench_eviction.py and benchmarks/bench_policy.py: smoke runs on small
generated workloads, so every line they print is exercised."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from prefixcache.workloads import synthetic_records, write_records

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_eviction_sweep_and_attempts_smoke(tmp_path, capsys, monkeypatch):
    bench = load("bench_eviction")
    trace = tmp_path / "small_trace.jsonl"
    write_records(trace, synthetic_records(120, seed=3))
    monkeypatch.setattr(sys, "argv", ["bench_eviction.py", "--trace", str(trace), "--capacities", "2e4", "3e6",
                                      "--attempts", "--attempts-capacity", "2e4", "--out", str(tmp_path)])
    monkeypatch.setitem(sys.modules, "__main__", bench)  # the attempts name their policies "__main__:Class"
    bench.main()
    out = capsys.readouterr().out
    assert "worst change vs LRU" in out and "at 3M tokens, share of the LRU->Belady gap recovered" in out
    assert "attempts on hash/512 at 20,000 tokens" in out
    for name, _, _ in bench.ATTEMPTS:
        assert f"\n{name:<20} " in out
    assert (tmp_path / "eviction_small_trace.csv").read_text().count("\n") == 1 + 2 * 6


def test_policy_cost_smoke(capsys, monkeypatch):
    bench = load("bench_policy")
    monkeypatch.setattr(sys, "argv", ["bench_policy.py", "--repeat", "1"])
    monkeypatch.setitem(sys.modules, "__main__", bench)
    bench.main()
    out = capsys.readouterr().out
    assert out.count("request by request: True") == 3
    assert "hash/gslru (python)" in out and "radix/lru (python)" in out
