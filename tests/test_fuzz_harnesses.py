"""The fuzz harnesses (fuzz/), replayed without atheris: their saved regression inputs
and a fixed set of random inputs, so the harness code and the bugs they found stay
covered by the ordinary test run (and by the sanitized one in CI)."""

from __future__ import annotations

import importlib
import random
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent.parent / "fuzz"
HARNESSES = sorted(p.stem for p in FUZZ.glob("fuzz_*.py"))


@pytest.fixture(scope="module", params=HARNESSES)
def harness(request):
    sys.path.insert(0, str(FUZZ))
    try:
        yield importlib.import_module(request.param)
    finally:
        sys.path.remove(str(FUZZ))


def test_every_harness_is_known():
    assert HARNESSES == [
        "fuzz_backends", "fuzz_block_contents", "fuzz_block_pool", "fuzz_config", "fuzz_hashing", "fuzz_hybrid",
        "fuzz_radix_tree", "fuzz_reentry", "fuzz_tiers", "fuzz_tokens", "fuzz_trace",
    ]  # fmt: skip


def test_saved_regressions_replay(harness):
    inputs = sorted((FUZZ / "regressions" / harness.__name__).glob("*"))
    for path in inputs:
        harness.test_one_input(path.read_bytes())


def test_random_inputs_replay(harness):
    rng = random.Random(harness.__name__)
    for _ in range(60):
        harness.test_one_input(bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))))
