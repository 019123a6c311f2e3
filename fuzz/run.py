"""Run every fuzz harness for a bounded time, or replay saved inputs.

    python fuzz/run.py                        # each harness 30 s (CI: --seconds 6 --seed 1); --jobs N runs N at once
    python fuzz/run.py --seconds 3600         # the long run: an hour each
    python fuzz/run.py --only fuzz_backends --seconds 600
    python fuzz/run.py --replay fuzz/artifacts/crash-...   # without atheris, with a traceback

Each harness runs in its own process under atheris (libFuzzer) with a fresh corpus
(seeded from fuzz/regressions/<harness>/, the inputs of bugs found before) and writes
any failing input to fuzz/artifacts/. Prints one line per harness (runs, executions
per second, coverage, result) and exits non-zero if any harness failed. A failing
input becomes a regression: a test in tests/test_fuzz_regressions.py, and the input
itself in fuzz/regressions/<harness>/, which tests/test_fuzz_harnesses.py replays.

Must never: hide a failure (any non-zero harness exit fails the run).
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESSES = sorted(p.stem for p in HERE.glob("fuzz_*.py"))


def run(name: str, seconds: int, artifacts: Path, seed: int | None = None) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix=f"{name}-corpus-") as corpus:
        seeds = HERE / "regressions" / name
        cmd = [
            sys.executable,
            str(HERE / f"{name}.py"),
            corpus,
            *([str(seeds)] if seeds.is_dir() else []),
            f"-max_total_time={seconds}",
            "-max_len=600",
            "-len_control=0",
            "-timeout=20",
            f"-artifact_prefix={artifacts}/{name}-",
            "-print_final_stats=1",
            *([f"-seed={seed}"] if seed is not None else []),
        ]
        started = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
        elapsed = time.perf_counter() - started
    log = proc.stdout + proc.stderr
    runs = re.search(r"Done (\d+) runs", log) or re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
    cov = re.findall(r"cov: (\d+)", log)
    ok = proc.returncode == 0
    line = (
        f"{name:22s} {'ok' if ok else 'FAILED':6s} {elapsed:6.1f} s  "
        f"{int(runs.group(1)) if runs else 0:>9,} runs  "
        f"{(int(runs.group(1)) / elapsed if runs else 0):>7,.0f}/s  cov {cov[-1] if cov else '?'}"
    )
    if not ok:
        line += "\n" + "\n".join(log.splitlines()[-40:])
    return ok, line


def replay(paths: list[str]) -> int:
    """Run the harness named by each file's prefix on its bytes, in this process."""
    sys.path.insert(0, str(HERE))
    for path in paths:
        name = next((h for h in HARNESSES if Path(path).name.startswith(h) or Path(path).parent.name == h), None)
        if name is None:
            raise SystemExit(f"{path}: name it <harness>-... or put it in a folder named after one: {HARNESSES}")
        importlib.import_module(name).test_one_input(Path(path).read_bytes())
        print(f"{path}: {name} passes")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=30, help="time per harness")
    parser.add_argument("--only", nargs="+", choices=HARNESSES, help="run just these harnesses")
    parser.add_argument("--artifacts", type=Path, default=HERE / "artifacts", help="where failing inputs go")
    parser.add_argument("--replay", nargs="+", metavar="FILE", help="replay inputs instead of fuzzing")
    parser.add_argument("--jobs", type=int, default=1, help="harnesses run at once (each is one process)")
    parser.add_argument("--seed", type=int, help="libFuzzer's random seed (default: a new one each run); CI fixes "
                        "it, so a run that passed here replays the same search there, and a new finding comes "
                        "from a change, not from the draw")
    args = parser.parse_args()
    if args.replay:
        return replay(args.replay)
    args.artifacts.mkdir(parents=True, exist_ok=True)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.seed is not None and args.seed < 1:
        parser.error(f"--seed must be >= 1 (libFuzzer reads 0 as 'draw one'), got {args.seed}")
    names = args.only or HARNESSES
    print(f"# fuzz: {len(names)} harnesses, {args.seconds} s each, {args.jobs} at once, seed "
          f"{args.seed if args.seed is not None else 'drawn'}; command: {' '.join(sys.argv)}")
    failed = 0
    # Threads only wait on the harness processes; lines print in harness order.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for ok, line in pool.map(lambda name: run(name, args.seconds, args.artifacts.resolve(), args.seed), names):
            print(line, flush=True)
            failed += not ok
    print(f"# {failed} harness(es) failed" if failed else "# every harness passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
