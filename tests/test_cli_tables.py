"""Tables fit the terminal (whole columns dropped by priority, never a number or an arm name
cut) and print as table, markdown, json or csv."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.tables import Column, Table, fit, render

from cli_cases import write_config

THREE_ARMS = """
workload:
  generator: multi_turn
  params: {num_conversations: 4, turns: 3, system_prompt_len: 64, question_len: 20, answer_len: 30, seed: 0}
capacity_tokens: 1024
arms:
  hash/16:  {backend: hash, block_size: 16}
  radix/16: {backend: radix, block_size: 16}
  radix/1:  {backend: radix, block_size: 1}
"""



@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """These tests read tables and JSON: no PNG is drawn (seconds each on a busy machine)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)

def three_arms(tmp_path: Path) -> Path:
    return write_config(tmp_path, THREE_ARMS, "ab.yaml")


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("┃", "│", "┏", "┡", "└", "├"))]


@pytest.mark.parametrize("columns", [80, 100, 200])
def test_the_ab_table_fits_the_terminal_and_cuts_no_number_or_name(tmp_path, capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    out = tmp_path / "o"
    assert main(["ab", str(three_arms(tmp_path)), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "…" not in text
    assert all(len(line) <= columns for line in table_lines(text))
    rows = json.loads((out / "ab.json").read_text())["arms"]
    body = "\n".join(table_lines(text))
    for arm in rows:
        assert f"│ {arm['name']} " in body and f"{arm['hit_ratio']:.4f}" in body
    hidden = "column(s) hidden to fit" in " ".join(text.split())
    assert hidden == (columns < 200)
    if columns == 80:  # the lowest priorities went first; the hit ratios and savings stayed
        assert "µs p99" not in body and "events" not in body and "prefill" in body


def test_fit_drops_the_lowest_keep_first_and_never_a_kept_column():
    cols = (Column("name", "name", keep=None, left=True), Column("a", "a", keep=2), Column("b", "b", keep=0),
            Column("c", "c", keep=1))
    table = Table("t", cols, ({"name": "x" * 10, "a": 1234567, "b": 7654321, "c": 1111111},))
    assert [c.key for c in fit(table, 100)[0]] == ["name", "a", "b", "c"]
    assert [c.key for c in fit(table, 35)[0]] == ["name", "a", "c"]
    assert [c.key for c in fit(table, 30)[0]] == ["name", "a"]
    assert [c.key for c in fit(table, 10)[0]] == ["name"]  # too narrow even so: the name is kept whole
    assert [c.key for c in fit(table, 10)[1]] == ["b", "c", "a"]


def test_fit_counts_the_width_rich_draws():
    from rich.console import Console

    cols = (Column("name", "a name", keep=None, left=True), Column("n", "some count", lambda v: f"{v:,}"))
    table = Table("t", cols, ({"name": "ceiling B=16", "n": 1234567}, {"name": "x", "n": 5}))
    console = Console(width=200, file=io.StringIO())
    console.print(render(table, "table", 200))
    drawn = max(len(line) for line in console.file.getvalue().splitlines())
    assert drawn == 1 + (12 + 3) + (9 + 3)  # each column: its widest cell, a space each side, a rule
    assert [c.key for c in fit(table, drawn)[0]] == ["name", "n"] and fit(table, drawn - 1)[1] == (cols[1],)


def test_the_sweep_table_drops_last_half_columns_before_whole_run_ones(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    capacities = [str(256 << k) for k in range(8)]
    assert main(["sweep", str(three_arms(tmp_path)), "--capacities", *capacities, "--out", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    body = "\n".join(table_lines(text))
    assert "…" not in text and all(len(line) <= 80 for line in table_lines(text))
    hidden = " ".join(text.split()).split("hidden to fit 80 columns: ")[1].split(" (widen")[0].split(", ")
    # every last-50% column went (rightmost first) before the first whole-run one
    assert hidden[:8] == [f"{int(c):,} last 50%" for c in reversed(capacities)]
    assert all(h.endswith(" tok") for h in hidden[8:])
    assert "radix/16" in body and all(f"{int(c):,}" in body for c in capacities if f"{int(c):,} tok" not in hidden)


def test_formats(tmp_path, capsys):
    config = str(three_arms(tmp_path))
    assert main(["ab", config, "--out", str(tmp_path / "o"), "--format", "json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)  # stdout is only the table: notes and progress went to stderr
    assert [r["series"] for r in rows][:3] == ["hash/16", "radix/16", "radix/1"]
    assert "wrote" in captured.err
    assert main(["ab", config, "--out", str(tmp_path / "o"), "--format", "csv"]) == 0
    records = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert records[0]["series"] == "hash/16" and float(records[0]["hit_ratio"]) == rows[0]["hit_ratio"]
    assert main(["ab", config, "--out", str(tmp_path / "o"), "--format", "markdown"]) == 0
    text = capsys.readouterr().out
    assert "| series | backend | B |" in text and "| hash/16 | hash | 16 |" in text
    assert main(["sweep", config, "--capacities", "256", "--out", str(tmp_path / "s"), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)[0] == {"series": "hash/16", "hit_ratio@256": pytest.approx(
        json.loads((tmp_path / "s" / "sweep.json").read_text())["points"][0]["hit_ratio"]),
        "last_half_hit_ratio@256": pytest.approx(json.loads((tmp_path / "s" / "sweep.json").read_text())
                                                 ["points"][0]["last_half_hit_ratio"])}


def test_render_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="unknown format 'html'; allowed: table, markdown, json, csv"):
        render(Table("t", (Column("a", "a"),), ()), "html", 80)
