"""The one way every harness in fuzz/ runs under atheris (libFuzzer).

Owns `main(test_one_input)` (and, on import, putting tests/ on sys.path: the harnesses
drive the native-vs-model pairs of the stateful tests). It instruments the Python code
already imported from prefixcache, the harness and the test pairs for coverage, hands
libFuzzer the harness, and passes libFuzzer's own flags through
(`-max_total_time=SECONDS`, `-runs=N`, a corpus directory, ...). The native code is
not coverage-instrumented (that would take clang's -fsanitize=fuzzer-no-link; CI
builds with gcc): libFuzzer steers by the Python branches, and a wrong answer or a
crash in C++ still surfaces as a failed assertion or an exception. Memory errors are
the sanitized run's job (.ci/sanitize replays the harnesses on an ASan build).

Must never: decide what counts as a failure (each harness's assertions do), or be
imported by the library.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

# The harnesses drive the same native-vs-model pairs as the stateful tests: make them importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


# Code whose branches steer the fuzzer: the library, the harnesses and the test pairs
# they drive. Not hypothesis, yaml or the standard library (instrumenting everything
# loaded takes the first half minute of every run).
INSTRUMENTED = ("prefixcache", "fuzz_", "reader", "test_")


def main(test_one_input: Callable[[bytes], None]) -> None:
    import gc
    import inspect

    import atheris  # only here: the harnesses replay without it (tests/test_fuzz_harnesses.py)

    # The registry imports the built-in backends on first use: import them now, so that
    # their code is instrumented too.
    import prefixcache.backends.hash  # noqa: F401
    import prefixcache.backends.radix  # noqa: F401

    for func in [f for f in gc.get_objects() if inspect.isfunction(f)]:
        if (func.__module__ or "").startswith(INSTRUMENTED):
            atheris.instrument_func(func)
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
