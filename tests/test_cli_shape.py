"""One shape for every command: `prefixcache CMD [CONFIG] [--out DIR] [overrides]`,
`--version`, defaults in `--help`, and `--set` / `--seed` / `--backend` / `--block-size`
overrides validated exactly as the file is."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import prefixcache
from prefixcache.cli import _shipped, build_parser, main
from prefixcache.overrides import apply_overrides, parse_override

from cli_cases import CONFIGS, junk_engine, write_config




@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """These tests read tables and JSON: no PNG is drawn (seconds each on a busy machine)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)

def tiny(tmp_path: Path) -> Path:
    return write_config(tmp_path)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"prefixcache {prefixcache.__version__}\n"


@pytest.mark.parametrize("command, shown", [
    ("ab", ["(default: out/ab)", "(default: table)", "default: the shipped ab.yaml"]),
    ("sweep", ["(default: out/sweep)", "default: the shipped ab.yaml"]),
    ("cluster", ["(default: out/cluster)", "default: the shipped cluster.yaml"]),
    ("generate", ["default: the shipped engine.yaml", "deprecated"]),
    ("serve", ["(default: 127.0.0.1)", "(default: 8000)"]),
])
def test_help_shows_the_defaults(capsys, command, shown):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for s in shown:
        assert s in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_every_experiment_command_takes_the_config_as_an_optional_positional():
    parser = build_parser()
    for command in ("ab", "sweep", "cluster", "generate", "serve"):
        assert parser.parse_args([command] + (["--prompts", "p"] if command == "generate" else [])).config is None
        assert parser.parse_args([command, "f.yaml"] + (["--prompts", "p"] if command == "generate" else [])
                                 ).config == "f.yaml"


def test_sweep_runs_the_shipped_default_shrunk_with_set(tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["sweep", "--set", "workload.params.num_conversations=3", "--capacities", "4096",
                 "--out", str(out)]) == 0
    data = json.loads((out / "sweep.json").read_text())
    assert data["workload"]["requests"] == 3 * 8 and data["capacities"] == [4096]


def test_set_changes_the_loaded_data_and_shortcuts_set_every_arm(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["ab", str(tiny(tmp_path)), "--out", str(out), "--set", "capacity_tokens=1024",
                 "--set", "arms.radix/1.eviction=lfu", "--seed", "7"]) == 0
    data = json.loads((out / "ab.json").read_text())
    assert data["capacity_tokens"] == 1024 and [a["config"]["num_blocks"] for a in data["arms"]] == [64, 1024]
    assert data["arms"][1]["config"]["eviction"] == "lfu" and data["workload"]["params"]["seed"] == 7
    assert main(["ab", str(tiny(tmp_path)), "--out", str(out), "--block-size", "32", "--backend", "radix"]) == 0
    arms = json.loads((out / "ab.json").read_text())["arms"]
    assert [(a["config"]["backend"], a["config"]["block_size"], a["config"]["num_blocks"]) for a in arms] == [
        ("radix", 32, 16), ("radix", 32, 16)]


def test_shortcuts_on_a_cache_file(capsys):
    assert main(["validate", str(CONFIGS / "hash.yaml"), "--block-size", "32", "--backend", "radix"]) == 0
    out = capsys.readouterr().out
    assert "block_size: 32" in out and "backend: radix" in out and "with command-line overrides" in out


@pytest.mark.parametrize("args, message", [
    (["--set", "capacity_tokens=-5"], "(with command-line overrides): capacity_tokens: must be an integer >= 1, got -5"),
    (["--set", "arms.hash/16.evicton=lfu"], "arms.hash/16.evicton: unknown key; allowed keys:"),
    (["--set", "arms.radix/1.eviction=rand"], "arms.radix/1.eviction: unknown eviction policy 'rand'"),
    (["--block-size", "0"], "arms.hash/16.block_size: must be"),
    (["--set", "capacity_tokens"], "--set: expected key.path=value, got 'capacity_tokens'"),
    (["--set", "capacity_tokens.x=1"], "--set: capacity_tokens.x: 'capacity_tokens' is int 512, not a section"),
])
def test_a_bad_override_is_one_line_exit_2_before_any_work(tmp_path, capsys, args, message):
    out = tmp_path / "o"
    assert main(["ab", str(tiny(tmp_path)), "--out", str(out), *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and captured.out == ""
    assert not out.exists()


def test_a_shortcut_the_file_has_no_key_for_is_refused(capsys):
    assert main(["validate", str(CONFIGS / "mooncake.yaml"), "--seed", "3"]) == 2
    assert "error: --seed: this file has none of workload.params.seed, engine.seed, seed" in capsys.readouterr().err


def test_override_paths_match_keys_holding_dots():
    data = {"arms": {"a.b": {"block_size": 16}}}
    assert apply_overrides(data, [parse_override("arms.a.b.block_size=32")]) == {"arms": {"a.b": {"block_size": 32}}}
    assert data == {"arms": {"a.b": {"block_size": 16}}}  # the input is not changed
    assert parse_override("x.y=[1, 2]") == (("x", "y"), [1, 2]) and parse_override("x=null") == (("x",), None)


def test_generate_takes_the_config_positionally_and_the_old_flag_still_works(tmp_path, capsys, monkeypatch):
    config, prompts = junk_engine(tmp_path)
    expected = f"error: {config}: engine.model: cannot load"
    for args in ([str(config)], ["--config", str(config)]):
        assert main(["generate", *args, "--prompts", str(prompts)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(expected) and err.count("\n") == 1  # an error is one line, whichever form
    assert main(["generate", str(config), "--config", str(config), "--prompts", str(prompts)]) == 2
    assert "--config: give the config once" in capsys.readouterr().err
    import prefixcache.engine.cli

    seen = []
    monkeypatch.setattr(prefixcache.engine.cli, "generate", lambda path, prompts, as_json: seen.append(path) or 0)
    assert main(["generate", "--config", str(config), "--prompts", str(prompts)]) == 0
    assert "note: --config is deprecated; pass the config as the first argument" in capsys.readouterr().err
    assert main(["generate", "--prompts", str(prompts)]) == 0
    assert seen == [str(config), str(_shipped("engine.yaml", ""))]  # no CONFIG: the shipped engine.yaml


def test_serve_takes_overrides_checked_before_the_model_loads(capsys, monkeypatch):
    import prefixcache.serve.server

    started = []
    monkeypatch.setattr(prefixcache.serve.server, "serve", lambda path, **kw: started.append(kw["config"]) or 0)
    assert main(["serve", "--set", "kv_events.endpoint=udp://x"]) == 2
    assert "(with command-line overrides): kv_events.endpoint: must be a ZeroMQ endpoint" in capsys.readouterr().err
    assert not started
    assert main(["serve", "--block-size", "32"]) == 0
    assert started[0].serving.cache.block_size == 32


def test_serve_sets_a_passive_openmp_wait_policy_unless_one_is_set(monkeypatch):
    import os

    import prefixcache.serve.server

    seen = []
    monkeypatch.setattr(prefixcache.serve.server, "serve", lambda path, **kw: seen.append(os.environ.get("OMP_WAIT_POLICY")) or 0)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert main(["serve"]) == 0
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert main(["serve"]) == 0
    assert seen == ["PASSIVE", "ACTIVE"]
