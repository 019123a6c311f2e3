"""How long a step takes: a roofline over one model on one device.

Owns `ServiceModel` (the `service:` section of a cluster file, and an engine's
`engine.pace`), its parts `ModelSpec` and `DeviceSpec` with their named presets (`MODELS`,
`DEVICES`), the cost of one scheduler step (`step_s`, and `chunks_s` over a step's
chunks), the KV capacity a device leaves for the cache (`capacity_tokens`), and the
closed-form estimates a router may read (`prefill_s`, `decode_step_s`). Must never:
touch a cache, decide a hit or schedule a request (the simulated replica does,
`prefixcache.cluster.replica`; a paced engine, `prefixcache.engine`).

A replica runs vLLM V1's continuous batching with chunked prefill: every step processes
up to `max_num_batched_tokens` tokens of at most `max_num_seqs` requests, one token for
each decoding request and chunks of the prompts still being prefilled. One step costs

    step_s = step_overhead_s + max(FLOPs / (peak FLOP/s x mfu), bytes / (HBM bandwidth x mbu))
             + load_s(tokens read from lower tiers)
    FLOPs  = 2 x params x tokens + 4 x layers x attention_dim x query-key pairs
    bytes  = params x dtype_bytes (the weights, read once a step)
             + kv_bytes_per_token x KV tokens read (every decoding request's context,
               every chunk's prefix and itself)

so decode is memory-bound and slows as the batch's contexts grow (a roofline over weights
plus KV read), prefill is compute-bound with a term linear in its tokens and one linear
in its context (a chunk of c tokens from position p has c x p + c(c + 1)/2 query-key
pairs: attention adds about 140% to the linear work of an 85k-token prompt for an
8B-class model), and a step that carries a prefill chunk is a long step for every request
decoding in it. A cache hit skips its tokens' FLOPs and lets a prompt start at a later
position, so hits raise throughput, not only latency.

Capacity. A device of `memory_gib` with vLLM's `gpu_memory_utilization` keeps, after the
weights and `reserved_gib` (activations, CUDA graphs, the allocator), this many TOKENS of
KV: (memory x utilization - weights - reserved) / kv_bytes_per_token; kv_bytes_per_token
= 2 (K and V) x layers x kv_dim x dtype_bytes. Llama-3.1-8B in bf16: 128 KiB a token, so
one H100 holds 440k tokens and one H200 888k: an 8B model's KV in one GPU's
memory, where caches churn.

Lower tiers enter as `load_s`: KV loaded from a lower tier crosses the host link, so it
costs its bytes over `host_link_gb_s`, or over the tier's own bandwidth where that is
slower (a disk), plus the tier's latency once; the cluster simulation adds it to the step
that loads a request's hit (`prefixcache.cluster.replica`). A paced engine's loads are
real copies that take their own time.

Speed. `speedup_ratio` divides every time (Dynamo's mocker engine calls its knob the
same): 1 is the modelled hardware, 0.1 ten times slower. Routing does not change with it
(a router's estimates all scale alike); it is there so that a small host can run paced
engines (`engine.pace`) at their knee, where the real forward pass of a tiny model stays
well inside each modelled step.

Defaults (`ServiceModel()`): Llama-3.1-8B on one H100 SXM with vLLM's defaults there.
Sources: the model's config.json (hidden 4,096 = 32 heads x 128, 8 KV heads, 32 layers,
8.03B parameters); NVIDIA's H100 SXM and H200 SXM datasheets (989 dense BF16 TFLOP/s
both; 3.35 and 4.8 TB/s; 80 and 141 GB, nvidia-smi's 81,559 and 143,771 MiB); vLLM's
`EngineArgs.get_batch_defaults` (a >= 70 GiB GPU that is not an A100, OpenAI server:
max_num_batched_tokens 8,192, max_num_seqs 1,024) and `gpu_memory_utilization` 0.9.
Assumed, not measured here: mfu 0.5 and mbu 0.8 (so one request decodes a step in about
6.5 ms, ~150 tokens/s, and a 12k-token prompt prefills in about 0.47 s, ~26k tokens/s:
the range vLLM is reported to reach with this model on this GPU), 0.5 ms of step
overhead and 3 GiB reserved. Every number is a YAML key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prefixcache.config import ConfigError

__all__ = ["ModelSpec", "DeviceSpec", "ServiceModel", "MODELS", "DEVICES", "GIB"]

GIB = 1 << 30


def _positive(owner: object, *names: str) -> None:
    for name in names:
        value = getattr(owner, name)
        if not value > 0 or value == math.inf:
            raise ConfigError(name, f"must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer.

    params:        parameters (2 FLOPs each per token; their bytes read once a step)
    layers:        transformer layers
    attention_dim: query heads x head dim (the width attention FLOPs scale with)
    kv_dim:        KV heads x head dim (the width of K and of V per layer)
    dtype_bytes:   bytes per weight and per KV element (2: bf16)"""

    params: float = 8.03e9
    layers: int = 32
    attention_dim: int = 4096
    kv_dim: int = 1024
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        _positive(self, "params", "layers", "attention_dim", "kv_dim", "dtype_bytes")

    @property
    def kv_bytes_per_token(self) -> int:
        """BYTES of KV one token takes: K and V, every layer."""
        return 2 * self.layers * self.kv_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    memory_gib:     device memory, GiB
    tflops:         peak dense TFLOP/s at the model's dtype
    bandwidth_tb_s: peak memory bandwidth, TB/s (10**12 bytes/s)
    host_link_gb_s: host <-> device bandwidth, GB/s (a lower tier's loads cross it)"""

    memory_gib: float = 81_559 / 1024
    tflops: float = 989.0
    bandwidth_tb_s: float = 3.35
    host_link_gb_s: float = 64.0

    def __post_init__(self) -> None:
        _positive(self, "memory_gib", "tflops", "bandwidth_tb_s", "host_link_gb_s")


MODELS: Mapping[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec(),
}
"""Named models a `service.model:` may give instead of a mapping."""

DEVICES: Mapping[str, DeviceSpec] = {
    "h100": DeviceSpec(),  # H100 SXM 80 GB, HBM3; PCIe Gen5 x16 to the host
    "h200": DeviceSpec(memory_gib=143_771 / 1024, bandwidth_tb_s=4.8),  # H200 SXM 141 GB, HBM3e
}
"""Named devices a `service.device:` may give instead of a mapping."""


def _preset(value: object, table: Mapping[str, object], key: str) -> object:
    if isinstance(value, str):
        try:
            return table[value]
        except KeyError:
            raise ConfigError(key, f"unknown {key} {value!r}; known: {', '.join(table)}, or a mapping") from None
    return value


@dataclass(frozen=True)
class ServiceModel:
    """A replica's service model (module docstring). SECONDS, TOKENS and GiB unless named.

    model, device:          a `ModelSpec` / `DeviceSpec`, or a preset's name
    max_num_seqs:           requests a replica runs at once (vLLM's; its "slots")
    max_num_batched_tokens: tokens a step processes at most (vLLM's token budget)
    gpu_memory_utilization: share of device memory the engine may use (vLLM's)
    reserved_gib:           of it, what neither weights nor KV take
    mfu, mbu:               achieved shares of peak FLOP/s and of peak bandwidth
    step_overhead_s:        SECONDS a step costs besides its roofline (scheduling, sampling)
    speedup_ratio:          the modelled hardware's speed multiple: every time is divided by it"""

    model: ModelSpec | str = "llama-3.1-8b"
    device: DeviceSpec | str = "h100"
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    reserved_gib: float = 3.0
    mfu: float = 0.5
    mbu: float = 0.8
    step_overhead_s: float = 5e-4
    speedup_ratio: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _preset(self.model, MODELS, "model"))
        object.__setattr__(self, "device", _preset(self.device, DEVICES, "device"))
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("gpu_memory_utilization", "mfu", "mbu"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ConfigError(name, f"must be in (0, 1], got {value!r}")
        _positive(self, "speedup_ratio")
        for name in ("reserved_gib", "step_overhead_s"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ConfigError(name, f"must be a finite number >= 0, got {value!r}")

    # -- the parts, resolved ----------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        assert isinstance(self.model, ModelSpec)
        return self.model

    @property
    def hardware(self) -> DeviceSpec:
        assert isinstance(self.device, DeviceSpec)
        return self.device

    # -- rates ------------------------------------------------------------------------
    @property
    def token_s(self) -> float:
        """SECONDS of compute per token processed (the linear term: 2 x params FLOPs)."""
        return 2.0 * self.spec.params / (self.hardware.tflops * 1e12 * self.mfu * self.speedup_ratio)

    @property
    def pair_s(self) -> float:
        """SECONDS of compute per query-key pair (attention: 4 x layers x attention_dim FLOPs)."""
        return 4.0 * self.spec.layers * self.spec.attention_dim / (self.hardware.tflops * 1e12 * self.mfu
                                                                   * self.speedup_ratio)

    @property
    def weights_s(self) -> float:
        """SECONDS to read the weights once (a step's memory floor)."""
        return self.spec.weight_bytes / (self.hardware.bandwidth_tb_s * 1e12 * self.mbu * self.speedup_ratio)

    @property
    def kv_token_s(self) -> float:
        """SECONDS to read one token's KV."""
        return self.spec.kv_bytes_per_token / (self.hardware.bandwidth_tb_s * 1e12 * self.mbu * self.speedup_ratio)

    # -- one step -----------------------------------------------------------------------
    def step_s(self, tokens: float, pairs: float, kv_tokens: float, loaded_tokens: float = 0.0) -> float:
        """SECONDS one scheduler step takes: `tokens` processed, `pairs` query-key pairs
        attended, `kv_tokens` of KV read, `loaded_tokens` of KV loaded from a lower tier."""
        compute = self.token_s * tokens + self.pair_s * pairs
        memory = self.weights_s + self.kv_token_s * kv_tokens
        return self.overhead_s + max(compute, memory) + self.load_s(loaded_tokens)

    @property
    def overhead_s(self) -> float:
        """SECONDS a step costs besides its roofline, at this speed."""
        return self.step_overhead_s / self.speedup_ratio

    def chunks_s(self, chunks: Iterable[tuple[int, int]]) -> float:
        """SECONDS one step takes over `chunks`, (start, tokens) pairs: each computes
        `tokens` TOKENS of a sequence from position `start` (a decode is one token at its
        context length), attending to its prefix and itself."""
        tokens = pairs = kv = 0
        for start, n in chunks:
            tokens += n
            pairs += n * start + n * (n + 1) // 2
            kv += start + n
        return self.step_s(tokens, pairs, kv)

    def load_s(self, tokens: float, tier_gb_s: float = math.inf, latency_s: float = 0.0) -> float:
        """SECONDS to bring `tokens` of KV from a lower tier: over the host link, or the
        tier's `tier_gb_s` (GB/s) where it is slower, after its `latency_s`."""
        gb_s = min(self.hardware.host_link_gb_s, tier_gb_s)
        return (tokens * self.spec.kv_bytes_per_token / (gb_s * 1e9) + latency_s) / self.speedup_ratio

    # -- capacity -------------------------------------------------------------------------
    def capacity_tokens(self) -> int:
        """TOKENS of KV one replica's device keeps after the weights and the reserve;
        ConfigError if the model does not fit."""
        free = self.hardware.memory_gib * GIB * self.gpu_memory_utilization - self.spec.weight_bytes \
            - self.reserved_gib * GIB
        tokens = int(free // self.spec.kv_bytes_per_token)
        if tokens < 1:
            raise ConfigError(
                "device.memory_gib",
                f"{self.hardware.memory_gib:g} GiB x {self.gpu_memory_utilization:g} leaves no room for KV after "
                f"{self.spec.weight_bytes / GIB:.1f} GiB of weights and {self.reserved_gib:g} GiB reserved",
            )
        return tokens

    # -- estimates (what a router may read) ---------------------------------------------
    def prefill_s(self, tokens: float, start: float = 0.0, decode_requests: int = 0) -> float:
        """SECONDS to prefill `tokens` of one prompt from position `start` (its cached
        prefix) on a replica decoding `decode_requests` requests: the prompt in chunks of
        the budget the decodes leave, each step at least the weights' read. Attention of
        the decodes, and the steps' rounding, are left out: an estimate, not the
        simulation."""
        if tokens <= 0:
            return 0.0
        chunk = max(self.max_num_batched_tokens - decode_requests, 1)
        steps = tokens / chunk
        pairs = tokens * start + tokens * (tokens + 1) / 2
        compute = self.token_s * (tokens + decode_requests * steps) + self.pair_s * pairs
        return steps * self.overhead_s + max(compute, steps * self.weights_s)

    def decode_step_s(self, requests: int, context_tokens: float) -> float:
        """SECONDS of a step that only decodes: `requests` tokens over `context_tokens` of
        KV in all (the inter-token latency of every request in it)."""
        return self.step_s(requests, context_tokens, context_tokens)
