"""The serving layer: a `prefixcache` replica that clients, benchmarks and routers talk to.

`prefixcache serve CONFIG` runs the engine (`prefixcache.engine`) behind an
OpenAI-compatible HTTP server, publishes the cache's KV events on ZeroMQ exactly as
vLLM 0.33 does, and exposes Prometheus metrics under vLLM's names.

Modules: config (the `kv_events:` section and the serve file), publisher (ZeroMQ PUB +
replay), engine_loop (the engine in a thread of its own; handlers only enqueue and
await), openai_types (request and response bodies), errors (OpenAI-style error bodies),
metrics (Prometheus), app (the FastAPI routes), server (uvicorn, startup and shutdown).

Must never: be imported by `import prefixcache` or by the engine (data flows down), or
touch the cache other than through the engine loop's thread.
"""
