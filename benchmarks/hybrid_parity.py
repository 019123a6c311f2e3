"""Hybrid layouts: per-request parity of `hash` with vLLM 0.33's own hybrid KV cache manager.

Replays deterministic workloads through our `hash` cache with a hybrid `cache.layout` and,
side by side, through vLLM 0.33's unmodified `KVCacheManager` over the matching hybrid
`KVCacheConfig` (benchmarks/vllm_v1_core.py runs it on CPU from the wheel), for the
layouts full+SWA, full+chunked-local, full+Mamba and full+SWA+Mamba at blocks 16 and
528, with an ample pool and under eviction pressure, at vLLM's defaults. Checked per
request: the hit tokens, the prefill's chunk ends (ours `Admission.checkpoints`, vLLM's
scheduler's own `_mamba_block_aligned_split`), every group's block table after admission
(ours + 1, NULL_BLOCK = vLLM's null block 0), refusals, and every KV event field for
field (BlockStored with group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window;
BlockRemoved with its group).

    python benchmarks/hybrid_parity.py --vllm-dir ~/.cache/prefixcache/vllm-0.33.0

How both sides are driven, one request at a time (a serial scheduler with an unbounded
token budget): admission (vLLM: `get_computed_blocks`, the request's
`shared_prefix_boundary` set from it, `allocate_slots(..., full_sequence_must_fit=True)`
for the first chunk); each later prefill chunk (vLLM: `new_step_starts`, the scheduler's
split, `allocate_slots`; ours: `commit` at the checkpoint, then `append(r, [])` until it
fits); then `output - 1` decode steps (vLLM: append the token, `allocate_slots(1)`; ours:
`commit` + `append`). Whatever is refused releases the oldest live request and retries,
on both sides. A request is released once `--concurrency` newer ones are live.
"""

from __future__ import annotations

import argparse
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

VOCAB = 128_256

LAYOUTS: dict[str, list[tuple[str, int | None, int | None]]] = {
    "full+swa": [("full_attention", None, None), ("sliding_window", 1024, None)],
    "full+chunked": [("full_attention", None, None), ("chunked_local_attention", None, 2112)],
    "full+mamba": [("full_attention", None, None), ("mamba", None, None)],
    "full+swa+mamba": [("full_attention", None, None), ("sliding_window", 1024, None), ("mamba", None, None)],
}
"""Windows and chunks in TOKENS (a chunk a multiple of both block sizes, as vLLM requires
of chunked-local groups; Llama 4's is 8192)."""


@dataclass(frozen=True)
class Req:
    prompt: list[int]
    output: list[int]


def shared_system_prompt(rng: random.Random, n: int = 64) -> list[Req]:
    """A 1,024-token system prompt + a 64-512-token question: the issue's shared prompt."""
    system = [rng.randrange(VOCAB) for _ in range(1024)]
    return [Req(system + [rng.randrange(VOCAB) for _ in range(rng.randint(64, 512))],
                [rng.randrange(VOCAB) for _ in range(rng.randint(8, 32))]) for _ in range(n)]  # fmt: skip


def multi_turn(rng: random.Random, sessions: int = 16, turns: int = 4) -> list[Req]:
    """Chat sessions, round-robin by turn, prompts of 320-600 tokens: each turn is the
    conversation so far plus a message (a session restarts from its first turn's
    history once it would pass 600)."""
    out: list[Req] = []
    histories = [[rng.randrange(VOCAB) for _ in range(rng.randint(320, 400))] for _ in range(sessions)]
    for _ in range(turns):
        for s in range(sessions):
            answer = [rng.randrange(VOCAB) for _ in range(rng.randint(16, 48))]
            out.append(Req(list(histories[s]), answer))
            grown = histories[s] + answer + [rng.randrange(VOCAB) for _ in range(rng.randint(16, 48))]
            histories[s] = grown if len(grown) <= 600 else histories[s][:320]
    return out


def long_shared_prefix(rng: random.Random, n: int = 64) -> list[Req]:
    """The issue's 1,500-token shared prefix + 700 unique tokens, 64 requests."""
    shared = [rng.randrange(VOCAB) for _ in range(1500)]
    return [Req(shared + [rng.randrange(VOCAB) for _ in range(700)], [rng.randrange(VOCAB) for _ in range(8)])
            for _ in range(n)]  # fmt: skip


