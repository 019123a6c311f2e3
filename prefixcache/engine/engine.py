"""The engine: requests in, completions and measurements out, through a `PrefixCache`.

Owns `Engine`: it builds the configured cache (or `NoPrefixCache` when
`engine.prefix_caching` is false) over a pool of `cache.num_blocks` blocks, the model with
a KV tensor per layer of the same geometry, and the scheduler; `step()` runs one forward
pass over what the scheduler picked, commits, samples, and finishes requests. Also
`GenerationRequest` (what a caller asks for), `RequestOutput` (what it gets back) and
`StepOutput` (what one step sampled, for callers that stream).

KV events: the engine records them only when it has somewhere to send them (an
`event_sink`, e.g. the serving layer's publisher): it builds the cache with
`enable_events` set to that, whatever `cache.enable_events` says, and hands the sink
the events the cache logged once per step (and after an abort or a reset), so the log
never grows between steps. Without a sink no event is recorded at all.

The cache decides which prompt tokens are already computed; the engine computes only
the rest, so a hit is prefill skipped, and rule 6 of the protocol (cached KV equals
recomputed KV) is what keeps the output unchanged (tests/test_engine.py checks it).

Pacing (`engine.pace`, a `ServiceModel`): a step lasts at least the time the model gives
its chunks; the engine sleeps out the rest after the forward pass, before it commits and
samples, so a small host's replicas time their steps as the modelled GPU would.

One request's fault ends that request alone, as vLLM's `FinishReason.ERROR` does: a
forward pass that raises is retried request by request and only a request that fails on
its own is finished with reason "error"; a row of logits that cannot be sampled fails
its request the same way (`sampling.SamplingError`).

Must never: talk to a cache other than through the `PrefixCache` protocol (a user's
backend drops in), keep a block table across a commit, or fail a batch for one request.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import accumulate
from pathlib import Path

import torch

from prefixcache import BlockPool, build_cache
from prefixcache.engine.batch import SeqChunk
from prefixcache.engine.config import ServingConfig, load_serving_config
from prefixcache.engine.detokenizer import StopStrings
from prefixcache.engine.kv_tiers import KVTiers
from prefixcache.engine.gemma3 import Gemma3Model, Gemma3Weights
from prefixcache.engine.hybrid_model import HybridModel, HybridWeights
from prefixcache.engine.loader import LoadedModel, load_model
from prefixcache.engine.logprobs import MAX_LOGPROB_TOKEN_IDS, TokenLogprobs, token_logprobs
from prefixcache.engine.memory import check_engine_memory
from prefixcache.engine.metrics import RequestMetrics, RunStats
from prefixcache.engine.model import LlamaModel
from prefixcache.engine.nocache import NoPrefixCache
from prefixcache.engine.sampling import SamplingError, SamplingParams, bad_word_tokens, processed_logits, sample
from prefixcache.engine.repetition import RepetitionDetection, ends_in_repetition
from prefixcache.engine.scheduler import Scheduled, Scheduler, Sequence as Seq
from prefixcache.engine.structured import Grammar, Grammars, StructuredOutputs
from prefixcache.errors import ConfigError
from prefixcache.events import KVEvent
from prefixcache.protocol import PrefixCache, as_tokens, skips_reading
from prefixcache.requests import check_namespace
from prefixcache.tiers import Tiers

__all__ = ["Engine", "GenerationRequest", "RequestOutput", "StepOutput", "EventSink"]

_log = logging.getLogger(__name__)

EventSink = Callable[[list[KVEvent]], None]
"""Where the engine sends the KV events of a step (called in the engine's thread)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One request: a `prompt` (text or token ids) or chat `messages` (rendered with the
    tokenizer's chat template), its `namespace` (cache isolation), and optional
    overrides of the engine's defaults. `keep_first_logits`: return the fp32 logits the
    first output token was drawn from. `ignore_eos`: the tokenizer's end-of-sequence
    and end-of-turn tokens do not stop it (vLLM's `ignore_eos`; configured stop tokens still do).
    `stop`: strings that end it once its output text reaches one (vLLM's; the text is
    cut before it, or after it with `include_stop_str_in_output`: `detokenizer`).
    `arrival_s`: when it arrived (`time.perf_counter()` SECONDS; default: when added),
    the start of its TTFT and latency. `logprobs`: return each drawn token's logprob with
    this many of the most likely tokens (vLLM's `SamplingParams.logprobs`; None: none).
    `min_tokens`: no stop token can be drawn, and no stop string ends it, before it has
    this many output tokens (vLLM's; at most `max_tokens`). `skip_special_tokens`: the
    output text (and what stop strings see) leaves out the tokenizer's special tokens
    (vLLM's, default on; the token ids keep them). `prompt_logprobs`: return each prompt
    token's logprob given the tokens before it, with this many of the most likely tokens
    (vLLM's `SamplingParams.prompt_logprobs`; None: none). Such a request reads nothing
    from the cache (vLLM's `skip_reading_prefix_cache`): every prompt position is computed.
    `structured_outputs`: a grammar its output follows (`structured`: vLLM's, on llguidance).
    `bad_words`: words its output never ends with (vLLM's, `sampling.bad_word_tokens`).
    `logprob_token_ids`: return each drawn token's logprob with these ids' logprobs (1 to
    `MAX_LOGPROB_TOKEN_IDS` of them, in the vocabulary) in place of the most likely ones
    (vLLM's; `logprobs` then None or their number). `repetition_detection`: end it, with
    finish reason "repetition", once its output ends in a loop (`repetition`: vLLM's).
    `priority`: its place under `engine.scheduling_policy: priority` (lower first, vLLM's;
    any value but 0 under "fcfs" is refused, as vLLM refuses it)."""

    prompt: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, str]] | None = None
    namespace: str | None = None
    max_tokens: int | None = None
    sampling: SamplingParams | None = None
    stop_token_ids: tuple[int, ...] = ()
    keep_first_logits: bool = False
    request_id: str | None = None
    ignore_eos: bool = False
    arrival_s: float | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    bad_words: tuple[str, ...] = ()
    logprob_token_ids: tuple[int, ...] | None = None
    repetition_detection: RepetitionDetection | None = None
    priority: int = 0


@dataclass
class RequestOutput:
    """A finished request. `token_ids` include a final stop token; `text` does not.
    `stop_str`: the stop string that ended it (its `text` cut there; `token_ids` keep
    every token drawn). `finish_reason` "error" (vLLM's `FinishReason.ERROR`): its forward
    pass or sampling failed, `error` says how, and the tokens are those drawn before.
    `logprobs`: one per token id, for a request that asked for them (else None).
    `prompt_logprobs`: one per prompt token, the first None (nothing comes before it), for
    a request that asked for them (else None)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "repetition" | "error"
    metrics: RequestMetrics
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    error: str | None = None
    stop_str: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class StepOutput:
    """What one step did: `tokens` are the (request id, token id) pairs it sampled, in
    batch order (a request's final stop token included), `finished` the requests it
    finished (their last sampled token is in `tokens` too; a request that failed this
    step, reason "error", sampled nothing). `logprobs`: (request id, its token's logprobs)
    for the requests of `tokens` that asked for them. `prompt_logprobs`: (request id, its
    prompt's logprobs) for the requests that asked for them and drew their first token now."""

    tokens: tuple[tuple[str, int], ...]
    finished: tuple[RequestOutput, ...]
    logprobs: tuple[tuple[str, TokenLogprobs], ...] = ()
    prompt_logprobs: tuple[tuple[str, tuple[TokenLogprobs | None, ...]], ...] = ()


class Engine:
    """Continuous-batching inference over a `PrefixCache` (see the module docstring).

    `model`: an already loaded model to share between engines (tests, A/B); by default
    the one `config.engine.model` names is loaded. `event_sink`: where the KV events of
    each step go (module docstring); None records none. Sets torch's thread count when
    `engine.num_threads` is given (a process-wide setting). Not thread-safe: one thread
    drives an engine (`prefixcache.serve.engine_loop` runs it in a thread of its own).
    """

    def __init__(
        self, config: ServingConfig, *, model: LoadedModel | None = None, event_sink: EventSink | None = None
    ) -> None:
        self.config = config
        ec, cc = config.engine, config.cache
        if ec.num_threads is not None:
            torch.set_num_threads(ec.num_threads)
        self.loaded = model or load_model(ec.model, seed=ec.seed, chat_template=ec.chat_template)
        check_engine_memory(config, self.loaded.weights.config)  # before the pool and the KV are allocated
        self.tokenizer = self.loaded.tokenizer
        self._event_sink = event_sink
        if cc.enable_events != (event_sink is not None):
            cc = cc.replace(enable_events=event_sink is not None)
        # The model's layers decide the cache's layout; a config that says otherwise is wrong.
        if self.loaded.layout:
            if cc.layout and tuple(cc.layout) != tuple(self.loaded.layout):
                raise ConfigError(
                    "cache.layout", f"model {self.loaded.name!r} needs layout {list(self.loaded.layout)}, not {list(cc.layout)}"
                )
            cc = cc.replace(layout=tuple(self.loaded.layout))
        self.config = replace(config, cache=cc)
        pool = BlockPool(cc.num_blocks)
        self.cache: PrefixCache = build_cache(cc, pool) if ec.prefix_caching else NoPrefixCache(pool, cc.replace(options={}))
        if isinstance(self.loaded.weights, HybridWeights):
            self.model: LlamaModel | HybridModel | Gemma3Model = HybridModel(self.loaded.weights, attention_impl=ec.attention)
        elif isinstance(self.loaded.weights, Gemma3Weights):
            self.model = Gemma3Model(self.loaded.weights, attention_impl=ec.attention)
        else:
            self.model = LlamaModel(self.loaded.weights, attention_impl=ec.attention)
        if isinstance(self.model, HybridModel):
            self.model.state_tokens = self.cache.state_tokens  # where the cache keeps states
        self.model.allocate_kv(cc.num_blocks, cc.block_size)
        #: The data of the cache's lower tiers (`cache.tiers`): host pools, disk files.
        self.kv_tiers: KVTiers | None = None
        if cc.tiers and ec.prefix_caching:
            tiers = getattr(self.cache, "tiers", None)
            if not isinstance(tiers, Tiers):
                raise ConfigError("cache.tiers", f"backend {cc.backend!r} exposes no `tiers` (prefixcache.tiers.Tiers): "
                                  "the engine cannot move its blocks between tiers")  # fmt: skip
            self.kv_tiers = KVTiers(cc, tiers, self.model.kv, ec.model)
        self.scheduler = Scheduler(
            self.cache, max_num_batched_tokens=ec.max_num_batched_tokens, max_num_seqs=ec.max_num_seqs,
            in_batch_prefix_tokens=ec.in_batch_prefix_tokens if ec.prefix_caching else 0,
            priority=ec.scheduling_policy == "priority",
        )
        self._pace = ec.pace
        self._config_stop_ids = frozenset(ec.stop_token_ids)
        self._stop_ids = self._config_stop_ids | {self.tokenizer.eos_token_id, *self.tokenizer.stop_token_ids}
        self._next_id = 0
        self._grammars: Grammars | None = None  # built at the first request with a grammar
        self._grammars_lock = threading.Lock()  # compile_grammar may run in another thread
        self._finished: list[Seq] = []
        self.reset_stats()

    @classmethod
    def from_yaml(cls, path: str | Path, *, model: LoadedModel | None = None) -> Engine:
        """An engine from the `cache:` and `engine:` sections of a YAML file."""
        return cls(load_serving_config(path), model=model)

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request: GenerationRequest | str | Sequence[int], *, grammar: Grammar | None = None) -> str:
        """Queue a request; returns its id. ValueError naming the field for a request
        that can never run (empty, out-of-vocabulary ids, longer than the context or the
        pool). `grammar`: its `structured_outputs` compiled already (`compile_grammar`, in
        another thread); else they are compiled here."""
        if not isinstance(request, GenerationRequest):
            request = GenerationRequest(prompt=request)
        ec, cc = self.config.engine, self.config.cache
        prompt = self._prompt_ids(request)
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]!r} is not in the vocabulary [0, {vocab})")
        max_tokens = ec.max_tokens if request.max_tokens is None else request.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        total = len(prompt) + max_tokens
        if total > self.model.config.max_position:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's context length "
                f"{self.model.config.max_position}"
            )
        if -(-total // cc.block_size) > cc.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs {-(-total // cc.block_size)} blocks of "
                f"{cc.block_size}, more than the whole pool (cache.num_blocks = {cc.num_blocks})"
            )
        stop_strings = None
        if request.stop:  # checked before the request takes an id: ValueError naming `stop`
            if isinstance(request.stop, str):
                raise ValueError(f"stop must be a sequence of str, got the str {request.stop!r}")
            stop_strings = StopStrings(self.tokenizer, request.stop, request.include_stop_str_in_output,
                                       request.skip_special_tokens)
        min_tokens = request.min_tokens
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens <= max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={max_tokens}], got {min_tokens!r}")
        num_logprobs = request.logprobs
        if num_logprobs is not None and (isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int)
                                         or not 0 <= num_logprobs <= vocab):
            raise ValueError(f"logprobs must be None or an integer in [0, {vocab}] (the vocabulary), got {num_logprobs!r}")
        priority = request.priority
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(2**63) <= priority < 2**63:
            raise ConfigError("priority", f"must be an integer (int64), got {priority!r}")
        if priority != 0 and not self.scheduler.priority:
            raise ConfigError("priority", f"Got priority {priority} but Priority scheduling is not enabled "
                              "(engine.scheduling_policy: fcfs)")  # fmt: skip
        repetition = request.repetition_detection
        if repetition is not None and not isinstance(repetition, RepetitionDetection):
            raise ValueError(f"repetition_detection must be a RepetitionDetection or None, got {repetition!r}")
        repetition = repetition if repetition is not None and repetition.enabled else None
        named = request.logprob_token_ids
        if named is not None:
            named = tuple(named)
            if not 1 <= len(named) <= MAX_LOGPROB_TOKEN_IDS or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in named):
                raise ValueError(f"logprob_token_ids must be 1 to {MAX_LOGPROB_TOKEN_IDS} token ids in [0, {vocab}), "
                                 f"got {list(named)!r}")  # fmt: skip
            if num_logprobs is not None and num_logprobs != len(named):
                raise ValueError(f"logprobs must be None or len(logprob_token_ids) = {len(named)} when both are "
                                 f"set, got {num_logprobs}")  # fmt: skip
            num_logprobs = len(named)
        num_prompt_logprobs = request.prompt_logprobs
        if num_prompt_logprobs is not None:
            if isinstance(num_prompt_logprobs, bool) or not isinstance(num_prompt_logprobs, int) \
                    or not 0 <= num_prompt_logprobs <= vocab:
                raise ValueError(f"prompt_logprobs must be None or an integer in [0, {vocab}] (the vocabulary), "
                                 f"got {num_prompt_logprobs!r}")
            if isinstance(self.model, HybridModel):
                raise ConfigError("prompt_logprobs", "the test hybrid model returns no logits but its chunks' last")
            if not skips_reading(self.cache):
                raise ConfigError("prompt_logprobs", f"the cache backend {type(self.cache).__qualname__} cannot "
                                  "admit a request without reading its cache (`admit(read_cache=False)`)")
        params = request.sampling or ec.sampling
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ConfigError(name, f"token id {outside[0]} is not in the vocabulary [0, {vocab})")
        seed = params.seed
        if request.sampling is None and seed is not None:
            seed += self._next_id  # request i of the engine draws from seed + i
        generator = None
        if not params.greedy and seed is not None:
            # torch seeds with 64 bits; an int64 seed (+ i) is taken modulo 2**64, as torch
            # itself takes a negative one (two's complement).
            generator = torch.Generator().manual_seed(seed % 2**64)
        stop_ids = (self._config_stop_ids if request.ignore_eos else self._stop_ids) | frozenset(request.stop_token_ids)
        if min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= stop_ids:
            raise ConfigError("allowed_token_ids", "every allowed token is a stop token, which min_tokens forbids "
                              "drawing: no token could be drawn")
        bad_words = bad_word_tokens(request.bad_words, lambda t: self.tokenizer.encode(t, add_special_tokens=False))
        if request.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(request.structured_outputs)
        rid = request.request_id if request.request_id is not None else f"req-{self._next_id}"
        if not isinstance(rid, str):
            raise TypeError(f"request_id must be a str, got {type(rid).__name__}")
        self._next_id += 1
        now = time.perf_counter() if request.arrival_s is None else request.arrival_s
        self.scheduler.add(
            Seq(
                request_id=rid,
                prompt=prompt,
                namespace=check_namespace(request.namespace),
                params=params,
                max_tokens=max_tokens,
                stop_token_ids=stop_ids,
                generator=generator,
                metrics=RequestMetrics(arrival_s=now, prompt_tokens=len(prompt)),
                keep_first_logits=request.keep_first_logits,
                stop_strings=stop_strings,
                num_logprobs=num_logprobs,
                logprob_token_ids=named,
                repetition=repetition,
                priority=priority,
                min_tokens=min_tokens,
                skip_special_tokens=bool(request.skip_special_tokens),
                num_prompt_logprobs=num_prompt_logprobs,
                prompt_logprobs=[None] if num_prompt_logprobs is not None else [],  # position 0 has none
                grammar=grammar,
                bad_words=bad_words,
            )
        )
        self._requests += 1
        self._prompt_tokens += len(prompt)
        return rid

    def compile_grammar(self, spec: StructuredOutputs) -> Grammar:
        """`spec` compiled for this engine's tokenizer (ConfigError naming the field if it
        does not compile). Safe from any thread, unlike the rest of the engine: a server
        compiles beside the engine's thread, so a large schema stalls no step."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)
            grammars = self._grammars
        return grammars.compile(spec)

    def _prompt_ids(self, request: GenerationRequest) -> list[int]:
        if (request.prompt is None) == (request.messages is None):
            raise ValueError("a request needs exactly one of prompt and messages")
        if request.messages is not None:
            ids = self.tokenizer.apply_chat_template(request.messages)
        elif isinstance(request.prompt, str):
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = list(as_tokens(request.prompt))
        if not ids:
            raise ValueError("prompt: a prompt needs at least one token")
        return ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: str) -> bool:
        """Stop a request now, queued or running: its blocks are released (what it had
        computed stays cached, as on any release) and it produces no output. False if
        no such request is unfinished."""
        seq = self.scheduler.abort(request_id)
        self._forget(request_id)
        self._publish_events()
        return seq is not None

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block (`PrefixCache.reset`); False, with nothing changed,
        while any request holds blocks."""
        done = self.cache.reset()
        self._publish_events()
        return done

    def _run_transfers(self) -> None:
        if self.kv_tiers is not None:
            self.kv_tiers.run(self.cache.drain_transfers())

    def close(self) -> None:
        """Run the transfers still recorded, copy every cached block the disk tiers lack
        into them (`Tiers.persist`: the device's and the host tiers' blocks, whose KV is
        complete once no step runs), and close the files, so an engine started on them
        again serves whole chains at once."""
        if self.kv_tiers is not None:
            self._run_transfers()
            if self.kv_tiers.files and not self.has_unfinished():  # open (a second close persists nothing)
                self.kv_tiers.tiers.persist()
                self._run_transfers()
                self._publish_events()
            self.kv_tiers.close()

    def _publish_events(self) -> None:
        if self._event_sink is not None:
            events = self.cache.drain_events()
            if events:
                self._event_sink(events)

    # -- running ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward pass over the scheduled work; returns the requests it finished."""
        return list(self.run_step().finished)

    def run_step(self) -> StepOutput:
        """One forward pass over the scheduled work: what it sampled and finished. A
        request whose forward pass or sampling fails finishes alone with reason "error"
        (its `RequestOutput.error` says why); the rest of the batch goes on."""
        t0 = time.perf_counter()
        work = self.scheduler.schedule()
        if not work:
            if self.has_unfinished():
                # Cannot happen for a request add_request accepted (it fits the empty pool);
                # raising beats a generate() loop that never ends.
                raise RuntimeError(
                    f"no request could be scheduled: {len(self.scheduler.waiting)} waiting, "
                    f"{len(self.scheduler.running)} running, {self.cache.pool.num_free} free blocks"
                )
            return StepOutput((), ())
        # Lower tiers: blocks move (stores down, loads up) in the order the cache recorded,
        # before anything reads or overwrites them in this pass.
        self._run_transfers()
        # A partial-hit backend (Admission.copies) reuses the head of a cached block by
        # copying it into the request's own block; the copy must land before this pass.
        self.model.copy_blocks(self.scheduler.take_copies())
        pace_until = t0 + self._pace.chunks_s((w.start, w.num_tokens) for w in work) if self._pace else 0.0
        logits, prompt_logits, work, failed = self._forward(work)
        if self._pace is not None:
            self._sleep_until(pace_until)
        self.scheduler.computed(work)
        self._run_transfers()  # what the commits wrote through, copied down now that it is computed
        for w, (rows, row_logits) in zip(work, prompt_logits):
            self._add_prompt_logprobs(w, rows, row_logits)
        sampling = [w for w in work if w.samples]
        firsts = [w.seq for w in sampling if w.seq.num_prompt_logprobs is not None and not w.seq.output]
        sampled, finished, logprobs = self._sample(sampling, logits)
        self._steps += 1
        self._wall_s += time.perf_counter() - t0
        self._publish_events()
        prompt_logprobs = tuple((s.request_id, tuple(s.prompt_logprobs)) for s in firsts if s.output)
        return StepOutput(tuple(sampled), tuple(failed + finished), tuple(logprobs), prompt_logprobs)

    def _sleep_until(self, until: float) -> None:
        """Pace the step (`engine.pace`): its logits come out when the model says the
        step ends, so first tokens, commits and events are timed by it."""
        left = until - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self._paced_s += left
        else:
            self._overrun_steps += 1

    def _forward(
        self, work: list[Scheduled]
    ) -> tuple[torch.Tensor, list[tuple[range, torch.Tensor]], list[Scheduled], list[RequestOutput]]:
        """The logits of `work`'s sampling chunks, each chunk's prompt rows and their
        logits (`_prompt_rows`), the chunks that ran, and the requests that failed. A pass over
        the whole batch that raises is run again chunk by chunk (each rewrites the same KV
        at the same slots), and only a chunk that fails on its own fails its request; its
        KV is never committed, so never cached."""
        try:
            return (*self._forward_chunks(work), work, [])
        except Exception as err:  # noqa: BLE001 - one request's fault must not end the batch
            if len(work) == 1:
                return self._no_logits(), [], [], [self._fail(work[0].seq, err)]
            _log.warning("a forward pass over %d requests failed (%s); running them one by one", len(work), err)
        kept, rows, prompt_rows, failed = [], [], [], []
        for w in work:
            try:
                last, prompt = self._forward_chunks([w])
            except Exception as err:  # noqa: BLE001 - as above: this request alone
                failed.append(self._fail(w.seq, err))
            else:
                kept.append(w)
                rows.append(last)
                prompt_rows.extend(prompt)
        return (torch.cat(rows) if rows else self._no_logits()), prompt_rows, kept, failed

    def _forward_chunks(self, work: list[Scheduled]) -> tuple[torch.Tensor, list[tuple[range, torch.Tensor]]]:
        """The logits of the sampling chunks, and per chunk its prompt rows and theirs."""
        hybrid = isinstance(self.model, (HybridModel, Gemma3Model))  # a table per layout group
        wanted = [self._prompt_rows(w) for w in work]
        chunks = [
            SeqChunk(w.seq.tokens[w.start : w.start + w.num_tokens], w.start, self.scheduler.block_table(w.seq), w.samples,
                     self.scheduler.block_tables(w.seq) if hybrid else (), w.seq.request_id, w.fresh, rows)
            for w, rows in zip(work, wanted)
        ]  # fmt: skip
        logits = self.model.forward(self.model.plan(chunks))
        first = sum(w.samples for w in work)
        bounds = list(accumulate((len(r) for r in wanted), initial=first))
        return logits[:first], [(rows, logits[a:b]) for rows, a, b in zip(wanted, bounds, bounds[1:])]

    @staticmethod
    def _prompt_rows(w: Scheduled) -> range:
        """The rows of `w`'s chunk whose logits give prompt logprobs still missing: row j
        (position start + j) gives the logprob of prompt token start + j + 1."""
        seq = w.seq
        if seq.num_prompt_logprobs is None:
            return range(0)
        have = len(seq.prompt_logprobs)  # positions [0, have) are done (a recompute skips them)
        lo = max(w.start, have - 1)
        hi = min(w.start + w.num_tokens, len(seq.prompt) - 1)
        return range(lo - w.start, hi - w.start) if lo < hi else range(0)

    @staticmethod
    def _add_prompt_logprobs(w: Scheduled, rows: range, logits: torch.Tensor) -> None:
        """Append the prompt logprobs that `logits`, those of `w`'s prompt `rows`, give."""
        if not rows:
            return
        seq = w.seq
        first = w.start + rows.start + 1  # the prompt position the first row gives
        targets = seq.prompt[first : first + len(rows)]
        seq.prompt_logprobs.extend(token_logprobs(logits, range(len(rows)), targets, [seq.num_prompt_logprobs] * len(rows)))

    def _no_logits(self) -> torch.Tensor:
        return torch.empty((0, self.model.config.vocab_size))

    def _fail(self, seq: Seq, err: BaseException) -> RequestOutput:
        """Finish `seq` with reason "error": its blocks are released (what it committed
        before stays cached; this step's chunk was not committed)."""
        _log.warning("request %s failed: %s: %s", seq.request_id, type(err).__name__, err)
        self.scheduler.finish(seq, "error")
        self._forget(seq.request_id)
        seq.metrics.finish_s = time.perf_counter()
        output = self._output(seq)
        output.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        return output

    def _sample(
        self, work: list[Scheduled], logits: torch.Tensor
    ) -> tuple[list[tuple[str, int]], list[RequestOutput], list[tuple[str, TokenLogprobs]]]:
        """Draw each request's next token: the (request id, token) pairs drawn, the
        requests this finished (a row that cannot be sampled fails its request alone), and
        the drawn tokens' logprobs for the requests that asked."""
        seqs = [w.seq for w in work]
        params = [s.params for s in seqs]
        constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        if constrained:  # vLLM masks the logits by the grammar first: the raw logprobs see the mask
            logits = logits.clone()  # the model's are inference tensors
            for row in constrained:
                logits[row].masked_fill_(~seqs[row].grammar.allowed(), float("-inf"))  # type: ignore[union-attr]
        # The logits processors shape what is drawn (min_tokens: no stop token yet); the
        # logprobs a request returns are the raw ones (vLLM's).
        banned = [s.stop_token_ids if len(s.output) < s.min_tokens else () for s in seqs]
        drawn_from = processed_logits(logits, params, [s.prompt for s in seqs], [s.output for s in seqs], banned,
                                      [s.bad_words for s in seqs])
        tokens = sample(drawn_from, params, [s.generator for s in seqs])
        asked = [i for i, (s, t) in enumerate(zip(seqs, tokens)) if s.num_logprobs is not None and isinstance(t, int)]
        computed = token_logprobs(logits, asked, [tokens[i] for i in asked], [seqs[i].num_logprobs for i in asked],
                                  [seqs[i].logprob_token_ids for i in asked])  # fmt: skip
        row_logprobs = dict(zip(asked, computed))
        logprobs = [(seqs[i].request_id, lp) for i, lp in row_logprobs.items()]
        now = time.perf_counter()
        sampled, done = [], []
        max_position = self.model.config.max_position
        for row, (seq, tok) in enumerate(zip(seqs, tokens)):
            if seq.grammar is not None:
                if not isinstance(tok, SamplingError) and not seq.grammar.accept(tok):
                    tok = SamplingError(f"the grammar refused token {tok}: {seq.grammar.error}")
                elif isinstance(tok, SamplingError) and seq.grammar.error:  # it says why nothing could be drawn
                    tok = SamplingError(f"the grammar allows no token: {seq.grammar.error}")
            if isinstance(tok, SamplingError):
                done.append(self._fail(seq, tok))
                continue
            if seq.metrics.first_token_s is None:
                seq.metrics.first_token_s = now
                if seq.keep_first_logits:
                    seq.first_logits = logits[row].clone()
            seq.decoding = True
            if row in row_logprobs:
                seq.logprobs.append(row_logprobs[row])
            seq.output.append(tok)
            seq.tokens.append(tok)
            seq.metrics.output_tokens += 1
            self._output_tokens += 1
            sampled.append((seq.request_id, tok))
            reason = None
            if tok in seq.stop_token_ids:
                reason = "stop"
            elif (seq.stop_strings is not None
                  and seq.stop_strings.add(tok, check=len(seq.output) > seq.min_tokens) is not None):
                reason = "stop"  # before the length limit, as vLLM's output processor overrides it
            elif len(seq.output) >= seq.max_tokens or len(seq.tokens) >= max_position:
                reason = "length"
            elif (seq.repetition is not None and len(seq.output) >= seq.min_tokens
                  and ends_in_repetition(seq.output, seq.repetition)):
                reason = "repetition"  # after the length limit and before nothing else, as vLLM's check_stop
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._forget(seq.request_id)
                seq.metrics.finish_s = now
                done.append(self._output(seq))
        return sampled, done, logprobs

    def _forget(self, request_id: str) -> None:
        """A request left: a recurrent model drops its running state."""
        if isinstance(self.model, (HybridModel, Gemma3Model)):
            self.model.forget(request_id)

    def _output(self, seq: Seq) -> RequestOutput:
        stopped = seq.stop_strings.stop if seq.stop_strings is not None else None
        if stopped is not None:
            text = seq.stop_strings.text  # type: ignore[union-attr]
        else:
            text = self.tokenizer.decode(seq.output[:-1] if seq.finish_reason == "stop" else seq.output,
                                         skip_special_tokens=seq.skip_special_tokens)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt),
            token_ids=list(seq.output),
            text=text,
            finish_reason=seq.finish_reason or "",
            metrics=seq.metrics,
            first_logits=seq.first_logits,
            stop_str=stopped,
            logprobs=list(seq.logprobs) if seq.num_logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.num_prompt_logprobs is not None else None,
        )

    def generate(
        self,
        requests: Iterable[GenerationRequest | str | Sequence[int]],
        *,
        arrival_offsets_s: Sequence[float] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run the requests until all finish; outputs in input order. `on_output` is
        called with each as it finishes (what a caller keeps if it is interrupted).

        `arrival_offsets_s`: per request, when it arrives, in SECONDS after this call
        (finite, >= 0, any order). A request is added at the first step boundary at or
        after its arrival, and an idle engine sleeps until the next one, so a request
        arriving after an earlier one's prefill hits the prefix that prefill committed
        (the way requests reach a server). Its TTFT counts from its arrival time, queueing
        included; the offset replaces the request's own `arrival_s`. None: every request
        arrives now (those admitted in the same step as the first request with a prefix
        all miss it: it is cached when that step commits it)."""
        reqs = [r if isinstance(r, GenerationRequest) else GenerationRequest(prompt=r) for r in requests]
        ids: list[str | None]
        pending: list[tuple[float, int]] = []  # (arrival time, index), by arrival
        if arrival_offsets_s is None:
            ids = [self.add_request(r) for r in reqs]
        else:
            offsets = [float(x) for x in arrival_offsets_s]
            if len(offsets) != len(reqs):
                raise ValueError(f"arrival_offsets_s: {len(offsets)} offsets for {len(reqs)} requests")
            for i, x in enumerate(offsets):
                if not (math.isfinite(x) and x >= 0):
                    raise ValueError(f"arrival_offsets_s[{i}]: must be a finite number of SECONDS >= 0, got {x!r}")
            start = time.perf_counter()
            pending = sorted((start + x, i) for i, x in enumerate(offsets))
            ids = [None] * len(reqs)
        by_id: dict[str, RequestOutput] = {}
        k = 0
        while k < len(pending) or self.has_unfinished():
            now = time.perf_counter()
            while k < len(pending) and pending[k][0] <= now:
                at, i = pending[k]
                ids[i] = self.add_request(replace(reqs[i], arrival_s=at))
                k += 1
            if self.has_unfinished():
                for out in self.step():
                    by_id[out.request_id] = out
                    if on_output is not None:
                        on_output(out)
            elif k < len(pending):
                time.sleep(max(0.0, pending[k][0] - time.perf_counter()))
        return [by_id[i] for i in ids if i is not None]

    # -- measurements -------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Start counting RunStats afresh (the cache's own counters are not reset)."""
        self._requests = self._prompt_tokens = self._output_tokens = self._steps = self._overrun_steps = 0
        self._wall_s = self._paced_s = 0.0
        self._base = (
            self.scheduler.prefill_tokens_computed,
            self.scheduler.prefill_tokens_saved,
            self.scheduler.num_preemptions,
            self.scheduler.cache_s,
            self.scheduler.num_prefix_waits,
        )

    def stats(self) -> RunStats:
        """Totals since construction or `reset_stats` (wall time = time inside `step`)."""
        s = self.scheduler
        computed, saved, preemptions, cache_s, waits = self._base
        return RunStats(
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            prefill_tokens_computed=s.prefill_tokens_computed - computed,
            prefill_tokens_saved=s.prefill_tokens_saved - saved,
            output_tokens=self._output_tokens,
            steps=self._steps,
            preemptions=s.num_preemptions - preemptions,
            wall_s=self._wall_s,
            cache_s=s.cache_s - cache_s,
            cache=self.cache.stats(),
            paced_s=self._paced_s,
            overrun_steps=self._overrun_steps,
            prefix_waits=s.num_prefix_waits - waits,
        )

    def check_invariants(self) -> None:
        """The cache's and the scheduler's invariants (tests call this)."""
        self.scheduler.check_invariants()
