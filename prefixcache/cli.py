"""The `prefixcache` command line: thin glue from arguments to the library.

Owns argument parsing, printing and where output files go. Every subcommand calls
library functions and shows their results; none holds logic of its own. One shape:

    prefixcache CMD [CONFIG] [--out DIR] [--set KEY.PATH=VALUE ...] [--seed N]
                    [--backend NAME] [--block-size B] [--format table|markdown|json|csv]

    prefixcache validate FILE                 check a cache, engine, A/B or cluster YAML with the
                                              loader the other commands use; print the resolved values
    prefixcache ab [CONFIG] [--trace PATH]    A/B the arms of CONFIG (default: the shipped
                                              configs/ab.yaml): table, JSON, CSV, PNG
    prefixcache sweep [CONFIG] [--capacities N ... | --device-tokens N ... --host-tokens N ...] [--trace PATH]
                                              hit ratio vs capacity: table, CSV, JSON, PNG
    prefixcache generate [CONFIG] --prompts FILE.jsonl
                                              run prompts through the engine (default: the
                                              shipped engine.yaml; `--config FILE` is a
                                              deprecated alias of CONFIG, `--json` of
                                              `--format json`)
    prefixcache serve [CONFIG] [--host 127.0.0.1] [--port 8000]
                                              an OpenAI-compatible server over the engine,
                                              KV events on ZeroMQ, Prometheus /metrics
    prefixcache bench --base-url URL ...      timed load against any OpenAI-compatible
                                              server: TTFT/TPOT/ITL/latency, hit ratio
    prefixcache tokenizer MODEL [--out DIR]   an engine model's tokenizer as Hugging Face
                                              files, for benchmark clients that tokenize
    prefixcache cluster [CONFIG] [--trace PATH] [--replicas N ...]
                                              routers over N simulated replicas by arrival
                                              time: table, JSON, CSV, PNG
    prefixcache cluster serve CONFIG [--host 127.0.0.1] [--port 8000]
                                              N engine replicas on Ray Serve (a local Ray
                                              cluster) behind one OpenAI-compatible ingress,
                                              routed by a prefixcache router or Ray's own

Overrides (`--set`, and `--seed`/`--backend`/`--block-size` as its shortcuts:
`prefixcache.overrides`) apply to validate, ab, sweep, generate, cluster and serve;
`--format` to the commands that print a results table (ab, sweep, generate, cluster).
`--out` is checked, created and cleared of an old PNG before the work starts; results
are rewritten whole as each arm (ab), capacity (sweep) or run (cluster: a router or the shared cache at one size)
finishes, so Ctrl-C keeps those and exits 130 with one line. A workload with no requests is refused before any replay. See docs/cli.md.

Every command takes `--no-import` (the same as PREFIXCACHE_NO_IMPORT=1, which it sets for
this process and its children): a config's "module:Class" paths are refused and only
registered backend and policy names resolve, for configs from elsewhere
(docs/security.md). Any error in a file or an option is one line on stderr and exit
status 2.

Must never: implement caching, workloads or experiments here.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import io
import importlib
import importlib.resources
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefixcache.ab_config import ABConfig, is_ab_mapping, parse_ab_config, parse_tokens
from prefixcache.config import ConfigError, load_yaml, require_section, to_plain
from prefixcache.config_checks import parse_cache_config
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


def _plugin_path(folder: str | Path) -> None:
    """Put `folder` first on sys.path (once), so that a plugin module beside the user's
    files imports: the working directory, as `python -m` puts it, and a config's folder."""
    folder = str(Path(folder).resolve())
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _import_plugins(modules: Sequence[str]) -> None:
    """`--import MODULE ...`: each imported from the working directory (or installed); a
    failure is one ConfigError naming the flag. Refused with --no-import."""
    from prefixcache.registry import imports_allowed

    if modules and not imports_allowed():
        raise ConfigError("--import", f"imports are off ({NO_IMPORT_ENV}=1 or --no-import)")
    for name in modules:
        _plugin_path(os.getcwd())
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 -- the module's own code failed: one line naming it
            raise ConfigError("--import", f"{name!r}: {type(err).__name__}: {err}") from None


