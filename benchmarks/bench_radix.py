"""The `radix` backend on SGLang-style workloads, side by side with SGLang 0.5.23's RadixCache.

Replays two workloads request by request through our `radix` backend and, when it can be
loaded (see benchmarks/sglang_reference.py), through SGLang 0.5.23's own `RadixCache`
driven the way its scheduler drives it: admission (match, lock, allocate), the prefill's
checkpoint, then ONE DECODE STEP PER GENERATED TOKEN but the last (each allocating the
slot of the token it feeds back, evicting first when short, as `alloc_for_decode` does),
then the finished request's release (a last checkpoint of everything computed). Ours gets
the same calls through the protocol: admit, commit(prompt), append([token]) per step,
commit(all computed) + release.

Rows: each workload at page 1 and 16, with an ample pool (no eviction) and under heavy
eviction pressure, pools of 1/4 and 1/8 of the workload's distinct tokens, for every
eviction policy both sides have (SGLang's plain RadixCache has no tlru: its TreeNode lacks
the fields TLRUStrategy reads). Reported: hit tokens, bookkeeping time per request (every
cache call, allocation and eviction included; each request timed by its best replay over
`--repeat` rounds that alternate the two sides), and for SGLang whether the per-request
hit tokens are identical (else the first difference) and the speed ratio. Targets:
identical hits on every row; ours >= 10x faster on every row.

Workloads (deterministic, seeded):
  gsp        SGLang bench_serving `generated-shared-prefix`: 64 groups x 16 prompts,
             2048-token system prompt per group + 128-token question, 256 output
             tokens, all 1024 shuffled. Ideal token hit rate 0.882.
  multiturn  chat sessions: a shared 256-token system prompt, each turn = the whole
             history + a new user message (32-256 tokens), output 64-384 tokens;
             sessions interleaved round by round in shuffled order.

    python benchmarks/bench_radix.py [--sglang-src DIR] [--sglang-cache DIR] [--no-sglang]
                                     [--policies lru,lfu] [--seed 0] [--repeat 2] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import random
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from prefixcache import CacheConfig, build_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from sglang_reference import SGLangArm, SGLangUnavailable, load_sglang  # noqa: E402

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")  # both sides have these

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
    """Our `radix` backend behind the replay's calls."""

    def __init__(self, page_size: int, num_blocks: int, eviction: str = "lru") -> None:
        config = CacheConfig(backend="radix", block_size=page_size, num_blocks=num_blocks, eviction=eviction,
                             enable_events=False)  # fmt: skip
        self.cache = build_cache(config)

    def admit(self, rid, prompt: array):
        adm = self.cache.admit(rid, prompt)
        return None if adm is None else adm.num_cached_tokens

    def prefilled(self, rid, prompt_len: int, sampled: int) -> None:
        self.cache.commit(rid, prompt_len)

    def decoded(self, rid, fed: int, sampled: int) -> None:
        if self.cache.append(rid, [fed]) is None:
            raise RuntimeError(f"request {rid}: no room to decode")

    def finish(self, rid, computed: int) -> None:
        self.cache.commit(rid, computed)
        self.cache.release(rid)


class TheirsArm:
    """SGLang's RadixCache behind the replay's calls (sglang_reference.SGLangArm)."""

    def __init__(self, sglang, page_size: int, num_blocks: int, eviction: str, max_len: int) -> None:
        self.arm = SGLangArm(sglang, page_size, num_blocks, eviction, max_len=max_len)

    def admit(self, rid, prompt: array):
        return self.arm.admit(rid, prompt)

    def prefilled(self, rid, prompt_len: int, sampled: int) -> None:
        self.arm.prefilled(rid, sampled)

    def decoded(self, rid, fed: int, sampled: int) -> None:
        self.arm.decode(rid, sampled)

    def finish(self, rid, computed: int) -> None:
        self.arm.release(rid)  # SGLang's request knows what it computed, as its scheduler's does


def replay(arm, workload: Workload) -> tuple[list[int | None], list[float]]:
    """Hit tokens per request (None: refused) and each request's seconds in cache calls.

    A request: admitted, its prompt prefilled (sampling output[0]), then one decode step
    per further output token (feeding back the previous one), then finished: the KV of
    every token but the last sampled one is computed."""
    hits: list[int | None] = []
    seconds: list[float] = []
    clock = time.perf_counter
    prompts = [array("q", r.prompt) for r in workload.requests]
    for rid, (r, prompt) in enumerate(zip(workload.requests, prompts)):
        out = r.output
        t0 = clock()
        hit = arm.admit(rid, prompt)
        if hit is not None:
            arm.prefilled(rid, len(prompt), out[0])
            for i in range(1, len(out)):
                arm.decoded(rid, out[i - 1], out[i])
            arm.finish(rid, len(prompt) + len(out) - 1)
        seconds.append(clock() - t0)
        hits.append(hit)
    return hits, seconds


def first_difference(ours: list, theirs: list) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"request {i}: ours {a}, SGLang {b}"
    return "identical" if len(ours) == len(theirs) else f"lengths differ: {len(ours)} vs {len(theirs)}"


