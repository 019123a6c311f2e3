"""benchmarks/bench_verify.py: a smoke run. Its table reads the hash backend's verifier
(the node count of the contents it proves hits against); a rename there must fail here,
not in a user's hands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_verify.py"


def test_bench_verify_runs_and_finds_the_arms_identical() -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH), "--repeat", "1", "--num-blocks", "256", "--workload", "multi-turn",
         "--algorithms", "xxhash"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line.startswith("| multi-turn |")]
    assert len(rows) == 1, run.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[8] == "identical" and cells[9] == "0", rows[0]  # same hits and tables; no verify failure
    assert int(cells[10]) > 0, rows[0]  # the verifier holds what the run cached
