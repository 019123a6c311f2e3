"""What `prefixcache bench` sends, and when: a workload as timed `BenchRequest`s.

Owns turning a workload into the requests of one run:

- a Mooncake trace (`--trace`): one request per record, at its timestamp (relative to
  the first, times `--time-scale`), its prompt expanded from its block ids as
  `prefixcache.workloads` does (equal ids, equal tokens), asking for `output_length`
  tokens (at least 1);
- a generator (`--workload`, `--workload-arg`): its requests in order, at Poisson
  arrivals of `--request-rate` requests/s drawn from `random.Random(seed)` (all at time 0
  for `inf`), asking for as many tokens as the generator's outputs hold (at least 1).

Token ids are mapped into the server's vocabulary (`--vocab-size`) by a fixed
pseudo-random function of (id, seed): equal ids stay equal, so every prefix a workload
shares is shared on the server, while distinct token runs stay distinct (a plain
`id % V` would make, e.g., Mooncake blocks 0 and 5 identical at V = 320). Prompts cut
by `--max-input-tokens` keep their heads, so their sharing too.

Must never: send anything or sleep.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.config import ConfigError
from prefixcache.loadgen.options import FALLBACK_VOCAB_SIZE, BenchOptions
from prefixcache.workloads import Workload, generate
from prefixcache.workloads.mooncake import read_records, records_to_workload

__all__ = ["BenchRequest", "build_schedule", "map_tokens"]

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class BenchRequest:
    """Send `prompt` (token ids) at `arrival_s` SECONDS after the start, for `max_tokens`."""

    index: int
    arrival_s: float
    prompt: tuple[int, ...]
    max_tokens: int
    namespace: str | None = None


def _mix(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit ints that scatters neighbours."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def map_tokens(ids: Sequence[int], vocab_size: int, seed: int = 0) -> tuple[int, ...]:
    """Workload token ids -> ids in [0, vocab_size), the same id always to the same id."""
    salt = _mix(seed)
    return tuple(_mix(t ^ salt) % vocab_size for t in ids)


def _trace(options: BenchOptions) -> tuple[Workload, list[int]]:
    try:
        records = read_records(options.trace, limit=options.num_requests)
    except (OSError, ValueError) as err:
        raise ConfigError("--trace", str(err)) from None
    if not records:
        raise ConfigError("--trace", f"{options.trace} holds no requests")
    workload = records_to_workload(records, name=str(options.trace), outputs=False)
    return workload, [r.output_length for r in records]


def _generated(options: BenchOptions) -> tuple[Workload, list[int]]:
    try:
        workload = generate(options.workload, **{"seed": options.seed, **options.workload_args})
    except (TypeError, ValueError) as err:
        raise ConfigError("--workload", str(err)) from None
    requests = workload.requests[: options.num_requests]
    return workload, [len(r.output) for r in requests]


def build_schedule(options: BenchOptions) -> tuple[list[BenchRequest], Workload]:
    """The run's requests in arrival order, and the workload they come from."""
    workload, outputs = _trace(options) if options.trace is not None else _generated(options)
    requests = workload.requests[: len(outputs)]
    if options.trace is not None:
        t0 = requests[0].arrival_s
        arrivals = [(r.arrival_s - t0) * options.time_scale for r in requests]
    else:
        rng = random.Random(options.seed)
        t, arrivals = 0.0, []
        for _ in requests:
            arrivals.append(t)
            if not math.isinf(options.request_rate):
                t += rng.expovariate(options.request_rate)
    vocab = options.vocab_size if options.vocab_size is not None else FALLBACK_VOCAB_SIZE
    out = []
    for i, (r, arrival, n_out) in enumerate(zip(requests, arrivals, outputs)):
        prompt = r.prompt.tolist()[: options.max_input_tokens]
        n_out = max(1, n_out)
        if options.max_output_tokens is not None:
            n_out = min(n_out, options.max_output_tokens)
        out.append(BenchRequest(i, arrival, map_tokens(prompt, vocab, options.seed), n_out, r.namespace))
    return out, workload