def cmd_validate(args: argparse.Namespace) -> int:
    """The file through the loader of the command that reads it (`_validated`), printed
    resolved; or every mistake in it, one `error:` line each (exit 2): after each error
    the key it names is set aside and the file checked again, so one run lists them all
    (a mistake that hides behind another, such as a key inside a section that is not a
    mapping, shows once that one is fixed)."""
    path = str(args.file)
    data, source = _data(path, args), _source(path, args)
    errors: list[ConfigError] = []
    trial = copy.deepcopy(dict(data))
    dropped: list[str] = []
    while True:
        try:
            lines = _validated(trial, source)
            break
        except ConfigError as err:
            consequence = any(err.path == d or err.path.startswith(d + ".") for d in dropped) or (
                err.missing_paths() and set(err.missing_paths()) <= set(dropped))
            if consequence or len(errors) >= _MAX_ERRORS:
                break  # a consequence of setting an earlier mistake aside
            if any(_options_of(d, err.path) for d in dropped):
                # The options are a backend's: with the backend set aside they would be
                # checked against the default one, which the file never named.
                if not _drop(trial, err.path):
                    break
                dropped.append(err.path)
                continue
            errors.append(err)
            if not err.path or not _drop(trial, err.path):
                break
            dropped.append(err.path)
    if errors:
        for err in errors:
            print(f"error: {err}", file=sys.stderr)
        return 2
    print(lines, end="")
    return 0


_MAX_ERRORS = 25


def _options_of(backend_path: str, path: str) -> bool:
    """Whether `path` is in the options beside the backend key `backend_path` (`cache.backend`
    and `cache.options.x`; an arm's, or a bare `backend` and `options.x`)."""
    if backend_path != "backend" and not backend_path.endswith(".backend"):
        return False
    options = backend_path[: -len("backend")] + "options"
    return path == options or path.startswith(options + ".")


def _drop(data: dict, path: str) -> bool:
    """Remove the key at dotted `path` from nested mappings (a key holding dots is matched
    whole, as --set does); whether there was one."""
    parts = path.split(".")
    node: Any = data
    while parts:
        for n in range(len(parts), 0, -1):
            key = ".".join(parts[:n])
            if isinstance(node, dict) and key in node:
                if n == len(parts):
                    del node[key]
                    return True
                node, parts = node[key], parts[n:]
                break
        else:
            return False
    return False


def _validated(data: Mapping[str, Any], source: str) -> str:
    """What `validate` prints of a file read by the loader of the command that reads it
    (ConfigError for its first mistake): a cluster file
    (`routers:` or `replicas:`) as `cluster` does; an A/B file (`arms:` or `workload:`) as
    `ab` does, generator included; one with `kv_events:` or `server:` (or a near miss) as `serve` does;
    one with `engine:` (or a near miss of it, such as `engin:`) as `generate` does; else
    its `cache:` section (other sections may share such a file)."""
    out = io.StringIO()

    def say(*values: object, **kwargs: Any) -> None:
        print(*values, file=out, **kwargs)

    from prefixcache.cluster.config import is_cluster_mapping, parse_cluster_config
    from prefixcache.serve.cluster_config import is_cluster_serve_mapping, parse_cluster_serve_config

    if is_cluster_serve_mapping(data):  # no Ray, no torch: the schema only
        served = parse_cluster_serve_config(data, source)
        say(f"# {source}: valid (as prefixcache cluster serve reads it; the hash seed resolved, "
            "event sockets per replica)")
        say(yaml.safe_dump(served.plain(), sort_keys=False), end="")
        return out.getvalue()
    if is_cluster_mapping(data):
        cluster = parse_cluster_config(data, source)
        say(f"# {source}: valid cluster experiment; each replica's num_blocks = capacity_tokens // block_size")
        say(yaml.safe_dump(cluster.plain(), sort_keys=False), end="")
        return out.getvalue()
    if is_ab_mapping(data):
        ab = parse_ab_config(data, source)
        spec = ab.workload
        # As `ab` does: a generator's size is checked before it runs; a trace is read and
        # its token ids checked against every arm.
        w = _workload(ab, source) if spec.generator is not None or spec.mooncake.path is not None else None
        say(f"# {source}: valid A/B; every arm's num_blocks = capacity_tokens // block_size")
        say(yaml.safe_dump(to_plain(ab), sort_keys=False), end="")
        if w is not None:
            analytic = ", ".join(f"B={b}: {w.analytic_hit_ratio(b):.4f}" for b in ab.block_sizes
                                 if w.analytic_hit_ratio(b) is not None)
            say(f"# workload {w.name}: {len(w):,} requests, {w.prompt_tokens:,} prompt tokens"
                  + (f"; analytic ceiling {analytic}" if analytic else ""))
        else:
            say("# workload: a Mooncake trace, path given at run time with --trace PATH")
        return out.getvalue()
    if any(difflib.get_close_matches(name, [str(k) for k in data], n=1) for name in ("kv_events", "server")):
        from prefixcache.serve.config import parse_serve_config  # no torch, no sockets: the schema only

        served = parse_serve_config(data, source)
        _check_engine_memory(served.serving, source)
        say(f"# {source}: valid (cache, engine, kv_events and server, as prefixcache serve reads them)")
        plain = {**to_plain(served.serving), "kv_events": to_plain(served.kv_events), "server": to_plain(served.server)}
        say(yaml.safe_dump(plain, sort_keys=False), end="")
        return out.getvalue()
    if difflib.get_close_matches("engine", [str(k) for k in data], n=1):
        from prefixcache.engine.config import parse_serving_config  # no torch: the schema only

        serving = parse_serving_config(data, source)
        _check_engine_memory(serving, source)
        say(f"# {source}: valid (cache and engine, as prefixcache generate reads them)")
        say(yaml.safe_dump(to_plain(serving), sort_keys=False), end="")
        return out.getvalue()
    config = parse_cache_config(require_section(data, "cache", source), "cache", source)
    say(f"# {source}: valid")
    say(yaml.safe_dump({"cache": to_plain(config)}, sort_keys=False), end="")
    return out.getvalue()


