"""`prefixcache bench`: the command, from its flags to the table and the JSON file.

Owns wiring the loadgen modules together for the command line: validate the flags,
build the schedule, run it with a progress bar on a terminal (a line per
`--progress-every` finished requests otherwise), stop cleanly on Ctrl-C (what finished
is reported and written), print the table, write `--out`.

Must never: hold benchmark logic of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefixcache.config import ConfigError
from prefixcache.loadgen.client import RequestResult
from prefixcache.loadgen.options import options_from_args
from prefixcache.loadgen.report import summary_tables, write_json
from prefixcache.loadgen.runner import run_bench
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
    """Run `prefixcache bench` with parsed `args`; the exit code."""
    options = options_from_args(args)
    schedule, _ = build_schedule(options)
    console = Console(width=shutil.get_terminal_size((160, 24)).columns)
    prompt_tokens = sum(len(r.prompt) for r in schedule)
    console.print(f"# {len(schedule)} requests ({prompt_tokens:,} prompt tokens) from {options.source}; "
                  f"max concurrency {options.max_concurrency or 'unlimited'}; at most {options.duration_s:g} s",
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
    return 0 if summary.completed else 1
