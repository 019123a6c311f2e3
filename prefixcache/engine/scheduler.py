"""Continuous batching over a `PrefixCache`: who runs this step, how many tokens each.

Owns the waiting queue and the running list, each request's path through the cache
(`admit` -> prefill of the uncached tokens in chunks -> `commit` after every step ->
`append` of each sampled token -> `release`, or `abort` at any point), the per-step
token budget, and what happens when the pool is full. Every cache call goes through here and is timed.

A step, in vLLM V1's order:
1. Running requests, oldest first, each gets `min(tokens it still needs, budget left)`:
   one token in decode, the next chunk of its prompt in prefill. A decoding request
   first `append`s the token it sampled last step; a refused append PREEMPTS the
   newest running request (`release`, back to the FRONT of the waiting queue, its
   tokens so far kept) and retries, until the append fits or the request preempted
   itself. A preempted request is recomputed on re-admission: prompt + output so far
   is its new prompt, and the blocks `release` cached usually make that a hit.
2. If nothing was preempted, waiting requests are admitted in arrival order while the
   budget and `max_num_seqs` allow. A refused `admit` (no room even after eviction)
   leaves the request at the head of the queue until running requests free blocks:
   first come, first served, no overtaking. The one exception (`in_batch_prefix_tokens`,
   SGLang's in-batch prefix caching): a request whose prompt shares with a running
   request still in its prefill (in the same namespace) at least that many tokens more
   than the cache would give it now (`match`: what the leader committed, as the
   strategy hits it) waits, and the requests behind it may go first. Once the leader
   commits them it hits them, where it would have computed them again beside the leader
   (vLLM reaches the same by caching blocks before they are computed, which our protocol
   does not allow: a hit is only ever committed KV). A request that asks for prompt
   logprobs is admitted with `read_cache=False` (it needs every prompt position's logits)
   and never waits for a leader. At most `max_num_seqs` waiting
   requests are passed over a step, so a burst costs a step O(max_num_seqs x requests in
   prefill) prefix comparisons and O(max_num_seqs) matches, not O(queue).
Nothing here raises when the pool is full: a request that fits the pool alone
(`Engine.add_request` checks) always finishes, because the oldest running request is
never preempted by a newer one.

With `priority` scheduling (vLLM's policy of that name), "oldest" reads "first in
(priority, arrival)" throughout: the waiting queue is kept in that order (a preempted
request goes back at its place in it, not at the front), and a refused append preempts
the running request that is last in it, which may be one this step already scheduled (its
chunk is taken back). A request of the best priority still always finishes; one of a
worse priority waits while better ones keep the pool full, as in vLLM.

Must never: run the model, sample, or hold a block table across a commit (radix
re-points tables on commit: the engine reads `block_table` after it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from prefixcache.engine.detokenizer import StopStrings
from prefixcache.engine.logprobs import TokenLogprobs
from prefixcache.engine.metrics import RequestMetrics
from prefixcache.engine.repetition import RepetitionDetection
from prefixcache.engine.sampling import SamplingParams
from prefixcache.engine.structured import Grammar
from prefixcache.protocol import Namespace, PrefixCache

__all__ = ["Sequence", "Scheduled", "Scheduler"]


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. `tokens` = prompt + output so far (TOKENS)."""

    request_id: str
    prompt: list[int]
    namespace: Namespace
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None
    metrics: RequestMetrics
    keep_first_logits: bool = False
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is written, in the current admission
    num_in_cache: int = 0  # tokens the cache holds for it (admitted + appended)
    checkpoints: list[int] = field(default_factory=list)  # prefill ends still to reach (Admission.checkpoints)
    fresh: bool = False  # admitted, nothing computed since
    at_checkpoint: bool = False  # its last chunk ended on a checkpoint: the next one's blocks may wait
    admitted: bool = False
    decoding: bool = False  # sampled since its last admission: one token per step from here
    finish_reason: str | None = None
    first_logits: torch.Tensor | None = None
    stop_strings: StopStrings | None = None  # the request's stop strings over its output text
    num_logprobs: int | None = None  # top logprobs per drawn token (None: no logprobs)
    logprob_token_ids: tuple[int, ...] | None = None  # the ids whose logprobs it returns instead of a top
    repetition: RepetitionDetection | None = None  # a loop at its output's end ends it
    priority: int = 0  # with priority scheduling: lower goes first (vLLM's)
    skip_special_tokens: bool = True  # its output text leaves out the tokenizer's special tokens
    num_prompt_logprobs: int | None = None  # top logprobs per prompt token (None: none; else it reads no cache)
    prompt_logprobs: list = field(default_factory=list)  # per prompt position so far (TokenLogprobs | None)
    grammar: Grammar | None = None  # what it may draw next (None: anything)
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences its output never ends with
    min_tokens: int = 0  # output tokens before a stop token or string may end it
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, when asked
    _ids: np.ndarray | None = field(default=None, repr=False)  # `tokens` as an array, for prefix comparisons

    def ids(self) -> np.ndarray:
        """`tokens` as an int64 array (made again when they have grown)."""
        if self._ids is None or len(self._ids) != len(self.tokens):
            self._ids = np.asarray(self.tokens, dtype=np.int64)
        return self._ids

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt)


