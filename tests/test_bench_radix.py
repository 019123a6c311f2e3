"""benchmarks/bench_radix.py: the workloads are what they claim, and a smoke run works.

The SGLang side is not exercised here (it downloads SGLang 0.5.23); `--no-sglang` runs ours.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_radix.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_radix", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_radix"] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_generated_shared_prefix_shape_and_ideal_hit_rate(bench):
    w = bench.generated_shared_prefix(seed=1, num_groups=8, prompts_per_group=4, system_len=64, question_len=8)
    assert len(w.requests) == 32
    assert {len(r.prompt) for r in w.requests} == {72} and {len(r.output) for r in w.requests} == {256}
    assert len({tuple(r.prompt[:64]) for r in w.requests}) == 8
    # Replayed with room for everything, every prompt but a group's first hits its system prompt.
    arm = bench.OursArm(page_size=1, num_blocks=w.distinct_tokens + w.longest)
    hits, _ = bench.replay(arm, w)
    assert sum(h >= 64 for h in hits) == 8 * 3
    assert bench.generated_shared_prefix(seed=1, num_groups=8, prompts_per_group=4, system_len=64, question_len=8) == w


def test_multi_turn_prompts_extend_their_history(bench):
    w = bench.multi_turn(seed=0, sessions=3, turns=3, system_len=16)
    assert len(w.requests) == 9
    by_prefix = [r for r in w.requests if r.prompt[:16] == w.requests[0].prompt[:16]]
    assert len(by_prefix) == 9  # one shared system prompt
    arm = bench.OursArm(page_size=4, num_blocks=-(-w.distinct_tokens // 4) + w.longest)
    hits, _ = bench.replay(arm, w)
    # A later turn hits its session's previous turn: prompt + output but the last
    # generated token (whose KV is never computed), cut to whole pages.
    for i, r in enumerate(w.requests):
        previous = [q for q in w.requests[:i] if r.prompt[: len(q.prompt) + len(q.output)] == q.prompt + q.output]
        if previous:
            q = previous[-1]
            assert hits[i] == (len(q.prompt) + len(q.output) - 1) // 4 * 4
    assert hits[0] == 0 and min(hits[1:]) >= 16  # everyone after the first shares the system prompt


def test_smoke_run_without_sglang(bench, capsys):
    assert bench.main(["--quick", "--no-sglang", "--repeat", "1", "--policies", "lru,mru"]) == 0
    out = capsys.readouterr().out
    # Per workload: pages 1 and 16, each with an ample pool (one policy) and pools of 1/4
    # and 1/8 of the distinct tokens (each policy).
    assert out.count("| gsp") == 10 and out.count("| multiturn") == 10


def test_pressure_pools_are_fractions_of_the_distinct_tokens(bench):
    w = bench.generated_shared_prefix(seed=0)
    labels = dict(bench.pools(w, 16))
    assert labels["1/4"] == -(-w.distinct_tokens // 16) // 4 and labels["1/8"] == -(-w.distinct_tokens // 16) // 8
    assert labels["ample"] * 16 >= w.distinct_tokens + w.longest
