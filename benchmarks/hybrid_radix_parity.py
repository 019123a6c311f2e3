"""Hybrid layouts: per-request parity of `radix` with SGLang 0.5.23's own UnifiedRadixCache.

Replays deterministic workloads through our `radix` cache with a hybrid `cache.layout`
and, side by side, through SGLang 0.5.23's unmodified `UnifiedRadixCache` (its Python
TreeCore, FULL + SWA or FULL + MAMBA components, its static SWA allocator and Mamba slot
allocator, its scheduler's allocation and checkpoint functions), run on CPU from the
wheel by benchmarks/sglang_reference.py (`SGLangHybridArm`), with the same pool sizes:

    python benchmarks/hybrid_radix_parity.py
    python benchmarks/hybrid_radix_parity.py --block-size 528 --mamba-chunk 48
    python benchmarks/hybrid_radix_parity.py --chunked-prefill-size 256 [--interleave]

Checked per request: the hit (TOKENS), where the prefill tracks a Mamba state and, with
`--chunked-prefill-size`, where its chunks end (ours `Admission.checkpoints`, SGLang's
`_mamba_radix_cache_v2_req_prepare_for_extend` per extend and its PrefillAdder's cuts), and
after every request each pool's free and evictable size and the tree's node count
(so a difference in what was evicted, tombstoned or split shows where it happens).

How both sides are driven, one request at a time: admission; the prefill (ours: a
commit at each checkpoint, then at the prompt's end; SGLang: a stash and the next
`alloc_for_extend` at each chunk's end, then `checkpoint_kv_cache`); with `--interleave`
the next request is admitted before a request's last chunk runs (its earlier chunks
stashed, the last allocated), as SGLang's scheduler admits requests beside a chunked
request's last chunk (both sides allocate one request at a time where SGLang allocates
the batch's extends together);
`output - 1` decode steps (ours: `append` + `commit`; SGLang: `check_decode_mem`,
`alloc_for_decode`, the track update); a request is released once `--concurrency`
newer ones are live (SGLang: `release_kv_cache`). Pools: `ample` holds every request
without evicting; `half` and `quarter` hold that share of what the workload touches,
so the pools evict (`pool_sizes`). Layouts: full+SWA (window 1024 tokens, SGLang's sliding_window_size
1023, SWA pool 0.8 of the full one), full+Mamba (SGLang's extra_buffer strategy:
states every max(64, page) tokens, every 256 while decoding) and full+SWA+Mamba (both).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_parity import WORKLOADS, first_field_difference  # noqa: E402
from machine import cpu_model  # noqa: E402

WINDOW = 1024
SWA_RATIO = 0.8
MAMBA_CHUNK, TRACK_INTERVAL = 64, 256
LAYOUTS = ("full+swa", "full+mamba", "full+swa+mamba")


@dataclass
class Trace:
    hits: list[int] = field(default_factory=list)
    checkpoints: list[tuple[int, ...]] = field(default_factory=list)
    pools: list[tuple[int, ...]] = field(default_factory=list)
    evicted: int = 0  # blocks (every pool) evicted
    seconds: float = 0.0


def pool_sizes(reqs, block_size: int, concurrency: int, layout: str) -> dict[str, tuple[int, int, int]]:
    """(full pages, SWA pages, Mamba slots) per pool setting (module docstring): `half`
    and `quarter` are that share of the pages the workload touches (at least the live
    requests and two more), with a state pool of the live requests' slots and a quarter
    (an eighth) of the requests."""
    per_request = max(-(-(len(r.prompt) + len(r.output)) // block_size) for r in reqs)
    total = sum(-(-(len(r.prompt) + len(r.output)) // block_size) for r in reqs)
    floor = per_request * (concurrency + 2)
    full = {"ample": total + per_request, "half": max(floor, total // 2), "quarter": max(floor, total // 4)}
    swa = {name: round(pages * SWA_RATIO) if "swa" in layout else 0 for name, pages in full.items()}
    live_slots = 4 * (concurrency + 1)  # each: running, two track slots, the one a checkpoint takes
    slots = {"ample": 2 * len(reqs), "half": max(3, len(reqs) // 4), "quarter": max(3, len(reqs) // 8)}
    return {name: (pages, swa[name], live_slots + slots[name] if "mamba" in layout else 0) for name, pages in full.items()}


def _layout(full: int, swa: int, slots: int):
    from prefixcache.layout import LayerGroup

    groups = [LayerGroup("full_attention")]
    if swa:
        groups.append(LayerGroup("sliding_window", window=WINDOW, pool_ratio=swa / full))
    if slots:
        groups.append(LayerGroup("mamba", slots=slots))
    return tuple(groups), full + swa + slots


def _in_order(n: int, start, finish, interleave: bool) -> None:
    """Requests 0..n-1 each started (admitted, every prefill chunk but the last run) and
    finished (the last chunk, decode); with `interleave` a request starts before the one
    before it finishes."""
    previous = None
    for i in range(n):
        start(i)
        if previous is not None:
            finish(previous)
            previous = None
        if interleave:
            previous = i
        else:
            finish(i)
    if previous is not None:
        finish(previous)


def replay_ours(reqs, block_size: int, full: int, swa: int, slots: int, concurrency: int, chunk: int,
                chunked_prefill: int = 0, interleave: bool = False) -> Trace:
    import prefixcache
    from prefixcache.backends.hybrid_radix_tree import Component
    from prefixcache.config import CacheConfig

    groups, num_blocks = _layout(full, swa, slots)
    options = {"mamba_chunk": chunk, "mamba_track_interval": TRACK_INTERVAL} if slots else {}
    options["chunked_prefill_size"] = chunked_prefill
    cache = prefixcache.build_cache(CacheConfig(backend="radix", block_size=block_size, num_blocks=num_blocks,
                                                layout=groups, options=options))  # fmt: skip
    aux = ([Component.SWA] if swa else []) + ([Component.MAMBA] if slots else [])
    assert [cache._budgets[c].capacity for c in [Component.FULL, *aux]] == [full, *(n for n in (swa, slots) if n)]
    trace = Trace()
    live: deque[int] = deque()

    def finish(i: int) -> None:
        """The prefill's last chunk ran: the prompt's commit, the decode steps, a release."""
        n = len(reqs[i].prompt)
        cache.commit(i, n)
        for token in reqs[i].output[:-1]:
            if cache.append(i, [token]) is None:
                raise SystemExit(f"ours refused a decode step of request {i}")
            n += 1
            cache.commit(i, n)
        live.append(i)
        if len(live) > concurrency:
            cache.release(live.popleft())
        tree = cache.tree
        trace.pools.append((cache._available(Component.FULL), tree.evictable[Component.FULL],
                            *(x for c in aux for x in (cache._available(c), tree.evictable[c])), tree.num_nodes))  # fmt: skip

    def start(i: int) -> None:
        adm = cache.admit(i, reqs[i].prompt)
        if adm is None:
            raise SystemExit(f"ours refused request {i}: the pool is too small for the replay")
        trace.hits.append(adm.num_cached_tokens)
        trace.checkpoints.append(tuple(adm.checkpoints))
        for c in adm.checkpoints:  # every chunk but the last run, the last allocated
            cache.commit(i, c)

    t0 = time.perf_counter()
    _in_order(len(reqs), start, finish, interleave)
    while live:
        cache.release(live.popleft())
    trace.seconds = time.perf_counter() - t0
    trace.evicted = cache.stats().evictions
    cache.check_invariants()
    return trace


def replay_sglang(sg, reqs, block_size: int, full: int, swa: int, slots: int, concurrency: int, chunk: int,
                  chunked_prefill: int = 0, interleave: bool = False) -> Trace:
    from sglang_reference import SGLangHybridArm

    arm = SGLangHybridArm(sg, block_size, full, window=WINDOW if swa else None, swa_pages=swa, mamba_slots=slots,
                          mamba_chunk=chunk, mamba_track_interval=TRACK_INTERVAL,
                          chunked_prefill_size=chunked_prefill, rows=concurrency + 2)  # fmt: skip
    trace = Trace()
    live: deque[int] = deque()

    def finish(i: int) -> None:
        req = reqs[i]
        arm.prefilled(i, req.output[0])
        for token in req.output[1:]:
            arm.decode(i, token)
        live.append(i)
        if len(live) > concurrency:
            arm.release(live.popleft())
        aux: tuple[int, ...] = ()
        if swa:
            aux += (arm.alloc.swa_available_size(), arm.tree.swa_evictable_size())
            free_full = arm.alloc.full_available_size()
        else:
            free_full = arm.alloc.available_size()
        if slots:
            aux += (arm.pool.mamba_allocator.available_size(), arm.tree.mamba_evictable_size())
        trace.pools.append((free_full, arm.tree.full_evictable_size(), *aux, len(arm.tree.tree_core._node_arena)))

    def start(i: int) -> None:
        prompt = reqs[i].prompt
        hit, track = arm.admit(i, array("q", prompt))
        trace.hits.append(hit)
        later = arm.advance(i)  # the scheduler's next rounds, up to the last chunk's allocation
        trace.checkpoints.append(tuple(sorted({p for p in (track, *later) if p is not None and p < len(prompt)})))

    t0 = time.perf_counter()
    _in_order(len(reqs), start, finish, interleave)
    while live:
        arm.release(live.popleft())
    trace.seconds = time.perf_counter() - t0
    arm.check()
    return trace


def first_difference(ours: Trace, theirs: Trace) -> str | None:
    return first_field_difference(ours, theirs, ("hits", "checkpoints", "pools"), "SGLang")


def record(sg) -> None:
    """SGLang's hits on tests/test_hybrid_radix.py's SCENARIOS, as the test's EXPECTED."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tests" / "test_hybrid_radix.py"
    spec = importlib.util.spec_from_file_location("test_hybrid_radix", path)
    assert spec is not None and spec.loader is not None
    t = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(t)
    from sglang_reference import SGLangHybridArm

    print("EXPECTED.update({")
    for name, (kind, bs, full, other, options) in sorted(t.SCENARIOS.items()):
        chunked = options.get("chunked_prefill_size", 0)
        if kind == "swa":
            arm = SGLangHybridArm(sg, bs, full, window=t.WINDOW, swa_pages=other, chunked_prefill_size=chunked)
        else:
            swa_pages, slots = other if kind == "swa+mamba" else (0, other)
            arm = SGLangHybridArm(sg, bs, full, window=t.WINDOW if swa_pages else None, swa_pages=swa_pages,
                                  mamba_slots=slots, mamba_chunk=options["mamba_chunk"],
                                  mamba_track_interval=options["mamba_track_interval"],
                                  chunked_prefill_size=chunked)  # fmt: skip
        hits, live = [], []
        for i, (prompt, answer, ns) in enumerate(t.workload()):
            hits.append(arm.admit(i, array("q", prompt), ns)[0])
            arm.prefilled(i, answer[0])
            for token in answer[1:]:
                arm.decode(i, token)
            live.append(i)
            if len(live) > t.CONCURRENCY:
                arm.release(live.pop(0))
        for i in live:
            arm.release(i)
        arm.check()
        print(f"    {name!r}: {hits},")
    print("})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-src", type=Path, default=None, help="a directory holding sglang/ (default: the wheel)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/prefixcache/sglang")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=[*LAYOUTS, "all"], default="all")
    parser.add_argument("--block-size", type=int, nargs="*", default=[16, 1])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--mamba-chunk", type=int, default=MAMBA_CHUNK,
                        help="the model's Mamba chunk in TOKENS (must divide the block or be a multiple of it)")
    parser.add_argument("--chunked-prefill-size", type=int, default=0,
                        help="TOKENS of a prefill chunk (SGLang's --chunked-prefill-size; 0: one extend)")
    parser.add_argument("--interleave", action="store_true",
                        help="admit each request before the previous one's last prefill chunk completes (its "
                             "earlier chunks stashed), as SGLang admits a request beside a chunked one's last chunk")
    parser.add_argument("--pool", choices=["ample", "half", "quarter", "all"], default="all")
    parser.add_argument("--record", action="store_true", help="print SGLang's hits on tests/test_hybrid_radix.py's scenarios")
    args = parser.parse_args()

    from sglang_reference import SGLangUnavailable, load_sglang_unified

    try:
        sg = load_sglang_unified(args.sglang_src, args.cache_dir)
    except SGLangUnavailable as err:
        print(f"SGLang unavailable: {err}")
        return 2
    if args.record:
        record(sg)
        return 0
    print(f"# hybrid_radix_parity: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load {open('/proc/loadavg').read().split()[:3]}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"SGLang {sg.source.version} ({sg.source.origin})")  # fmt: skip
    print(f"# command: {' '.join(sys.argv)}")
    print("| layout | block | workload | pool (full / SWA / states) | requests | ours hit tokens | SGLang hit tokens | "
          "evicted (ours) | ours s | SGLang s | parity |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for bs in args.block_size:
        for lname in LAYOUTS:
            if args.layout not in ("all", lname):
                continue
            for wname, make in WORKLOADS.items():
                if args.workload not in ("all", wname):
                    continue
                reqs = make(random.Random(args.seed))
                for pname, (full, swa, slots) in pool_sizes(reqs, bs, args.concurrency, lname).items():
                    if args.pool not in ("all", pname):
                        continue
                    run = (reqs, bs, full, swa, slots, args.concurrency, args.mamba_chunk, args.chunked_prefill_size,
                           args.interleave)
                    ours = replay_ours(*run)
                    theirs = replay_sglang(sg, *run)
                    diff = first_difference(ours, theirs)
                    ok &= diff is None
                    print(f"| {lname} | {bs} | {wname} | {pname} ({' / '.join(str(n) for n in (full, swa, slots) if n)}) | {len(reqs)} | {sum(ours.hits):,} | "
                          f"{sum(theirs.hits):,} | {ours.evicted:,} | {ours.seconds:.2f} | {theirs.seconds:.2f} | "
                          f"{'identical' if diff is None else 'DIFFERS'} |", flush=True)  # fmt: skip
                    if diff:
                        print(f"# first difference: {diff}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
