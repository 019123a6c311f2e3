"""One shape for every command: `prefixcache CMD [CONFIG] [--out DIR] [overrides]`,
`--version`, defaults in `--help`, and `--set` / `--seed` / `--backend` / `--block-size`
overrides validated exactly as the file is."""

from __future__ import annotations

import csv
import io
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
    monkeypatch.setattr(prefixcache.engine.cli, "generate", lambda path, prompts, **kw: seen.append(path) or 0)
    assert main(["generate", "--config", str(config), "--prompts", str(prompts)]) == 0
    assert "note: --config is deprecated; pass the config as the first argument" in capsys.readouterr().err
    assert main(["generate", "--prompts", str(prompts)]) == 0
    assert seen == [str(config), str(_shipped("engine.yaml", ""))]  # no CONFIG: the shipped engine.yaml


def _tiny_engine(tmp_path: Path) -> tuple[Path, Path]:
    """(an engine file on the tiny model, whose tokens are bytes, at block_size 4; two prompts:
    the second arrives after the first is computed and repeats its 28 tokens, then more)."""
    config = tmp_path / "engine.yaml"
    config.write_text("cache: {backend: hash, block_size: 4, num_blocks: 64}\n"
                      "engine: {model: tiny, max_tokens: 2, seed: 0}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello there, how are you, ok"}\n'
                       '{"prompt": "hello there, how are you, ok then", "arrival_s": 0.05}\n')
    return config, prompts


def test_generate_takes_overrides_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import prefixcache.engine.cli

    config, prompts = _tiny_engine(tmp_path)
    seen = []
    monkeypatch.setattr(prefixcache.engine.cli, "generate", lambda path, prompts, **kw: seen.append(kw) or 0)
    for args, message in (
        (["--set", "cache.block_size=0"], "(with command-line overrides): cache.block_size: must be an integer >= 1"),
        (["--set", "engine.max_tokns=3"], "engine.max_tokns: unknown key"),
        (["--block-size", "-4"], "cache.block_size: must be an integer >= 1, got -4"),
        (["--json", "--format", "csv"], "error: --json: is --format json; it cannot go with --format csv"),
    ):
        assert main(["generate", str(config), "--prompts", str(prompts), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert not seen  # refused before the engine (and torch's model) is touched
    assert main(["generate", str(config), "--prompts", str(prompts), "--set", "engine.max_tokens=5",
                 "--backend", "radix", "--seed", "9", "--format", "markdown"]) == 0
    assert seen[0]["fmt"] == "markdown" and seen[0]["config"].cache.backend == "radix"
    assert seen[0]["config"].engine.max_tokens == 5 and seen[0]["config"].engine.seed == 9
    assert main(["generate", str(config), "--prompts", str(prompts), "--json"]) == 0
    assert seen[1]["fmt"] == "json"


def test_generate_prints_every_format_on_the_tiny_model(tmp_path, capsys):
    config, prompts = _tiny_engine(tmp_path)
    base = ["generate", str(config), "--prompts", str(prompts), "--set", "cache.block_size=8"]
    assert main([*base, "--format", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [r["request_id"] for r in rows] == ["line-1", "line-2"]
    assert set(rows[0]) >= {"text", "token_ids", "cached_tokens", "computed_prompt_tokens", "ttft_s"}
    assert [int(r["cached_tokens"]) for r in rows] == [0, 24]  # 28 shared tokens in whole blocks of 8 (--set)
    assert all(len(r["token_ids"].split()) == int(r["output_tokens"]) == 2 for r in rows)
    assert main([*base, "--format", "json"]) == 0
    objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["cached_tokens"] for o in objects] == [0, 24]
    assert [o["token_ids"] for o in objects] == [[int(t) for t in r["token_ids"].split()] for r in rows]
    assert main([*base, "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "### line-1 (length, 2 tokens)" in out and "**Requests (model tiny, cache hash, block_size 8)**" in out
    assert "| request | prompt | cached | computed |" in out and "| prefill tokens saved (cache hits) | 24 |" in out
    assert main(base) == 0  # the default: tables that fit the terminal
    out = capsys.readouterr().out
    assert "### line-2 (length, 2 tokens)" in out and "prefill tokens saved (cache hits)" in out
    assert "| request |" not in out


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
