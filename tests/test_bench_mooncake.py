"""benchmarks/mooncake.py: a smoke run on a small generated trace named like a published one,
so every check line is exercised; the simulator's whole-trace padding is checked too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from prefixcache.workloads import synthetic_records, write_records

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "mooncake.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_mooncake", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_mooncake"] = module
    spec.loader.exec_module(module)
    return module


def test_smoke_run_prints_checks_and_writes_plot_and_csv(bench, tmp_path, capsys, monkeypatch):
    trace = tmp_path / "mooncake_synthetic_trace.jsonl"  # not the real one: 150 generated records
    write_records(trace, synthetic_records(150, seed=2))
    monkeypatch.setattr(sys, "argv", ["mooncake.py", "--trace", str(trace), "--capacities", "1e5", "3e6",
                                      "--out", str(tmp_path)])
    bench.main()
    out = capsys.readouterr().out
    assert "150 requests" in out and "check: plateau (whole trace): published 0.651" in out
    assert "check: LRU at 3,000,000 tokens (whole trace): published 0.315" in out
    assert "LRU at 10,000,000 tokens: published 0.577; not run" in out
    assert "check: LRU variants at 3,000,000 tokens" in out and "s per million requests" in out
    assert (tmp_path / "mooncake_synthetic_trace.csv").read_text().count("\n") == 1 + 4 * 2
    assert (tmp_path / "mooncake_synthetic_trace.png").stat().st_size > 10_000


def test_simulator_whole_trace_padding_equals_an_empty_start(bench):
    pytest.importorskip("kvcache_sim", reason="kvcache-simulator is a dev dependency")
    from prefixcache.ab import replay_arm
    from prefixcache.config import CacheConfig
    from prefixcache.workloads import records_to_workload

    # On block-aligned prompts our hash/512 LRU equals the simulator's request by request
    # (tests/test_ab_kvcache_simulator.py), so over the whole trace it must equal the
    # padded run, at a capacity that evicts and at one that holds everything.
    records = synthetic_records(300, seed=6, aligned_probability=1.0)
    workload = records_to_workload(records, outputs=False)
    for blocks in (150, 10_000):
        ours = replay_arm(workload, "hash/512", CacheConfig(backend="hash", block_size=512, num_blocks=blocks))
        whole, _ = bench.simulator_lru(records, blocks)
        assert whole == pytest.approx(ours.hit_ratio, abs=1e-12)
        assert (ours.evicted_blocks > 0) == (blocks == 150)
