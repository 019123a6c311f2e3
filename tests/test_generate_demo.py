"""`prefixcache generate` shows the cache: the shipped demo (configs/engine.yaml with
examples/prompts.jsonl) run on the tiny model hits its shared prefix, because its prompts
arrive over time (requests admitted in one step all miss a prefix none has computed yet); `--json` carries each request's TTFT and cached tokens; generation runs
with a passive OpenMP wait policy unless the environment sets one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prefixcache.config import ConfigError
from prefixcache.engine.cli import generate, read_prompts_file
from prefixcache.engine.engine import Engine, GenerationRequest

ROOT = Path(__file__).resolve().parents[1]
DEMO_PROMPTS = ROOT / "examples" / "prompts.jsonl"
JSON_FIELDS = {
    "request_id", "text", "token_ids", "finish_reason", "prompt_tokens", "cached_tokens",
    "computed_prompt_tokens", "output_tokens", "ttft_s", "tpot_s", "latency_s", "preemptions",
}


def _demo_config_on_tiny(tmp_path: Path) -> Path:
    """configs/engine.yaml exactly, but for the model: the seeded tiny one."""
    data = yaml.safe_load((ROOT / "configs" / "engine.yaml").read_text())
    data["engine"]["model"] = "tiny"
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_demo_hits_the_shared_prefix_and_json_carries_ttft_and_cached_tokens(tmp_path, capsys):
    assert generate(_demo_config_on_tiny(tmp_path), DEMO_PROMPTS, as_json=True) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]

    assert [r["request_id"] for r in rows] == [f"line-{n}" for n in range(1, 7)]
    for r in rows:
        assert JSON_FIELDS <= set(r)
        assert r["ttft_s"] > 0 and r["latency_s"] >= r["ttft_s"] and r["preemptions"] == 0
        assert r["cached_tokens"] + r["computed_prompt_tokens"] == r["prompt_tokens"]
        assert r["output_tokens"] == len(r["token_ids"])
    first, *same_namespace, other_namespace = rows
    assert first["cached_tokens"] == 0  # nothing is cached yet
    # Each later request arrives after the first one's prefill committed the system prompt.
    assert all(r["cached_tokens"] >= 16 * 50 for r in same_namespace)
    assert other_namespace["cached_tokens"] == 0  # tenant-b never hits the default namespace


def test_arrivals_are_read_per_line_and_bad_ones_name_the_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "arrival_s": 1.5}\n{"prompt": "b"}\n')
    assert read_prompts_file(path).arrival_offsets_s == [1.5, 0.0]
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    assert read_prompts_file(path).arrival_offsets_s is None  # all at once
    for bad in ("-1", '"soon"', "true", "1e999"):
        path.write_text('{"prompt": "a"}\n{"prompt": "b", "arrival_s": %s}\n' % bad)
        with pytest.raises(ConfigError, match=rf"p\.jsonl:2: arrival_s: must be a number of SECONDS >= 0"):
            read_prompts_file(path)


def test_engine_generate_adds_each_request_at_its_arrival(tmp_path):
    prefix = list(range(1, 65))
    requests = [GenerationRequest(prompt=prefix + [70, 71], max_tokens=2), GenerationRequest(prompt=prefix + [80], max_tokens=2)]
    config = _tiny_config(tmp_path, "in_batch_prefix_tokens: 0")
    at_once = Engine.from_yaml(config).generate(requests)
    assert [o.metrics.cached_tokens for o in at_once] == [0, 0]  # both admitted in the first step
    engine = Engine.from_yaml(config)
    outs = engine.generate(requests, arrival_offsets_s=[0.0, 0.05])
    assert [o.metrics.cached_tokens for o in outs] == [0, 64]
    assert [o.token_ids for o in outs] == [o.token_ids for o in at_once]
    # At once, with the default in_batch_prefix_tokens (32), the second waits for the first's
    # prefill and hits it, as it does arriving later.
    waited = Engine.from_yaml(_tiny_config(tmp_path))
    assert [o.metrics.cached_tokens for o in waited.generate(requests)] == [0, 64]
    assert waited.stats().prefix_waits == 1
    assert outs[1].metrics.arrival_s - outs[0].metrics.arrival_s == pytest.approx(0.05)
    for offsets, message in (([0.0], "1 offsets for 2 requests"), ([0.0, -1.0], r"arrival_offsets_s\[1\]")):
        with pytest.raises(ValueError, match=message):
            engine.generate([[1, 2], [3, 4]], arrival_offsets_s=offsets)
    engine.check_invariants()


def _tiny_config(tmp_path: Path, engine: str = "") -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text("cache: {backend: hash, block_size: 16, num_blocks: 64}\nengine: {model: tiny%s}\n"
                    % (", " + engine if engine else ""))
    return path


@pytest.mark.parametrize(("preset", "expected"), [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_generation_sets_a_passive_openmp_wait_policy_unless_one_is_set(preset, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset is not None:
        env["OMP_WAIT_POLICY"] = preset
    # Import what `prefixcache generate` imports, and read the policy at the moment torch's
    # import starts (OpenMP reads it once, when torch loads); the import stops there.
    code = (
        "import os, sys\n"
        "class AtTorch(Exception): pass\n"
        "class Finder:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            print(os.environ.get('OMP_WAIT_POLICY'))\n"
        "            raise AtTorch\n"
        "sys.meta_path.insert(0, Finder())\n"
        "import prefixcache.cli\n"
        "try:\n"
        "    import prefixcache.engine.cli\n"
        "except AtTorch:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('prefixcache.engine.cli never imported torch')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == expected