def pools(w: Workload, page: int) -> list[tuple[str, int]]:
    """(label, pool blocks): room for everything, then 1/4 and 1/8 of the distinct tokens
    (never below two of the longest requests)."""
    floor = 2 * -(-w.longest // page)
    distinct = -(-w.distinct_tokens // page)
    return [("ample", distinct + -(-w.longest // page)), ("1/4", max(floor, distinct // 4)),
            ("1/8", max(floor, distinct // 8))]  # fmt: skip


def run_row(w: Workload, page: int, blocks: int, policy: str, repeat: int, sglang) -> dict:
    """Both sides, alternating, `repeat` rounds; per-request best times."""
    best = {"ours": [float("inf")] * len(w.requests), "sglang": [float("inf")] * len(w.requests)}
    hits: dict = {}
    evicted = 0
    sides = ["ours", "sglang"] if sglang is not None else ["ours"]
    for round_ in range(repeat):
        for side in sides if round_ % 2 == 0 else sides[::-1]:
            if side == "ours":
                arm = OursArm(page, blocks, policy)
            else:
                arm = TheirsArm(sglang, page, blocks, policy, max_len=w.longest + 1)
            gc.collect()
            hits[side], seconds = replay(arm, w)
            best[side] = [min(a, b) for a, b in zip(best[side], seconds)]
            if side == "ours":
                evicted = arm.cache.stats().evictions
                arm.cache.check_invariants()
            else:
                arm.arm.check()
    return {"hits": hits, "us": {s: sum(t) / len(t) * 1e6 for s, t in best.items() if s in hits}, "evicted": evicted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-src", default=None,
                        help="a directory holding SGLang's `sglang/` (a checkout's python/, an unpacked wheel); "
                             "default: SGLang's wheel from the package index")
    parser.add_argument("--sglang-cache", default=str(Path.home() / ".cache/prefixcache/sglang"),
                        help="where SGLang's wheel is downloaded and unpacked (default: %(default)s)")
    parser.add_argument("--no-sglang", action="store_true", help="run our backend only")
    parser.add_argument("--policies", default=",".join(POLICIES), help="eviction policies for the pressure rows")
    parser.add_argument("--workloads", default="gsp,multiturn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=2, help="rounds per row, sides alternating")
    parser.add_argument("--quick", action="store_true", help="small workloads (a smoke run)")
    args = parser.parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = set(policies) - set(POLICIES)
    if unknown:
        parser.error(f"--policies: {', '.join(sorted(unknown))} not in {', '.join(POLICIES)}")

    if args.quick:
        workloads = {"gsp": generated_shared_prefix(args.seed, 4, 4, 256, 32, 16), "multiturn": multi_turn(args.seed, 4, 3, 64)}
    else:
        workloads = {"gsp": generated_shared_prefix(args.seed), "multiturn": multi_turn(args.seed)}
    workloads = {k: v for k, v in workloads.items() if k in args.workloads.split(",")}

    sglang = None
    if not args.no_sglang:
        try:
            sglang = load_sglang(args.sglang_src, args.sglang_cache)
        except SGLangUnavailable as err:
            print(f"SGLang side skipped: {err}")

    print(f"# bench_radix  {datetime.date.today()}  {cpu_model()} x{os.cpu_count()}  "
          f"Python {platform.python_version()}  seed {args.seed}  {args.repeat} alternating rounds, "
          f"per-request best")  # fmt: skip
    print(f"# command: python benchmarks/bench_radix.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    if sglang is not None:
        print(f"# SGLang {sglang.source.version} RadixCache from {sglang.source.origin}")
    header = "| workload | page | pool | pool blocks | policy | hit tokens | hit rate | evicted blocks | ours µs/req |"
    if sglang is not None:
        header += " SGLang µs/req | speed-up | per-request hits vs SGLang |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    worst = None
    all_identical = True
    for w in workloads.values():
        for page in (1, 16):
            for label, blocks in pools(w, page):
                for policy in policies if label != "ample" else policies[:1]:
                    r = run_row(w, page, blocks, policy, args.repeat, sglang)
                    ours = r["hits"]["ours"]
                    hit = sum(h or 0 for h in ours)
                    row = (f"| {w.name} | {page} | {label} | {blocks} | {policy} | {hit} | "
                           f"{hit / w.prompt_tokens:.3f} | {r['evicted']} | {r['us']['ours']:.1f} |")  # fmt: skip
                    if sglang is not None:
                        ratio = r["us"]["sglang"] / r["us"]["ours"]
                        same = first_difference(ours, r["hits"]["sglang"])
                        all_identical &= same == "identical"
                        worst = ratio if worst is None else min(worst, ratio)
                        row += f" {r['us']['sglang']:.1f} | {ratio:.1f}x | {same} |"
                    print(row, flush=True)
    if sglang is not None:
        print(f"# per-request hits identical on every row: {'yes' if all_identical else 'NO'}")
        print(f"# slowest speed-up {worst:.1f}x: target >= 10x on every row: {'met' if worst >= 10 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