WORKLOADS = {"shared-system-prompt": shared_system_prompt, "multi-turn": multi_turn, "1500-shared": long_shared_prefix}


@dataclass
class Trace:
    hits: list[int] = field(default_factory=list)
    checkpoints: list[tuple[int, ...]] = field(default_factory=list)
    tables: list[tuple[tuple[int, ...], ...]] = field(default_factory=list)
    refused: int = 0
    events: list[tuple] = field(default_factory=list)
    seconds: float = 0.0


def event_key(event) -> tuple:
    """Every field of vLLM's KV events, in comparable form (hashes as bytes)."""
    name = type(event).__name__
    if name == "BlockStored":
        extra = None if event.extra_keys is None else tuple(event.extra_keys)
        return ("stored", tuple(event.block_hashes), event.parent_block_hash, tuple(event.token_ids),
                event.block_size, event.lora_id, event.medium, event.lora_name, extra, event.group_idx,
                str(event.kv_cache_spec_kind), event.kv_cache_spec_sliding_window, event.locality,
                event.ownership, event.session_id, event.lookahead_token_ids)  # fmt: skip
    if name == "BlockRemoved":
        return ("removed", tuple(event.block_hashes), event.medium, event.group_idx, event.locality, event.ownership)
    return (name,)


def our_layout(groups):
    from prefixcache.layout import LayerGroup

    return tuple(LayerGroup(kind, window=window, chunk=chunk) for kind, window, chunk in groups)


def replay_ours(reqs, groups, block_size, num_blocks, concurrency, events=True) -> Trace:
    import prefixcache
    from prefixcache.config import CacheConfig

    cache = prefixcache.build_cache(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                enable_events=events, layout=our_layout(groups)))  # fmt: skip
    trace = Trace()
    live: deque[int] = deque()

    def make_room() -> None:
        if not live:
            raise SystemExit("a request does not fit the pool alone")
        trace.refused += 1
        cache.release(live.popleft())

    t0 = time.perf_counter()
    for i, req in enumerate(reqs):
        while (adm := cache.admit(i, req.prompt)) is None:
            make_room()
        trace.hits.append(adm.num_cached_tokens)
        trace.checkpoints.append(tuple(adm.checkpoints))
        trace.tables.append(tuple(tuple(b + 1 for b in t) for t in adm.group_tables))
        for c in adm.checkpoints:
            cache.commit(i, c)
            while cache.append(i, []) is None:
                make_room()
        n = len(req.prompt)
        cache.commit(i, n)
        for token in req.output[:-1]:
            while cache.append(i, [token]) is None:
                make_room()
            n += 1
            cache.commit(i, n)
        live.append(i)
        if len(live) > concurrency:
            cache.release(live.popleft())
    while live:
        cache.release(live.popleft())
    trace.seconds = time.perf_counter() - t0
    cache.check_invariants()
    trace.events = [event_key(e) for e in cache.drain_events()]
    return trace


def replay_vllm(core, reqs, groups, num_blocks, concurrency, events=True) -> Trace:
    mgr = core.make_hybrid_manager(groups, num_blocks + 1, enable_events=events)
    mamba = any(kind == "mamba" for kind, _, _ in groups)
    trace = Trace()
    live: deque = deque()

    def make_room() -> None:
        if not live:
            raise SystemExit("a request does not fit the pool alone")
        trace.refused += 1
        mgr.free(live.popleft())

    t0 = time.perf_counter()
    for i, req in enumerate(reqs):
        request = core.Request(str(i), req.prompt, core.block_hasher)
        n = len(req.prompt)
        while True:
            mgr.new_step_starts()
            blocks, hit, request.shared_prefix_boundary = mgr.get_computed_blocks(request)
            chunk = core.mamba_split(request, n - hit, hit) if mamba else n - hit
            if mgr.allocate_slots(request, chunk, hit, blocks, full_sequence_must_fit=True) is not None:
                break
            make_room()
        trace.hits.append(hit)
        trace.tables.append(tuple(tuple(b.block_id for b in row) for row in mgr.get_blocks(str(i)).blocks))
        request.num_computed_tokens = hit + chunk
        ends = []
        while request.num_computed_tokens < n:
            ends.append(request.num_computed_tokens)
            while True:
                mgr.new_step_starts()
                chunk = core.mamba_split(request, n - request.num_computed_tokens) if mamba else n - request.num_computed_tokens
                if mgr.allocate_slots(request, chunk) is not None:
                    break
                make_room()
            request.num_computed_tokens += chunk
        trace.checkpoints.append(tuple(ends))
        for token in req.output[:-1]:
            request.append_output_token_ids([token])
            mgr.new_step_starts()
            while mgr.allocate_slots(request, 1) is None:
                make_room()
            request.num_computed_tokens += 1
        live.append(request)
        if len(live) > concurrency:
            mgr.free(live.popleft())
    while live:
        mgr.free(live.popleft())
    trace.seconds = time.perf_counter() - t0
    trace.events = [event_key(e) for e in mgr.take_events()]
    return trace


