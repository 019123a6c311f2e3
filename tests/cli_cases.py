"""Small inputs the command-line tests share: a tiny A/B file and an engine file whose
model does not load (so `generate` fails fast, before any model work)."""

from __future__ import annotations

import textwrap
from pathlib import Path

CONFIGS = Path(__file__).parent.parent / "configs"

TINY = """
workload:
  generator: shared_prefix
  params: {num_groups: 3, prompts_per_group: 4, system_prompt_len: 100, question_len: 20, output_len: 8, seed: 2}
capacity_tokens: 512
sweep_capacities: [256, 1024]
arms:
  hash/16: {backend: hash, block_size: 16}
  radix/1: {backend: radix, block_size: 1}
"""
"""12 requests through two arms of 512 tokens: well under a second."""


def write_config(tmp_path: Path, text: str = TINY, name: str = "tiny.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def junk_engine(tmp_path: Path) -> tuple[Path, Path]:
    """(an engine config naming a model file that is not GGUF, a one-prompt JSONL file)."""
    (tmp_path / "junk.gguf").write_text("not a gguf file")
    config = tmp_path / "c.yaml"
    config.write_text(f"cache: {{}}\nengine: {{model: {tmp_path / 'junk.gguf'}}}\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    return config, prompts