def _check_engine_memory(serving: Any, source: str) -> None:
    """The engine's memory against the machine and `engine.max_memory_bytes`, as building
    it checks first (the model's geometry from its GGUF metadata; this imports torch)."""
    from prefixcache.engine.loader import load_model_config
    from prefixcache.engine.memory import check_engine_memory

    try:
        model = load_model_config(serving.engine.model)
    except (OSError, ValueError) as err:
        raise ConfigError("engine.model", f"cannot load {serving.engine.model!r}: {err}", source) from None
    check_engine_memory(serving, model, source=source)


class _Reporter:
    """Where a command's output goes. The result (a table in --format) goes to stdout;
    notes ("wrote ...") go to stdout with the terminal table, else to stderr, so that
    `--format json|csv` output stays parseable. Progress: a rich bar when stdout is a
    terminal, else one plain line on stderr per finished unit (an arm, a bound, a
    capacity's arm, a router at a cluster size)."""

    def __init__(self, fmt: str = "table") -> None:
        self.fmt = fmt
        from prefixcache.tables import terminal_console

        self.console = terminal_console()
        self.notes = self.console if fmt == "table" else Console(stderr=True, width=self.console.width)

    def note(self, text: str) -> None:
        self.notes.print(text, highlight=False, soft_wrap=True)

    def show(self, table: Any) -> None:
        from prefixcache.tables import write

        write(table, self.fmt, self.console)

    @contextmanager
    def progress(self) -> Iterator[Callable[[str, int, int], None]]:
        """A `prefixcache.ab.Progress` callback."""
        if not self.console.is_terminal:
            done: set[str] = set()
            since = [time.perf_counter()]  # units run one after another: each takes from the last's end

            def line(label: str, completed: int, total: int) -> None:
                if completed >= total and label not in done:
                    done.add(label)
                    now = time.perf_counter()
                    print(f"done {label}: {total:,} of {total:,} in {now - since[0]:.1f} s", file=sys.stderr, flush=True)
                    since[0] = now

            yield line
            return
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as bar:
            tasks: dict[str, Any] = {}

            def update(label: str, completed: int, total: int) -> None:
                if label not in tasks:
                    tasks[label] = bar.add_task(label, total=total)
                bar.update(tasks[label], completed=completed)

            yield update


def _workload(config: Any, path: str) -> Workload:
    """The config's workload (an ABConfig's, checked to fit every arm, or a cluster's); its
    errors name the config file too; one with no requests is refused here, before any
    replay or plot."""
    try:
        workload = config.build_workload() if isinstance(config, ABConfig) else config.workload.build()
    except ConfigError as err:
        raise err.within("", path) from None
    if len(workload) == 0:
        trace = config.workload.mooncake.path if config.workload.mooncake is not None else None
        what = f"the trace {trace!r}" if trace else f"generator {config.workload.generator!r}"
        raise ConfigError("workload", f"{what} gives no requests: nothing to replay", path)
    return workload


_SHIPPED_FOLDERS = ("configs", "examples")


