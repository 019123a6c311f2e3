"""An installable prefixcache plugin: `backend: hash-histogram`.

`HitHistogramHash` is the `hash` strategy that also counts admissions by hit length
(in blocks), for a dashboard. The `prefixcache.backends` entry point in pyproject.toml
is all it takes for the registry to find it by name once the package is installed::

    cache:
      backend: hash-histogram
"""

from __future__ import annotations

from collections import Counter

from prefixcache.backends.hash import HashCache

__all__ = ["HitHistogramHash"]


class HitHistogramHash(HashCache):
    """`hash`, plus `hit_histogram()`: admissions per hit length in BLOCKS."""

    def __init__(self, pool, config) -> None:
        super().__init__(pool, config)
        self._hits: Counter[int] = Counter()

    def admit(self, request_id, tokens, *, namespace=None, priority=0, read_cache=True):
        admission = super().admit(request_id, tokens, namespace=namespace, priority=priority, read_cache=read_cache)
        if admission is not None:
            self._hits[admission.num_cached_tokens // self.block_size] += 1
        return admission

    def hit_histogram(self) -> dict[int, int]:
        """{hit length in blocks: admissions}, since construction or the last reset."""
        return dict(sorted(self._hits.items()))

    def reset(self) -> bool:
        if not super().reset():
            return False
        self._hits.clear()
        return True
