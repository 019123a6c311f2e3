"""The one way every harness in fuzz/ runs under atheris (libFuzzer).

Owns `main(test_one_input)` (and, on import, putting tests/ on sys.path: the harnesses
drive the native-vs-model pairs of the stateful tests): instruments the Python code already imported (prefixcache
and the harness) for coverage, hands libFuzzer the harness, and passes libFuzzer's own
flags through (`-max_total_time=SECONDS`, `-runs=N`, a corpus directory, ...). The
native code is not coverage-instrumented (that would take clang's
-fsanitize=fuzzer-no-link; CI builds with gcc): libFuzzer steers by the Python
branches, and crashes in C++ still surface, as an exception or, under a sanitized
build, as a sanitizer report.

Must never: decide what counts as a failure (each harness's assertions do), or be
imported by the library.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

# The harnesses drive the same native-vs-model pairs as the stateful tests: make them importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main(test_one_input: Callable[[bytes], None]) -> None:
    import atheris  # only here: the harnesses replay without it (tests/test_fuzz_harnesses.py)

    atheris.instrument_all()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