def first_field_difference(ours: object, theirs: object, fields: tuple[str, ...], reference: str) -> str | None:
    """The first entry where two traces' sequences `fields` differ, in order; None if equal.
    (hybrid_radix_parity.py compares its traces with it too.)"""
    for what in fields:
        a, b = getattr(ours, what), getattr(theirs, what)
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"{what} #{i}: ours {repr(x)[:400]} vs {reference} {repr(y)[:400]}"
        if len(a) != len(b):
            return f"{what}: {len(a)} vs {len(b)}"
    return None


def first_difference(ours: Trace, theirs: Trace) -> str | None:
    diff = first_field_difference(ours, theirs, ("hits", "checkpoints", "tables", "events"), "vLLM")
    if diff is None and ours.refused != theirs.refused:
        return f"refusals: ours {ours.refused} vs vLLM {theirs.refused}"
    return diff


def pool_sizes(reqs, block_size: int, num_groups: int, concurrency: int) -> dict[str, int]:
    """`ample`: every request's blocks in every group, never evicting; `pressure`: room
    for the live requests and a little more, so the LRU evicts throughout; `tight`: about
    the live requests alone, so admissions and chunks are refused and live requests
    released to make room."""
    per_request = max(-(-(len(r.prompt) + len(r.output)) // block_size) for r in reqs) * num_groups
    total = sum(-(-(len(r.prompt) + len(r.output)) // block_size) for r in reqs) * num_groups
    return {"ample": total + per_request, "pressure": per_request * (concurrency + 2), "tight": per_request * concurrency + 2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-dir", type=Path, default=Path.home() / ".cache/prefixcache/vllm-0.33.0")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", choices=[*LAYOUTS, "all"], default="all")
    parser.add_argument("--block-size", type=int, choices=[16, 528], nargs="*", default=[16, 528])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--pool", choices=["ample", "pressure", "tight", "all"], default="all")
    args = parser.parse_args()

    import vllm_v1_core

    print(f"# hybrid_parity: {cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load {open('/proc/loadavg').read().split()[:3]}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"# command: {' '.join(sys.argv)}")
    print("| layout | block | workload | pool | requests | ours hit tokens | vLLM hit tokens | refusals (ours / vLLM) | "
          "events | parity |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for bs in args.block_size:
        core = vllm_v1_core.load(args.vllm_dir.expanduser(), bs)  # vLLM imported once, closures per block size
        for lname, groups in LAYOUTS.items():
            if args.layout not in ("all", lname):
                continue
            for wname, make in WORKLOADS.items():
                if args.workload not in ("all", wname):
                    continue
                reqs = make(random.Random(args.seed))
                for pname, num_blocks in pool_sizes(reqs, bs, len(groups), args.concurrency).items():
                    if args.pool not in ("all", pname):
                        continue
                    ours = replay_ours(reqs, groups, bs, num_blocks, args.concurrency)
                    theirs = replay_vllm(core, reqs, groups, num_blocks, args.concurrency)
                    diff = first_difference(ours, theirs)
                    ok &= diff is None
                    print(f"| {lname} | {bs} | {wname} | {pname} ({num_blocks}) | {len(reqs)} | {sum(ours.hits):,} | "
                          f"{sum(theirs.hits):,} | {ours.refused} / {theirs.refused} | {len(ours.events):,} | "
                          f"{'identical' if diff is None else 'DIFFERS'} |")
                    if diff:
                        print(f"# first difference: {diff}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
