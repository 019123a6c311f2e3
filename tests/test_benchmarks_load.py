"""Every script in benchmarks/ loads: its imports resolve against the current code.

A benchmark is run by hand (commands in docs/), not by the suite, so a rename in the
library could break one silently; loading each module (its `main` is not called)
catches that in a second.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_module_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the scripts import each other by name
    name = f"_benchmarks_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up here
    spec.loader.exec_module(module)
    if '__name__ == "__main__"' in path.read_text():
        assert callable(getattr(module, "main", None)), f"{path.name}: a script without main()"
