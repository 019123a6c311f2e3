"""The `prefixcache` command line: thin glue from arguments to the library.

Owns argument parsing, printing and where output files go. Every subcommand calls
library functions and shows their results; none holds logic of its own.

    prefixcache validate FILE                 check a cache, engine or A/B YAML with the loader
                                              the other commands use; print the resolved values
    prefixcache ab [CONFIG] [--out DIR] [--trace PATH]
                                              A/B the arms of CONFIG (default: configs/ab.yaml,
                                              shipped as package data): table, JSON, CSV, PNG
    prefixcache sweep CONFIG [--capacities N ...] [--out DIR] [--trace PATH]
                                              hit ratio vs capacity: table, CSV, JSON, PNG
    prefixcache generate --config FILE --prompts FILE.jsonl
                                              run prompts through the engine: completions
                                              and a metrics table
    prefixcache serve [CONFIG] [--host 127.0.0.1] [--port 8000]
                                              an OpenAI-compatible server over the engine,
                                              KV events on ZeroMQ, Prometheus /metrics
    prefixcache bench --base-url URL ...      timed load against any OpenAI-compatible
                                              server: TTFT/TPOT/ITL/latency, hit ratio
    prefixcache cluster CONFIG [--out DIR] [--trace PATH] [--replicas N ...]
                                              routers over N simulated replicas by arrival
                                              time: table, JSON, CSV, PNG

Every command takes `--no-import` (the same as PREFIXCACHE_NO_IMPORT=1, which it sets for
this process and its children): a config's "module:Class" paths are refused and only
registered backend and policy names resolve, for configs from elsewhere
(docs/security.md). Any error in a file is one line on stderr and exit status 2.

Must never: implement caching, workloads or experiments here.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.resources
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefixcache.ab_config import ABConfig, is_ab_mapping, load_ab_config, parse_ab_config, parse_tokens
from prefixcache.config import ConfigError, load_config, load_yaml, to_plain
from prefixcache.registry import NO_IMPORT_ENV
from prefixcache.workloads import Workload

__all__ = ["main", "DEFAULT_AB_CONFIG", "default_ab_config"]

DEFAULT_AB_CONFIG = "ab.yaml"
"""The shipped A/B (`prefixcache ab` with no file): `configs/ab.yaml` of the source tree,
installed as package data of `prefixcache.configs` (see setup.py)."""


def default_ab_config() -> Path:
    """The installed copy of the shipped A/B file (a real file: the package is not zipped)."""
    return _shipped(DEFAULT_AB_CONFIG, "prefixcache ab path/to/ab.yaml")


def _shipped(name: str, instead: str) -> Path:
    """The installed copy of a shipped config (`configs/NAME`, package data)."""
    try:
        resource = importlib.resources.files("prefixcache.configs") / name
    except ModuleNotFoundError:
        resource = None
    if resource is None or not resource.is_file():
        raise ConfigError("", f"the shipped default {name} is not installed with prefixcache "
                          "(an editable install from before it was package data: pip install -e . again); "
                          f"or pass a config: {instead}")
    return Path(str(resource))


def _console() -> Console:
    # A pipe or a test gets the terminal's width if it has one, else wide enough for the table.
    return Console(width=shutil.get_terminal_size((160, 24)).columns)


def cmd_validate(args: argparse.Namespace) -> int:
    """The file through the loader of the command that reads it: a cluster file
    (`routers:` or `replicas:`) as `cluster` does; an A/B file (`arms:` or `workload:`) as
    `ab` does, generator included; one with `kv_events:` (or a near miss) as `serve` does;
    one with `engine:` (or a near miss of it, such as `engin:`) as `generate` does; else
    its `cache:` section (other sections may share such a file). Prints nothing but the
    error when anything is wrong."""
    source = str(args.file)
    data = load_yaml(source)
    from prefixcache.cluster.config import is_cluster_mapping, parse_cluster_config

    if is_cluster_mapping(data):
        cluster = parse_cluster_config(data, source)
        print(f"# {source}: valid cluster experiment; each replica's num_blocks = capacity_tokens // block_size")
        print(yaml.safe_dump(cluster.plain(), sort_keys=False), end="")
        return 0
    if is_ab_mapping(data):
        ab = parse_ab_config(data, source)
        spec = ab.workload
        # As `ab` does: a generator's size is checked before it runs; a trace is read and
        # its token ids checked against every arm.
        w = _workload(ab, source) if spec.generator is not None or spec.mooncake.path is not None else None
        print(f"# {source}: valid A/B; every arm's num_blocks = capacity_tokens // block_size")
        print(yaml.safe_dump(to_plain(ab), sort_keys=False), end="")
        if w is not None:
            analytic = ", ".join(f"B={b}: {w.analytic_hit_ratio(b):.4f}" for b in ab.block_sizes
                                 if w.analytic_hit_ratio(b) is not None)
            print(f"# workload {w.name}: {len(w):,} requests, {w.prompt_tokens:,} prompt tokens"
                  + (f"; analytic ceiling {analytic}" if analytic else ""))
        else:
            print("# workload: a Mooncake trace, path given at run time with --trace PATH")
        return 0
    if difflib.get_close_matches("kv_events", [str(k) for k in data], n=1):
        from prefixcache.serve.config import parse_serve_config  # no torch, no sockets: the schema only

        served = parse_serve_config(data, source)
        print(f"# {source}: valid (cache, engine and kv_events, as prefixcache serve reads them)")
        plain = {**to_plain(served.serving), "kv_events": to_plain(served.kv_events)}
        print(yaml.safe_dump(plain, sort_keys=False), end="")
        return 0
    if difflib.get_close_matches("engine", [str(k) for k in data], n=1):
        from prefixcache.engine.config import parse_serving_config  # no torch: the schema only

        serving = parse_serving_config(data, source)
        print(f"# {source}: valid (cache and engine, as prefixcache generate reads them)")
        print(yaml.safe_dump(to_plain(serving), sort_keys=False), end="")
        return 0
    config = load_config(source)
    print(f"# {source}: valid")
    print(yaml.safe_dump({"cache": to_plain(config)}, sort_keys=False), end="")
    return 0


@contextmanager
def _progress(console: Console) -> Iterator[Callable[[str, int, int], None]]:
    """A `prefixcache.ab.Progress` callback drawing one rich bar per label."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(label: str, completed: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=completed)

        yield update


