"""The A/B runner: one workload replayed through several caches of equal capacity, next to
the two reference bounds, with results as data (JSON and CSV).

Owns the replay of a `Workload` through a `PrefixCache` (`replay_arm`), the reference
lines on the same workload (`ReferenceBounds`: infinite ceiling and Belady at the same
capacity, per block size present), the A/B and the capacity sweep (`run_ab`, `sweep`),
and their results (`ArmResult`, `ABResult`, `SweepResult`). Must never: print, plot or
parse arguments (`prefixcache.ab_report` and `prefixcache.cli` do), or reach into a
backend past the protocol.

Replay model. It is the model of `prefixcache.workloads.blocks` and the bounds, so an
arm's per-request hits compare one to one with theirs. Requests go in arrival order;
for each one the runner calls, through the protocol:

    admit(i, prompt)            the hit is what the arm reports (whole blocks, <= P-1)
    commit(i, P)                the uncached prompt tokens are computed
    append(i, output)           the whole output at once (P + O tokens in the table)
    commit(i, P + O)
    release(i)                  full blocks of prompt + output stay cached

With `max_concurrent = K` up to K requests are live at once: request i is admitted while
the K-1 before it still hold their blocks (already committed, so they can be hit), and the
oldest is released when a K+1-th would start. K = 1 is the bounds' model exactly. When the
pool cannot hold request i (`admit` or `append` returns None) the runner releases the
oldest other live request, as if it had finished, and retries; each such retry counts in
`waits`. A request whose footprint, ceil((P + O) / B) blocks, exceeds the pool can never
run: it is not offered to the cache, counts 0 hit tokens and is listed in `rejected`,
as in the bounds. Under K > 1 live requests pin more blocks than the bounds assume, so
Belady is then a reference line rather than a bound; the ceiling still bounds every
request (every block an earlier request computed is committed before i is admitted).

Tokens reach each cache as one int64 buffer per request (`TokenRuns.to_array`, expanded in
C++), never as Python ints.

Hybrid layouts (`cache.layout` with a group that is not full attention). Beside each
such arm, its layout's ceiling (`layout_ceiling`): the same replay through the same
configuration with a pool large enough that nothing is ever evicted (in any of the pools
`radix` splits it into), so it hits what the layout and the options let any pool hit
(where states are kept, at which granularity, which window tails) and loses nothing to
capacity or eviction. The tokens the full-attention ceiling at the arm's block size hits
on a request and the layout's ceiling does not are "uncacheable by layout", counted
apart from the misses a larger pool or a better policy could avoid
(`uncacheable_by_layout`, `of_layout_ceiling`). It is a reference line measured on the
arm's own rules, not a proof: a replay hits what it hits, request by request. Then
Belady over the layout's units at the arm's pool (`layout_belady`,
`prefixcache.workloads.layout_bounds`): what eviction alone could keep at that size when
a hit needs every group's blocks, with every window block and every state a request
computed offered to the cache (so it may pass the layout ceiling, which keeps only what
the arm's retention keeps), planned at the arm's `state_granule` where it has one. And
the bytes a cached token costs in each group, from the layout's sizes
(`bytes_per_token`).

Measured per arm: per-request hit tokens (`HitCounts`), evicted blocks (the cache's own
`stats().evictions`), peak pinned blocks (the most distinct blocks that live requests'
block tables hold at once: backend-neutral, unlike the pool's ref counts, which for
`radix` include the tree's own reference; kept as a count per block over the live
tables, so a request costs O(its own table), not O(every live table)), bookkeeping time
per request (only the cache calls for that request, `time.perf_counter_ns` around each),
and KV events by type.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import json
import time
from array import array
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixcache import build_cache
from prefixcache.ab_config import ABConfig
from prefixcache.config import CacheConfig, from_mapping, to_plain
from prefixcache.layout import MAMBA, SLIDING_WINDOW
from prefixcache.percentiles import percentile
from prefixcache.protocol import PrefixCache
from prefixcache.stats import TierStats
from prefixcache.tiers import prefill_seconds_saved
from prefixcache.workloads import BlockPlan, BoundResult, HitCounts, Workload, belady, infinite_cache, layout_belady
from prefixcache.workloads.tokens import TokenRuns
from prefixcache.workloads.metrics import HitRatios

__all__ = [
    "ArmResult",
    "ABResult",
    "SweepPoint",
    "SweepResult",
    "ReferenceBounds",
    "Progress",
    "replay_arm",
    "run_ab",
    "sweep",
    "sweep_split",
    "check_capacities",
    "bound_name",
    "describe_workload",
    "write_csv",
]

Progress = Callable[[str, int, int], None]
"""`progress(label, completed, total)`: called as a replay advances (requests done of total)."""

_PROGRESS_EVERY = 64  # requests between progress calls: a rich refresh costs more than a request


def bound_name(bound: str, block_size: int) -> str:
    """The series name of a bound line, e.g. 'ceiling B=16' (cannot clash with an arm name,
    which has no space)."""
    return f"{'ceiling' if bound == 'infinite' else bound} B={block_size}"


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """`rows` (dicts with the same keys) as a CSV file with a header line; None -> empty."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)


