"""How much memory an engine will take, checked against the machine before anything is
allocated.

Owns `engine_memory_bytes` (the KV tensors of every layer, the block pool's bookkeeping
and the weights, in BYTES, from the model's geometry and the cache config alone),
`available_memory_bytes` (what the machine can still give: Linux's MemAvailable, or the
cgroup's limit less its usage when that is lower) and `check_engine_memory`, which
`Engine` runs before it allocates and `prefixcache validate` runs on an engine or serve
file. A `num_blocks` within the pool's own limit (2**30) but past the memory ended in
`std::bad_alloc` or torch's "can't allocate memory" traceback, or in the kernel's OOM
killer once the zeroed pages were touched; now it is one line naming `cache.num_blocks`
and the most blocks that fit.

Must never: allocate, or load weights (the geometry comes from the GGUF metadata).
"""

from __future__ import annotations

from pathlib import Path

from prefixcache.config import ConfigError
from prefixcache.engine.config import ServingConfig
from prefixcache.engine.weights import LlamaConfig

__all__ = ["engine_memory_bytes", "available_memory_bytes", "check_engine_memory", "POOL_BYTES_PER_BLOCK",
           "KV_DTYPE_BYTES"]

KV_DTYPE_BYTES = 4  # the engine's KV and weights are fp32 on the CPU
POOL_BYTES_PER_BLOCK = 128
"""The block pool's bookkeeping per block, an upper estimate: 62 bytes measured at
construction (its free queue and reference counts), up to twice that once every block
holds a key in the index."""
_HEADROOM = 0.9  # of what the machine has: the process needs some beside the engine


def kv_bytes(model: LlamaConfig, num_blocks: int, block_size: int) -> int:
    """BYTES of the KV tensors: per layer `[num_blocks, 2, num_kv_heads, block_size, head_dim]`."""
    return model.num_layers * num_blocks * 2 * model.num_kv_heads * block_size * model.head_dim * KV_DTYPE_BYTES


def weight_bytes(model: LlamaConfig) -> int:
    """BYTES of the dequantized weights (fp32), from the geometry."""
    q = model.num_heads * model.head_dim
    kv = model.num_kv_heads * model.head_dim
    layer = model.hidden_size * (q + 2 * kv) + q * model.hidden_size + 3 * model.hidden_size * model.intermediate_size
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_embeddings else 2)
    return (model.num_layers * (layer + 2 * model.hidden_size) + embeddings + model.hidden_size) * KV_DTYPE_BYTES


def engine_memory_bytes(model: LlamaConfig, num_blocks: int, block_size: int) -> int:
    """BYTES an engine of this geometry holds: KV, pool bookkeeping and weights."""
    return kv_bytes(model, num_blocks, block_size) + num_blocks * POOL_BYTES_PER_BLOCK + weight_bytes(model)


def available_memory_bytes() -> int | None:
    """What this process can still allocate, BYTES: MemAvailable (/proc/meminfo), or the
    cgroup v2 limit less its usage when lower; None where neither can be read."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_engine_memory(config: ServingConfig, model: LlamaConfig, *, source: str | None = None,
                        available: int | None = None) -> int:
    """The engine's BYTES (`engine_memory_bytes`), or ConfigError at `cache.num_blocks`
    when they pass `engine.max_memory_bytes` or 90% of `available` (default: what the
    machine has now), saying how many blocks would fit."""
    cc, ec = config.cache, config.engine
    need = engine_memory_bytes(model, cc.num_blocks, cc.block_size)
    machine = available_memory_bytes() if available is None else available
    limits = []
    if ec.max_memory_bytes is not None:
        limits.append((ec.max_memory_bytes, f"engine.max_memory_bytes ({_gib(ec.max_memory_bytes)})"))
    if machine is not None:
        limit = int(machine * _HEADROOM)
        limits.append((limit, f"90% of the {_gib(machine)} this machine has available ({_gib(limit)})"))
    for limit, what in limits:
        if need > limit:
            per_block = kv_bytes(model, 1, cc.block_size) + POOL_BYTES_PER_BLOCK
            fit = max(0, (limit - weight_bytes(model)) // per_block)
            kv = _gib(kv_bytes(model, cc.num_blocks, cc.block_size))
            what_for = f"{ec.model!r} (KV {kv} in fp32 over {model.num_layers} layers, the pool, the weights)"
            raise ConfigError("cache.num_blocks", f"{cc.num_blocks} blocks of {cc.block_size} tokens need {_gib(need)} "
                              f"for {what_for}, more than {what}; at most {fit} blocks fit", source)
    return need


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
