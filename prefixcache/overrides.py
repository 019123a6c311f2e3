"""Command-line overrides of a loaded YAML file: `--set key.path=value` and the shortcuts
`--seed`, `--backend`, `--block-size`.

Owns parsing an override and applying it to the file's data (a new mapping; the input is
not changed). The result then goes through the same loader as the file, so a bad value
is the loader's own one-line `ConfigError` naming the key path. Must never: validate a
value itself (the schema does), or know a command.

A key path is dot-separated mapping keys (`workload.params.seed`); a key that itself holds
dots (an arm named `a.b`) is matched whole when the mapping has it. A value is read as a
YAML scalar or flow collection (`512`, `null`, `lru`, `[1, 2]`, `{x: 1}`). A key that the
file lacks is added, so a misspelled key is the loader's "unknown key; did you mean".
"""

from __future__ import annotations

import re

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from prefixcache.config import ConfigError

__all__ = ["Override", "parse_override", "apply_overrides", "shortcut_overrides", "relabel_arms", "SHORTCUT_PATHS"]

Override = tuple[tuple[str, ...], Any]
"""(key path, value)."""

SHORTCUT_PATHS: Mapping[str, tuple[str, ...]] = {
    "seed": ("workload.params.seed", "engine.seed", "seed"),
    "backend": ("cache.backend", "arms.*.backend"),
    "block_size": ("cache.block_size", "arms.*.block_size"),
}
"""Where each shortcut writes, tried in order: every path the file HAS gets the value
(`*` is every arm); `workload.params.seed` is also set when the workload is a generator
without a seed of its own. A file with none of them refuses the shortcut."""


def parse_override(text: str) -> Override:
    """'key.path=value' -> (('key', 'path'), value); ConfigError (`--set`) if malformed."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError("--set", f"expected key.path=value, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError("--set", f"{key}: value {raw!r} is not a YAML value ({err.__class__.__name__})") from None
    return tuple(key.strip().split(".")), value


def _split(mapping: Mapping[str, Any], parts: Sequence[str]) -> tuple[str, Sequence[str]]:
    """The key of `mapping` that `parts` starts with (longest dotted match first)."""
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in mapping:
            return key, parts[n:]
    return parts[0], parts[1:]


def _set(data: Mapping[str, Any], parts: Sequence[str], value: Any, shown: str) -> dict[str, Any]:
    key, rest = _split(data, parts)
    out = dict(data)
    if not rest:
        out[key] = value
        return out
    inner = data.get(key)
    if inner is None:
        inner = {}
    if not isinstance(inner, Mapping):
        raise ConfigError("--set", f"{shown}: {key!r} is {type(inner).__name__} {inner!r}, not a section")
    out[key] = _set(inner, rest, value, shown)
    return out


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[Override]) -> Mapping[str, Any]:
    """`data` with each (path, value) set, in order (a later one wins)."""
    for parts, value in overrides:
        data = _set(data, parts, value, ".".join(parts))
    return data


def _has(data: Any, parts: Sequence[str]) -> bool:
    for part in parts:
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def shortcut_overrides(data: Mapping[str, Any], name: str, value: Any) -> list[Override]:
    """The overrides that shortcut `name` (a key of SHORTCUT_PATHS) stands for in `data`;
    ConfigError naming the option when the file has none of its keys."""
    out: list[Override] = []
    for path in SHORTCUT_PATHS[name]:
        parts = path.split(".")
        if parts[0] == "arms" and parts[1] == "*":
            arms = data.get("arms")
            if isinstance(arms, Mapping):
                out += [(("arms", str(arm), *parts[2:]), value) for arm in arms]
            continue
        generator_seed = (path == "workload.params.seed" and isinstance(data.get("workload"), Mapping)
                          and "generator" in data["workload"])
        if _has(data, parts) or generator_seed:
            out.append((tuple(parts), value))
            if name == "seed":
                break  # one seed: the workload's, else the engine's, else the file's own
    if not out:
        option = "--" + name.replace("_", "-")
        raise ConfigError(option, f"this file has none of {', '.join(SHORTCUT_PATHS[name])}; use --set KEY=VALUE")
    return out


_ARM_LABEL = re.compile(r"(?P<backend>[A-Za-z_][\w.:-]*)/(?P<block_size>\d+)")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def relabel_arms(before: Mapping[str, Any], after: Mapping[str, Any]) -> Mapping[str, Any]:
    """`after` (`before` with overrides applied) with every A/B arm named for its contents
    (`BACKEND/BLOCK_SIZE`, as the shipped ab.yaml names them) renamed for its new contents
    when an override changed them: `--backend radix` turns `hash/16` into `radix/16` (or
    `radix/16-was-hash/16` when another arm has that name). Other names are the user's
    and stay, and so does a name whose new contents are invalid (`--block-size 0`), so the
    error names the key the file has."""
    old_arms, arms = before.get("arms"), after.get("arms")
    if not isinstance(old_arms, Mapping) or not isinstance(arms, Mapping):
        return after
    renamed: dict[str, Any] = {}
    for name, arm in arms.items():
        label = _ARM_LABEL.fullmatch(str(name))
        old = old_arms.get(name)
        described = (label is not None and isinstance(old, Mapping) and isinstance(arm, Mapping)
                     and str(old.get("backend")) == label["backend"] and str(old.get("block_size")) == label["block_size"]
                     and isinstance(arm.get("backend"), str) and _positive_int(arm.get("block_size")))
        new = f"{arm.get('backend')}/{arm.get('block_size')}" if described else str(name)
        if described and new != name and (new in arms or new in renamed):
            new = f"{new}-was-{name}"
        renamed[new] = arm
    return {**after, "arms": renamed}