@dataclass(frozen=True)
class ArmResult(HitRatios):
    """What one arm did on the workload. Counts in TOKENS unless a name says blocks.

    hits:             per-request hit and prompt tokens, in arrival order
    bookkeeping_us:   per request, the MICROSECONDS spent in its cache calls
    evicted_blocks:   cached blocks the cache dropped to make room (`stats().evictions`)
    peak_pinned_blocks: the most distinct blocks live requests held at once
    events:           KV events emitted, by type name
    rejected:         indices of requests larger than the pool (0 hits, never admitted)
    waits:            admissions/appends retried after releasing the oldest live request
    wall_s:           wall time of the whole replay, SECONDS (token conversion included)
    first_eviction:   index of the first request during which the cache evicted (None: never)
    tiers:            the arm's lower tiers' counters at the end (`CacheStats.tiers`; empty
                      without `tiers`)
    prefill_s_saved:  modelled prefill SECONDS the hits saved, loads' time subtracted
                      (`prefixcache.tiers.prefill_seconds_saved`, the arm's cost_model)
    declined_tokens:  TOKENS found in lower tiers that admissions recomputed (cost model)
    layout_ceiling:   hybrid layouts: per-request hits of the same replay with a pool that
                      never evicts (module docstring); None otherwise
    layout_belady:    hybrid layouts: per-request hits of Belady over the layout's units
                      with the arm's pool (module docstring); None otherwise
    """

    name: str
    config: CacheConfig
    hits: HitCounts
    bookkeeping_us: tuple[float, ...]
    evicted_blocks: int
    peak_pinned_blocks: int
    events: Mapping[str, int]
    rejected: tuple[int, ...] = ()
    waits: int = 0
    wall_s: float = 0.0
    first_eviction: int | None = None
    tiers: tuple[TierStats, ...] = ()
    prefill_s_saved: float = 0.0
    declined_tokens: int = 0
    layout_ceiling: HitCounts | None = None
    layout_belady: HitCounts | None = None

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def capacity_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def prefill_tokens_saved(self) -> int:
        """Prompt TOKENS served from cache over the run."""
        return self.hits.total_hit_tokens

    @property
    def evicted_tokens(self) -> int:
        """Evicted blocks in TOKENS (comparable across block sizes)."""
        return self.evicted_blocks * self.block_size

    @property
    def us_p50(self) -> float:
        """Median bookkeeping MICROSECONDS per request."""
        return percentile(self.bookkeeping_us, 50)

    @property
    def us_p99(self) -> float:
        """99th-percentile bookkeeping MICROSECONDS per request."""
        return percentile(self.bookkeeping_us, 99)

    @property
    def events_total(self) -> int:
        return sum(self.events.values())

    def uncacheable_by_layout(self, full_ceiling: HitCounts) -> int | None:
        """TOKENS `full_ceiling` (full attention, same block size) hits that the layout's
        ceiling does not, summed over requests; None without a hybrid layout."""
        if self.layout_ceiling is None:
            return None
        return sum(max(0, f - h) for f, h in zip(full_ceiling.hit_tokens, self.layout_ceiling.hit_tokens))

    @property
    def bytes_per_token(self) -> str | None:
        """BYTES a cached token costs per group, as 'kind: bytes | ...' (None without a
        hybrid layout or sizes)."""
        groups = self.config.groups
        if not groups.hybrid or not any(g.bytes_per_token or g.state_bytes for g in groups):
            return None
        return " | ".join(f"{g.kind}: {g.bytes_per_cached_token(self.block_size):,.0f}" for g in groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": to_plain(self.config),
            "hit_ratio": self.hit_ratio,
            "last_half_hit_ratio": self.last_half_hit_ratio,
            "prefill_tokens_saved": self.prefill_tokens_saved,
            "evicted_blocks": self.evicted_blocks,
            "peak_pinned_blocks": self.peak_pinned_blocks,
            "bookkeeping_us_p50": self.us_p50,
            "bookkeeping_us_p99": self.us_p99,
            "events": dict(self.events),
            "rejected": list(self.rejected),
            "waits": self.waits,
            "wall_s": self.wall_s,
            "first_eviction": self.first_eviction,
            "hit_tokens": list(self.hits.hit_tokens),
            "bookkeeping_us": list(self.bookkeeping_us),
            **({"tiers": [dataclasses.asdict(t) for t in self.tiers], "prefill_s_saved": self.prefill_s_saved,
                "declined_tokens": self.declined_tokens} if self.tiers else {}),
            "layout_ceiling_hit_tokens": None if self.layout_ceiling is None else list(self.layout_ceiling.hit_tokens),
            "layout_belady_hit_tokens": None if self.layout_belady is None else list(self.layout_belady.hit_tokens),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prompt_tokens: Sequence[int]) -> ArmResult:
        return cls(
            data["name"], from_mapping(CacheConfig, data["config"], "config"),
            HitCounts(data["hit_tokens"], prompt_tokens), tuple(data["bookkeeping_us"]),
            data["evicted_blocks"], data["peak_pinned_blocks"], data["events"], tuple(data["rejected"]),
            data["waits"], data["wall_s"], data.get("first_eviction"),
            tuple(TierStats(**t) for t in data.get("tiers", ())), data.get("prefill_s_saved", 0.0),
            data.get("declined_tokens", 0),
            None if data.get("layout_ceiling_hit_tokens") is None else HitCounts(data["layout_ceiling_hit_tokens"], prompt_tokens),
            None if data.get("layout_belady_hit_tokens") is None else HitCounts(data["layout_belady_hit_tokens"], prompt_tokens),
        )


