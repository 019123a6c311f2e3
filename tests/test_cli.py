"""The command line: each subcommand on a real file, errors as exit code 2 with the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.cli import main
from prefixcache.registry import NO_IMPORT_ENV

from cli_cases import junk_engine

CONFIGS = Path(__file__).parent.parent / "configs"


def test_validate_prints_resolved_config(capsys):
    assert main(["validate", str(CONFIGS / "radix.yaml")]) == 0
    out = capsys.readouterr().out
    assert "valid" in out and "backend: radix" in out and "algorithm: sha256_cbor" in out


def test_validate_reports_bad_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: {block_size: 0}\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: cache.block_size: must be an integer >= 1, got 0" in err


def run_validate(tmp_path, capsys, text: str, name: str = "f.yaml"):
    path = tmp_path / name
    path.write_text(text)
    code = main(["validate", str(path)])
    out, err = capsys.readouterr()
    return path, code, out, err


@pytest.mark.parametrize(
    "text, message",
    [
        ("cache: {backend: hash, options: {verify_hit: never}}",
         "cache.options.verify_hit: unknown option for backend hash; allowed: no_tail_cliff, retention, state_cap, state_granule, state_interval, verify_hits; did you mean 'verify_hits'?"),
        ("cache: {backend: hash, options: {verify_hits: maybe}}",
         "cache.options.verify_hits: 'maybe' is not allowed for backend hash; allowed values: auto, always, never"),
        ("cach: {block_size: 4}",
         "cache: missing required section; did you mean 'cache'? (found 'cach'); top-level keys found: cach"),
    ],
)
def test_validate_cache_file_errors_print_only_the_error(tmp_path, capsys, text, message):
    path, code, out, err = run_validate(tmp_path, capsys, text)
    assert code == 2 and out == ""
    assert err == f"error: {path}: {message}\n"


ENGINE_ERRORS = [
    ("engine: {max_tokens: 0}", "engine.max_tokens: must be an integer >= 1, got 0"),
    ("engine: {attention: gpu}", "engine.attention: 'gpu' is not allowed; allowed values: auto, cpu, reference"),
    ("engine: {prefix_cache: true}", "engine.prefix_cache: unknown key; allowed keys: model, seed"),
    ("engine: {model: huge}", "engine.model: 'huge' is not a built-in model or a .gguf path; "
     "allowed: smollm2, tiny, tiny-hybrid, gemma3 (built-in) or the path of an existing .gguf file"),
    ("engine: {model: /nonexist.gguf}", "engine.model: no such file '/nonexist.gguf'"),
    ("engin: {}", "engin: unknown section; allowed sections: cache, engine; did you mean 'engine'?"),
]


@pytest.mark.parametrize("engine, message", ENGINE_ERRORS)
def test_validate_rejects_what_generate_rejects(tmp_path, capsys, engine, message):
    path, code, out, err = run_validate(tmp_path, capsys, f"cache: {{block_size: 4}}\n{engine}\n")
    assert (code, out) == (2, "")
    assert f"error: {path}: {message}" in err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["generate", "--config", str(path), "--prompts", str(prompts)]) == 2
    assert f"error: {path}: {message}" in capsys.readouterr().err


def test_validate_an_engine_file_prints_both_sections(tmp_path, capsys):
    path, code, out, err = run_validate(tmp_path, capsys, "cache: {block_size: 4}\nengine: {model: tiny}\n")
    assert code == 0 and err == ""
    assert "valid (cache and engine" in out and "block_size: 4" in out and "model: tiny" in out
    assert main(["validate", str(CONFIGS / "engine.yaml")]) == 0
    assert "model: smollm2" in capsys.readouterr().out


def test_generate_reports_a_model_file_that_does_not_load(tmp_path, capsys):
    config, prompts = junk_engine(tmp_path)
    # validate reads the model's geometry (its GGUF metadata) to size the engine, so it
    # refuses what generate would
    assert main(["validate", str(config)]) == 2
    assert f"error: {config}: engine.model: cannot load '{tmp_path / 'junk.gguf'}'" in capsys.readouterr().err
    assert main(["generate", "--config", str(config), "--prompts", str(prompts)]) == 2
    assert f"error: {config}: engine.model: cannot load '{tmp_path / 'junk.gguf'}'" in capsys.readouterr().err


def test_validate_lists_every_mistake_with_a_did_you_mean_for_names(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  backend: radx\n  block_size: 0\n  num_blockz: 10\n  eviction: lfuu\n")
    assert main(["validate", str(bad)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"error: {bad}: cache.num_blockz: unknown key; allowed keys: backend, block_size, ")
    assert lines[0].endswith("; did you mean 'num_blocks'?")
    assert lines[1:] == [
        f"error: {bad}: cache.block_size: must be an integer >= 1, got 0",
        f"error: {bad}: cache.backend: unknown backend 'radx'; known: hash, radix, or 'package.module:ClassName'; "
        "did you mean 'radix'?",
        f"error: {bad}: cache.eviction: unknown eviction policy 'lfuu'; known: chain, fifo, filo, gslru, lfu, lru, mru, "
        "priority, slru, tlru, or 'package.module:ClassName'; did you mean 'lfu'?",
    ]
    section = tmp_path / "section.yaml"
    section.write_text("cache: [1, 2]\n")  # a section that is not a mapping: one error, none made up after it
    assert main(["validate", str(section)]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_validate_does_not_check_a_refused_backends_options_against_the_default_one(tmp_path, monkeypatch, capsys):
    """With imports off, a plugin backend is refused; its options are that backend's, not
    the default `hash`'s, so no second error claims they are unknown for `hash`."""
    monkeypatch.setenv(NO_IMPORT_ENV, "1")  # what --no-import sets, undone after the test
    plugin = tmp_path / "plugin.yaml"
    plugin.write_text("cache:\n  backend: 'min_match:MinMatchHash'\n  evicton: lru\n  options: {min_tokens: 64}\n")
    assert main(["validate", str(plugin)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"error: {plugin}: cache.evicton: unknown key")
    assert lines[1].startswith(f"error: {plugin}: cache.backend: backend 'min_match:MinMatchHash' is an import path")
    bad_option = tmp_path / "bad_option.yaml"  # a named backend's options are still checked
    bad_option.write_text("cache:\n  backend: hash\n  options: {min_tokens: 64}\n")
    assert main(["validate", str(bad_option)]) == 2
    assert "cache.options.min_tokens: unknown option for backend hash" in capsys.readouterr().err


def test_readme_paths_work_from_any_directory(tmp_path, monkeypatch, capsys):
    """`configs/...` and `examples/prompts.jsonl` as the README writes them, run where no
    such folder exists: the shipped copies are used, and said to be."""
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "configs/hash.yaml"]) == 0
    out = capsys.readouterr()
    assert "configs/hash.yaml: not in" in out.err and "using the shipped hash.yaml" in out.err
    assert "backend: hash" in out.out
    assert main(["validate", "configs/nope.yaml"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