def shipped_fallback(path: str) -> str:
    """`path`, or when no such file exists here and it names a shipped file by the
    repository's folder (`configs/ab.yaml`, `examples/prompts.jsonl`, or a bare
    `ab.yaml`), the installed copy of that file, said on stderr: the README's commands
    then work from any directory."""
    given = Path(path)
    if given.exists() or str(given.parent) not in (".", *_SHIPPED_FOLDERS):
        return path
    try:
        shipped = _shipped(given.name, "")
    except ConfigError:
        return path
    print(f"# {path}: not in {Path.cwd()}; using the shipped {given.name} ({shipped})", file=sys.stderr)
    return str(shipped)


def _data(path: str, args: argparse.Namespace) -> Mapping[str, Any]:
    """The YAML file's data with the command line's --set and shortcut overrides applied
    (`prefixcache.overrides`), for the same loader as the file."""
    from prefixcache.overrides import apply_overrides, parse_override, relabel_arms, shortcut_overrides

    path = shipped_fallback(path)
    data = load_yaml(path)
    from prefixcache.registry import imports_allowed

    if imports_allowed():  # a config's "module:Class" plugin beside it, or in the working directory
        _plugin_path(os.getcwd())
        _plugin_path(Path(path).parent)
    overrides = []
    for name in ("seed", "backend", "block_size"):
        value = getattr(args, name, None)
        if value is not None:
            overrides += shortcut_overrides(data, name, value)
    overrides += [parse_override(text) for text in getattr(args, "overrides", None) or ()]
    return relabel_arms(data, apply_overrides(data, overrides)) if overrides else data


def _source(path: str, args: argparse.Namespace) -> str:
    """How errors name the config: the file, and that the command line changed it."""
    changed = getattr(args, "overrides", None) or any(
        getattr(args, n, None) is not None for n in ("seed", "backend", "block_size"))
    return f"{path} (with command-line overrides)" if changed else path


def _load(args: argparse.Namespace) -> tuple[ABConfig, str]:
    """The A/B file (default: the shipped one) with overrides, and --trace, validated."""
    path = args.config if args.config is not None else str(default_ab_config())
    trace = args.trace
    if trace is not None and not Path(trace).is_file():
        raise ConfigError("--trace", f"no such file {trace!r}")
    config = parse_ab_config(_data(path, args), _source(path, args), check_trace=trace is None)
    if trace is not None:
        config = config.with_trace(trace)
    return config, path


class _Outputs:
    """The files of one result in `--out`, checked before the work starts, written
    whole (a temporary file, then a rename) each time a unit of work finishes."""

    def __init__(self, out: str, files: Sequence[str], png: str) -> None:
        self.folder = Path(out)
        self.png = self.folder / png
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError("--out", f"{out!r} is a file, not a folder: nothing was run")
        for name in (*files, png):
            if (self.folder / name).is_dir():
                raise ConfigError("--out", f"{str(self.folder / name)!r} is a folder; the result needs that name")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError("--out", f"cannot create folder {out!r}: {err.strerror}") from None
        if not os.access(self.folder, os.W_OK):
            raise ConfigError("--out", f"folder {out!r} is not writable")
        self.png.unlink(missing_ok=True)  # a PNG left beside new results would be of other ones
        self.kept = ""

    def write(self, name: str, write: Callable[[Path], None]) -> Path:
        path = self.folder / name
        tmp = path.with_name(f".{name}.tmp")
        try:
            write(tmp)
            os.replace(tmp, path)
        except BaseException:  # Ctrl-C mid-write included: the last whole file stays
            tmp.unlink(missing_ok=True)
            raise
        return path


def _plot(reporter: _Reporter, draw: Callable[[], None], path: Path) -> None:
    from prefixcache.ab_report import PlotUnavailable

    try:
        draw()
    except PlotUnavailable as err:
        print(f"note: {err}; no {path.name} written", file=sys.stderr)
        return
    reporter.note(f"wrote {path}")


