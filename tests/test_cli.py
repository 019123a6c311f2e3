"""The command line: each subcommand on a real file, errors as exit code 2 with the message."""

from __future__ import annotations

from pathlib import Path

from prefixcache.cli import main

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
