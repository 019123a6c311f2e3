"""`prefixcache generate`: a JSONL file of prompts through the engine, printed.

Owns reading the prompts file (one JSON object a line: {"prompt": str} or
{"messages": [{"role", "content"}, ...]}, optional "namespace", "max_tokens" and
"arrival_s", the SECONDS after the start at which the request arrives) into
`GenerationRequest`s and their arrival offsets, and printing completions, the per-request
metrics table and the run's totals, in any `--format` (`json`: one JSON object per
request with its TTFT and cached tokens, as `--json` always printed). Errors in the file
name the line and the field (`ConfigError`, exit 2).

Importing it sets OMP_WAIT_POLICY=PASSIVE unless the environment already sets one: the
engine's torch uses OpenMP, which reads that variable once, when torch loads (the engine
modules are imported below, after it is set). Spinning OpenMP threads (the default) make
generation 5-15x slower on a machine whose cores are busy with other work.

Must never: hold engine logic; `prefixcache.cli` only dispatches here.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: see the module docstring

from prefixcache.config import ConfigError  # noqa: E402 (after the OpenMP setting)
from prefixcache.engine.config import ServingConfig, load_serving_config  # noqa: E402
from prefixcache.engine.engine import Engine, GenerationRequest, RequestOutput  # noqa: E402
from prefixcache.engine.loader import load_model  # noqa: E402
from prefixcache.engine.metrics import request_table, run_summary  # noqa: E402
from prefixcache.tables import FORMATS, Column, Table, render, terminal_console, write  # noqa: E402

__all__ = ["Prompts", "read_prompts", "read_prompts_file", "request_json", "generate"]

_KEYS = ("prompt", "messages", "namespace", "max_tokens", "arrival_s")


class Prompts(NamedTuple):
    """A prompts file: its requests, and when each arrives (SECONDS after the start;
    None when no line gives an `arrival_s`: all arrive at once)."""

    requests: list[GenerationRequest]
    arrival_offsets_s: list[float] | None


def read_prompts(path: str | Path) -> list[GenerationRequest]:
    """The requests of a prompts file; ConfigError naming `file:line` and the field."""
    return read_prompts_file(path).requests


def read_prompts_file(path: str | Path) -> Prompts:
    """The requests of a prompts file and their arrival offsets (a line without
    `arrival_s` arrives at 0 s); ConfigError naming `file:line` and the field."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ConfigError("", f"cannot read prompts file: {err.strerror}", str(path)) from None
    out = []
    arrivals: list[float] = []
    timed = False
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
        at = obj.get("arrival_s", 0.0)
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not (math.isfinite(at) and at >= 0):
            raise ConfigError("arrival_s", f"must be a number of SECONDS >= 0, got {at!r}", where)
        timed = timed or "arrival_s" in obj
        arrivals.append(float(at))
        out.append(
            GenerationRequest(
                prompt=obj.get("prompt"), messages=obj.get("messages"), namespace=ns, max_tokens=mt, request_id=f"line-{n}"
            )
        )
    if not out:
        raise ConfigError("", "no prompts in the file", str(path))
    return Prompts(out, arrivals if timed else None)


def request_json(output: RequestOutput) -> dict:
    """One finished request as `generate --json` prints it: the completion, its token
    counts (TOKENS) and its times (SECONDS; TTFT from its arrival, queueing included)."""
    m = output.metrics
    return {
        "request_id": output.request_id,
        "text": output.text,
        "token_ids": output.token_ids,
        "finish_reason": output.finish_reason,
        "prompt_tokens": m.prompt_tokens,
        "cached_tokens": m.cached_tokens,
        "computed_prompt_tokens": m.computed_prompt_tokens,
        "output_tokens": m.output_tokens,
        "ttft_s": m.ttft_s,
        "tpot_s": m.tpot_s,
        "latency_s": m.latency_s,
        "preemptions": m.preemptions,
    }


def _records(outputs: list[RequestOutput]) -> Table:
    """Every request as `request_json` gives it, one row each (for --format csv)."""
    rows = tuple(request_json(o) for o in outputs)
    columns = tuple(Column(key, key) for key in (rows[0] if rows else ()))
    return Table(title="Requests", columns=columns, rows=rows)


def generate(
    config_path: str | Path,
    prompts_path: str | Path,
    *,
    fmt: str = "table",
    as_json: bool = False,
    config: ServingConfig | None = None,
) -> int:
    """Run the prompts and print them in `fmt` (one of `prefixcache.tables.FORMATS`):
    `table` and `markdown` print each completion, then the per-request metrics and the
    run's totals as tables; `json` one JSON object per request and line (`request_json`;
    `as_json` is the same); `csv` a header, then those objects' fields a row each.
    `config` is the file already loaded (with command-line overrides), else it is read
    from `config_path`. Returns the exit code."""
    if as_json:
        fmt = "json"
    if fmt not in FORMATS:
        raise ConfigError("--format", f"unknown format {fmt!r}; allowed values: {', '.join(FORMATS)}")
    if config is None:
        config = load_serving_config(config_path)
    prompts = read_prompts_file(prompts_path)
    ec = config.engine
    try:  # the config names a model that exists; this is whether it loads
        model = load_model(ec.model, seed=ec.seed, chat_template=ec.chat_template)
    except (OSError, ValueError) as err:  # smollm2's package missing, not a GGUF file
        raise ConfigError("engine.model", f"cannot load {ec.model!r}: {err}", str(config_path)) from None
    engine = Engine(config, model=model)
    finished: list[RequestOutput] = []
    try:
        outputs = engine.generate(prompts.requests, arrival_offsets_s=prompts.arrival_offsets_s,
                                  on_output=finished.append)
    except ValueError as err:  # a request that can never run (too long for the pool or context)
        raise ConfigError("", str(err), str(prompts_path)) from None
    except KeyboardInterrupt:  # Ctrl-C: what finished is printed, then the CLI's one line (exit 130)
        order = {r.request_id: i for i, r in enumerate(prompts.requests)}
        _print(sorted(finished, key=lambda o: order.get(o.request_id, len(order))), fmt, config, engine)
        raise KeyboardInterrupt(f"{len(finished)} of {len(prompts.requests)} requests finished "
                                f"({'printed above' if finished else 'nothing printed'})") from None
    _print(outputs, fmt, config, engine)
    engine.check_invariants()
    return 0


def _print(outputs: list[RequestOutput], fmt: str, config: ServingConfig, engine: Engine) -> None:
    """The completions, then the requests and the run's totals, in `fmt` (`generate`)."""
    if fmt == "json":
        for o in outputs:
            print(json.dumps(request_json(o)))
    elif fmt == "csv":
        sys.stdout.write(render(_records(outputs), "csv", 0))
    else:
        console = terminal_console()
        for o in outputs:
            print(f"### {o.request_id} ({o.finish_reason}, {len(o.token_ids)} tokens)\n{o.text}\n")
        mode = f"{config.cache.backend}" if config.engine.prefix_caching else "no cache"
        title = f"Requests (model {config.engine.model}, cache {mode}, block_size {config.cache.block_size})"
        write(request_table([o.request_id for o in outputs], [o.metrics for o in outputs], title), fmt, console)
        print()
        write(run_summary(engine.stats()), fmt, console)
