"""Cached against uncached on the tiny hybrid model: one randomized trace, compared exactly.

Owns `random_trace` (requests that share prefixes of random lengths, in waves, so hits
land on whole, partial and window-sized prefixes and the small pool evicts) and
`compare_trace`, which runs one trace through two engines over the same weights, one
with the configured prefix cache and one without (`engine.prefix_caching: false`), and
returns what differs: a request's greedy tokens, its first-token logits beyond the
tolerance, or its recurrent state at the end (bit for bit). tests/test_hybrid_engine.py
runs a few traces; benchmarks/hybrid_soak.py runs 1,000.

Must never: hide a difference (the first one is returned, naming the request and what),
or compare anything the two runs are not meant to agree on (timing, hit counts).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from prefixcache.config import CacheConfig
from prefixcache.engine.config import EngineConfig, ServingConfig
from prefixcache.engine.engine import Engine, GenerationRequest
from prefixcache.engine.loader import LoadedModel, load_model

__all__ = ["TraceResult", "random_trace", "compare_trace", "engines_for"]


@dataclass(frozen=True)
class TraceResult:
    """One trace's comparison: `difference` is None when the runs agree; `hit_tokens`
    and `evictions` say how much of the trace the cache served and what it dropped."""

    requests: int
    hit_tokens: int
    evictions: int
    max_logit_error: float
    difference: str | None


def random_trace(rng: random.Random, vocab: int, *, max_prompt: int = 160) -> list[list[GenerationRequest]]:
    """Waves of requests; a request continues an earlier prompt (a branch of a random
    length, or the whole of it plus more: a multi-turn) or starts afresh."""
    waves: list[list[GenerationRequest]] = []
    prompts: list[list[int]] = []
    n = 0
    for _ in range(rng.randint(2, 4)):
        wave = []
        for _ in range(rng.randint(1, 3)):
            if prompts and rng.random() < 0.75:
                base = rng.choice(prompts)
                cut = rng.randint(1, len(base)) if rng.random() < 0.7 else len(base)
                prompt = base[:cut] + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            else:
                prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, max_prompt))]
            prompt = prompt[:max_prompt]
            prompts.append(prompt)
            wave.append(GenerationRequest(prompt=prompt, max_tokens=rng.randint(1, 6), keep_first_logits=True,
                                          request_id=f"r{n}", ignore_eos=True))  # fmt: skip
            n += 1
        waves.append(wave)
    return waves


def engines_for(
    loaded: LoadedModel, cache: CacheConfig, *, max_num_batched_tokens: int = 64
) -> tuple[Engine, Engine]:
    """(cached, uncached) engines on the same weights and pool geometry. torch runs on
    one thread (`engine.num_threads: 1`, process-wide): a model this small spends more
    waiting on a second thread than computing, on a busy machine many times more."""
    engine = EngineConfig(model=loaded.name, max_num_batched_tokens=max_num_batched_tokens, max_tokens=6, num_threads=1)
    cached = Engine(ServingConfig(cache, engine), model=loaded)
    # The uncached engine takes no strategy options (a cache's options are its backend's).
    plain = replace(cache, options={})
    uncached = Engine(ServingConfig(plain, engine.replace(prefix_caching=False)), model=loaded)
    for e in (cached, uncached):
        e.model.keep_final_states = True
    return cached, uncached


def compare_trace(
    cached: Engine, uncached: Engine, waves: list[list[GenerationRequest]], *, logits_atol: float = 1e-4
) -> TraceResult:
    """Run `waves` (one `generate` call each) through both engines and compare."""
    before = cached.cache.stats()
    outs = {}
    for engine in (cached, uncached):
        got = {}
        for wave in waves:
            for out in engine.generate(wave):
                got[out.request_id] = out
        outs[engine] = got
    stats = cached.cache.stats()
    worst = 0.0
    for rid, want in outs[uncached].items():
        have = outs[cached][rid]
        if have.token_ids != want.token_ids:
            return _result(outs, stats, before, worst, f"{rid}: tokens {have.token_ids} cached vs {want.token_ids} uncached")
        err = float((have.first_logits - want.first_logits).abs().max())
        worst = max(worst, err)
        if err > logits_atol:
            return _result(outs, stats, before, worst, f"{rid}: first logits differ by {err:.3g} > {logits_atol}")
        for i, (a, b) in enumerate(zip(cached.model.final_states.pop(rid), uncached.model.final_states.pop(rid))):
            if not torch.equal(a, b):
                return _result(outs, stats, before, worst, f"{rid}: recurrent state {i} differs (max {float((a - b).abs().max()):.3g})")
    cached.check_invariants()
    if cached.cache.pool.num_pinned:
        # A tree that holds what it caches (radix) lets go of it when it evicts everything.
        cached.cache.evict(cached.cache.pool.num_blocks)
    if cached.cache.pool.num_pinned:
        return _result(outs, stats, before, worst, f"{cached.cache.pool.num_pinned} blocks pinned after the trace")
    return _result(outs, stats, before, worst, None)


def _result(outs, stats, before, worst: float, difference: str | None) -> TraceResult:
    requests = len(next(iter(outs.values())))
    return TraceResult(requests, stats.hits - before.hits, stats.evictions - before.evictions, worst, difference)


def tiny_hybrid(seed: int = 0) -> LoadedModel:
    """The tiny hybrid model (`engine.model: tiny-hybrid`)."""
    return load_model("tiny-hybrid", seed=seed)


__all__ += ["tiny_hybrid"]