@dataclass(frozen=True)
class Scheduled:
    """Compute `tokens[start : start + num_tokens]` of `seq` this step."""

    seq: Sequence
    start: int
    num_tokens: int
    prefill: bool  # part of a prompt (or of a preempted request's recompute), not a decode
    fresh: bool = False  # the request's first chunk since its admission

    @property
    def samples(self) -> bool:
        """The chunk ends at the request's last token, so its logits give the next one."""
        return self.start + self.num_tokens == len(self.seq.tokens)


def _rank(seq: Sequence) -> tuple[int, float]:
    """A request's place under priority scheduling: lower first (vLLM's)."""
    return seq.priority, seq.metrics.arrival_s


class Scheduler:
    """Waiting queue + running list over `cache` (see the module docstring)."""

    def __init__(self, cache: PrefixCache, *, max_num_batched_tokens: int, max_num_seqs: int,
                 in_batch_prefix_tokens: int = 0, priority: bool = False) -> None:
        self.cache = cache
        self.priority = priority  # vLLM's "priority" policy (else first come, first served)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.in_batch_prefix_tokens = in_batch_prefix_tokens  # 0: off
        self.num_prefix_waits = 0  # steps a waiting request was passed over for a leader's prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.cache_s = 0.0  # SECONDS spent inside cache calls
        self.num_preemptions = 0
        self.prefill_tokens_computed = 0
        self.prefill_tokens_saved = 0
        # Copy-on-write requests of this step's admissions (Admission.copies): the engine
        # applies them to the KV pool before the forward pass that reads them.
        self.pending_copies: list[tuple[int, int, int]] = []

    # -- the cache, timed ---------------------------------------------------------------
    def _timed(self, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.cache_s += time.perf_counter() - t0

    def block_table(self, seq: Sequence) -> tuple[int, ...]:
        """The request's current blocks (read after every commit: radix re-points them)."""
        return tuple(self._timed(self.cache.block_table, seq.request_id))

    def block_tables(self, seq: Sequence) -> tuple[tuple[int, ...], ...]:
        """Each layout group's current blocks (hybrid layouts; read after every commit)."""
        return tuple(tuple(t) for t in self._timed(self.cache.block_tables, seq.request_id))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """TOKENS of `seq` to compute now: what it needs, within the budget, and no
        further than its next checkpoint (a prefill chunk ends there, so the cache can
        keep a state at it)."""
        n = min(len(seq.tokens) - seq.num_computed, budget)
        if seq.checkpoints:
            n = min(n, seq.checkpoints[0] - seq.num_computed)
        return n

    # -- queue ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.priority:
            self._queue(seq)
        else:
            self.waiting.append(seq)

    def _queue(self, seq: Sequence) -> None:
        """Put `seq` in the waiting queue at its place in (priority, arrival) order, after
        those equal to it."""
        key = _rank(seq)
        at = len(self.waiting)
        while at > 0 and _rank(self.waiting[at - 1]) > key:  # usually at or near the end
            at -= 1
        self.waiting.insert(at, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        """This step's work (empty only when nothing is unfinished)."""
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_in_cache < len(seq.tokens) or seq.at_checkpoint:
                # Past a checkpoint the next chunk's blocks may still wait for room: append([]) asks.
                seq.at_checkpoint = False
                fits, victims, earlier = self._append_or_preempt(seq, out)
                preempted = preempted or victims > 0
                if earlier:  # requests before it left the running list, their chunks taken back (priority)
                    i -= earlier
                    budget = self.max_num_batched_tokens - sum(w.num_tokens for w in out)
                if not fits:
                    continue  # it preempted itself (the last in order): the next one is at i now
            n = self._chunk(seq, budget)
            out.append(Scheduled(seq, seq.num_computed, n, prefill=not seq.decoding, fresh=seq.fresh))
            seq.fresh = False
            budget -= n
            i += 1
        # vLLM admits nothing in a step that had to preempt: the pool is tight.
        w = passed = 0
        while w < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[w]
            # A request that needs every prompt position's logits reads nothing (and so waits for no leader).
            unread = {} if seq.num_prompt_logprobs is None else {"read_cache": False}
            if not unread and self.in_batch_prefix_tokens and self._waits_for_leader(seq):
                self.num_prefix_waits += 1
                passed += 1
                if passed >= self.max_num_seqs:
                    break
                w += 1
                continue
            adm = self._timed(self.cache.admit, seq.request_id, seq.tokens, namespace=seq.namespace, **unread)
            if adm is None:
                break
            del self.waiting[w]
            self.running.append(seq)
            self.pending_copies.extend(adm.copies)
            seq.admitted = True
            seq.num_computed = adm.num_cached_tokens
            seq.num_in_cache = len(seq.tokens)
            seq.checkpoints = list(adm.checkpoints)
            self.prefill_tokens_saved += adm.num_cached_tokens
            if seq.metrics.preemptions == 0:
                seq.metrics.cached_tokens = adm.num_cached_tokens
            n = self._chunk(seq, budget)
            out.append(Scheduled(seq, seq.num_computed, n, prefill=True, fresh=True))
            budget -= n
        return out

    def _waits_for_leader(self, seq: Sequence) -> bool:
        """Whether a running request in its prefill, in `seq`'s namespace, shares at least
        `in_batch_prefix_tokens` more of `seq`'s prompt than `seq` could hit now: by the
        end of its prefill the leader has cached them. What `seq` could hit is the cache's
        `match`, asked only when some leader shares that many at all, so it counts what the
        leader committed so far as the strategy hits it: a hybrid layout that caches a
        prompt only at its end (or states only at checkpoints) keeps a request waiting for
        what a full-attention cache would already hit."""
        need = self.in_batch_prefix_tokens
        limit = len(seq.tokens) - 1  # seq's last token is always computed
        shared = 0
        for leader in self.running:
            if leader.decoding or leader.namespace != seq.namespace:
                continue
            n = min(len(leader.tokens), limit)
            if n <= shared:  # it cannot share more than the best leader so far
                continue
            differ = np.flatnonzero(leader.ids()[:n] != seq.ids()[:n])
            shared = max(shared, int(differ[0]) if differ.size else n)
        if shared < need:
            return False
        hit = self._timed(self.cache.match, seq.tokens[:limit], namespace=seq.namespace).num_tokens
        return shared - hit >= need

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The (src, dst, num_tokens) copies admitted since the last call, oldest first."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _append_or_preempt(self, seq: Sequence, scheduled: list[Scheduled]) -> tuple[bool, int, int]:
        """Give the cache `seq`'s sampled tokens, preempting the running request last in
        order (the newest; with priority, the worst (priority, arrival)) until they fit; a
        victim this step already `scheduled` has its chunk taken back out of it. Returns
        (False if `seq` itself was preempted, requests preempted, of those how many stood
        before `seq` in the running list)."""
        new = seq.tokens[seq.num_in_cache :]
        victims = earlier = 0
        while self._timed(self.cache.append, seq.request_id, new) is None:
            victim = max(self.running, key=_rank) if self.priority else self.running[-1]
            if self.running.index(victim) < self.running.index(seq):
                earlier += 1
                scheduled[:] = [w for w in scheduled if w.seq is not victim]
            self.preempt(victim)
            victims += 1
            if victim is seq:
                return False, victims, earlier
        seq.num_in_cache = len(seq.tokens)
        return True, victims, earlier

    def preempt(self, seq: Sequence) -> None:
        """Release `seq` and put it at the front of the waiting queue to be recomputed."""
        self.running.remove(seq)
        self._timed(self.cache.release, seq.request_id)
        seq.admitted = False
        seq.decoding = False
        seq.num_computed = 0
        seq.num_in_cache = 0
        seq.checkpoints = []
        seq.at_checkpoint = False
        seq.metrics.preemptions += 1
        self.num_preemptions += 1
        if self.priority:
            self._queue(seq)
        else:
            self.waiting.appendleft(seq)

    # -- after the forward pass ---------------------------------------------------------
    def computed(self, work: list[Scheduled]) -> None:
        """The model wrote the KV of every scheduled chunk: commit them."""
        for w in work:
            seq = w.seq
            seq.num_computed = w.start + w.num_tokens
            while seq.checkpoints and seq.checkpoints[0] <= seq.num_computed:
                seq.at_checkpoint = seq.checkpoints.pop(0) == seq.num_computed
            if w.prefill:
                self.prefill_tokens_computed += w.num_tokens
                seq.metrics.computed_prompt_tokens += w.num_tokens
            self._timed(self.cache.commit, seq.request_id, seq.num_computed)

    def finish(self, seq: Sequence, reason: str) -> None:
        """`seq` is done: release its blocks (full computed ones stay cached)."""
        self.running.remove(seq)
        self._timed(self.cache.release, seq.request_id)
        seq.admitted = False
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is: out of the waiting queue, or out of the
        running list with its blocks released (what it computed stays cached, as on
        any release). The request, or None if it is not here (finished, or unknown)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def check_invariants(self) -> None:
        """The cache's invariants, and every running request is admitted exactly once."""
        self.cache.check_invariants()
        ids: list[Hashable] = [s.request_id for s in self.running]
        if len(set(ids)) != len(ids):
            raise AssertionError(f"a request is running twice: {ids}")
        for s in self.running:
            if not s.admitted:
                raise AssertionError(f"request {s.request_id!r} is running but not admitted")
