"""Hybrid layouts: bookkeeping cost (both strategies), in `hash` the sliding-window miss and the options, in `radix` SGLang's chunked prefill and branch tails.

Eight measurements, each side by side in one run (record `cat /proc/loadavg` with them):

1. Cost: per-request bookkeeping (hashing + admit + the prompt's commits + release, µs,
   p50 over the requests, best of `--repeat` replays), and `admit` alone, of a
   full-attention-only cache (the plain `HashCache`, or `RadixCache` for `radix`) and of
   hybrid layouts on the same workload, and the ratios to the same strategy's plain cache;
   then (`decode`) a decode step's `append` + `commit` the same way.
2. A sliding-window miss: block look-ups a miss costs on a long prompt, ours against the
   right-to-left scan vLLM 0.33 makes (one probe per block): O(blocks / window + window)
   against O(blocks).
3. Options beyond vLLM: hit tokens of `retention: dense` (+ `state_interval` for mamba)
   against vLLM's defaults (sparse retention), on the second sighting of a shared
   prefix and over whole workloads.
4. States finer than the block (`state_granule`): full + mamba at block 528 against
   vLLM's defaults there and full attention at block 16, requests decoded token by
   token (so a conversation's next turn can start where the last one ended); then
   `radix`, whose state pool is apart, at block 16 (a state costing its bytes) against
   block 528.
5. A per-path state cap (`state_cap`, replay-length-aware) against LRU alone at equal
   memory: long conversations, full + mamba at block 528 with `state_granule: 16`,
   keeping every state written (`retention: dense, state_interval: 64`: a state every
   64 prompt tokens and every 16 decoded ones, one 528-token page each) or the sparse
   ones, in pools where the states crowd the KV out; then `radix` at SGLang's defaults,
   one extend or chunks of 256, in state pools the states crowd.
6. `radix` under SGLang's chunked prefill (`chunked_prefill_size`) against one extend
   (SGLang's `-1`): hit tokens on the second sighting of a shared prefix and over whole
   workloads (each chunk's insert leaves a live window and a state behind it).
7. `radix` with `no_tail_cliff` (branch tails evicted last, dead leaves with them)
   against SGLang's SWA LRU: section 5's conversations over full+SWA, SWA pools the
   windows crowd (`--only tail-sweep`: over a 240-cell grid, counted).
8. What that option's eviction walk costs when branch tails fill a state pool.

    python benchmarks/bench_hybrid.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_parity import WORKLOADS, long_shared_prefix, our_layout  # noqa: E402
from machine import cpu_model  # noqa: E402

FULL = [("full_attention", None, None)]
LAYOUTS = {
    "full": FULL,
    "full+swa": FULL + [("sliding_window", 1024, None)],
    "full+mamba": FULL + [("mamba", None, None)],
    "full+swa+mamba": FULL + [("sliding_window", 1024, None), ("mamba", None, None)],
}


def build(groups, block_size: int, num_blocks: int, backend: str = "hash", **options):
    import prefixcache
    from prefixcache.config import CacheConfig

    layout = our_layout(groups) if len(groups) > 1 else ()
    return prefixcache.build_cache(CacheConfig(backend=backend, block_size=block_size, num_blocks=num_blocks,
                                               enable_events=False, layout=layout, options=options))  # fmt: skip


def build_radix(layout, num_blocks: int, block_size: int = 16, **options):
    """`radix` over `layout` (LayerGroups: its pools' sizes included), block 16 by default."""
    import prefixcache
    from prefixcache.config import CacheConfig

    return prefixcache.build_cache(CacheConfig(backend="radix", block_size=block_size, num_blocks=num_blocks,
                                               enable_events=False, layout=layout, options=options))  # fmt: skip


def replay(cache, reqs, admit_seconds: list[float] | None = None) -> tuple[list[float], list[int]]:
    """Per request: seconds of bookkeeping, hit tokens (admit, checkpoints, commit, release);
    the seconds of `admit` alone appended to `admit_seconds`."""
    clock = time.perf_counter
    seconds, hits = [], []
    for i, req in enumerate(reqs):
        t0 = clock()
        adm = cache.admit(i, req.prompt)
        t1 = clock()
        for c in adm.checkpoints:
            cache.commit(i, c)
        cache.commit(i, len(req.prompt))
        cache.release(i)
        seconds.append(clock() - t0)
        hits.append(adm.num_cached_tokens)
        if admit_seconds is not None:
            admit_seconds.append(t1 - t0)
    return seconds, hits


def cost(args) -> None:
    reqs = WORKLOADS["shared-system-prompt"](random.Random(args.seed))
    print("\n## 1. Bookkeeping per request (shared system prompt, 64 requests, block 16, ample pool)\n")
    print("| strategy | layout | p50 µs/request | ratio to its full attention | admit alone: p50 µs | ratio | hit tokens |")
    print("|---|---|---|---|---|---|---|")
    arms = [(backend, name) for backend in args.backends for name in LAYOUTS]
    runs: dict[tuple[str, str], list] = {arm: [] for arm in arms}
    admits: dict[tuple[str, str], list[list[float]]] = {arm: [] for arm in arms}
    for _ in range(args.repeat):  # sides alternate, each request keeps its best
        for backend, name in arms:
            admits[backend, name].append([])
            cache = build(LAYOUTS[name], 16, 20_000, backend)
            runs[backend, name].append(replay(cache, reqs, admits[backend, name][-1]))
    base: dict[str, tuple[float, float]] = {}
    for backend, name in arms:
        p50 = statistics.median(min(t) for t in zip(*(r[0] for r in runs[backend, name]))) * 1e6
        admit = statistics.median(min(t) for t in zip(*admits[backend, name])) * 1e6
        b, a = base.setdefault(backend, (p50, admit))
        hits = sum(runs[backend, name][0][1])
        print(f"| {backend} | {name} | {p50:.1f} | {p50 / b:.2f}x | {admit:.1f} | {admit / a:.2f}x | {hits:,} |")


def decode_steps(args) -> None:
    """Per decode step of a request: `append` of one token, then its `commit`."""
    print("\n## 1b. A decode step (8 requests after a 1,000-token prompt, 256 tokens each, one at a "
          "time; append + commit, mean µs over the steps, best of `--repeat`; block 16, ample pool)\n")
    print("| strategy | layout | step µs | ratio to its full attention | append µs | commit µs |")
    print("|---|---|---|---|---|---|")
    rng = random.Random(args.seed)
    prompt = [rng.randrange(50_000) for _ in range(900)]
    clock = time.perf_counter
    for backend in args.backends:
        base = None
        for name in LAYOUTS:
            best = (float("inf"), 0.0, 0.0)
            for _ in range(args.repeat):
                cache = build(LAYOUTS[name], 16, 20_000, backend)
                for r in range(8):
                    adm = cache.admit(r, prompt + [r] * 100)
                    for c in adm.checkpoints:
                        cache.commit(r, c)
                    cache.commit(r, 1000)
                appends = commits = 0.0
                for step in range(256):
                    for r in range(8):
                        t0 = clock()
                        cache.append(r, [step])
                        t1 = clock()
                        cache.commit(r, 1001 + step)
                        appends, commits = appends + t1 - t0, commits + clock() - t1
                for r in range(8):
                    cache.release(r)
                n = 256 * 8
                if (appends + commits) / n < best[0]:
                    best = ((appends + commits) / n, appends / n, commits / n)
            base = base or best[0]
            print(f"| {backend} | {name} | {best[0] * 1e6:.2f} | {best[0] / base:.2f}x | {best[1] * 1e6:.2f} | "
                  f"{best[2] * 1e6:.2f} |")


def window_miss(args) -> None:
    """A prompt of `blocks` blocks is cached (sparse: its window tail at its end only);
    a sibling that shares all but its last 64 blocks is looked up: full attention hits
    that far, and no window ends there, a miss all the way down."""
    print("\n## 2. A sliding-window miss (block 16): block look-ups of the window group\n")
    print("| prompt blocks | window (tokens) | blocks scanned | ours: single-block probes (+1 run from block 0) | vLLM 0.33 (one per block scanned) |")
    print("|---|---|---|---|---|")
    rng = random.Random(args.seed)
    for blocks, window in ((256, 512), (1024, 512), (4096, 512), (4096, 4096)):
        cache = build(FULL + [("sliding_window", window, None)], 16, 2 * blocks + 64)
        prompt = [rng.randrange(1 << 20) for _ in range(blocks * 16)]
        cache.admit(0, prompt)
        cache.commit(0, len(prompt))
        cache.release(0)
        sibling = prompt[: (blocks - 64) * 16] + [rng.randrange(1 << 20) for _ in range(16)]
        hit = cache.match(sibling).num_tokens
        assert hit == 0, hit
        print(f"| {blocks} | {window} | {blocks - 64} | {cache.hit_finder.last_probes} | {blocks - 64} |")


def _hit_rows(args, backend: str, arms_of) -> None:
    """Table rows of hit tokens: full+SWA and full+Mamba at blocks 16 and 528, every
    workload and the 1,500-shared case's second request alone; `arms_of(layout, block)`
    gives each column's options (None: a "-")."""
    workloads = dict(WORKLOADS)
    workloads["1500-shared: 2nd request"] = lambda rng: long_shared_prefix(rng, n=2)
    for lname in ("full+swa", "full+mamba"):
        for bs in (16, 528):
            arms = arms_of(lname, bs)
            for wname, make in workloads.items():
                reqs = make(random.Random(args.seed))
                cells = []
                for opts in arms:
                    if opts is None:
                        cells.append("-")
                        continue
                    hits = replay(build(LAYOUTS[lname], bs, 60_000 if bs == 16 else 2000, backend, **opts), reqs)[1]
                    cells.append(f"{hits[-1] if '2nd' in wname else sum(hits):,}")
                print(f"| {lname} | {bs} | {wname} | " + " | ".join(cells) + " |")


def options(args) -> None:
    print("\n## 3. Options beyond vLLM 0.33 (hit tokens; vLLM's default = sparse retention)\n")
    print("| layout | block | workload | vLLM 0.33 default | retention: dense | dense + state_interval |")
    print("|---|---|---|---|---|---|")
    _hit_rows(args, "hash", lambda lname, bs: [
        {}, {"retention": "dense"},
        None if lname == "full+swa" else {"retention": "dense", "state_interval": 256 if bs == 16 else 528}])


def replay_decoded(cache, reqs) -> list[int]:
    """Hit tokens per request: admit, commit at each checkpoint and the prompt's end,
    decode the output one token a step (commit + append), release."""
    hits = []
    for i, req in enumerate(reqs):
        adm = cache.admit(i, req.prompt)
        for c in adm.checkpoints:
            cache.commit(i, c)
            cache.append(i, [])
        n = len(req.prompt)
        cache.commit(i, n)
        for token in req.output[:-1]:
            cache.append(i, [token])
            n += 1
            cache.commit(i, n)
        cache.release(i)
        hits.append(adm.num_cached_tokens)
    cache.check_invariants()
    return hits


def finer_states(args) -> None:
    g = args.granule
    print(f"\n## 4. States finer than the block: full+mamba at block 528, `state_granule: {g}` (hit tokens, decoded outputs)\n")
    print("| workload | full attention, block 16 | vLLM 0.33 default, block 528 | state_granule, block 528 | "
          "of full attention | requests after the first hitting >= 1,350 |")
    print("|---|---|---|---|---|---|")
    for wname, make in WORKLOADS.items():
        reqs = make(random.Random(args.seed))
        full16 = replay_decoded(build(FULL, 16, 60_000), reqs)
        vllm = replay_decoded(build(LAYOUTS["full+mamba"], 528, 2000), reqs)
        fine = replay_decoded(build(LAYOUTS["full+mamba"], 528, 2000, state_granule=g), reqs)
        over = f"{sum(h >= 1350 for h in fine[1:])} of {len(fine) - 1} (vLLM: {sum(h >= 1350 for h in vllm[1:])})" \
            if wname == "1500-shared" else "-"
        share = f"{sum(fine) / sum(full16):.3f}" if sum(full16) else "-"
        print(f"| {wname} | {sum(full16):,} | {sum(vllm):,} | {sum(fine):,} | {share} | {over} |")
    radix_states(args)


def radix_states(args) -> None:
    """`radix` keeps states in a pool of their own (SGLang's), so its block is not raised to
    hold one: the same workloads at block 16, a state costing the 33 blocks its bytes fill
    (a 2 MiB state, 528 tokens of a 4 KiB-a-token layer), against block 528."""
    from prefixcache.layout import LayerGroup

    layout = (LayerGroup("full_attention", bytes_per_token=4096), LayerGroup("mamba", state_bytes=528 * 4096))

    arms = [("block 528, `mamba_chunk: 48`", 528, {"mamba_chunk": 48}), ("block 16, SGLang's defaults", 16, {}),
            ("block 16, `mamba_track_interval: 64`", 16, {"mamba_track_interval": 64})]
    print("\n`radix` (SGLang 0.5.23's rules; hit tokens, of full attention at block 16, requests after the first "
          "hitting >= 1,350 on the 1,500-shared case)\n")
    print("| workload | full attention, block 16 | " + " | ".join(a[0] for a in arms) + " |")
    print("|---|---|" + "---|" * len(arms))
    for wname, make in WORKLOADS.items():
        reqs = make(random.Random(args.seed))
        full16 = sum(replay_decoded(build(FULL, 16, 60_000), reqs))
        cells = []
        for _, bs, opts in arms:
            hits = replay_decoded(build_radix(layout, 60_000 if bs == 16 else 2000, bs, **opts), reqs)
            over = f"; {sum(h >= 1350 for h in hits[1:])} of {len(hits) - 1}" if wname == "1500-shared" else ""
            cells.append(f"{sum(hits):,} ({sum(hits) / full16:.3f}{over})")
        print(f"| {wname} | {full16:,} | " + " | ".join(cells) + " |")


def long_chats(rng: random.Random, sessions: int = 24, turns: int = 6):
    """Conversations round-robin by turn: a 256-400-token first prompt, each turn adding
    the answer (32-96 tokens, decoded) and a 32-96-token message."""
    from hybrid_parity import VOCAB, Req

    histories = [[rng.randrange(VOCAB) for _ in range(rng.randint(256, 400))] for _ in range(sessions)]
    out = []
    for _ in range(turns):
        for s in range(sessions):
            answer = [rng.randrange(VOCAB) for _ in range(rng.randint(32, 96))]
            out.append(Req(list(histories[s]), answer))
            histories[s] = histories[s] + answer + [rng.randrange(VOCAB) for _ in range(rng.randint(32, 96))]
    return out


def replay_pressed(cache, reqs, concurrency: int = 4) -> list[int]:
    """`replay_decoded` with up to `concurrency` requests live (released oldest first,
    and early when the pool refuses)."""
    from collections import deque

    live: deque[int] = deque()
    hits = []

    def until(call, current=None):
        while (out := call()) is None:
            if not live or live[0] == current:  # only the request itself is left to release
                raise SystemExit("a request does not fit the pool alone")
            cache.release(live.popleft())
        return out

    for i, req in enumerate(reqs):
        adm = until(lambda: cache.admit(i, req.prompt))
        live.append(i)
        for c in adm.checkpoints:
            cache.commit(i, c)
            until(lambda: cache.append(i, []), i)
        n = len(req.prompt)
        cache.commit(i, n)
        for token in req.output[:-1]:
            until(lambda: cache.append(i, [token]), i)
            n += 1
            cache.commit(i, n)
        hits.append(adm.num_cached_tokens)
        while len(live) > concurrency:
            cache.release(live.popleft())
    while live:
        cache.release(live.popleft())
    cache.check_invariants()
    return hits


def state_cap(args) -> None:
    reqs = long_chats(random.Random(args.seed))
    prompts = sum(len(r.prompt) for r in reqs)
    dense = {"state_granule": 16, "retention": "dense", "state_interval": 64}
    sparse = {"state_granule": 16}
    print(f"\n## 5. Per-path state cap against LRU at equal memory ({len(reqs)} requests, {prompts:,} prompt tokens; "
          "full+mamba, block 528, `state_granule: 16`; hit ratio)\n")
    arms = [("dense, LRU", dense, 0), ("dense, state_cap: 1", dense, 1), ("dense, state_cap: 2", dense, 2),
            ("sparse, LRU", sparse, 0), ("sparse, state_cap: 1", sparse, 1),
            ("sparse, no_tail_cliff", {**sparse, "no_tail_cliff": True}, 0)]  # fmt: skip
    print("| pool (blocks of 528) | " + " | ".join(name for name, _, _ in arms) + " | dense: cap 1 - LRU (points) |")
    print("|---|" + "---|" * (len(arms) + 1))
    for blocks in args.pools:
        ratios = [sum(replay_pressed(build(LAYOUTS["full+mamba"], 528, blocks, **opts, state_cap=c), reqs)) / prompts
                  for _, opts, c in arms]  # fmt: skip
        print(f"| {blocks} | " + " | ".join(f"{r:.3f}" for r in ratios) + f" | {100 * (ratios[1] - ratios[0]):+.1f} |")
    # radix: SGLang's own pools (a state pool of `slots` beside an ample KV pool), its
    # defaults (a state every 64 tokens, every 256 decoding), one extend or chunks of 256.
    print(f"\n`radix`, full+mamba at block 16, SGLang 0.5.23's defaults, the same requests; hit ratio by state pool:\n")
    arms = [("one extend, LRU (SGLang)", 0, {}), ("one extend, state_cap: 1", 0, {"state_cap": 1}),
            ("one extend, no_tail_cliff", 0, {"no_tail_cliff": True}),
            ("chunks of 256, LRU (SGLang)", 256, {}), ("chunks of 256, state_cap: 1", 256, {"state_cap": 1}),
            ("chunks of 256, no_tail_cliff", 256, {"no_tail_cliff": True})]  # fmt: skip
    print("| state slots | " + " | ".join(name for name, _, _ in arms) + " | cap 1 / no_tail_cliff - LRU (points) |")
    print("|---|" + "---|" * (len(arms) + 1))
    from prefixcache.layout import LayerGroup

    for slots in args.slots:
        layout = (LayerGroup("full_attention"), LayerGroup("mamba", slots=slots))
        ratios = [sum(replay_pressed(build_radix(layout, 4000 + slots, chunked_prefill_size=chunk, **opts), reqs)) / prompts
                  for _, chunk, opts in arms]  # fmt: skip
        gains = "; ".join(f"{100 * (ratios[i + 1] - ratios[i]):+.1f} / {100 * (ratios[i + 2] - ratios[i]):+.1f}"
                          for i in (0, 3))  # fmt: skip
        print(f"| {slots} | " + " | ".join(f"{r:.3f}" for r in ratios) + f" | {gains} |")


def chunked_prefill(args) -> None:
    print("\n## 6. `radix` under SGLang's chunked prefill (hit tokens; a unit is 256 TOKENS at block 16, 528 at 528)\n")
    print("| layout | block | workload | one extend (SGLang's -1) | chunks of 1 unit | 2 units | 4 units |")
    print("|---|---|---|---|---|---|---|")

    def arms(lname: str, bs: int) -> list[dict]:
        unit = 256 if bs == 16 else 528
        mamba = {"mamba_chunk": 48} if bs == 528 and "mamba" in lname else {}  # SGLang's rule: it divides 528
        return [{"chunked_prefill_size": k * unit, **mamba} for k in (0, 1, 2, 4)]

    _hit_rows(args, "radix", arms)


def tail_cliff(args) -> None:
    """`radix` with `no_tail_cliff` against SGLang's SWA LRU, SWA pools the windows crowd."""
    from prefixcache.backends.hybrid_radix_tree import Component
    from prefixcache.layout import LayerGroup

    reqs = long_chats(random.Random(args.seed))
    prompts = sum(len(r.prompt) for r in reqs)
    blocks = 4000
    print(f"\n## 7. `radix`: branch tails last (`no_tail_cliff`) against SGLang's SWA LRU ({len(reqs)} requests, "
          f"{prompts:,} prompt tokens, full+SWA at block 16, {blocks:,} blocks split FULL : SWA = 1 : pool_ratio, "
          "up to 4 live; hit ratio)\n")
    print("| window | `pool_ratio` | SWA pool (pages) | SGLang 0.5.23 | `no_tail_cliff` | points |")
    print("|---|---|---|---|---|---|")
    for window in args.windows:
        for ratio in args.ratios:
            layout = (LayerGroup("full_attention"), LayerGroup("sliding_window", window=window, pool_ratio=ratio))
            caches = [build_radix(layout, blocks, no_tail_cliff=cliff) for cliff in (False, True)]
            swa = caches[0]._budgets[Component.SWA].capacity  # the cache's own split, pages
            ratios = [sum(replay_pressed(cache, reqs)) / prompts for cache in caches]
            print(f"| {window} | {ratio} | {swa:,} | {ratios[0]:.3f} | {ratios[1]:.3f} | {100 * (ratios[1] - ratios[0]):+.1f} |")


def tail_sweep(args) -> None:
    """Section 7 over a wider grid: windows, pools, SWA ratios and conversation counts;
    the cells where the two orders differ, then how many it wins, loses and ties."""
    from prefixcache.layout import LayerGroup

    print("\n## 7b. `no_tail_cliff` against SGLang's SWA LRU over a grid (hit ratio; cells where they differ)\n")
    print("| conversations | window | pool (blocks of 16) | `pool_ratio` | SGLang 0.5.23 | `no_tail_cliff` | points |")
    print("|---|---|---|---|---|---|---|")
    count = {"ahead": 0, "behind": 0, "equal": 0, "only the option fits": 0, "neither fits": 0}
    for sessions in (8, 16, 32):
        reqs = long_chats(random.Random(args.seed), sessions=sessions)
        prompts = sum(len(r.prompt) for r in reqs)
        for window in (64, 128, 512, 1024):
            for blocks in (800, 1200, 2000, 3000, 6000):
                for ratio in (0.1, 0.2, 0.4, 0.8):
                    layout = (LayerGroup("full_attention"), LayerGroup("sliding_window", window=window, pool_ratio=ratio))
                    got: list[float | None] = []
                    for cliff in (False, True):
                        try:
                            got.append(sum(replay_pressed(build_radix(layout, blocks, no_tail_cliff=cliff), reqs)) / prompts)
                        except SystemExit:  # a request does not fit the pool alone
                            got.append(None)
                    if None in got:
                        count["neither fits" if got[1] is None else "only the option fits"] += 1
                        continue
                    d = got[1] - got[0]
                    count["equal" if abs(d) < 1e-12 else "ahead" if d > 0 else "behind"] += 1
                    if abs(d) >= 1e-12:
                        print(f"| {sessions} | {window} | {blocks:,} | {ratio} | {got[0]:.3f} | {got[1]:.3f} | {100 * d:+.1f} |")
    print("\n" + ", ".join(f"{k}: {v}" for k, v in count.items()) + f" (of {sum(count.values())} cells)")


def tail_cost(args) -> None:
    """What `no_tail_cliff`'s first walk costs when branch tails fill the state pool:
    conversations of 2 turns, full+Mamba, a KV pool that never evicts."""
    from prefixcache.layout import LayerGroup

    print("\n## 8. `no_tail_cliff`'s cost: bookkeeping per request (µs, whole replay / requests), state pools full of tails\n")
    print("| conversations | state slots | SGLang 0.5.23 | `no_tail_cliff` | ratio |")
    print("|---|---|---|---|---|")
    for sessions, slots in ((200, 150), (800, 600)):
        reqs = long_chats(random.Random(args.seed), sessions=sessions, turns=2)
        layout = (LayerGroup("full_attention"), LayerGroup("mamba", slots=slots))
        best = [float("inf"), float("inf")]
        for _ in range(args.repeat):  # sides alternate, each keeps its best
            for i, cliff in enumerate((False, True)):
                cache = build_radix(layout, 200_000 + slots, no_tail_cliff=cliff)
                t0 = time.perf_counter()
                replay_pressed(cache, reqs)
                best[i] = min(best[i], (time.perf_counter() - t0) / len(reqs) * 1e6)
        print(f"| {sessions} | {slots} | {best[0]:.0f} | {best[1]:.0f} | {best[1] / best[0]:.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--granule", type=int, default=16, help="state_granule of section 4 (TOKENS)")
    parser.add_argument("--only", choices=("cost", "decode", "window", "options", "finer", "cap", "chunked", "tail",
                                           "tail-sweep", "tail-cost"),
                        help="one section only")
    parser.add_argument("--backends", nargs="+", choices=("hash", "radix"), default=["hash", "radix"],
                        help="the strategies section 1 measures (each against its own full-attention cache)")
    parser.add_argument("--pools", type=int, nargs="+", default=[64, 96, 128, 160, 192, 256, 384],
                        help="section 5's pool sizes (BLOCKS of 528)")
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 40, 48, 56, 64, 96, 128],
                        help="section 5's radix state pools (state slots)")
    parser.add_argument("--windows", type=int, nargs="+", default=[128, 512], help="section 7's windows (TOKENS)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4],
                        help="section 7's SWA pool_ratio values (SWA : FULL)")
    args = parser.parse_args()
    print(f"# bench_hybrid: {cpu_model()}, load {open('/proc/loadavg').read().split()[:3]}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# command: {' '.join(sys.argv)}")
    sections = {"cost": cost, "decode": decode_steps, "window": window_miss, "options": options,
                "finer": finer_states, "cap": state_cap, "chunked": chunked_prefill, "tail": tail_cliff,
                "tail-sweep": tail_sweep, "tail-cost": tail_cost}
    for name, section in sections.items():
        if args.only in (None, name):
            section(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
