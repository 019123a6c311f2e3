"""min_match: ignore prefix hits shorter than `min_tokens` (a matching policy plugin).

A short hit can cost more to load than to recompute (KV offloaded to host memory or
another node, a tiny prefix before a long prompt). This plugin keeps the strategy's
matching and only throws such hits away, through the protocol's `usable_hit` hook, which
both built-in backends apply in `match` and `admit` alike. Select it in YAML by path::

    cache:
      backend: "min_match:MinMatchHash"     # or "min_match:MinMatchRadix"
      block_size: 16
      num_blocks: 4096
      options: {min_tokens: 256}

with this folder on `sys.path` (or the module installed). See docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixcache.backends.hash import HashCache
from prefixcache.backends.radix import RadixCache
from prefixcache.config import ConfigError


class MinMatch:
    """Mixin for a built-in backend: a hit shorter than `min_tokens` TOKENS counts as none."""

    option_defaults = {"min_tokens": 256}

    def __init__(self, pool, config) -> None:
        super().__init__(pool, config)
        if self.options["min_tokens"] < 0:
            raise ConfigError("options.min_tokens", f"must be >= 0, got {self.options['min_tokens']}")

    def usable_hit(self, tokens: Sequence[int], num_tokens: int, namespace=None) -> int:
        return num_tokens if num_tokens >= self.options["min_tokens"] else 0


class MinMatchHash(MinMatch, HashCache):
    """vLLM-style hashing that ignores short hits."""


class MinMatchRadix(MinMatch, RadixCache):
    """SGLang-style radix tree that ignores short hits."""
