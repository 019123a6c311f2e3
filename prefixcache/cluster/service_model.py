"""How long a simulated replica takes to serve a request.

Owns `ServiceModel`. A replica runs up to `max_concurrent` requests at once (its
continuous batch); later ones queue in arrival order for a slot. A running request is
prefilled, then decoded:

- prefill is compute-bound: the replica prefills ONE request at a time, in the order
  they got their slots, in `fixed_s + prefill_token_s x` the prompt tokens its cache did
  not hold;
- decode is memory-bound and overlaps everything else: `output_token_s` per output
  token, in the request's slot, however many others run.

So for a request that gets a slot at time s, on a replica whose prefill is busy until b,

    first token = max(s, b) + fixed_s + prefill_token_s * uncached prompt tokens
    ttft        = first token - arrival
    done        = first token + output_token_s * output tokens

It is the simplest model in which a cache hit shortens the prefill queue for everyone
behind it and a busy replica makes a request wait twice (for a slot, for the prefill),
so a router trades hits against queueing, as on a real engine. Must never: touch a
cache or decide a hit.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.config import ConfigError

__all__ = ["ServiceModel"]


@dataclass(frozen=True)
class ServiceModel:
    """fixed_s:         SECONDS of prefill per request, whatever its size
    prefill_token_s: SECONDS of prefill per uncached prompt token (1 / prefill throughput)
    output_token_s:  SECONDS per output token of one request (its time per output token)
    max_concurrent:  requests a replica runs at once; later ones queue"""

    fixed_s: float = 0.01
    prefill_token_s: float = 5e-5
    output_token_s: float = 0.02
    max_concurrent: int = 8

    def __post_init__(self) -> None:
        for name in ("fixed_s", "prefill_token_s", "output_token_s"):
            value = getattr(self, name)
            if not value >= 0 or value == float("inf"):
                raise ConfigError(name, f"must be a finite number of SECONDS >= 0, got {value!r}")
        if self.max_concurrent < 1:
            raise ConfigError("max_concurrent", f"must be an integer >= 1, got {self.max_concurrent!r}")

    def prefill_s(self, uncached_tokens: int) -> float:
        """SECONDS the replica's prefill is busy with one request."""
        return self.fixed_s + self.prefill_token_s * uncached_tokens

    def decode_s(self, output_tokens: int) -> float:
        """SECONDS a request decodes after its first token."""
        return self.output_token_s * output_tokens
