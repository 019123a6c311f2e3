"""Exactness soak of the engine on a hybrid model: 1,000 randomized traces, cached vs uncached.

Each trace (`prefixcache.engine.exactness.random_trace`: waves of requests that branch
off and extend earlier prompts) runs through two engines on the tiny hybrid model (full,
sliding-window 48, chunked-local 64 and recurrent layers): one with the `hash` strategy
on the model's layout and a pool small enough to evict, one without caching. Every
request's greedy tokens must be identical, its first-token logits within 1e-4 and its
recurrent state bit for bit; the first difference stops the run.

    python benchmarks/hybrid_soak.py [--traces 1000] [--num-blocks 40] [--block-size 16]
    python benchmarks/hybrid_soak.py --backend radix [--chunked-prefill-size 64] [--state-cap 1] [--no-tail-cliff]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=1000)
    parser.add_argument("--num-blocks", type=int, default=40, help="pool BLOCKS (small: the cache evicts)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--backend", default="hash")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state-granule", type=int, default=0,
                        help="options.state_granule (TOKENS; on a full-attention + recurrent variant of the model)")
    parser.add_argument("--chunked-prefill-size", type=int, default=0,
                        help="radix: options.chunked_prefill_size (TOKENS; SGLang's chunked prefill)")
    parser.add_argument("--state-cap", type=int, default=0, help="options.state_cap (states a released path keeps)")
    parser.add_argument("--no-tail-cliff", action="store_true",
                        help="options.no_tail_cliff (branch tails evicted last; radix: dead leaves pruned)")
    args = parser.parse_args()

    from prefixcache.config import CacheConfig
    from prefixcache.engine.exactness import compare_trace, engines_for, random_trace, tiny_hybrid

    model = tiny_hybrid(seed=args.seed)
    options = {}
    if args.state_granule:  # finer states need full attention and recurrent layers only
        from prefixcache.engine.hybrid_model import HybridConfig, random_hybrid_weights
        from prefixcache.engine.loader import LoadedModel
        from prefixcache.engine.tokenizer import ByteTokenizer

        config = HybridConfig(layers=("full_attention", "mamba", "full_attention"))
        model = LoadedModel("tiny-hybrid", random_hybrid_weights(config, args.seed), ByteTokenizer(config.vocab_size),
                            config.layout)  # fmt: skip
        options = {"state_granule": args.state_granule}
    if args.chunked_prefill_size:
        options["chunked_prefill_size"] = args.chunked_prefill_size
    if args.state_cap:
        options["state_cap"] = args.state_cap
    if args.no_tail_cliff:
        options["no_tail_cliff"] = True
    cache = CacheConfig(backend=args.backend, block_size=args.block_size, num_blocks=args.num_blocks, options=options)
    cached, uncached = engines_for(model, cache)
    print(f"# hybrid_soak: {cpu_model()}, load {open('/proc/loadavg').read().split()[:3]}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# command: {' '.join(sys.argv)}")
    t0 = time.perf_counter()
    requests = hits = evictions = 0
    worst = 0.0
    for i in range(args.traces):
        r = compare_trace(cached, uncached, random_trace(random.Random(args.seed * 1_000_003 + i), model.weights.config.vocab_size))
        requests += r.requests
        hits += r.hit_tokens
        evictions += r.evictions
        worst = max(worst, r.max_logit_error)
        if r.difference is not None:
            print(f"trace {i}: DIFFERS: {r.difference}")
            return 1
    print(f"{args.traces} traces, {requests} requests, {hits} prompt tokens hit, {evictions} blocks evicted: "
          f"tokens identical, recurrent states bit-identical, max first-logit difference {worst:.3g} "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