def _workload(config: ABConfig, path: str) -> Workload:
    """The config's workload, checked to fit every arm; its errors name the config file too."""
    try:
        return config.build_workload()
    except ConfigError as err:
        raise err.within("", path) from None


def _load(config_path: str | None, trace: str | None) -> tuple[ABConfig, str]:
    path = config_path if config_path is not None else str(default_ab_config())
    if trace is not None and not Path(trace).is_file():
        raise ConfigError("--trace", f"no such file {trace!r}")
    return load_ab_config(path, trace=trace), path


def _plot(console: Console, draw: Callable[[], None], path: Path) -> None:
    from prefixcache.ab_report import PlotUnavailable

    try:
        draw()
    except PlotUnavailable as err:
        print(f"note: {err}; no {path.name} written", file=sys.stderr)
        return
    console.print(f"wrote {path}")


def cmd_ab(args: argparse.Namespace) -> int:
    from prefixcache.ab import run_ab
    from prefixcache.ab_report import ab_table, plot_ab

    console = _console()
    config, path = _load(args.config, args.trace)
    console.print(f"# config: {path}" + (" (the shipped default)" if args.config is None else ""))
    workload = _workload(config, path)
    with _progress(console) as progress:
        result = run_ab(config, workload, progress=progress)
    console.print(ab_table(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.write_json(out / "ab.json")
    result.write_csv(out / "ab_summary.csv", out / "ab_requests.csv")
    console.print(f"wrote {out / 'ab.json'}, {out / 'ab_summary.csv'}, {out / 'ab_requests.csv'}")
    _plot(console, lambda: plot_ab(result, out / "ab.png"), out / "ab.png")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from prefixcache.ab import sweep
    from prefixcache.ab_report import plot_sweep, sweep_table

    console = _console()
    config, path = _load(args.config, args.trace)
    capacities = tuple(args.capacities) if args.capacities else config.sweep_capacities_or_default()
    workload = _workload(config, path)
    with _progress(console) as progress:
        try:
            result = sweep(config, capacities, workload, progress=progress)
        except ValueError as err:
            raise ConfigError("--capacities", str(err)) from None
    console.print(sweep_table(result))
    _save(console, result, Path(args.out), "sweep", plot_sweep)
    return 0


def _save(console: Console, result: Any, out: Path, name: str, plot: Callable[[Any, Path], None]) -> None:
    """`result` as out/NAME.json, out/NAME.csv and (matplotlib permitting) out/NAME.png."""
    out.mkdir(parents=True, exist_ok=True)
    result.write_json(out / f"{name}.json")
    result.write_csv(out / f"{name}.csv")
    console.print(f"wrote {out / f'{name}.json'}, {out / f'{name}.csv'}")
    _plot(console, lambda: plot(result, out / f"{name}.png"), out / f"{name}.png")


def _capacity(text: str) -> int:
    try:
        return parse_tokens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from prefixcache.engine.cli import generate  # late: the engine needs torch

    return generate(args.config, args.prompts, as_json=args.json)


DEFAULT_SERVE_CONFIG = "serve.yaml"


def cmd_serve(args: argparse.Namespace) -> int:
    from prefixcache.serve.server import serve  # late: the engine needs torch, the server fastapi

    path = args.config if args.config is not None else str(_shipped(DEFAULT_SERVE_CONFIG, "prefixcache serve CONFIG"))
    return serve(path, host=args.host, port=args.port, served_model_name=args.served_model_name)


def cmd_bench(args: argparse.Namespace) -> int:
    from prefixcache.loadgen.cli import bench  # late: the load generator needs httpx

    return bench(args)


def cmd_cluster(args: argparse.Namespace) -> int:
    from prefixcache.cluster.config import load_cluster_config
    from prefixcache.cluster.report import cluster_table, plot_cluster
    from prefixcache.cluster.simulate import run_cluster

    console = _console()
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError("--trace", f"no such file {args.trace!r}")
    config = load_cluster_config(args.config, trace=args.trace)
    if args.replicas:
        config = config.with_replicas(tuple(args.replicas))
    try:
        workload = config.workload.build()
    except ConfigError as err:
        raise err.within("", args.config) from None
    with _progress(console) as progress:
        result = run_cluster(config, workload, progress=progress)
    console.print(cluster_table(result))
    _save(console, result, Path(args.out), "cluster", plot_cluster)
    return 0


def _replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a cluster size is an integer >= 1, got {text!r}")
    return value


_NO_IMPORT_HELP = (f"refuse 'module:Class' paths in configs: only registered backend and policy names "
                   f"(the same as {NO_IMPORT_ENV}=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description="Prefix caching for LLM inference.")
    parser.add_argument("--no-import", action="store_true", help=_NO_IMPORT_HELP)
    # The flag after the command too (`prefixcache validate --no-import f.yaml`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-import", action="store_true", default=argparse.SUPPRESS, help=_NO_IMPORT_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", parents=[common],
                              help="check a cache, engine or A/B YAML file and print the resolved values")
    validate.add_argument("file")
    validate.set_defaults(func=cmd_validate)

    ab = sub.add_parser("ab", parents=[common], help="replay one workload through every arm of an A/B config, with the bounds")
    ab.add_argument("config", nargs="?", help=f"A/B YAML (default: the shipped {DEFAULT_AB_CONFIG})")
    ab.add_argument("--out", default="out/ab", help="folder for ab.json, ab_summary.csv, ab_requests.csv, ab.png")
    ab.add_argument("--trace", help="replay this Mooncake JSONL trace instead of the config's workload")
    ab.set_defaults(func=cmd_ab)

    sw = sub.add_parser("sweep", parents=[common], help="hit ratio vs pool capacity for every arm and both bounds")
    sw.add_argument("config", help="A/B YAML")
    sw.add_argument("--capacities", type=_capacity, nargs="+",
                    help="pool sizes in TOKENS, e.g. 4096 1e5 (default: the config's sweep_capacities)")
    sw.add_argument("--out", default="out/sweep", help="folder for sweep.json, sweep.csv, sweep.png")
    sw.add_argument("--trace", help="replay this Mooncake JSONL trace instead of the config's workload")
    sw.set_defaults(func=cmd_sweep)

    gen = sub.add_parser("generate", parents=[common], help="run prompts (JSONL) through the engine; completions and metrics")
    gen.add_argument("--config", required=True, help="YAML with cache: and engine: sections")
    gen.add_argument("--prompts", required=True, help='JSONL: {"prompt": str} or {"messages": [...]}, optional "namespace", "max_tokens"')
    gen.add_argument("--json", action="store_true", help="one JSON object per completion instead of text")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", parents=[common], help="serve the engine over an OpenAI-compatible HTTP API (KV events, metrics)")
    srv.add_argument("config", nargs="?", help=f"YAML with cache:, engine: and kv_events: (default: the shipped "
                                               f"{DEFAULT_SERVE_CONFIG})")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", help="the name clients send as `model` (default: engine.model)")
    srv.set_defaults(func=cmd_serve)

    from prefixcache.loadgen.options import add_bench_arguments  # argparse only: no httpx

    bench = sub.add_parser("bench", parents=[common], help="timed load against an OpenAI-compatible server (ours, vLLM, SGLang)")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    cl = sub.add_parser("cluster", parents=[common], help="routers over N simulated replicas (each a real cache), by arrival time")
    cl.add_argument("config", help="cluster YAML (see configs/cluster.yaml)")
    cl.add_argument("--out", default="out/cluster", help="folder for cluster.json, cluster.csv, cluster.png")
    cl.add_argument("--trace", help="replay this Mooncake JSONL trace instead of the config's workload")
    cl.add_argument("--replicas", type=_replica_count, nargs="+", help="cluster sizes N (default: the config's)")
    cl.set_defaults(func=cmd_cluster)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = ["prefixcache", *(sys.argv[1:] if argv is None else argv)]  # for a result's metadata
    if args.no_import:
        os.environ[NO_IMPORT_ENV] = "1"  # read by the registry; inherited by any worker process
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
