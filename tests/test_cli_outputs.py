"""The command line never loses work: `--out` checked before the work, results written as
each arm / capacity finishes (Ctrl-C keeps them and exits 130 with one line), empty inputs
refused with one line, no stale PNG beside new results, progress lines off a terminal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import prefixcache.ab
from prefixcache.cli import main

from cli_cases import CONFIGS, write_config



def tiny(tmp_path: Path) -> Path:
    return write_config(tmp_path)


def no_replay(*args, **kwargs):
    raise AssertionError("the replay started")


@pytest.mark.parametrize("command", ["ab", "sweep", "cluster"])
def test_an_out_that_is_a_file_is_refused_before_any_replay(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setattr(prefixcache.ab, "replay_arm", no_replay)
    import prefixcache.cluster.simulate as simulate

    monkeypatch.setattr(simulate, "run_cluster", no_replay)
    taken = tmp_path / "taken"
    taken.write_text("mine")
    config = str(CONFIGS / "cluster.yaml") if command == "cluster" else str(tiny(tmp_path))
    assert main([command, config, "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --out: '{taken}' is a file, not a folder: nothing was run\n"
    assert taken.read_text() == "mine"


def interrupt_on(n: int, monkeypatch):
    """Make the n-th arm replay (1-based) raise KeyboardInterrupt, as Ctrl-C would."""
    real, calls = prefixcache.ab.replay_arm, []

    def replay(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(prefixcache.ab, "replay_arm", replay)


def test_ctrl_c_in_ab_keeps_the_finished_arms_and_exits_130_with_one_line(tmp_path, capsys, monkeypatch):
    interrupt_on(2, monkeypatch)
    out = tmp_path / "o"
    assert main(["ab", str(tiny(tmp_path)), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"interrupted: kept 1 finished arm(s) in {out / 'ab.json'}"
    assert "Traceback" not in err
    assert [a["name"] for a in json.loads((out / "ab.json").read_text())["arms"]] == ["hash/16"]
    assert sorted(p.name for p in out.iterdir()) == ["ab.json"]  # no temporary file, no plot of nothing


def test_ctrl_c_in_sweep_keeps_the_finished_capacities(tmp_path, capsys, monkeypatch):
    interrupt_on(3, monkeypatch)  # two arms per capacity: the second capacity's first arm
    out = tmp_path / "s"
    assert main(["sweep", str(tiny(tmp_path)), "--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == f"interrupted: kept 1 finished capacity in {out / 'sweep.json'}"
    data = json.loads((out / "sweep.json").read_text())
    assert data["capacities"] == [256] and {p["capacity_tokens"] for p in data["points"]} == {256}
    assert (out / "sweep.csv").read_text().count("\n") == 1 + 2 + 4


def test_ctrl_c_before_anything_finished_says_so(tmp_path, capsys, monkeypatch):
    interrupt_on(1, monkeypatch)
    assert main(["ab", str(tiny(tmp_path)), "--out", str(tmp_path / "o")]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "interrupted: nothing written"


@pytest.mark.parametrize("command", ["ab", "sweep"])
def test_an_empty_trace_is_refused_with_one_line_before_any_output(tmp_path, capsys, command):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "o"
    assert main([command, str(CONFIGS / "mooncake.yaml"), "--trace", str(empty), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: {CONFIGS / 'mooncake.yaml'}: workload: the trace '{empty}' gives no requests: "
                            "nothing to replay\n")
    assert not out.exists()


def test_an_empty_trace_is_refused_by_cluster(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["cluster", str(CONFIGS / "cluster_mooncake.yaml"), "--trace", str(empty),
                 "--out", str(tmp_path / "o")]) == 2
    assert "gives no requests: nothing to replay" in capsys.readouterr().err


def test_no_stale_png_is_left_beside_new_results(tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    out.mkdir()
    (out / "ab.png").write_bytes(b"an old run's plot")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # this run cannot draw one
    assert main(["ab", str(tiny(tmp_path)), "--out", str(out)]) == 0
    assert "no ab.png written" in capsys.readouterr().err
    assert (out / "ab.json").exists() and not (out / "ab.png").exists()


def test_progress_is_one_plain_line_per_finished_unit_when_not_a_terminal(tmp_path, capsys):
    # 64 requests: the replay's own progress calls land on the last request too; one line still
    assert main(["ab", str(tiny(tmp_path)), "--set", "workload.params.num_groups=16", "--out", str(tmp_path / "o")]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("done ")]
    assert [line.split(":")[0] for line in lines] == ["done hash/16", "done radix/1", "done bounds"]
    assert lines[0].startswith("done hash/16: 64 of 64 in ") and lines[0].endswith(" s")


def test_ctrl_c_in_a_command_without_outputs_is_one_word(tmp_path, capsys, monkeypatch):
    import prefixcache.engine.cli
    from cli_cases import junk_engine

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(prefixcache.engine.cli, "generate", interrupted)
    config, prompts = junk_engine(tmp_path)
    assert main(["generate", str(config), "--prompts", str(prompts)]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def test_ctrl_c_in_cluster_keeps_the_finished_runs(tmp_path, capsys, monkeypatch):
    import prefixcache.cluster.simulate as simulate

    real, calls = simulate.simulate, []

    def router_run(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(simulate, "simulate", router_run)
    out = tmp_path / "c"
    assert main(["cluster", str(CONFIGS / "cluster.yaml"), "--replicas", "2",
                 "--set", "workload.params.num_conversations=4", "--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == f"interrupted: kept 2 finished run(s) in {out / 'cluster.json'}"
    runs = json.loads((out / "cluster.json").read_text())["runs"]
    assert [r["series"] for r in runs] == ["round_robin", "power_of_two"]
    assert (out / "cluster.csv").read_text().count("\n") == 1 + 2


def test_a_bad_capacity_is_refused_before_the_old_results_are_touched(tmp_path, capsys):
    out = tmp_path / "s"
    out.mkdir()
    (out / "sweep.png").write_bytes(b"the last good plot")
    assert main(["sweep", str(tiny(tmp_path)), "--capacities", "8", "--out", str(out)]) == 2
    assert "--capacities: capacity 8 must be an int of TOKENS >= the largest block size 16" in capsys.readouterr().err
    assert (out / "sweep.png").read_bytes() == b"the last good plot"