def _bound_dict(b: BoundResult) -> dict[str, Any]:
    return {
        "name": bound_name(b.bound, b.block_size), "bound": b.bound, "block_size": b.block_size,
        "capacity_blocks": b.capacity_blocks, "hit_ratio": b.hit_ratio,
        "last_half_hit_ratio": b.last_half_hit_ratio, "evicted_blocks": b.evictions,
        "rejected": list(b.rejected), "hit_tokens": list(b.hits.hit_tokens),
    }


def _bound_from_dict(data: Mapping[str, Any], prompt_tokens: Sequence[int]) -> BoundResult:
    return BoundResult(data["bound"], data["block_size"], data["capacity_blocks"],
                       HitCounts(data["hit_tokens"], prompt_tokens), data["evicted_blocks"], tuple(data["rejected"]))


class _Replay:
    """One arm's replay state: the cache, the live requests, and what is measured."""

    def __init__(self, workload: Workload, name: str, cache: PrefixCache, max_concurrent: int) -> None:
        self.workload, self.name, self.cache, self.max_concurrent = workload, name, cache, max_concurrent
        n = len(workload)
        self.hits = [0] * n
        self.ns = [0] * n  # bookkeeping NANOSECONDS per request
        self.live: deque[int] = deque()
        self.events: Counter[str] = Counter()
        self.tables: dict[int, Sequence[int]] = {}  # live request -> its table when last measured
        self.pinned: Counter[int] = Counter()  # block -> live tables holding it
        self.peak_pinned = 0
        self.waits = 0
        self.first_eviction: int | None = None
        self.itemsize = type(cache).token_itemsize
        self.tiered = bool(cache.config.tiers)
        self.saved_s = 0.0
        self.declined = 0

    def release(self, j: int) -> None:
        """Release live request j (timed into its bookkeeping); its table stops counting."""
        self.call(j, self.cache.release, j)
        table = self.tables.pop(j, ())
        pinned = self.pinned
        for b in table:
            n = pinned[b] - 1
            if n:
                pinned[b] = n
            else:
                dict.__delitem__(pinned, b)  # Counter's own __delitem__ is Python code

    def call(self, i: int, method: Callable[..., Any], *args: Any) -> Any:
        """One cache call on behalf of request i, timed into its bookkeeping."""
        t0 = time.perf_counter_ns()
        out = method(*args)
        self.ns[i] += time.perf_counter_ns() - t0
        return out

    def finish_oldest(self, current: int) -> None:
        """Release the oldest live request other than `current` to make room."""
        for j in self.live:
            if j != current:
                self.live.remove(j)
                self.release(j)
                self.waits += 1
                return
        r = self.workload.requests[current]
        raise RuntimeError(
            f"arm {self.name!r}: request {current} ({len(r.prompt)} + {len(r.output)} tokens) fits the pool of "
            f"{self.cache.config.num_blocks} blocks but the cache refused it with nothing else live"
        )

    def until_done(self, i: int, method: Callable[..., Any], *args: Any) -> Any:
        """`method(*args)` for request i, releasing older live requests until it succeeds."""
        out = self.call(i, method, *args)
        while out is None:
            self.finish_oldest(i)
            out = self.call(i, method, *args)
        return out

    def tokens(self, runs: TokenRuns) -> array:
        """One request's tokens as a buffer as wide as the cache keeps them (its copy is then
        a memcpy), or int64 if an id does not fit."""
        if self.itemsize == 4:
            try:
                return runs.to_array(4)
            except ValueError:
                pass
        return runs.to_array(8)

    def run(self, i: int) -> None:
        r, cache = self.workload.requests[i], self.cache
        prompt = self.tokens(r.prompt)
        output = self.tokens(r.output) if len(r.output) else ()
        while len(self.live) >= self.max_concurrent:
            self.release(self.live.popleft())
        admission = self.until_done(i, lambda: cache.admit(i, prompt, namespace=r.namespace))
        self.hits[i] = admission.num_cached_tokens
        if self.tiered:
            self.saved_s += prefill_seconds_saved(cache.config, admission)
            self.declined += admission.declined_tokens
        self.live.append(i)
        self.call(i, cache.commit, i, len(prompt))
        self.until_done(i, cache.append, i, output)
        self.call(i, cache.commit, i, len(prompt) + len(output))
        # Only request i's table changed since the last measurement (the others are idle).
        table = self.tables[i] = cache.block_table(i)
        self.pinned.update(table)
        self.peak_pinned = max(self.peak_pinned, len(self.pinned))
        if cache.config.enable_events:
            self.events.update(type(e).__name__ for e in cache.drain_events())
        if self.tiered:  # no engine moves the data: the replay drains (and drops) what it would move
            self.call(i, cache.drain_transfers)
        if self.first_eviction is None and cache.stats().evictions:  # untimed; stops once found
            self.first_eviction = i

    def drain(self) -> None:
        while self.live:
            self.release(self.live.popleft())
        self.events.update(type(e).__name__ for e in self.cache.drain_events())
        self.cache.drain_transfers()