def cmd_ab(args: argparse.Namespace) -> int:
    from prefixcache.ab import run_ab, write_csv
    from prefixcache.ab_report import ab_table, plot_ab

    reporter = _Reporter(args.format)
    config, path = _load(args)
    workload = _workload(config, path)
    outputs = args.outputs = _Outputs(args.out, ("ab.json", "ab_summary.csv", "ab_requests.csv"), "ab.png")
    reporter.note(f"# config: {path}" + (" (the shipped default)" if args.config is None else ""))

    def save(result: Any) -> None:
        outputs.write("ab.json", result.write_json)
        outputs.kept = f"kept {len(result.arms)} finished arm(s) in {outputs.folder / 'ab.json'}"

    with reporter.progress() as progress:
        result = run_ab(config, workload, progress=progress, on_arm=save)
    save(result)
    reporter.show(ab_table(result))
    outputs.write("ab_summary.csv", lambda p: write_csv(p, result.summary_rows()))
    outputs.write("ab_requests.csv", lambda p: write_csv(p, result.request_rows()))
    reporter.note(f"wrote {outputs.folder / 'ab.json'}, {outputs.folder / 'ab_summary.csv'}, "
                  f"{outputs.folder / 'ab_requests.csv'}")
    _plot(reporter, lambda: plot_ab(result, outputs.png), outputs.png)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from prefixcache.ab import check_capacities, sweep, sweep_split
    from prefixcache.ab_report import plot_sweep, sweep_table

    reporter = _Reporter(args.format)
    config, path = _load(args)
    split = args.device_tokens is not None or args.host_tokens is not None
    if split and (args.device_tokens is None or args.host_tokens is None or args.capacities):
        raise ConfigError("--device-tokens", "a split sweep takes --device-tokens and --host-tokens (and no --capacities)")
    capacities = tuple(args.capacities) if args.capacities else config.sweep_capacities_or_default()
    try:
        check_capacities(config, tuple(args.device_tokens) if split else capacities)
    except ValueError as err:
        raise ConfigError("--device-tokens" if split else "--capacities", str(err)) from None
    workload = _workload(config, path)
    outputs = args.outputs = _Outputs(args.out, ("sweep.json", "sweep.csv"), "sweep.png")

    def save(result: Any) -> None:
        outputs.write("sweep.json", result.write_json)
        outputs.write("sweep.csv", result.write_csv)
        outputs.kept = (f"kept {len(result.capacities)} finished capacit{'y' if len(result.capacities) == 1 else 'ies'}"
                        f" in {outputs.folder / 'sweep.json'}")

    with reporter.progress() as progress:
        if split:
            result = sweep_split(config, args.device_tokens, args.host_tokens, workload, progress=progress,
                                 on_capacity=save)  # fmt: skip
        else:
            result = sweep(config, capacities, workload, progress=progress, on_capacity=save)
    reporter.show(sweep_table(result))
    reporter.note(f"wrote {outputs.folder / 'sweep.json'}, {outputs.folder / 'sweep.csv'}")
    _plot(reporter, lambda: plot_sweep(result, outputs.png), outputs.png)
    return 0


def _capacity(text: str) -> int:
    try:
        return parse_tokens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from prefixcache.engine.cli import generate  # late: the engine needs torch

    if args.config_flag is not None and args.config is not None:
        raise ConfigError("--config", "give the config once: as CONFIG (the --config flag is deprecated)")
    if args.json and args.format not in ("table", "json"):
        raise ConfigError("--json", f"is --format json; it cannot go with --format {args.format}")
    path = args.config or args.config_flag or str(_shipped(DEFAULT_ENGINE_CONFIG, "prefixcache generate CONFIG"))
    from prefixcache.engine.config import parse_serving_config  # the schema: no torch

    config = parse_serving_config(_data(path, args), _source(path, args))  # overrides applied, checked first
    prompts = (shipped_fallback(args.prompts) if args.prompts is not None
               else str(_shipped(DEFAULT_PROMPTS, "prefixcache generate --prompts FILE.jsonl")))
    code = generate(path, prompts, fmt="json" if args.json else args.format, config=config)
    if args.config_flag is not None:  # after the run: an error stays the one line it is
        print("note: --config is deprecated; pass the config as the first argument: "
              "prefixcache generate CONFIG --prompts FILE", file=sys.stderr)
    return code


DEFAULT_ENGINE_CONFIG = "engine.yaml"
DEFAULT_PROMPTS = "prompts.jsonl"
DEFAULT_SERVE_CONFIG = "serve.yaml"
DEFAULT_CLUSTER_CONFIG = "cluster.yaml"


