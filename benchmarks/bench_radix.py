"""The `radix` backend on SGLang-style workloads, side by side with SGLang's RadixCache.

Replays two workloads request by request (admit -> prefill commit -> decode append ->
final commit -> release; the output is appended in one call, and the last generated
token's KV is never computed, as in SGLang) through our `radix` backend and, when it
can be loaded (see benchmarks/sglang_reference.py), through SGLang 0.5.6's own
`RadixCache` driven the way SGLang's scheduler drives it. Reports hit tokens and
bookkeeping time per request (every cache call, block allocation included), and for
SGLang (a) whether the per-request hit tokens are identical, else the first
difference, (b) the speed ratio. Target: identical hits, ours >= 5x faster.

Workloads (deterministic, seeded):
  gsp        SGLang bench_serving `generated-shared-prefix`: 64 groups x 16 prompts,
             2048-token system prompt per group + 128-token question, 256 output
             tokens, all 1024 shuffled. Ideal token hit rate 0.882.
  multiturn  chat sessions: a shared 256-token system prompt, each turn = the whole
             history + a new user message (32-256 tokens), output 64-384 tokens;
             sessions interleaved round by round in shuffled order.

Each runs with an ample pool (no eviction) and, for the pressure rows, a pool of a
quarter of the workload's distinct tokens (LRU eviction on most admissions).

    python benchmarks/bench_radix.py [--sglang-cache DIR] [--no-sglang] [--seed 0]
                                     [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prefixcache import CacheConfig, build_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from sglang_reference import SGLangArm, SGLangUnavailable, load_sglang  # noqa: E402

VOCAB = 32000


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    output: list[int]


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]
    distinct_tokens: int  # tokens a cache holding everything would hold (upper bound)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def longest(self) -> int:
        return max(len(r.prompt) + len(r.output) for r in self.requests)


def generated_shared_prefix(
    seed: int, num_groups: int = 64, prompts_per_group: int = 16, system_len: int = 2048,
    question_len: int = 128, output_len: int = 256,
) -> Workload:  # fmt: skip
    """SGLang's generated-shared-prefix requests, as token ids (no re-tokenisation)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    requests = []
    for _ in range(num_groups):
        system = tokens(system_len)
        requests += [Request(system + tokens(question_len), tokens(output_len)) for _ in range(prompts_per_group)]
    rng.shuffle(requests)
    distinct = num_groups * system_len + len(requests) * (question_len + output_len - 1)
    return Workload("gsp", requests, distinct)


def multi_turn(seed: int, sessions: int = 48, turns: int = 6, system_len: int = 256) -> Workload:
    """Chat sessions sharing a system prompt; turn t's prompt is the whole history."""
    rng = random.Random(seed)

    def tokens(lo: int, hi: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]

    system = tokens(system_len, system_len)
    history = [list(system) for _ in range(sessions)]
    requests = []
    for _ in range(turns):
        for s in rng.sample(range(sessions), sessions):
            prompt = history[s] + tokens(32, 256)
            output = tokens(64, 384)
            requests.append(Request(prompt, output))
            history[s] = prompt + output
    distinct = system_len + sum(len(h) - system_len for h in history)
    return Workload("multiturn", requests, distinct)


class OursArm:
    """Our `radix` backend behind the benchmark's calls."""

    def __init__(self, page_size: int, num_blocks: int) -> None:
        config = CacheConfig(backend="radix", block_size=page_size, num_blocks=num_blocks, enable_events=False)
        self.cache = build_cache(config)

    def admit(self, rid, tokens, namespace=None):
        adm = self.cache.admit(rid, tokens, namespace=namespace)
        return None if adm is None else adm.num_cached_tokens

    def append(self, rid, tokens):
        if self.cache.append(rid, tokens) is None:
            raise RuntimeError(f"request {rid}: no room to decode")

    def commit(self, rid, n):
        self.cache.commit(rid, n)

    def release(self, rid):
        self.cache.release(rid)


def replay(arm, workload: Workload) -> tuple[list[int | None], float]:
    """Hit tokens per request (None: refused) and the seconds spent in cache calls."""
    hits: list[int | None] = []
    start = time.perf_counter()
    for rid, r in enumerate(workload.requests):
        hit = arm.admit(rid, r.prompt)
        hits.append(hit)
        if hit is None:
            continue
        arm.commit(rid, len(r.prompt))
        arm.append(rid, r.output)
        arm.commit(rid, len(r.prompt) + len(r.output) - 1)
        arm.release(rid)
    return hits, time.perf_counter() - start


def best_of(repeat: int, make: Callable[[], object], workload: Workload):
    """Fresh cache per run: (hits, the fastest run's seconds, the last arm)."""
    best = float("inf")
    for _ in range(repeat):
        arm = make()
        hits, seconds = replay(arm, workload)
        best = min(best, seconds)
    return hits, best, arm


def first_difference(ours: list, theirs: list) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"request {i}: ours {a}, SGLang {b}"
    return "identical" if len(ours) == len(theirs) else f"lengths differ: {len(ours)} vs {len(theirs)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-cache", default=str(Path.home() / ".cache/prefixcache/sglang"),
                        help="where SGLang's wheel is downloaded and extracted (default: %(default)s)")
    parser.add_argument("--no-sglang", action="store_true", help="run our backend only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3, help="runs per arm; the fastest is reported")
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    args = parser.parse_args(argv)

    if args.quick:
        workloads = [generated_shared_prefix(args.seed, 4, 4, 256, 32, 16), multi_turn(args.seed, 4, 3, 64)]
    else:
        workloads = [generated_shared_prefix(args.seed), multi_turn(args.seed)]

    sglang = None
    if not args.no_sglang:
        try:
            sglang = load_sglang(args.sglang_cache)
        except SGLangUnavailable as err:
            print(f"SGLang side skipped: {err}")

    print(f"# bench_radix  {datetime.date.today()}  {cpu_model()} x{os.cpu_count()}  "
          f"Python {platform.python_version()}  seed {args.seed}  best of {args.repeat}")  # fmt: skip
    print(f"# command: python benchmarks/bench_radix.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    header = "| workload | page | pool blocks | hit tokens | hit rate | evicted blocks | ours µs/req |"
    if sglang is not None:
        header += " SGLang µs/req | speed-up | per-request hits vs SGLang |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for w in workloads:
        for page in (1, 16):
            ample = -(-w.distinct_tokens // page) + -(-w.longest // page)
            pressure = max(-(-w.longest // page) * 2, ample // 4)
            for label, blocks in (("", ample), (" (pressure)", pressure)):
                ours_hits, ours_s, ours = best_of(args.repeat, lambda: OursArm(page, blocks), w)
                stats = ours.cache.stats()
                hit = sum(h or 0 for h in ours_hits)
                row = (
                    f"| {w.name}{label} | {page} | {blocks} | {hit} | {hit / w.prompt_tokens:.3f} | "
                    f"{stats.evictions} | {ours_s / len(w.requests) * 1e6:.1f} |"
                )
                if sglang is not None:
                    theirs_hits, theirs_s, _ = best_of(args.repeat, lambda: SGLangArm(sglang, page, blocks), w)
                    row += (
                        f" {theirs_s / len(w.requests) * 1e6:.1f} | {theirs_s / ours_s:.1f}x | "
                        f"{first_difference(ours_hits, theirs_hits)} |"
                    )
                print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
