"""The engine layer: a real Llama-architecture model served through a `PrefixCache`.

`Engine(ServingConfig)` (or `Engine.from_yaml("configs/engine.yaml")`) runs requests
with continuous batching: the cache decides which prompt tokens are already computed,
the model computes the rest on the paged KV pool (`prefixcache.attention`), and every
request reports its cached tokens, TTFT and time per output token.

Modules: config (the `engine:` section), weights (GGUF / random weights), tokenizer,
loader (model name -> weights + tokenizer), batch (a step's plan), model (the forward
pass), sampling, nocache (the no-caching baseline), scheduler, metrics, engine.

Must never: be imported by `import prefixcache` (it needs torch) or by a backend.
"""

from prefixcache.engine.config import EngineConfig, SamplingConfig, ServingConfig, load_serving_config
from prefixcache.engine.engine import Engine, GenerationRequest, RequestOutput
from prefixcache.engine.loader import LoadedModel, load_model
from prefixcache.engine.metrics import RequestMetrics, RunStats
from prefixcache.engine.sampling import SamplingParams

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
