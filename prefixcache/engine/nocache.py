"""The no-caching baseline: the pool and block size of the configured cache, no hits.

Owns `NoPrefixCache`, what the engine runs with `engine.prefix_caching: false`. It
implements the `PrefixCache` protocol the engine talks to, so the scheduler, the model
and the pool are the same in both arms of an A/B and only caching differs: `admit`
allocates a block for every prompt token's block, `append` allocates as tokens cross
block boundaries, `release` frees every block. Nothing is hashed, indexed or kept, so
`match` is always empty and the cost of a request is the pool's allocate and free.

It is deliberately not a registered backend: as a `cache.backend` it would break the
protocol's rule 4 (committed blocks become hittable), and the conformance kit would
rightly fail it. It exists only as the engine's switch.

Must never: cache a block, or keep a freed block out of the pool.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from prefixcache._C import BlockPool, InvariantError
from prefixcache.config import CacheConfig
from prefixcache.protocol import Admission, Match, Namespace, PrefixCache
from prefixcache.requests import BlockwiseAppend, Request, RequestTable, check_namespace, check_tokens
from prefixcache.stats import CacheStats, StatsCounter

__all__ = ["NoPrefixCache"]


class NoPrefixCache(BlockwiseAppend, PrefixCache):
    """Allocate on admit/append, free on release, never hit (see the module docstring)."""

    # One table for every group: it caches nothing, so no group keeps less than another.
    supports_layout = True

    name = "none"

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        super().__init__(pool, config)
        self._requests: RequestTable[Request] = RequestTable()
        self._stats = StatsCounter()

    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        check_tokens(tokens, allow_empty=True)
        check_namespace(namespace)
        return Match(0, ())

    def admit(
        self, request_id: Hashable, tokens: Sequence[int], *, namespace: Namespace = None, read_cache: bool = True
    ) -> Admission | None:
        self._requests.check_new(request_id)
        toks = check_tokens(tokens)
        namespace = check_namespace(namespace)
        blocks = self.pool.allocate(-(-len(toks) // self.block_size))
        if blocks is None:
            self._stats.rejected += 1
            return None
        self._requests.add(Request(request_id, toks, namespace, blocks))
        if read_cache:
            self._stats.record_query(len(toks), 0)
        return Admission(tuple(blocks), 0)

    def _allocate_if_free(self, num_blocks: int) -> list[int] | None:
        return self.pool.allocate(num_blocks)

    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        req = self._requests.get(request_id)
        req.num_computed = req.check_commit(num_computed_tokens)

    def release(self, request_id: Hashable) -> None:
        req = self._requests.pop(request_id)
        if req.block_table:
            self.pool.free(req.block_table[::-1])

    def block_table(self, request_id: Hashable) -> Sequence[int]:
        return tuple(self._requests.get(request_id).block_table)

    def evict(self, num_blocks: int) -> int:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        return 0  # nothing is ever cached

    def reset(self) -> bool:
        if len(self._requests):
            return False
        self._stats.reset()
        return True

    def stats(self) -> CacheStats:
        return self._stats.snapshot()

    def drain_events(self) -> list:
        return []

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        owned = [b for r in self._requests for b in r.block_table]
        if len(set(owned)) != len(owned):
            raise InvariantError("nocache: a block is in two block tables, or twice in one")
        if self.pool.num_cached:
            raise InvariantError(f"nocache: {self.pool.num_cached} blocks hold a key, but nothing is ever cached")
        if self.pool.num_pinned != len(owned):
            raise InvariantError(f"nocache: {self.pool.num_pinned} blocks pinned, live requests hold {len(owned)}")