def cmd_serve(args: argparse.Namespace) -> int:
    from prefixcache.serve.config import parse_serve_config  # the schema: no torch, no sockets

    path = args.config if args.config is not None else str(_shipped(DEFAULT_SERVE_CONFIG, "prefixcache serve CONFIG"))
    config = parse_serve_config(_data(path, args), _source(path, args))  # overrides applied, checked first
    from prefixcache.serve.listen import check_serve_addresses  # no torch: a busy port is one line, at once

    check_serve_addresses(config, args.host, args.port, _source(path, args))
    # Before torch loads, as `generate` does (prefixcache/engine/cli.py): OpenMP threads that
    # spin while waiting slow the engine 5-15x on a busy machine.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from prefixcache.serve.server import serve  # late: the engine needs torch, the server fastapi

    return serve(path, host=args.host, port=args.port, served_model_name=args.served_model_name, config=config)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from prefixcache.engine.tokenizer_export import FILES, export_tokenizer  # late: tokenizers

    out = Path(args.out if args.out is not None else Path("out") / "tokenizer" / Path(args.model).stem)
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{str(out)!r} is a file, not a folder: nothing was written")
    for name in FILES:
        if (out / name).is_dir():
            raise ConfigError("--out", f"{str(out / name)!r} is a folder; the tokenizer needs that name")
    try:
        written = export_tokenizer(args.model, out)
    except (OSError, ValueError) as err:
        raise ConfigError("MODEL", f"{args.model!r}: {err}") from None
    print(f"wrote {', '.join(str(p) for p in written)}")
    print(f"# a client's tokenizer: --tokenizer {out} (aiperf, vllm bench serve, sglang.bench_serving; guidellm 0.8: "
          f"--tokenizer kind=hf_auto,model={out}); docs/clients.md")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from prefixcache.loadgen.cli import bench  # late: the load generator needs httpx

    return bench(args)


def cmd_cluster(args: argparse.Namespace) -> int:
    from prefixcache.cluster.config import parse_cluster_config
    from prefixcache.cluster.report import cluster_table, plot_cluster
    from prefixcache.cluster.simulate import run_cluster

    reporter = _Reporter(args.format)
    path = args.config if args.config is not None else str(_shipped(DEFAULT_CLUSTER_CONFIG, "prefixcache cluster CONFIG"))
    if args.trace is not None and not Path(args.trace).is_file():
        raise ConfigError("--trace", f"no such file {args.trace!r}")
    config = parse_cluster_config(_data(path, args), _source(path, args), check_trace=args.trace is None)
    if args.trace is not None:
        config = config.with_trace(args.trace)
    if args.replicas:
        config = config.with_replicas(tuple(args.replicas))
    workload = _workload(config, path)
    outputs = args.outputs = _Outputs(args.out, ("cluster.json", "cluster.csv"), "cluster.png")

    def save(result: Any) -> None:
        outputs.write("cluster.json", result.write_json)
        outputs.write("cluster.csv", result.write_csv)
        outputs.kept = f"kept {len(result.runs)} finished run(s) in {outputs.folder / 'cluster.json'}"

    with reporter.progress() as progress:
        result = run_cluster(config, workload, progress=progress, on_run=save)
    reporter.show(cluster_table(result))
    reporter.note(f"wrote {outputs.folder / 'cluster.json'}, {outputs.folder / 'cluster.csv'}")
    _plot(reporter, lambda: plot_cluster(result, outputs.png), outputs.png)
    return 0


def cmd_cluster_serve(args: argparse.Namespace) -> int:
    from prefixcache.serve.cluster_config import check_proxy_address_free, parse_cluster_serve_config, with_proxy_address

    # The whole file (overrides applied), its CPU layout on this machine and the proxy's
    # address are checked before Ray is imported: a mistake is one line, in a second.
    path = args.config if args.config is not None else str(_shipped(DEFAULT_CLUSTER_SERVE_CONFIG,
                                                                      "prefixcache cluster serve CONFIG"))
    config = parse_cluster_serve_config(_data(path, args), _source(path, args))
    config = with_proxy_address(config, host=args.host, port=args.port)
    check_proxy_address_free(config)
    try:
        from prefixcache.serve.ray_app import serve_cluster  # late: Ray, torch
    except ImportError as err:
        raise ConfigError("", f"`prefixcache cluster serve` needs the cluster extra (pip install "
                          f"'prefixcache[cluster]'): {err}") from None
    return serve_cluster(config)


DEFAULT_CLUSTER_SERVE_CONFIG = "cluster_serve.yaml"


