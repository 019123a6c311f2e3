"""`prefixcache bench`: the command, from its flags to the table and the JSON file.

Owns wiring the loadgen modules together for the command line: validate the flags,
build the schedule, run it with a progress bar on a terminal (a line per
`--progress-every` finished requests otherwise), stop cleanly on Ctrl-C (what finished
is reported and written, and the command exits 130 saying so), print the table, write
`--out`. Before anything is sent it checks `--out` (a folder is refused; a missing
parent folder is created, and said to be) and asks the server for its model and
vocabulary (`runner.probe_server`), so the token ids fit the server's vocabulary.

Must never: hold benchmark logic of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefixcache.config import ConfigError
from prefixcache.loadgen.client import RequestResult
from prefixcache.loadgen.options import FALLBACK_VOCAB_SIZE, options_from_args
from prefixcache.loadgen.report import summary_tables, write_json
from prefixcache.loadgen.runner import probe_server, run_bench
from prefixcache.loadgen.schedule import build_schedule
from prefixcache.loadgen.summary import summarize

__all__ = ["bench"]


@contextmanager
def _progress(console: Console, every: int) -> Iterator[Callable[[RequestResult, int, int], None]]:
    if console.is_terminal:
        columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = None

            def update(result: RequestResult, finished: int, planned: int) -> None:
                nonlocal task
                if task is None:
                    task = bar.add_task("requests", total=planned)
                bar.update(task, completed=finished)

            yield update
        return

    def line(result: RequestResult, finished: int, planned: int) -> None:
        if finished % every == 0 or finished == planned:
            console.print(f"{finished}/{planned} requests finished", highlight=False)

    yield line


def bench(args: argparse.Namespace) -> int:
    """Run `prefixcache bench` with parsed `args`; the exit code. Ctrl-C: what finished is
    reported and written, then `KeyboardInterrupt` saying so (the CLI exits 130)."""
    options = options_from_args(args)
    created = _prepare_out(options.out)
    console = Console(width=shutil.get_terminal_size((160, 24)).columns)
    try:  # before anything is sent: the server answers, and its vocabulary
        model, served_vocab = asyncio.run(probe_server(options))
    except RuntimeError as err:
        raise ConfigError("--base-url", str(err)) from None
    vocab = options.vocab_size or served_vocab
    if vocab is None:
        vocab = FALLBACK_VOCAB_SIZE
        console.print(f"# {options.base_url} reports no vocabulary size (GET /model_info): token ids in "
                      f"[0, {vocab:,}); pass --vocab-size V if its vocabulary is smaller", highlight=False)
    options = dataclasses.replace(options, model=model, vocab_size=vocab)
    schedule, _ = build_schedule(options)
    prompt_tokens = sum(len(r.prompt) for r in schedule)
    console.print(f"# {len(schedule)} requests ({prompt_tokens:,} prompt tokens, ids < {vocab:,}) from "
                  f"{options.source} to {model}; max concurrency {options.max_concurrency or 'unlimited'}; "
                  f"at most {options.duration_s:g} s" + (f"; created {created} for --out" if created else ""),
                  highlight=False)
    stop = asyncio.Event()

    async def main() -> object:
        loop = asyncio.get_running_loop()
        try:  # Ctrl-C: stop sending, cancel what is in flight, report what finished
            loop.add_signal_handler(signal.SIGINT, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):
            pass
        with _progress(console, options.progress_every) as progress:
            return await run_bench(options, schedule, progress=progress, stop=stop)

    try:
        run = asyncio.run(main())
    except RuntimeError as err:
        raise ConfigError("--base-url", str(err)) from None
    summary = summarize(run.results, run.planned, run.duration_s)
    for table in summary_tables(summary, run, options):
        console.print(table)
    failures = [r for r in run.results if not r.ok]
    if failures:
        console.print(f"{len(failures)} requests failed; the first: {failures[0].error}", highlight=False)
    if options.out:
        write_json(options.out, summary, run, options)
        console.print(f"wrote {options.out}", highlight=False)
    if run.stopped_by == "interrupted":
        where = f"in {options.out}" if options.out else "reported above (no --out)"
        raise KeyboardInterrupt(f"kept {len(run.results)} finished request(s) {where}")
    return 0 if summary.completed else 1


def _prepare_out(out: str | None) -> Path | None:
    """Check `--out` before anything is sent (ConfigError naming it); create its folder.
    The folder created, if one was."""
    if out is None:
        return None
    folder = Path(out).resolve().parent
    missing = None if folder.exists() else folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError("--out", f"cannot create folder {str(folder)!r}: {err.strerror}") from None
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ConfigError("--out", f"folder {str(folder)!r} is not writable")
    return missing
