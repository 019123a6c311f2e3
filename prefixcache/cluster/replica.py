"""One simulated serving engine: vLLM V1's scheduler over a real cache, timed by the
service model.

Owns `SimEngine` (a scheduler's state: its running requests, the step it is in) and
`Listener` (what it reports, as it happens). Must never: route, read a router, or look
inside a cache past the `PrefixCache` protocol; the replay (`prefixcache.cluster.simulate`)
owns time, arrivals and every measurement.

Scheduling, as vLLM V1 (`vllm/v1/core/sched/scheduler.py`) with chunked prefill: each
step has a budget of `max_num_batched_tokens` tokens. Running requests come first, in
the order they were admitted: a decoding request takes one token, a request still
prefilling takes a chunk of what is left of its prompt, as much as the budget allows.
Waiting requests are then admitted in arrival order while budget is left and fewer than
`max_num_seqs` run: `admit` (the hit is what the cache reports), with `commit_outputs`
also `append(output)` (the output's KV is reserved at once: no preemption, unlike vLLM,
as SGLang reserves room for a request's new tokens), and the admitted request's first
chunk is scheduled in the same step. A request the cache has no room for waits (the
queue is FIFO: nobody passes it); one whose footprint exceeds the whole pool is rejected.
The step that prefills a prompt's last token also samples its first output token; each
later step samples one more; the request finishes with its last. Cache calls: `commit`
after every chunk, `commit(P + O)` at the end with `commit_outputs`, `release` at the end.
With `cache_when_scheduled` each chunk is committed as it is scheduled, before the step
computes it, as vLLM caches the blocks a step will fill when it schedules them
(`allocate_slots`): a request admitted later in the same step hits them (a simulation
has no KV that could be read before it is written). Without it, requests admitted in
one step each compute a prefix none of them has computed yet.

Lower tiers. A request whose hit the cache loads from a lower tier (`Admission.loads`,
with `cache.tiers`) has those blocks copied in before its first chunk computes: that
step costs `ServiceModel.load_s` more for each tier it loads from (the blocks over the
host link, or over the tier's `bandwidth_gbps` where slower, plus its latency), and runs
alone as a segment of one step. The transfers the caches record are drained after each
call that makes them (the replay moves no data).

Time. A step's cost is `ServiceModel.step_s` of its tokens, query-key pairs and KV
read. Steps whose batch does not change (the same decodes, the same prompt's chunk) run
as one segment of k steps, costed at the middle step's contexts (exact where one side of
the roofline binds throughout, as both grow linearly); a segment ends when a prefill or
a request ends, and is cut short at the next step boundary when a request arrives or,
for engines sharing one cache, when another engine frees room (`wake`).

Several engines may share one cache and one queue (the shared-cache reference line): each
schedules its own batch, and a request goes to the first engine with room.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from prefixcache.service_model import ServiceModel
from prefixcache.protocol import PrefixCache
from prefixcache.workloads import Workload

__all__ = ["SimEngine", "Listener", "Running"]


class Running:
    """A request an engine has admitted: TOKENS of prompt computed (from its hit) and of
    output sampled."""

    __slots__ = ("i", "prompt_len", "output_len", "computed", "generated", "load_s")

    def __init__(self, i: int, prompt_len: int, output_len: int, hit: int, load_s: float = 0.0) -> None:
        self.i, self.prompt_len, self.output_len = i, prompt_len, output_len
        self.computed = hit
        self.generated = 0
        self.load_s = load_s  # SECONDS of lower-tier loads its first chunk waits for

    @property
    def context(self) -> int:
        """TOKENS of KV this request attends to in a decode step."""
        return self.prompt_len + self.generated


@dataclass
class Listener:
    """What an engine reports, each with (engine, request index, time in SECONDS)."""

    admitted: Callable[[SimEngine, int, int, float], None]  # also the hit, TOKENS
    first_token: Callable[[SimEngine, int, float], None]
    finished: Callable[[SimEngine, int, float], None]
    rejected: Callable[[SimEngine, int, float], None]
    wake: Callable[[SimEngine, float], None]  # the engine wants to run at this time
    freed: Callable[[SimEngine, float], None]  # a request released its blocks


class SimEngine:
    """One engine's scheduler (module docstring). `queue` holds workload request
    indices; engines that share a cache share the queue too."""

    def __init__(self, eid: int, cache: PrefixCache, queue: deque[int], service: ServiceModel, workload: Workload,
                 listener: Listener, *, commit_outputs: bool, prompt: Callable[[int], list[int]],
                 cache_when_scheduled: bool = False) -> None:
        self.eid, self.cache, self.queue, self.service = eid, cache, queue, service
        self.workload, self.listener, self.commit_outputs, self.prompt = workload, listener, commit_outputs, prompt
        self.cache_when_scheduled = cache_when_scheduled
        self.num_blocks = cache.config.num_blocks
        self.block_size = cache.config.block_size
        self.tiers = cache.config.tiers
        self.running: list[Running] = []
        self.busy_s = 0.0  # SECONDS of steps run
        self.prefilled = 0  # prompt TOKENS computed
        # The segment in progress: k steps of step_s from start, with what each step does.
        self.start_s = 0.0
        self.step = 0.0
        self.steps = 0
        self.decoding: list[Running] = []
        self.chunks: list[tuple[Running, int]] = []
        self.version = 0  # bumped when the segment's end moves: older wake-ups are stale
        self.blocked = False  # the queue's head waits for room in the cache

    @property
    def busy(self) -> bool:
        return self.steps > 0

    @property
    def end_s(self) -> float:
        return self.start_s + self.steps * self.step

    # -- the replay's calls -------------------------------------------------------------
    def poke(self, now: float) -> None:
        """Something changed for this engine (a request joined its queue, or room freed
        in its cache): idle, it plans now; mid-segment, the segment ends at the next step
        boundary, where the scheduler looks again."""
        if not self.busy:
            self.plan(now)
            return
        # A step that starts as the request arrives was launched without it (engine events
        # come first); the tolerance keeps float rounding from moving that boundary.
        done = min(self.steps, math.floor((now - self.start_s) / self.step + 1e-9) + 1)
        if done < self.steps:
            self.steps = done
            self.version += 1
            self.listener.wake(self, self.end_s)

    def end_segment(self) -> None:
        """The segment's steps are done: apply them, then plan the next."""
        now = self.end_s
        k = self.steps
        self.busy_s += k * self.step
        self.steps = 0
        for r in self.decoding:
            r.generated += k
        for r, chunk in self.chunks:
            r.load_s = 0.0
            r.computed += chunk * k
            self.prefilled += chunk * k
            if r.computed == r.prompt_len:
                self.cache.commit(r.i, r.prompt_len)
                r.generated = 1
                self.listener.first_token(self, r.i, now)
            else:
                self.cache.commit(r.i, r.computed)
        freed = False
        for r in [r for r in self.running if r.computed == r.prompt_len and r.generated >= max(r.output_len, 1)]:
            self.running.remove(r)
            if self.commit_outputs and r.output_len:
                self.cache.commit(r.i, r.prompt_len + r.output_len)
            self.cache.release(r.i)
            freed = True
            self.listener.finished(self, r.i, now)
        if self.tiers:
            self.cache.drain_transfers()
        if freed:
            self.listener.freed(self, now)
        self.plan(now)

    # -- scheduling ---------------------------------------------------------------------
    def plan(self, now: float) -> None:
        """Schedule the next segment at `now` (module docstring); idle if nothing runs."""
        service = self.service
        budget = service.max_num_batched_tokens
        decoding = [r for r in self.running if r.computed == r.prompt_len][:budget]
        left = budget - len(decoding)
        chunks: list[tuple[Running, int]] = []
        for r in self.running:
            if left <= 0:
                break
            if r.computed < r.prompt_len:
                left -= self._schedule_chunk(r, left, chunks)
        self.blocked = False
        while left > 0 and self.queue and len(self.running) < service.max_num_seqs:
            r = self.admit(self.queue[0], now)
            if r is None:
                break
            left -= self._schedule_chunk(r, left, chunks)
        if not decoding and not chunks:
            return
        steps = min((r.output_len - r.generated for r in decoding), default=math.inf)
        loading = sum(r.load_s for r, _ in chunks)
        if loading:  # the loads come before the step's compute, once
            steps = 1
        elif len(chunks) == 1:
            r, chunk = chunks[0]
            rest = r.prompt_len - r.computed
            steps = min(steps, (rest - 1) // chunk if rest > chunk else 1)
        elif chunks:
            steps = 1
        steps = int(steps)
        self.decoding, self.chunks, self.steps, self.start_s = decoding, chunks, steps, now
        self.step = self.step_cost(steps) + loading
        self.version += 1
        self.listener.wake(self, self.end_s)

    def _schedule_chunk(self, r: Running, left: int, chunks: list[tuple[Running, int]]) -> int:
        """Schedule `r`'s next prompt chunk within `left` TOKENS; returns its size. With
        `cache_when_scheduled` it is committed now (the step's first chunk always runs)."""
        chunk = min(r.prompt_len - r.computed, left)
        chunks.append((r, chunk))
        if self.cache_when_scheduled:
            self.cache.commit(r.i, r.computed + chunk)
        return chunk

    def step_cost(self, steps: int) -> float:
        """SECONDS of each step of the planned segment, at its middle step's contexts."""
        mid = (steps - 1) / 2
        kv = sum(r.context for r in self.decoding) + len(self.decoding) * mid
        pairs = kv
        tokens = len(self.decoding)
        for r, chunk in self.chunks:
            start = r.computed + chunk * mid
            tokens += chunk
            pairs += chunk * start + chunk * (chunk + 1) / 2
            kv += start + chunk
        return self.service.step_s(tokens, pairs, kv)

    def load_s(self, loads) -> float:
        """SECONDS the loads of an admission take (`Admission.loads`: (tier, slot, block))."""
        if not loads:
            return 0.0
        per_tier = Counter(t for t, _, _ in loads)
        return sum(self.service.load_s(n * self.block_size, self.tiers[t].gbps, self.tiers[t].latency_s)
                   for t, n in per_tier.items())

    def admit(self, i: int, now: float) -> Running | None:
        """The queue's head into the batch, or None if the cache has no room for it now
        (it waits; `blocked`). A request that can never fit is rejected and the next one
        tried."""
        while True:
            r = self.workload.requests[i]
            prompt_len, output_len = len(r.prompt), len(r.output)
            footprint = prompt_len + (output_len if self.commit_outputs else 0)
            if -(-footprint // self.block_size) > self.num_blocks:
                self.queue.popleft()
                self.listener.rejected(self, i, now)
                if not self.queue:
                    return None
                i = self.queue[0]
                continue
            admission = self.cache.admit(i, self.prompt(i), namespace=r.namespace)
            if admission is not None and self.commit_outputs and output_len:
                if self.cache.append(i, r.output.tolist()) is None:
                    self.cache.release(i)
                    admission = None
            if self.tiers:
                self.cache.drain_transfers()
            if admission is None:
                self.blocked = True
                return None
            self.queue.popleft()
            running = Running(i, prompt_len, output_len, admission.num_cached_tokens, self.load_s(admission.loads))
            self.running.append(running)
            self.listener.admitted(self, i, admission.num_cached_tokens, now)
            return running