def build_cluster_serve_parser() -> argparse.ArgumentParser:
    """`prefixcache cluster serve`: its own parser (`prefixcache cluster CONFIG` keeps the
    simulation, so a cluster file named `serve` needs a path such as ./serve)."""
    parser = argparse.ArgumentParser(
        prog="prefixcache cluster serve", parents=[_experiment_options()], formatter_class=_HelpFormatter,
        description="N prefixcache engine replicas on Ray Serve (a local Ray cluster) behind one OpenAI-compatible "
                    "ingress; the replicas' request router is a prefixcache router over their KV events, or Ray's own")
    parser.add_argument("config", nargs="?", help=f"YAML with cache:, engine:, cluster: (default: the shipped "
                                                  f"{DEFAULT_CLUSTER_SERVE_CONFIG}: two tiny replicas)")
    parser.add_argument("--host", help="where Ray Serve's HTTP proxy listens (default: cluster.host, 127.0.0.1)")
    parser.add_argument("--port", type=int, help="its port (default: cluster.port, 8000)")
    parser.add_argument("--no-import", action="store_true", help=_NO_IMPORT_HELP)
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE", help=_IMPORT_HELP)
    parser.set_defaults(func=cmd_cluster_serve)
    return parser


def _replica_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a cluster size is an integer >= 1, got {text!r}")
    return value


_IMPORT_HELP = ("import MODULE first (repeatable; found from the working directory, as `python -m` finds it): "
                "its @register_backend / @register_eviction_policy names then resolve in configs and --set")
_NO_IMPORT_HELP = (f"refuse 'module:Class' paths in configs: only registered backend and policy names "
                   f"(the same as {NO_IMPORT_ENV}=1)")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default when it has one (not for None, False or a flag's
    suppressed default), and leaves help that states its own default alone."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action)


def _experiment_options() -> argparse.ArgumentParser:
    """--set and its shortcuts, for every command that reads an experiment or cache YAML."""
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("overrides (applied to the file's data, then validated as the file is)")
    group.add_argument("--set", dest="overrides", action="append", metavar="KEY.PATH=VALUE",
                       help="set a key of the YAML file, e.g. capacity_tokens=8192 or arms.hash/16.eviction=lfu "
                            "(repeatable; the value is YAML)")
    group.add_argument("--seed", type=int, help="the workload generator's seed (workload.params.seed; engine.seed "
                                                "in an engine file)")
    group.add_argument("--backend", help="cache.backend, or every arm's backend in an A/B file")
    group.add_argument("--block-size", dest="block_size", type=int,
                       help="cache.block_size, or every arm's block_size in an A/B file (TOKENS)")
    return options


def _format_option() -> argparse.ArgumentParser:
    from prefixcache.tables import FORMATS

    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--format", choices=FORMATS, default="table",
                         help="how the table is printed: 'table' fits the terminal (dropping low-priority "
                              "columns, never cutting a number), markdown, json or csv")
    return options


