"""`prefixcache bench`: timed load against any OpenAI-compatible server.

Replays a workload against `--base-url` (a `prefixcache serve` replica, or a vLLM or
SGLang server: the same API) at the times it says: a Mooncake trace by its timestamps
(`--time-scale`), or a generated workload with Poisson arrivals (`--request-rate`),
at most `--max-concurrency` in flight. Prompts go out as token ids, so a workload's
sharing is exact on the server. It measures TTFT, TPOT, ITL and end-to-end latency,
throughput, and the server's prefix hit ratio from `usage.prompt_tokens_details`.

Modules: options (the command line, validated into `BenchOptions`), schedule (what is
sent when: `BenchRequest`s), client (one streamed request, timed), runner (the timed
loop: arrivals, concurrency, limits, Ctrl-C), summary (the statistics), report (table
and JSON with metadata), cli (the command).

Must never: import the engine, torch or a server; run without a bound on both the
number of requests and the wall time.
"""
