"""`prefixcache ab`, `sweep` and `validate` on A/B files, end to end on small configs."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import prefixcache.ab_report
from prefixcache.ab import ABResult
from prefixcache.ab_report import PlotUnavailable
from prefixcache.cli import default_ab_config, main
from prefixcache.workloads import synthetic_records, write_records

from cli_cases import CONFIGS, TINY, write_config



def tiny(tmp_path: Path, text: str = TINY) -> Path:
    return write_config(tmp_path, text)


def is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_ab_writes_table_json_csv_and_png(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["ab", str(tiny(tmp_path)), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "A/B on shared_prefix: 12 requests" in text and "pool 512 tokens" in text
    for series in ("hash/16", "radix/1", "ceiling B=1", "belady B=16"):
        assert series in text
    result = ABResult.read_json(out / "ab.json")
    assert [a.name for a in result.arms] == ["hash/16", "radix/1"]
    assert [a.capacity_blocks for a in result.arms] == [32, 512]
    assert (out / "ab_summary.csv").read_text().count("\n") == 1 + 2 + 4
    assert (out / "ab_requests.csv").read_text().count("\n") == 1 + 12
    assert is_png(out / "ab.png")


def test_ab_without_arguments_runs_the_shipped_default_within_a_minute(tmp_path, capsys):
    start = time.perf_counter()
    assert main(["ab", "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - start < 60
    text = capsys.readouterr().out
    assert f"config: {default_ab_config()} (the shipped default)" in text
    summary = json.loads((tmp_path / "ab.json").read_text())
    assert [a["name"] for a in summary["arms"]] == ["hash/16", "radix/16", "radix/1"]
    assert summary["workload"]["requests"] == 512 and is_png(tmp_path / "ab.png")


def test_sweep_writes_csv_and_png(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", str(tiny(tmp_path)), "--capacities", "256", "2e3", "--out", str(out)]) == 0
    assert "Sweep on shared_prefix" in capsys.readouterr().out
    rows = (out / "sweep.csv").read_text().splitlines()
    assert rows[0] == "series,kind,block_size,capacity_tokens,hit_ratio,last_half_hit_ratio,evicted_blocks,rejected"
    assert len(rows) == 1 + 6 * 2 and {r.split(",")[3] for r in rows[1:]} == {"256", "2000"}
    assert is_png(out / "sweep.png")
    assert json.loads((out / "sweep.json").read_text())["capacities"] == [256, 2000]


def test_sweep_defaults_to_the_configs_capacities_and_rejects_bad_ones(tmp_path, capsys):
    assert main(["sweep", str(tiny(tmp_path)), "--out", str(tmp_path / "s")]) == 0
    assert json.loads((tmp_path / "s" / "sweep.json").read_text())["capacities"] == [256, 1024]
    with pytest.raises(SystemExit):
        main(["sweep", str(tiny(tmp_path)), "--capacities", "lots"])
    assert "a capacity in TOKENS must be a number like 32768 or 3e6, got 'lots'" in capsys.readouterr().err
    assert main(["sweep", str(tiny(tmp_path)), "--capacities", "8", "--out", str(tmp_path / "s")]) == 2
    assert "--capacities: capacity 8 must be an int of TOKENS >= the largest block size 16" in capsys.readouterr().err


def test_mooncake_config_replays_the_trace_given_on_the_command_line(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    write_records(trace, synthetic_records(120, seed=4))
    assert main(["ab", str(CONFIGS / "mooncake.yaml")]) == 2
    assert "workload.mooncake.path: no trace given: set it, or pass --trace PATH" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["ab", str(CONFIGS / "mooncake.yaml"), "--trace", str(trace), "--out", str(out)]) == 0
    result = ABResult.read_json(out / "ab.json")
    assert result.workload["name"] == "trace" and len(result.prompt_tokens) == 120
    assert [(a.name, a.block_size, a.capacity_blocks) for a in result.arms] == [
        ("hash/512", 512, 5859), ("radix/512", 512, 5859)]
    assert result.arm("hash/512").hits == result.bound("infinite", 512).hits  # 3M tokens hold it all


def test_missing_matplotlib_still_writes_json_and_csv_and_says_how_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(PlotUnavailable, match="PNG plots need matplotlib, which is not installed"):
        prefixcache.ab_report.plot_ab(None, tmp_path / "x.png")  # type: ignore[arg-type]
    assert main(["ab", str(tiny(tmp_path)), "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "pip install 'prefixcache[plot]'" in err and "no ab.png written" in err
    assert (tmp_path / "ab.json").exists() and (tmp_path / "ab_summary.csv").exists()
    assert not (tmp_path / "ab.png").exists()


def test_validate_an_ab_file_prints_resolved_arms_and_the_workload(tmp_path, capsys):
    assert main(["validate", str(tiny(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "valid A/B" in out and "num_blocks: 32" in out and "num_blocks: 512" in out
    assert "# workload shared_prefix: 12 requests" in out and "analytic ceiling B=1: 0.6250, B=16: 0.6000" in out
    assert main(["validate", str(CONFIGS / "mooncake.yaml")]) == 0
    assert "path given at run time with --trace PATH" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, message",
    [
        (("capacity_tokens: 512", "capacity_tokens: -5"), "capacity_tokens: must be an integer >= 1, got -5"),
        (("hash/16: {backend: hash, block_size: 16}", "hash/16: {backend: hash, block_size: 16, num_blocks: 9}"),
         "arms.hash/16.num_blocks: set the pool size once with capacity_tokens"),
        (("radix/1: {backend: radix, block_size: 1}", "radix/1: {backend: radix, block_size: 1, eviction: rand}"),
         "arms.radix/1.eviction: unknown eviction policy 'rand'; known: chain, fifo, filo, gslru, lfu, lru"),
        (("generator: shared_prefix", "generator: shared"), "workload.generator: unknown generator 'shared'; "
         "allowed values: shared_prefix, few_shot"),
        (("seed: 2}", "sead: 2}"), "workload.params.sead: unknown parameter of generator 'shared_prefix'; "
         "allowed keys: num_groups, prompts_per_group"),
        (("num_groups: 3", "num_groups: -3"), "workload.params: num_groups must be an int >= 1, got -3"),
        (("radix/1: {backend: radix, block_size: 1}", "radix/1: {backend: radix, block_size: 1, options: {x: 1}}"),
         "arms.radix/1.options.x: unknown option for backend radix; allowed: chunked_prefill_size, mamba_chunk, mamba_track_interval, no_tail_cliff, state_cap"),
        (("hash/16: {backend: hash, block_size: 16}",
          "hash/16: {backend: hash, block_size: 16, options: {verify_hitz: never}}"),
         "arms.hash/16.options.verify_hitz: unknown option for backend hash; allowed: no_tail_cliff, retention, state_cap, state_granule, state_interval, verify_hits"),
        (("hash/16: {backend: hash, block_size: 16}",
          "hash/16: {backend: hash, block_size: 16, options: {verify_hits: maybe}}"),
         "arms.hash/16.options.verify_hits: 'maybe' is not allowed for backend hash; allowed values: auto, always"),
        (("arms:", "arm:"), "arm: unknown key; allowed keys: workload, arms, capacity_tokens, max_concurrent, "
         "sweep_capacities; did you mean 'arms'?"),
    ],
)
def test_bad_ab_files_exit_2_with_file_key_path_and_allowed_values(tmp_path, capsys, change, message):
    path = tiny(tmp_path, TINY.replace(*change))
    assert main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert f"error: {path}: {message}" in err
    assert out == ""  # only the error: no "valid A/B" and resolved YAML before it
    assert main(["ab", str(path), "--out", str(tmp_path / "o")]) == 2
    assert f"error: {path}: {message}" in capsys.readouterr().err


def test_a_trace_path_that_does_not_exist_is_a_load_error(tmp_path, capsys):
    text = (CONFIGS / "mooncake.yaml").read_text().replace("path: null", "path: nowhere/trace.jsonl")
    path = tiny(tmp_path, text)
    assert main(["validate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"error: {path}: workload.mooncake.path: no such file 'nowhere/trace.jsonl' "
                                 "(a relative path is read from the current directory)\n")
    trace = tmp_path / "t.jsonl"
    write_records(trace, synthetic_records(10, seed=1))
    assert main(["validate", str(tiny(tmp_path, text.replace("nowhere/trace.jsonl", str(trace))))]) == 0
    # --trace replaces the file's workload, so its stale path no longer matters; a --trace
    # that does not exist is named as such.
    assert main(["ab", str(path), "--trace", str(trace), "--out", str(tmp_path / "o")]) == 0
    capsys.readouterr()
    assert main(["ab", str(path), "--trace", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert f"--trace: no such file '{tmp_path / 'none.jsonl'}'" in capsys.readouterr().err


def test_the_default_ab_config_is_package_data():
    import importlib.resources

    installed = importlib.resources.files("prefixcache.configs")
    for shipped in CONFIGS.glob("*.yaml"):  # every shipped YAML, not only the default
        assert (installed / shipped.name).read_text() == shipped.read_text()
    assert default_ab_config().read_text() == (CONFIGS / "ab.yaml").read_text()


def test_a_missing_default_says_how_to_fix_it(monkeypatch, capsys):
    import importlib.resources

    def not_installed(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", not_installed)
    assert main(["ab"]) == 2
    assert "pip install -e . again" in capsys.readouterr().err


def test_a_backend_or_block_size_override_relabels_the_arms_it_changes():
    from prefixcache.overrides import apply_overrides, relabel_arms, shortcut_overrides

    data = {"arms": {"hash/16": {"backend": "hash", "block_size": 16}, "radix/16": {"backend": "radix", "block_size": 16},
                     "mine": {"backend": "hash", "block_size": 16}}}
    after = relabel_arms(data, apply_overrides(data, shortcut_overrides(data, "backend", "radix")))
    assert list(after["arms"]) == ["radix/16-was-hash/16", "radix/16", "mine"]  # a user's own name stays
    after = relabel_arms(data, apply_overrides(data, shortcut_overrides(data, "block_size", 32)))
    assert list(after["arms"]) == ["hash/32", "radix/32", "mine"]


@pytest.mark.parametrize("name", ["ab_hybrid.yaml", "ab_hybrid_radix.yaml", "ab_hybrid_tails.yaml"])
def test_the_shipped_hybrid_ab_files_load(name):
    """Each arm's cache config (layouts, options) is checked at load, as `prefixcache ab` does."""
    from prefixcache.ab_config import load_ab_config

    config = load_ab_config(CONFIGS / name)
    assert config.arms and all(arm.groups.hybrid or not arm.layout for arm in config.arms.values())
