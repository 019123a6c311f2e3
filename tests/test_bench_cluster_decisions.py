"""benchmarks/cluster_decisions.py: a smoke run on a small generated Mooncake trace. The
script rebuilds every replica's active blocks from the run's results and raises unless
they equal the `active_blocks` column the router saw, so this also checks the
simulation's Dynamo accounting against an independent reconstruction."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from prefixcache.workloads import synthetic_records, write_records

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "cluster_decisions.py"


def test_smoke_run_takes_the_decisions_apart(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_cluster_decisions", BENCH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_cluster_decisions", module)  # its router is found by module path
    monkeypatch.syspath_prepend(str(BENCH.parent))
    spec.loader.exec_module(module)
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(80, seed=5, max_gap_ms=500))
    monkeypatch.setattr(sys, "argv", ["cluster_decisions.py", "--trace", str(trace), "--replicas", "3"])
    assert module.main() == 0
    out = capsys.readouterr().out
    total = int(re.search(r"; (\d+) decisions", out).group(1))
    assert total == 80
    moved = int(re.search(r"moved off the longest-prefix holder: (\d+)", out).group(1))
    causes = [int(n) for n in re.findall(r"(?:credit|neither alone): (\d+) \(", out)]
    assert len(causes) == 3 and sum(causes) == moved
    assert "a_w differs between replicas" in out
