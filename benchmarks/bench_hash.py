"""Per-request bookkeeping of the `hash` backend, and parity with vLLM 0.33's own manager.

Replays two deterministic workloads (generated here: a shared-system-prompt workload
and a multi-turn chat workload) through `HashCache` and reports the time spent in the
cache per request (hashing + admit + the prompt's commit + release) and per decode step
(append + commit of one token), with the prompt tokens it hit. With `--vllm-dir`, vLLM
0.33's `KVCacheManager` (its unmodified `vllm/v1/core`, see vllm_v1_core.py) replays the
same workload side by side at the same capacity (ours `num_blocks` = vLLM's minus its
null block); the per-request hit tokens, prompt block tables (ours + 1), refusals,
block hashes and KV events must be identical, and the speed ratios are reported. Repeats alternate the
two sides, and each request is timed by its best replay (see `best_times`), so load from
other processes distorts neither side.

    python benchmarks/bench_hash.py [--vllm-dir ~/.cache/prefixcache/vllm-0.33.0] [--repeat 5]

Both caches see the same calls: a request is admitted (prefix lookup + allocation; on
"no room" the oldest live request is released and admission retried), its prompt
committed, then `output_len - 1` decode steps each append one token and commit it (the
last sampled token is never fed back), and it is released once `--concurrency` newer
requests are live. A decode step is one call on each side, as an engine makes it: ours
`commit_and_append` (commit what the last step computed, append the token fed back),
vLLM's `allocate_slots` (cache the full blocks, allocate the new slot) after the
request's `append_output_token_ids`. Events are off on both sides (vLLM's default).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 128_256  # Llama 3: most ids need 5 CBOR bytes, as in production


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    output: list[int]  # sampled tokens; all but the last are fed back (decode)


def shared_prefix(rng: random.Random, n: int = 400, num_prefixes: int = 4, prefix_len: int = 1024) -> list[Req]:
    """Requests = one of a few system prompts + a unique question; ~1.3k-token prompts."""
    prefixes = [[rng.randrange(VOCAB) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        Req(
            rng.choice(prefixes) + [rng.randrange(VOCAB) for _ in range(rng.randint(64, 512))],
            [rng.randrange(VOCAB) for _ in range(rng.randint(16, 64))],
        )
        for _ in range(n)
    ]


def multi_turn(rng: random.Random, sessions: int = 48, turns: int = 6, active: int = 8) -> list[Req]:
    """Chat sessions, `active` at a time, round-robin by turn: each turn's prompt is the
    whole conversation so far (previous prompt + answer) plus a new user message."""
    system = [rng.randrange(VOCAB) for _ in range(400)]
    out: list[Req] = []
    for first in range(0, sessions, active):
        histories = [system + [rng.randrange(VOCAB) for _ in range(rng.randint(50, 300))] for _ in range(active)]
        for _ in range(turns):
            for s in range(min(active, sessions - first)):
                answer = [rng.randrange(VOCAB) for _ in range(rng.randint(40, 200))]
                out.append(Req(histories[s], answer))
                histories[s] = histories[s] + answer + [rng.randrange(VOCAB) for _ in range(rng.randint(20, 150))]
    return out


WORKLOADS = {"shared-prefix": shared_prefix, "multi-turn": multi_turn}


@dataclass
class Trace:
    """What one replay observed: per-request results for the parity check, and time.

    request_s[i]: seconds request i spent in hashing, admission, its prompt's commit and
    releases (the per-request bookkeeping); decode_s[i]: in its decode steps (one append
    and one commit per token), decode_steps[i] of them.
    """

    hits: list[int] = field(default_factory=list)
    tables: list[tuple[int, ...]] = field(default_factory=list)
    hashes: list[list[bytes]] = field(default_factory=list)
    refused: int = 0
    evictions: int = 0
    request_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    decode_steps: list[int] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)

    def add_request(self, t0: float, t1: float, t2: float, t3: float, decode_steps: int) -> None:
        """Clock readings around one request: admission and the prompt's commit in
        [t0, t1), decode steps in [t1, t2), releases in [t2, t3)."""
        self.request_s.append((t1 - t0) + (t3 - t2))
        self.decode_s.append(t2 - t1)
        self.decode_steps.append(decode_steps)


def replay_ours(reqs: list[Req], num_blocks: int, concurrency: int, record: bool = False, cache=None) -> Trace:
    """One replay through HashCache (`cache`, fresh, or a default one); `record` (an
    untimed run) also keeps KV events."""
    import prefixcache
    from prefixcache.config import CacheConfig

    if cache is None:
        cache = prefixcache.build_cache(
            CacheConfig(backend="hash", block_size=BLOCK_SIZE, num_blocks=num_blocks, enable_events=record)
        )
    trace = Trace()
    live: deque[int] = deque()
    clock = time.perf_counter
    gc.collect()
    for i, req in enumerate(reqs):
        t0 = clock()
        while (adm := cache.admit(i, req.prompt)) is None:
            if not live:
                raise SystemExit(f"request {i}: {len(req.prompt)} prompt tokens do not fit in {num_blocks} blocks")
            trace.refused += 1
            cache.release(live.popleft())
        n = len(req.prompt)
        cache.commit(i, n)
        t1 = clock()
        # A step commits what the previous one computed and appends the token it feeds
        # back (the same calls, in the same order, as append-then-commit per token).
        for token in req.output[:-1]:
            new_blocks = cache.commit_and_append(i, n, [token])
            while new_blocks is None and live:
                trace.refused += 1
                cache.release(live.popleft())
                new_blocks = cache.append(i, [token])
            if new_blocks is None:
                break  # alone in the pool and out of room: the request stops here
            n += 1
        cache.commit(i, n)  # the last fed token's KV
        t2 = clock()
        live.append(i)
        if len(live) > concurrency:
            cache.release(live.popleft())
        trace.add_request(t0, t1, t2, clock(), n - len(req.prompt))
        trace.hits.append(adm.num_cached_tokens)
        trace.tables.append(adm.block_table)
    t0 = clock()
    while live:
        cache.release(live.popleft())
    trace.request_s[-1] += clock() - t0
    cache.check_invariants()
    trace.evictions = cache.stats().evictions
    trace.events = [event_key(e) for e in cache.drain_events()]
    return trace


def replay_vllm(core, reqs: list[Req], num_blocks: int, concurrency: int, record: bool = False) -> Trace:
    """The same replay through vLLM's manager; `record` (an untimed run) also keeps each
    request's prompt blocks (as our ids), block hashes and KV events."""
    mgr = core.make_manager(num_blocks + 1, enable_events=record)
    trace = Trace()
    live: deque = deque()
    clock = time.perf_counter
    gc.collect()
    for i, req in enumerate(reqs):
        t0 = clock()
        request = core.Request(str(i), req.prompt, core.block_hasher)
        while True:
            blocks, num_hit, _ = mgr.get_computed_blocks(request)
            if mgr.allocate_slots(request, len(req.prompt) - num_hit, num_hit, blocks) is not None or not live:
                break
            trace.refused += 1
            mgr.free(live.popleft())
        request.num_computed_tokens = len(req.prompt)
        t1 = clock()
        for token in req.output[:-1]:
            request.append_output_token_ids([token])
            allocated = mgr.allocate_slots(request, 1) is not None
            while not allocated and live:
                trace.refused += 1
                mgr.free(live.popleft())
                allocated = mgr.allocate_slots(request, 1) is not None
            if not allocated:
                break  # its last token is never computed, so nothing more is cached
            request.num_computed_tokens += 1
        t2 = clock()
        live.append(request)
        if len(live) > concurrency:
            mgr.free(live.popleft())
        trace.add_request(t0, t1, t2, clock(), request.num_computed_tokens - len(req.prompt))
        trace.hits.append(num_hit)
        if record:
            prompt_blocks = -(-len(req.prompt) // BLOCK_SIZE)
            trace.tables.append(tuple(b.block_id - 1 for b in request_blocks(mgr, str(i))[:prompt_blocks]))
            trace.hashes.append(request.block_hashes[: len(req.prompt) // BLOCK_SIZE])
    t0 = clock()
    while live:
        mgr.free(live.popleft())
    trace.request_s[-1] += clock() - t0
    trace.events = [event_key(e) for e in mgr.take_events()]
    return trace


def event_key(event) -> tuple:
    """The fields vLLM's and our KV events share, in comparable form."""
    if type(event).__name__ == "BlockStored":
        extra = None if event.extra_keys is None else tuple(event.extra_keys)
        return ("stored", tuple(event.block_hashes), event.parent_block_hash, tuple(event.token_ids),
                event.block_size, extra, event.group_idx)
    if type(event).__name__ == "BlockRemoved":
        return ("removed", tuple(event.block_hashes), event.group_idx)
    return (type(event).__name__,)


def request_blocks(mgr, request_id: str) -> list:
    """A live request's blocks in vLLM's manager (its only KV cache group)."""
    return mgr.get_blocks(request_id).blocks[0]


def best_times(runs: list[Trace]) -> tuple[float, float]:
    """µs per request (hashing + admit + commit + release) and per decode step.

    Every replay makes the same calls in the same state, so each request's time is
    taken as its best over the replays: a request preempted by another process in one
    replay is timed by another, and long replays (vLLM's) are not penalised for being
    more often interrupted than short ones.
    """
    request = sum(min(times) for times in zip(*(t.request_s for t in runs)))
    decode = sum(min(times) for times in zip(*(t.decode_s for t in runs)))
    return request / len(runs[0].request_s) * 1e6, decode / max(sum(runs[0].decode_steps), 1) * 1e6


def first_difference(name: str, ours: list, theirs: list) -> str | None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"{name} #{i}: ours {repr(a)[:300]} vs vLLM {repr(b)[:300]}"
    if len(ours) != len(theirs):
        return f"{name}: {len(ours)} requests vs {len(theirs)}"
    return None


def hashing_cost(reqs: list[Req], repeat: int) -> tuple[float, float]:
    """µs per prompt: native chain vs the Python reference (same digests)."""
    from prefixcache.hashing import chain_hashes, none_hash, reference_chain_hashes

    root = none_hash("sha256_cbor")
    sample = [r.prompt for r in reqs[:100]]
    out = []
    for fn in (chain_hashes, reference_chain_hashes):
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            for prompt in sample:
                fn(prompt, BLOCK_SIZE, "sha256_cbor", root)
            best = min(best, time.perf_counter() - start)
        out.append(best / len(sample) * 1e6)
    return out[0], out[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-dir", type=Path, help="cache directory for vLLM 0.33's wheel and sources")
    parser.add_argument("--num-blocks", type=int, default=1024, help="our pool size (vLLM gets one more)")
    parser.add_argument("--concurrency", type=int, default=4, help="live requests kept before releasing")
    parser.add_argument("--repeat", type=int, default=5, help="replays per side; each request's best time is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    args = parser.parse_args()

    core = None
    if args.vllm_dir is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        import vllm_v1_core

        core = vllm_v1_core.load(args.vllm_dir.expanduser(), BLOCK_SIZE)

    from prefixcache import _C

    print(f"# bench_hash: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"SHA-256 on {'the CPU SHA extensions' if _C.sha256_uses_cpu_extensions() else 'portable code'}")
    print(f"# block_size {BLOCK_SIZE}, num_blocks {args.num_blocks} (vLLM {args.num_blocks + 1}), "
          f"concurrency {args.concurrency}, best of {args.repeat}")
    print(f"# command: {' '.join(sys.argv)}")
    print("# prompt tokens, hit tokens: means per request; µs/request: hashing + admit + the prompt's "
          "commit + release; µs/decode step: one token appended and committed (ours: commit_and_append)")
    columns = ["workload", "requests", "prompt tokens", "hit tokens", "hit rate", "evicted blocks", "refused",
               "ours µs/request", "ours µs/decode step"]
    if core:
        columns += ["vLLM µs/request", "vLLM µs/decode step", "speed-up request", "speed-up decode", "parity"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    ok = True
    for name, make in WORKLOADS.items():
        if args.workload not in ("all", name):
            continue
        reqs = make(random.Random(args.seed))
        # Alternate the two sides so a change in machine load hits both alike.
        ours_runs, vllm_runs = [], []
        for _ in range(args.repeat):
            ours_runs.append(replay_ours(reqs, args.num_blocks, args.concurrency))
            if core:
                vllm_runs.append(replay_vllm(core, reqs, args.num_blocks, args.concurrency))
        ours = ours_runs[0]
        queries = sum(len(r.prompt) for r in reqs)
        per_request, per_step = best_times(ours_runs)
        cells = [name, len(reqs), f"{queries / len(reqs):.0f}", f"{sum(ours.hits) / len(reqs):.0f}",
                 f"{sum(ours.hits) / queries:.1%}",
                 ours.evictions, ours.refused, f"{per_request:.1f}", f"{per_step:.2f}"]
        if core:
            theirs_request, theirs_step = best_times(vllm_runs)
            diff = parity(
                reqs,
                replay_ours(reqs, args.num_blocks, args.concurrency, record=True),
                replay_vllm(core, reqs, args.num_blocks, args.concurrency, record=True),
            )
            ok &= diff is None
            cells += [f"{theirs_request:.1f}", f"{theirs_step:.2f}", f"{theirs_request / per_request:.1f}x",
                      f"{theirs_step / per_step:.1f}x", "identical" if diff is None else "DIFFERS"]
        print("| " + " | ".join(map(str, cells)) + " |")
        if core and diff:
            print(f"# first difference: {diff}")
    reqs = shared_prefix(random.Random(args.seed))
    native, python = hashing_cost(reqs, args.repeat)
    print(f"# hashing alone (shared-prefix prompts, sha256_cbor): native {native:.1f} µs/prompt, "
          f"Python reference {python:.1f} µs/prompt ({python / native:.1f}x)")
    return 0 if ok else 1


def parity(reqs: list[Req], ours: Trace, theirs: Trace) -> str | None:
    """The first way our replay differs from vLLM's recorded one, or None."""
    from prefixcache.hashing import block_hashes

    for what, a, b in (
        ("hit tokens", ours.hits, theirs.hits),
        ("block table", ours.tables, theirs.tables),
        ("refusals", [ours.refused], [theirs.refused]),
        ("KV event", ours.events, theirs.events),
    ):
        diff = first_difference(what, a, b)
        if diff:
            return diff
    for i, req in enumerate(reqs):
        full = len(req.prompt) // BLOCK_SIZE
        if block_hashes(req.prompt, BLOCK_SIZE) != theirs.hashes[i][:full]:
            return f"request {i}: prompt block hashes differ"
    return None


if __name__ == "__main__":
    sys.exit(main())
