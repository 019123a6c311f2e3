"""The engine layer: a real Llama-architecture model served through a `PrefixCache`.

`Engine(ServingConfig)` (or `Engine.from_yaml("configs/engine.yaml")`) runs requests
with continuous batching: the cache decides which prompt tokens are already computed,
the model computes the rest on the paged KV pool (`prefixcache.attention`), and every
request reports its cached tokens, TTFT and time per output token.

Modules: config (the `engine:` section), weights (GGUF / random weights), tokenizer,
loader (model name -> weights + tokenizer), batch (a step's plan), model (the forward
pass), sampling, nocache (the no-caching baseline), scheduler, metrics, engine.

Importing the package loads only the schema (`config`); the names that need torch
(`Engine`, `load_model`, ...) are imported on first use.

Must never: be imported by `import prefixcache` (it needs torch) or by a backend.
"""

import importlib
from typing import TYPE_CHECKING, Any

from prefixcache.engine.config import EngineConfig, SamplingConfig, ServingConfig, load_serving_config

if TYPE_CHECKING:
    from prefixcache.engine.engine import Engine, GenerationRequest, RequestOutput
    from prefixcache.engine.loader import LoadedModel, load_model
    from prefixcache.engine.metrics import RequestMetrics, RunStats
    from prefixcache.engine.sampling import SamplingParams

# Names of the modules that need torch, imported on first use, so the schema
# (`prefixcache.engine.config`, what `prefixcache validate` reads) loads without torch.
_LAZY = {
    "Engine": "engine", "GenerationRequest": "engine", "RequestOutput": "engine",
    "LoadedModel": "loader", "load_model": "loader",
    "RequestMetrics": "metrics", "RunStats": "metrics",
    "SamplingParams": "sampling",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "Engine",
    "EngineConfig",
    "GenerationRequest",
    "LoadedModel",
    "RequestMetrics",
    "RequestOutput",
    "RunStats",
    "SamplingConfig",
    "SamplingParams",
    "ServingConfig",
    "load_model",
    "load_serving_config",
]