def replay_arm(
    workload: Workload,
    name: str,
    config: CacheConfig,
    *,
    max_concurrent: int = 1,
    progress: Progress | None = None,
    check_invariants: bool = True,
) -> ArmResult:
    """Replay `workload` through a fresh cache built from `config` (module docstring)."""
    if isinstance(max_concurrent, bool) or not isinstance(max_concurrent, int) or max_concurrent < 1:
        raise ValueError(f"max_concurrent must be an int >= 1, got {max_concurrent!r}")
    t0 = time.perf_counter()
    cache = build_cache(config)
    state = _Replay(workload, name, cache, max_concurrent)
    bs, n = config.block_size, len(workload)
    rejected = []
    # The replay is timed, so the cyclic collector is off while it runs, as timeit does:
    # a full collection walks the whole workload (every request's runs), and no object
    # the replay makes is part of a cycle.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for i, r in enumerate(workload.requests):
            if -(-(len(r.prompt) + len(r.output)) // bs) > config.num_blocks:
                rejected.append(i)
            else:
                state.run(i)
            if progress is not None and (i + 1) % _PROGRESS_EVERY == 0:
                progress(name, i + 1, n)
        state.drain()
    finally:
        if collecting:
            gc.enable()
    if check_invariants:
        cache.check_invariants()
    if progress is not None:
        progress(name, n, n)
    prompts = [len(r.prompt) for r in workload.requests]
    ceiling = unit_belady = None
    if config.groups.hybrid:
        ceiling = HitCounts(_layout_ceiling(workload, config, max_concurrent), prompts)
        # Hits finer than the block (hash's `state_granule`) are planned at that granule.
        granule = config.options.get("state_granule") or bs
        # `radix` charges a state the blocks its bytes fill (its pool is apart, as SGLang's).
        state_blocks = config.groups.state_blocks(bs) if config.backend == "radix" else 1
        unit_belady = layout_belady(BlockPlan.of(workload, granule), config.groups, config.num_blocks, bs,
                                    state_blocks).hits
    stats = cache.stats()
    return ArmResult(
        name, config, HitCounts(state.hits, prompts), tuple(t / 1000.0 for t in state.ns),
        stats.evictions, state.peak_pinned, dict(state.events), tuple(rejected), state.waits,
        time.perf_counter() - t0, state.first_eviction, stats.tiers, state.saved_s, state.declined, ceiling,
        unit_belady,
    )


def _layout_ceiling(workload: Workload, config: CacheConfig, max_concurrent: int) -> list[int]:
    """Per-request hits of `config`'s rules with a pool nothing is evicted from: every
    request's blocks (every group's, ceil((P + O) / B) each) for the whole run, in each
    of the pools `radix` splits it into (its SWA share; its Mamba group's `slots` set to
    that footprint, each state taking its `Layout.state_blocks`)."""
    footprint = sum(-(-(len(r.prompt) + len(r.output)) // config.block_size) for r in workload.requests)
    needed, layout = footprint * len(config.groups) + 1, config.layout
    if config.backend == "radix":  # one pool split three ways (backends/hybrid_radix.py)
        scale = 1
        for g in config.groups:
            if g.kind == SLIDING_WINDOW:  # SWA gets rest * r / (1 + r), FULL rest / (1 + r)
                scale *= -(-(1 + g.pool_ratio) // g.pool_ratio)
        layout = tuple(dataclasses.replace(g, slots=footprint) if g.kind == MAMBA else g for g in layout)
        needed = int(needed * scale) + footprint * config.groups.state_blocks(config.block_size)
    unbounded = config.replace(num_blocks=max(config.num_blocks, needed), layout=layout, enable_events=False)
    state = _Replay(workload, "layout ceiling", build_cache(unbounded), max_concurrent)
    for i in range(len(workload)):
        state.run(i)
    state.drain()
    return state.hits


class ReferenceBounds:
    """The ceiling and Belady of one workload at each block size, block plans built once
    (so a sweep pays for them once per block size, not per capacity)."""

    def __init__(self, workload: Workload, block_sizes: Sequence[int]) -> None:
        self.plans = {b: BlockPlan.of(workload, b) for b in sorted(set(block_sizes))}
        self._ceilings = {b: infinite_cache(p) for b, p in self.plans.items()}

    def ceiling(self, block_size: int) -> BoundResult:
        return self._ceilings[block_size]

    def at(self, capacity_tokens: int) -> list[BoundResult]:
        """Ceiling and Belady (pool of capacity_tokens // B blocks) per block size B."""
        out = []
        for b, plan in self.plans.items():
            out += [self._ceilings[b], belady(plan, capacity_tokens // b)]
        return out


@dataclass(frozen=True)
class ABResult:
    """An A/B on one workload: every arm and the reference bounds, request by request."""

    workload: Mapping[str, Any]  # name, generator, params, requests, tokens, analytic ratios
    capacity_tokens: int
    max_concurrent: int
    prompt_tokens: tuple[int, ...]
    arms: tuple[ArmResult, ...]
    bounds: tuple[BoundResult, ...] = ()

    def arm(self, name: str) -> ArmResult:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(f"no arm {name!r}; arms: {', '.join(a.name for a in self.arms)}")

    def bound(self, bound: str, block_size: int) -> BoundResult:
        """The bound 'infinite' (the ceiling) or 'belady' at `block_size` TOKENS."""
        for b in self.bounds:
            if b.bound == bound and b.block_size == block_size:
                return b
        raise KeyError(f"no bound {bound!r} at block size {block_size}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": dict(self.workload), "capacity_tokens": self.capacity_tokens,
            "max_concurrent": self.max_concurrent, "prompt_tokens": list(self.prompt_tokens),
            "arms": [a.to_dict() for a in self.arms], "bounds": [_bound_dict(b) for b in self.bounds],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ABResult:
        prompts = tuple(data["prompt_tokens"])
        return cls(data["workload"], data["capacity_tokens"], data["max_concurrent"], prompts,
                   tuple(ArmResult.from_dict(a, prompts) for a in data["arms"]),
                   tuple(_bound_from_dict(b, prompts) for b in data["bounds"]))

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def read_json(cls, path: str | Path) -> ABResult:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def write_csv(self, summary_path: str | Path, requests_path: str | Path) -> None:
        """The summary (a row per arm and bound) and the per-request table as CSV files."""
        write_csv(summary_path, self.summary_rows())
        write_csv(requests_path, self.request_rows())

    def summary_rows(self) -> list[dict[str, Any]]:
        """One row per arm, then per bound: what the terminal table and summary CSV show.
        When an arm has lower tiers every row also has their columns (`tier_columns`)."""
        rows = []
        depth = max((len(a.tiers) for a in self.arms), default=0)
        for a in self.arms:
            rows.append({
                "series": a.name, "kind": "arm", "backend": a.config.backend, "block_size": a.block_size,
                "capacity_blocks": a.capacity_blocks, "capacity_tokens": a.capacity_blocks * a.block_size,
                "hit_ratio": a.hit_ratio, "last_half_hit_ratio": a.last_half_hit_ratio,
                "prefill_tokens_saved": a.prefill_tokens_saved, "evicted_blocks": a.evicted_blocks,
                "evicted_tokens": a.evicted_tokens, "peak_pinned_blocks": a.peak_pinned_blocks,
                "bookkeeping_us_p50": a.us_p50, "bookkeeping_us_p99": a.us_p99, "events": a.events_total,
                "rejected": len(a.rejected), "waits": a.waits, **tier_columns(a, depth),
                **self._layout_columns(a),
            })
        for b in self.bounds:
            blocks = b.capacity_blocks
            rows.append({
                "series": bound_name(b.bound, b.block_size), "kind": "bound", "backend": b.bound,
                "block_size": b.block_size, "capacity_blocks": blocks,
                "capacity_tokens": None if blocks is None else blocks * b.block_size,
                "hit_ratio": b.hit_ratio, "last_half_hit_ratio": b.last_half_hit_ratio,
                "prefill_tokens_saved": b.hits.total_hit_tokens, "evicted_blocks": b.evictions,
                "evicted_tokens": b.evictions * b.block_size, "peak_pinned_blocks": None,
                "bookkeeping_us_p50": None, "bookkeeping_us_p99": None, "events": None,
                "rejected": len(b.rejected), "waits": None, **tier_columns(None, depth),
                "layout_ceiling_hit_ratio": None, "of_layout_ceiling": None, "uncacheable_by_layout": None,
                "layout_belady_hit_ratio": None, "bytes_per_token": None,
            })
        return rows

    def _layout_columns(self, a: ArmResult) -> dict[str, Any]:
        """A hybrid arm's ceiling columns (None for a full-attention arm)."""
        if a.layout_ceiling is None:
            return {"layout_ceiling_hit_ratio": None, "of_layout_ceiling": None, "uncacheable_by_layout": None,
                    "layout_belady_hit_ratio": None, "bytes_per_token": a.bytes_per_token}  # fmt: skip
        ceiling = a.layout_ceiling.total_hit_tokens
        full = next((b for b in self.bounds if b.bound == "infinite" and b.block_size == a.block_size), None)
        return {
            "layout_ceiling_hit_ratio": a.layout_ceiling.hit_ratio,
            "of_layout_ceiling": a.prefill_tokens_saved / ceiling if ceiling else None,
            "uncacheable_by_layout": None if full is None else a.uncacheable_by_layout(full.hits),
            "layout_belady_hit_ratio": None if a.layout_belady is None else a.layout_belady.hit_ratio,
            "bytes_per_token": a.bytes_per_token,
        }

    def request_rows(self) -> list[dict[str, Any]]:
        """One row per request: prompt tokens, hit tokens of every series, µs of every arm."""
        rows = []
        for i, p in enumerate(self.prompt_tokens):
            row: dict[str, Any] = {"request": i, "prompt_tokens": p}
            for a in self.arms:
                row[f"hit:{a.name}"] = a.hits.hit_tokens[i]
            for b in self.bounds:
                row[f"hit:{bound_name(b.bound, b.block_size)}"] = b.hits.hit_tokens[i]
            for a in self.arms:
                row[f"us:{a.name}"] = a.bookkeeping_us[i]
            rows.append(row)
        return rows


def tier_columns(arm: ArmResult | None, depth: int) -> dict[str, Any]:
    """The tier columns of a summary row (none when no arm has tiers, so a flat A/B reads
    as it always did): the device's share of the hit, then per tier k its hit ratio
    (`tier{k}_hit_ratio`), blocks loaded and GB written, and the modelled prefill
    SECONDS saved and TOKENS declined."""
    if not depth:
        return {}
    out: dict[str, Any] = {}
    prompt = sum(arm.hits.prompt_tokens) if arm is not None else 0
    lower = sum(t.loaded_tokens for t in arm.tiers) if arm is not None else 0
    out["device_hit_ratio"] = (arm.prefill_tokens_saved - lower) / prompt if arm is not None and prompt else None
    for k in range(depth):
        t = arm.tiers[k] if arm is not None and k < len(arm.tiers) else None
        out[f"tier{k}_medium"] = t.medium if t else None
        out[f"tier{k}_hit_ratio"] = t.loaded_tokens / prompt if t and prompt else (0.0 if arm is not None else None)
        out[f"tier{k}_loads"] = t.loads if t else (0 if arm is not None else None)
        out[f"tier{k}_gb_written"] = t.bytes_written / 1e9 if t else (0.0 if arm is not None else None)
    if arm is not None and not arm.tiers:  # no loads: the hits' compute time, under the same cost model
        out["prefill_s_saved"] = arm.prefill_tokens_saved / arm.config.cost_model.prefill_tokens_per_s
    else:
        out["prefill_s_saved"] = arm.prefill_s_saved if arm is not None else None
    out["declined_tokens"] = arm.declined_tokens if arm is not None else None
    return out


def describe_workload(workload: Workload, block_sizes: Sequence[int]) -> dict[str, Any]:
    """The workload's identity and size, and its analytic ceiling at each block size."""
    return {
        "name": workload.name, "generator": workload.generator, "params": dict(workload.params),
        "requests": len(workload), "prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens,
        "analytic_hit_ratio": {str(b): workload.analytic_hit_ratio(b) for b in block_sizes},
        "analytic_exact": workload.analytic_exact,
    }


def run_ab(
    config: ABConfig,
    workload: Workload | None = None,
    *,
    progress: Progress | None = None,
    bounds: bool = True,
    bounds_cache: ReferenceBounds | None = None,
    on_arm: Callable[[ABResult], None] | None = None,
) -> ABResult:
    """Replay the workload (built from `config.workload` unless given) through every arm,
    and compute the bounds at `config.capacity_tokens` for each block size present.
    `on_arm` sees the result so far (the arms finished, no bounds yet) after each arm."""
    if workload is None:
        workload = config.workload.build()
    described = describe_workload(workload, config.block_sizes)
    prompts = tuple(len(r.prompt) for r in workload.requests)
    done: list[ArmResult] = []
    for name, cache in config.arms.items():
        done.append(replay_arm(workload, name, cache, max_concurrent=config.max_concurrent, progress=progress))
        if on_arm is not None:
            on_arm(ABResult(described, config.capacity_tokens, config.max_concurrent, prompts, tuple(done)))
    arms = tuple(done)
    refs: list[BoundResult] = []
    if bounds:
        if progress is not None:
            progress("bounds", 0, 1)
        refs = (bounds_cache or ReferenceBounds(workload, config.block_sizes)).at(config.capacity_tokens)
        if progress is not None:
            progress("bounds", 1, 1)
    return ABResult(described, config.capacity_tokens, config.max_concurrent, prompts, arms, tuple(refs))


@dataclass(frozen=True)
class SweepPoint:
    """One series at one capacity. `kind` is 'arm' or 'bound'; ratios are token hit ratios."""

    series: str
    kind: str
    block_size: int
    capacity_tokens: int
    hit_ratio: float
    last_half_hit_ratio: float
    evicted_blocks: int
    rejected: int
    device_tokens: int | None = None  # a split sweep (`sweep_split`): the arm's device pool, TOKENS
    host_tokens: int | None = None  # and its first lower tier, TOKENS (None: no tier)


@dataclass(frozen=True)
class SweepResult:
    """Hit ratio against capacity for every arm and both bounds on one workload."""

    workload: Mapping[str, Any]
    capacities: tuple[int, ...]  # TOKENS
    points: tuple[SweepPoint, ...] = field(default=())

    def series(self) -> dict[str, list[SweepPoint]]:
        """Points grouped by series, each in capacity order."""
        out: dict[str, list[SweepPoint]] = {}
        for p in sorted(self.points, key=lambda p: p.capacity_tokens):
            out.setdefault(p.series, []).append(p)
        return out

    def rows(self) -> list[dict[str, Any]]:
        rows = [dataclasses.asdict(p) for p in self.points]
        if not any(p.device_tokens is not None for p in self.points):  # a plain sweep reads as it always did
            for row in rows:
                del row["device_tokens"], row["host_tokens"]
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {"workload": dict(self.workload), "capacities": list(self.capacities), "points": self.rows()}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def write_csv(self, path: str | Path) -> None:
        """A row per (series, capacity)."""
        write_csv(path, self.rows())


def _points(result: ABResult) -> list[SweepPoint]:
    return [
        SweepPoint(row["series"], row["kind"], row["block_size"], result.capacity_tokens, row["hit_ratio"],
                   row["last_half_hit_ratio"], row["evicted_blocks"], row["rejected"])
        for row in result.summary_rows()
    ]


def sweep_split(
    config: ABConfig,
    device_capacities: Sequence[int],
    host_capacities: Sequence[int],
    workload: Workload | None = None,
    *,
    progress: Progress | None = None,
    on_capacity: Callable[[SweepResult], None] | None = None,
) -> SweepResult:
    """The A/B over a grid of device x host capacities (TOKENS): at each pair, arms with
    tiers hold `device` on the device and `host` in their first tier (`ABConfig.with_split`),
    arms without hold `device + host` on the device, and the bounds are at that total.
    Points carry `capacity_tokens` = the total (what the plot's x axis is), a tiered arm's
    series is named `<arm> host=<host>`, and a flat arm or bound appears once per total."""
    check_capacities(config, device_capacities)
    if not host_capacities or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in host_capacities):
        raise ValueError("a split sweep needs host capacities, ints of TOKENS >= 1")
    if workload is None:
        workload = config.workload.build()
    refs = ReferenceBounds(workload, config.block_sizes)
    described = describe_workload(workload, config.block_sizes)
    points: list[SweepPoint] = []
    seen: set[tuple[str, int]] = set()
    totals: list[int] = []
    for device in device_capacities:
        for host in host_capacities:
            split = config.with_split(device, host)
            labelled = None
            if progress is not None:
                def labelled(label: str, done: int, total: int, _d: int = device, _h: int = host) -> None:
                    progress(f"{label} @ {_d:,}+{_h:,}", done, total)
            result = run_ab(split, workload, progress=labelled, bounds_cache=refs)
            total = device + host
            totals.append(total)
            for p in _points(result):
                cache = split.arms.get(p.series)
                if cache is not None and cache.tiers:
                    points.append(dataclasses.replace(p, series=f"{p.series} host={host:,}", device_tokens=device,
                                                      host_tokens=host))  # fmt: skip
                elif (p.series, total) not in seen:
                    seen.add((p.series, total))
                    points.append(dataclasses.replace(p, device_tokens=total if p.kind == "arm" else None))
            if on_capacity is not None:
                on_capacity(SweepResult(described, tuple(sorted(set(totals))), tuple(points)))
    return SweepResult(described, tuple(sorted(set(totals))), tuple(points))


def check_capacities(config: ABConfig, capacities: Sequence[int]) -> None:
    """ValueError unless `capacities` is a non-empty list of ints of TOKENS, each at least
    the largest block size of `config`'s arms (what `sweep` accepts)."""
    if not capacities:
        raise ValueError("sweep needs at least one capacity (TOKENS)")
    for c in capacities:
        if isinstance(c, bool) or not isinstance(c, int) or c < max(config.block_sizes):
            raise ValueError(
                f"capacity {c!r} must be an int of TOKENS >= the largest block size {max(config.block_sizes)}"
            )


def sweep(
    config: ABConfig,
    capacities: Sequence[int],
    workload: Workload | None = None,
    *,
    progress: Progress | None = None,
    on_result: Callable[[ABResult], None] | None = None,
    on_capacity: Callable[[SweepResult], None] | None = None,
) -> SweepResult:
    """`run_ab` at each capacity (TOKENS), the workload and block plans built once.
    `on_result` sees each capacity's full `ABResult` as it completes; `on_capacity` the
    sweep so far (the capacities finished)."""
    check_capacities(config, capacities)
    if workload is None:
        workload = config.workload.build()
    refs = ReferenceBounds(workload, config.block_sizes)
    described = describe_workload(workload, config.block_sizes)
    points: list[SweepPoint] = []
    for k, capacity in enumerate(capacities):
        labelled = None
        if progress is not None:
            def labelled(label: str, done: int, total: int, _c: int = capacity) -> None:
                progress(f"{label} @ {_c:,}", done, total)
        result = run_ab(config.with_capacity(capacity), workload, progress=labelled, bounds_cache=refs)
        if on_result is not None:
            on_result(result)
        points += _points(result)
        if on_capacity is not None:
            on_capacity(SweepResult(described, tuple(capacities[: k + 1]), tuple(points)))
    return SweepResult(described, tuple(capacities), tuple(points))
