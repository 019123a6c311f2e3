"""A results table as data, and its four renderings: a terminal table that fits a width,
Markdown, JSON and CSV.

Owns `Column`, `Table`, `render`, and `write` (a rendering to stdout, through the
terminal's `rich` console for `table`). The reports (`prefixcache.ab_report`,
`prefixcache.cluster.report`) say what the columns are; this module only lays them out.
Must never: compute a number, or cut one. A cell is never truncated: when the table is
wider than the terminal, whole columns are dropped, lowest `keep` first (the rightmost
of equals first), and the caption names what was dropped. Columns with `keep=None` are
never dropped; a table that is still too wide is printed whole at its own width (the
terminal wraps its lines).
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import rich.table
from rich.console import Console

__all__ = ["Column", "Table", "FORMATS", "render", "write", "terminal_console", "fit", "width_of"]

FORMATS = ("table", "markdown", "json", "csv")
"""What `--format` accepts: `table` (fits the terminal), `markdown` (every column), and the
table's raw values as `json` (a list of objects) or `csv` (a header line, then a row each)."""


def _plain(value: Any) -> str:
    return "-" if value is None else str(value)


@dataclass(frozen=True)
class Column:
    """One column: `key` into each row's values, the `header` shown, how a value is shown,
    and `keep` (higher stays longer when the terminal is narrow; None: never dropped)."""

    key: str
    header: str
    show: Callable[[Any], str] = _plain
    keep: int | None = 0
    left: bool = False


@dataclass(frozen=True)
class Table:
    """Rows of raw values (None shows as '-'), in column order; `dim` rows (reference
    lines) are dimmed in the terminal; a section rule follows each row in `section_after`."""

    title: str
    columns: tuple[Column, ...]
    rows: tuple[Mapping[str, Any], ...]
    caption: str | None = None
    dim: frozenset[int] = field(default_factory=frozenset)
    section_after: frozenset[int] = field(default_factory=frozenset)

    def cells(self, columns: Sequence[Column] | None = None) -> list[list[str]]:
        cols = self.columns if columns is None else columns
        return [[c.show(row.get(c.key)) for c in cols] for row in self.rows]


def _width(column: Column, cells: Sequence[str]) -> int:
    """Characters the column needs: its widest cell, and its header's longest word (a
    header wraps at spaces; a cell never does)."""
    return max([len(w) for w in column.header.split()] + [len(s) for s in cells] + [1])


def _needs(table: Table) -> dict[str, int]:
    cells = table.cells()
    return {c.key: _width(c, [row[i] for row in cells]) for i, c in enumerate(table.columns)}


def _total(needs: Mapping[str, int], columns: Sequence[Column]) -> int:
    """Characters a rich table of `columns` takes: each cell has a space either side and a
    rule after it, plus the first rule."""
    return 1 + sum(needs[c.key] + 3 for c in columns)


def fit(table: Table, width: int) -> tuple[tuple[Column, ...], tuple[Column, ...]]:
    """(the columns shown, the columns dropped) for a terminal `width` characters wide."""
    shown = list(table.columns)
    needs = _needs(table)
    dropped: list[Column] = []
    while _total(needs, shown) > width:
        droppable = [c for c in shown if c.keep is not None]
        if not droppable:
            break
        lowest = min(c.keep for c in droppable if c.keep is not None)
        victim = [c for c in droppable if c.keep == lowest][-1]
        shown.remove(victim)
        dropped.append(victim)
    return tuple(shown), tuple(dropped)


def _rich(table: Table, width: int) -> rich.table.Table:
    shown, dropped = fit(table, width)
    caption = table.caption
    if dropped:
        note = (f"{len(dropped)} column(s) hidden to fit {width} columns: "
                + ", ".join(c.header for c in dropped) + " (widen the terminal, or --format markdown|csv|json)")
        caption = f"{caption}; {note}" if caption else note
    out = rich.table.Table(title=table.title, caption=caption)
    needs = _needs(table)
    for c in shown:  # a fixed width: rich never shrinks it, so no cell is cut; a header wraps at spaces
        out.add_column(c.header, justify="left" if c.left else "right", width=needs[c.key])
    for k, row in enumerate(table.cells(shown)):
        out.add_row(*row, style="dim" if k in table.dim else None, end_section=k in table.section_after)
    return out


def width_of(table: rich.table.Table) -> int:
    """Characters a table from `render(..., "table", w)` takes (more than `w` only when its
    never-dropped columns alone are wider)."""
    return 1 + sum((c.width or 0) + 3 for c in table.columns)


def _markdown(table: Table) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(s.replace("|", "\\|") for s in cells) + " |"

    rule = ["---" if c.left else "---:" for c in table.columns]
    lines = [f"**{table.title}**", "", line([c.header for c in table.columns]), line(rule)]
    lines += [line(row) for row in table.cells()]
    if table.caption:
        lines += ["", table.caption]
    return "\n".join(lines) + "\n"


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def _records(table: Table) -> list[dict[str, Any]]:
    return [{c.key: _json_value(row.get(c.key)) for c in table.columns} for row in table.rows]


def render(table: Table, fmt: str, width: int) -> str | rich.table.Table:
    """`table` as `fmt` (one of FORMATS): a rich table fitted to `width` characters, or text."""
    if fmt == "table":
        return _rich(table, width)
    if fmt == "markdown":
        return _markdown(table)
    if fmt == "json":
        return json.dumps(_records(table), indent=1) + "\n"
    if fmt == "csv":
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=[c.key for c in table.columns], lineterminator="\n")
        writer.writeheader()
        for record in _records(table):
            writer.writerow({k: " ".join(map(str, v)) if isinstance(v, list) else v for k, v in record.items()})
        return buffer.getvalue()
    raise ValueError(f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")


def terminal_console() -> Console:
    """A console on stdout as wide as the terminal; a pipe or a test gets the terminal's
    width if it has one, else one wide enough for the tables."""
    return Console(width=shutil.get_terminal_size((160, 24)).columns)


def write(table: Table, fmt: str, console: Console) -> None:
    """`table` as `fmt` on stdout: text as it is, a terminal table through `console`
    (wider than the console only if its never-dropped columns are: then printed whole)."""
    out = render(table, fmt, console.width)
    if isinstance(out, str):
        sys.stdout.write(out)
        sys.stdout.flush()
    else:
        console.print(out, width=max(console.width, width_of(out)), crop=False)
