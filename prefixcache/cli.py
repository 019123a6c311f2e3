"""The `prefixcache` command line: thin glue from arguments to the library.

Owns argument parsing and printing. Every subcommand calls one library function and
prints its result; none holds logic of its own.

    prefixcache validate FILE     check a YAML config and print the resolved values
    prefixcache generate --config FILE --prompts FILE.jsonl
                                  run prompts through the engine; completions + metrics

Must never: implement caching, workloads or experiments here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

import yaml

from prefixcache.config import ConfigError, load_config

__all__ = ["main"]


def _plain(value: object) -> object:
    """Dataclasses and read-only mappings as plain YAML-able data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}  # type: ignore[union-attr]
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def cmd_validate(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    print(f"# {args.file}: valid")
    print(yaml.safe_dump({"cache": _plain(config)}, sort_keys=False), end="")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from prefixcache.engine.cli import generate  # late: the engine needs torch

    return generate(args.config, args.prompts, as_json=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixcache", description="Prefix caching for LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    validate = sub.add_parser("validate", help="check a YAML config and print the resolved values")
    validate.add_argument("file")
    validate.set_defaults(func=cmd_validate)
    gen = sub.add_parser("generate", help="run prompts (JSONL) through the engine; completions and metrics")
    gen.add_argument("--config", required=True, help="YAML with cache: and engine: sections")
    gen.add_argument("--prompts", required=True, help='JSONL: {"prompt": str} or {"messages": [...]}, optional "namespace", "max_tokens"')
    gen.add_argument("--json", action="store_true", help="one JSON object per completion instead of text")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
