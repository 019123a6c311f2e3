"""`prefixcache generate`: a JSONL file of prompts through the engine, printed.

Owns reading the prompts file (one JSON object a line: {"prompt": str} or
{"messages": [{"role", "content"}, ...]}, optional "namespace" and "max_tokens") into
`GenerationRequest`s, and printing completions, the per-request metrics table and the
run's totals. Errors in the file name the line and the field (`ConfigError`, exit 2).

Must never: hold engine logic; `prefixcache.cli` only dispatches here.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixcache.config import ConfigError
from prefixcache.engine.config import load_serving_config
from prefixcache.engine.engine import Engine, GenerationRequest
from prefixcache.engine.loader import load_model
from prefixcache.engine.metrics import request_table, run_summary

__all__ = ["read_prompts", "generate"]

_KEYS = ("prompt", "messages", "namespace", "max_tokens")


def read_prompts(path: str | Path) -> list[GenerationRequest]:
    """The requests of a prompts file; ConfigError naming `file:line` and the field."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ConfigError("", f"cannot read prompts file: {err.strerror}", str(path)) from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError("", f"invalid JSON: {err.msg}", where) from None
        if not isinstance(obj, dict):
            raise ConfigError("", f"each line must be a JSON object, got {type(obj).__name__}", where)
        unknown = set(obj) - set(_KEYS)
        if unknown:
            raise ConfigError(sorted(unknown)[0], f"unknown key; allowed keys: {', '.join(_KEYS)}", where)
        if ("prompt" in obj) == ("messages" in obj):
            raise ConfigError("", 'needs exactly one of "prompt" and "messages"', where)
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise ConfigError("prompt", "must be a string", where)
        if "messages" in obj and not (isinstance(obj["messages"], list) and obj["messages"]):
            raise ConfigError("messages", 'must be a non-empty list of {"role", "content"} objects', where)
        ns = obj.get("namespace")
        if ns is not None and not isinstance(ns, str):
            raise ConfigError("namespace", f"must be a string or null, got {ns!r}", where)
        mt = obj.get("max_tokens")
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            raise ConfigError("max_tokens", f"must be an integer >= 1, got {mt!r}", where)
        out.append(
            GenerationRequest(
                prompt=obj.get("prompt"), messages=obj.get("messages"), namespace=ns, max_tokens=mt, request_id=f"line-{n}"
            )
        )
    if not out:
        raise ConfigError("", "no prompts in the file", str(path))
    return out


def generate(config_path: str | Path, prompts_path: str | Path, *, as_json: bool = False) -> int:
    """Run the prompts; print completions, then the metrics tables. Returns the exit code."""
    config = load_serving_config(config_path)
    requests = read_prompts(prompts_path)
    ec = config.engine
    try:  # the config names a model that exists; this is whether it loads
        model = load_model(ec.model, seed=ec.seed, chat_template=ec.chat_template)
    except (OSError, ValueError) as err:  # smollm2's package missing, not a GGUF file
        raise ConfigError("engine.model", f"cannot load {ec.model!r}: {err}", str(config_path)) from None
    engine = Engine(config, model=model)
    try:
        outputs = engine.generate(requests)
    except ValueError as err:  # a request that can never run (too long for the pool or context)
        raise ConfigError("", str(err), str(prompts_path)) from None
    mode = f"{config.cache.backend}" if config.engine.prefix_caching else "no cache"
    for o in outputs:
        if as_json:
            print(json.dumps({"request_id": o.request_id, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}))
        else:
            print(f"### {o.request_id} ({o.finish_reason}, {len(o.token_ids)} tokens)\n{o.text}\n")
    if not as_json:
        print(f"## Requests (model {config.engine.model}, cache {mode}, block_size {config.cache.block_size})")
        print(request_table([o.request_id for o in outputs], [o.metrics for o in outputs]))
        print("\n## Run")
        print(run_summary(engine.stats()))
    engine.check_invariants()
    return 0