def build_parser() -> argparse.ArgumentParser:
    from prefixcache import __version__

    parser = argparse.ArgumentParser(prog="prefixcache", description="Prefix caching for LLM inference.",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"prefixcache {__version__}")
    parser.add_argument("--no-import", action="store_true", help=_NO_IMPORT_HELP)
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE", help=_IMPORT_HELP)
    # The flags after the command too (`prefixcache validate --no-import f.yaml`).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-import", action="store_true", default=argparse.SUPPRESS, help=_NO_IMPORT_HELP)
    common.add_argument("--import", dest="imports", action="append", metavar="MODULE", default=argparse.SUPPRESS,
                        help=_IMPORT_HELP)
    experiment, table = _experiment_options(), _format_option()
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, *parents: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common, *parents], help=help, description=help,
                              formatter_class=_HelpFormatter)

    validate = command("validate", "check a cache, engine or A/B YAML file and print the resolved values", experiment)
    validate.add_argument("file", help="the YAML file")
    validate.set_defaults(func=cmd_validate)

    ab = command("ab", "replay one workload through every arm of an A/B config, with the bounds", experiment, table)
    ab.add_argument("config", nargs="?", help=f"A/B YAML (default: the shipped {DEFAULT_AB_CONFIG})")
    ab.add_argument("--out", default="out/ab", help="folder for ab.json, ab_summary.csv, ab_requests.csv, ab.png")
    ab.add_argument("--trace", help="replay this Mooncake JSONL trace instead of the config's workload")
    ab.set_defaults(func=cmd_ab)

    sw = command("sweep", "hit ratio vs pool capacity for every arm and both bounds", experiment, table)
    sw.add_argument("config", nargs="?", help=f"A/B YAML (default: the shipped {DEFAULT_AB_CONFIG})")
    sw.add_argument("--capacities", type=_capacity, nargs="+",
                    help="pool sizes in TOKENS, e.g. 4096 1e5 (default: the config's sweep_capacities)")
    sw.add_argument("--device-tokens", type=_capacity, nargs="+",
                    help="a split sweep: device pool sizes in TOKENS; each with every --host-tokens for the first "
                         "tier of the arms that have tiers (flat arms get the total)")
    sw.add_argument("--host-tokens", type=_capacity, nargs="+", help="a split sweep: first-tier sizes in TOKENS")
    sw.add_argument("--out", default="out/sweep", help="folder for sweep.json, sweep.csv, sweep.png")
    sw.add_argument("--trace", help="replay this Mooncake JSONL trace instead of the config's workload")
    sw.set_defaults(func=cmd_sweep)

    gen = command("generate", "run prompts (JSONL) through the engine; completions and metrics", experiment, table)
    gen.add_argument("config", nargs="?", help=f"YAML with cache: and engine: sections "
                                               f"(default: the shipped {DEFAULT_ENGINE_CONFIG})")
    gen.add_argument("--config", dest="config_flag", metavar="CONFIG", help="deprecated: the same as CONFIG")
    gen.add_argument("--prompts", help='JSONL: {"prompt": str} or {"messages": [...]}, optional "namespace", '
                                       '"max_tokens", "arrival_s" (default: the shipped demo, examples/prompts.jsonl: '
                                       'six chat requests sharing a system prompt)')
    gen.add_argument("--json", action="store_true", help="the same as --format json: one JSON object per request "
                                                         "and line (completion, token counts, TTFT)")
    gen.set_defaults(func=cmd_generate)

    srv = command("serve", "serve the engine over an OpenAI-compatible HTTP API (KV events, metrics)", experiment)
    srv.add_argument("config", nargs="?", help=f"YAML with cache:, engine: and kv_events: (default: the shipped "
                                               f"{DEFAULT_SERVE_CONFIG})")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port")
    srv.add_argument("--served-model-name", help="the name clients send as `model` (default: engine.model)")
    srv.set_defaults(func=cmd_serve)

    tok = command("tokenizer", "write an engine model's tokenizer as Hugging Face files (tokenizer.json, "
                  "tokenizer_config.json) for benchmark clients")
    tok.add_argument("model", help="tiny | smollm2 | gemma3 | path/to/model.gguf (engine.model)")
    tok.add_argument("--out", help="folder to write (default: out/tokenizer/MODEL)")
    tok.set_defaults(func=cmd_tokenizer)

    from prefixcache.loadgen.options import add_bench_arguments  # argparse only: no httpx

    bench = command("bench", "timed load against an OpenAI-compatible server (ours, vLLM, SGLang)")
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    cl = command("cluster", "routers over N simulated replicas (each a real cache), by arrival time; "
                 "`cluster serve CONFIG`: real replicas on Ray Serve", experiment, table)
    cl.add_argument("config", nargs="?", help=f"cluster YAML (default: the shipped {DEFAULT_CLUSTER_CONFIG})")
    cl.add_argument("--out", default="out/cluster", help="folder for cluster.json, cluster.csv, cluster.png")
    cl.add_argument("--trace", help="replay this Mooncake JSONL trace instead of the config's workload")
    cl.add_argument("--replicas", type=_replica_count, nargs="+", help="cluster sizes N (default: the config's)")
    cl.set_defaults(func=cmd_cluster)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, rest = build_parser(), argv
    lead = 1 if argv[:1] == ["--no-import"] else 0  # `prefixcache --no-import cluster serve CONFIG`
    if argv[lead:lead + 2] == ["cluster", "serve"]:
        parser, rest = build_cluster_serve_parser(), argv[:lead] + argv[lead + 2:]
    args = parser.parse_args(rest)
    args.argv = ["prefixcache", *argv]  # for a result's metadata
    if args.no_import:
        os.environ[NO_IMPORT_ENV] = "1"  # read by the registry; inherited by any worker process
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        _import_plugins(getattr(args, "imports", None) or [])
        return func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        outputs = getattr(args, "outputs", None)  # set by the commands that write --out
        if outputs is not None:
            kept = f": {outputs.kept or 'nothing written'}"
        else:  # a command that kept something says what (generate, bench): KeyboardInterrupt(what)
            kept = f": {err.args[0]}" if err.args else ""
        print(f"interrupted{kept}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
