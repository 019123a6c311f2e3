"""The command line of `prefixcache bench`, validated once into `BenchOptions`.

Owns the argparse arguments (`add_bench_arguments`, used by `prefixcache.cli`) and
`BenchOptions`, the frozen, checked form every other loadgen module reads. A mistake is
a `ConfigError` naming the flag and what is allowed.

Must never: open a connection or read a file (schedule does), or import httpx.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from prefixcache.config import ConfigError

__all__ = ["BenchOptions", "add_bench_arguments", "options_from_args", "parse_workload_args",
           "DEFAULT_WORKLOAD_ARGS", "FALLBACK_VOCAB_SIZE"]

DEFAULT_WORKLOAD_ARGS = {"num_groups": 4, "prompts_per_group": 16, "system_prompt_len": 1024, "question_len": 64,
                         "output_len": 16}
"""`shared_prefix`'s parameters when `--workload` is left at its default: four groups of
16 prompts sharing a 1,024-token system prompt (64 requests, 69,632 prompt tokens) whose
prefixes (4,096 tokens) fit any pool worth serving from (the shipped serve.yaml holds
16,384), so the first run against a default server shows the cache at work. Each
`--workload-arg` overrides one. (The generator's own defaults, 64 groups of 2,048 tokens,
are sized for pools of 100k+ tokens and thrash a small one.)"""

FALLBACK_VOCAB_SIZE = 32_000
"""The vocabulary assumed of a server that reports none (vLLM and SGLang do not serve
it over HTTP) when `--vocab-size` is not given: Llama-2's, within every current model's."""


@dataclass(frozen=True)
class BenchOptions:
    """What one `prefixcache bench` run does (see `add_bench_arguments` for each field)."""

    base_url: str
    model: str | None = None
    trace: str | None = None
    time_scale: float = 1.0
    workload: str = "shared_prefix"
    workload_args: Mapping[str, Any] = field(default_factory=dict)
    request_rate: float = math.inf
    max_concurrency: int | None = None
    num_requests: int | None = None
    duration_s: float = 600.0
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    vocab_size: int | None = None  # None: the server's (`runner.probe_server`)
    seed: int = 0
    timeout_s: float = 300.0
    out: str | None = None
    progress_every: int = 25
    command: tuple[str, ...] = ()  # the command line, for the metadata

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError("--base-url", f"must start with http:// or https://, got {self.base_url!r}")
        object.__setattr__(self, "base_url", self.base_url.rstrip("/").removesuffix("/v1"))
        positive = {"--time-scale": self.time_scale, "--request-rate": self.request_rate,
                    "--duration": self.duration_s, "--timeout": self.timeout_s}
        for flag, value in positive.items():
            if not (value > 0) or (math.isinf(value) and flag != "--request-rate"):
                raise ConfigError(flag, f"must be a number > 0{' (inf allowed)' if flag == '--request-rate' else ''}, "
                                  f"got {value!r}")
        if self.out is not None and Path(self.out).is_dir():
            raise ConfigError("--out", f"{self.out!r} is a folder; --out names the JSON file to write "
                              f"(e.g. {str(Path(self.out) / 'bench.json')!r})")
        ints = {"--max-concurrency": self.max_concurrency, "--num-requests": self.num_requests,
                "--max-input-tokens": self.max_input_tokens, "--max-output-tokens": self.max_output_tokens,
                "--vocab-size": self.vocab_size, "--progress-every": self.progress_every}
        for flag, value in ints.items():
            if value is not None and value < 1:
                raise ConfigError(flag, f"must be an integer >= 1, got {value!r}")
        if self.seed < 0:
            raise ConfigError("--seed", f"must be an integer >= 0, got {self.seed!r}")
        object.__setattr__(self, "workload_args", MappingProxyType(dict(self.workload_args)))

    @property
    def source(self) -> str:
        """What is replayed, in words."""
        if self.trace is not None:
            return f"Mooncake trace {self.trace} (timestamps x {self.time_scale})"
        rate = "all at once" if math.isinf(self.request_rate) else f"Poisson {self.request_rate} req/s"
        return f"workload {self.workload} ({rate})"


def _value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_workload_args(items: list[str] | None) -> dict[str, Any]:
    """`["num_groups=4", "question_len=64"]` -> {"num_groups": 4, "question_len": 64}."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("--workload-arg", f"must be KEY=VALUE, got {item!r}")
        out[key] = _value(value)
    return out


def workload_args(workload: str, items: list[str] | None) -> dict[str, Any]:
    """The generator's parameters: `DEFAULT_WORKLOAD_ARGS` under `items` for the default
    `shared_prefix`, else `items` alone."""
    given = parse_workload_args(items)
    return {**DEFAULT_WORKLOAD_ARGS, **given} if workload == "shared_prefix" else given


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `prefixcache bench`."""
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)")
    parser.add_argument("--model", help="the `model` to send (default: the first one the server's /v1/models lists)")
    src = parser.add_argument_group("what is sent")
    src.add_argument("--trace", help="a Mooncake JSONL trace, replayed by its timestamps")
    src.add_argument("--time-scale", type=float, default=1.0,
                     help="trace: multiply the gaps between timestamps by this (0.5 = twice as fast)")
    src.add_argument("--workload", default="shared_prefix",
                     help="without --trace: a generator (shared_prefix, few_shot, multi_turn, rag, ...)")
    src.add_argument("--workload-arg", action="append", metavar="KEY=VALUE",
                     help="a generator parameter, e.g. num_groups=8 (repeatable); the default shared_prefix runs "
                          + " ".join(f"{k}={v}" for k, v in DEFAULT_WORKLOAD_ARGS.items()))
    src.add_argument("--request-rate", type=float, default=math.inf,
                     help="without --trace: Poisson arrivals at this many requests/s (default inf: all at once)")
    src.add_argument("--max-input-tokens", type=int, help="cut prompts to this many TOKENS (keeps their shared heads)")
    src.add_argument("--max-output-tokens", type=int, help="cap each request's output TOKENS")
    src.add_argument("--vocab-size", type=int,
                     help="map token ids into [0, V) (default: the vocab_size the server's /model_info reports, "
                          f"as prefixcache serve does; else {FALLBACK_VOCAB_SIZE:,})")
    src.add_argument("--seed", type=int, default=0, help="seed of the generator, the arrivals and the id mapping")
    lim = parser.add_argument_group("limits")
    lim.add_argument("--max-concurrency", type=int, help="requests in flight at most (default: no limit)")
    lim.add_argument("--num-requests", type=int, help="send at most this many (default: the whole workload)")
    lim.add_argument("--duration", type=float, default=600.0, dest="duration_s",
                     help="stop after this many SECONDS; what finished is reported (default 600)")
    lim.add_argument("--timeout", type=float, default=300.0, dest="timeout_s", help="per-request timeout, SECONDS")
    out = parser.add_argument_group("output")
    out.add_argument("--out", help="write the results as JSON here (with metadata and every request)")
    out.add_argument("--progress-every", type=int, default=25,
                     help="when stdout is not a terminal, print a line per this many finished requests")


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    return BenchOptions(
        base_url=args.base_url, model=args.model, trace=args.trace, time_scale=args.time_scale,
        workload=args.workload, workload_args=workload_args(args.workload, args.workload_arg),
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, num_requests=args.num_requests,
        duration_s=args.duration_s, max_input_tokens=args.max_input_tokens,
        max_output_tokens=args.max_output_tokens, vocab_size=args.vocab_size, seed=args.seed,
        timeout_s=args.timeout_s, out=args.out, progress_every=args.progress_every,
        command=tuple(getattr(args, "argv", ())),
    )
