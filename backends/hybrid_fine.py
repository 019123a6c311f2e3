"""`hash` over a full-attention + mamba layout with recurrent states finer than the block.

Owns `FineStateHashCache`, the `HybridHashCache` that `HashCache` builds when
`options.state_granule` is set, `FineMambaGroup` (a mamba group whose table has one
entry per granule: entry i holds the state after exactly (i + 1) * granule tokens) and
`GranuleIndex` (which cached full-attention block holds the KV of each granule of a
prefix).

Why. vLLM raises the attention block until one block's page holds a Mamba state (528
tokens for Qwen3.5-4B, thousands for others), and keeps states only on block
boundaries: a prompt shorter than a block never hits, and a 1,500-token shared prefix
hits 1,056. Here a state may be kept after any multiple of `state_granule` TOKENS (a
divisor of the block size), one pool block each, as vLLM's are. A hit of p tokens then
needs, per full-attention group, the blocks before p // block_size (the usual chain)
and the head of the block that holds p: the request gets a fresh block there and the
engine copies the first p % block_size slots from a cached block holding the same
prefix (`Admission.copies`, the protocol's copy-on-write hit; the class declares
`partial_hits`). That source is a cached chain block when the prefix's block is
cached whole, else a block found through the `GranuleIndex`.

What is kept, with `retention: sparse` (the default): a state at the replay point
(`len(prompt) - 1` floored to the granule), at the junction (the longest prefix any
cached block holds, to the granule, where vLLM floors it to the block), and at release
the last state the request wrote (where its next turn will branch: a decode step ends
a chunk, so a state exists on every granule a decode passes). `retention: dense` keeps
every state written. The prefill is split as vLLM splits a Mamba prefill, on the granule
instead of the block. At release, a request's partial last full-attention block (its
computed tokens cover at least one granule of it) is keyed too, so it stays in the LRU
as the source of later hits instead of being reused first.

Keys: a state's is the granule's chained hash (the chain of `prefixcache.hashing` with
the granule as block size), then 0xFE and the group (4 bytes big-endian); a partial
block's is the hash of its last computed granule, then 0xFD and the group. Neither is
a vLLM block hash: they appear in no KV event (vLLM's wire has no sub-block position),
and BlockRemoved is not recorded for them; full-attention blocks' events are as at the
defaults. The `GranuleIndex` holds, for each granule of each keyed full-attention
block, the block and the key it had; a source counts only while the block still holds
that key (so a block reused for other content is never a source).

Must never: hand out a state for a position it was not written at (a state is keyed
only once a commit reached it, in a block allocated before the chunk that ends there
ran), or a source block the request does not pin until its first commit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from prefixcache._C import BlockPool
from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.hashing import chain_digests, namespace_extra_keys
from prefixcache.layout import FULL_ATTENTION, MAMBA, NULL_BLOCK, LayerGroup
from prefixcache.protocol import Namespace

from .hybrid_groups import FullAttentionGroup, GroupManager, GroupState
from .hybrid_hash import HitPlan, HybridHashCache, HybridRequest

__all__ = ["FineStateHashCache", "FineMambaGroup", "GranuleIndex"]

_STATE_MARK = b"\xfe"
_PARTIAL_MARK = b"\xfd"


class GranuleIndex:
    """Granule key (a prefix's granule hash + the group's suffix) -> (block, the key the
    block held when it was indexed). An entry is a source only while the block still
    holds that key: a block reused for other content drops its key, so stale entries
    are skipped (and dropped when met, or swept once the index outgrows `limit`)."""

    __slots__ = ("pool", "entries", "limit")

    def __init__(self, pool: BlockPool, limit: int) -> None:
        self.pool = pool
        self.entries: dict[bytes, tuple[int, bytes]] = {}
        self.limit = limit

    def add(self, keys: Sequence[bytes], block: int, key: bytes) -> None:
        entry = (block, key)
        for k in keys:
            self.entries[k] = entry
        if len(self.entries) > self.limit:
            self.sweep()

    def source(self, key: bytes) -> int | None:
        """The block holding the KV of the granule `key` names, or None."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        if self.pool.key(entry[0]) != entry[1]:
            del self.entries[key]
            return None
        return entry[0]

    def sweep(self) -> None:
        key = self.pool.key
        self.entries = {k: e for k, e in self.entries.items() if key(e[0]) == e[1]}

    def clear(self) -> None:
        self.entries.clear()


class FineMambaGroup(GroupManager):
    """A mamba group keeping states every `granule` TOKENS: entry i of a request's table
    holds the state after (i + 1) * granule tokens. A request holds a block only for a
    chunk's end on a granule (allocated before the chunk runs) and, once states past it
    are written, only the latest of them (older ones are freed: cached ones stay in the
    LRU)."""

    kind = MAMBA

    def __init__(self, group: LayerGroup, index: int, pool: BlockPool, block_size: int, granule: int) -> None:
        super().__init__(group, index, pool, block_size)
        self.granule = self.entry_tokens = granule
        self.state_suffix = _STATE_MARK + index.to_bytes(4, "big")

    def _holds(self, state: GroupState, num_tokens: int) -> bool:
        i = num_tokens // self.granule - 1
        return 0 <= i < len(state.table) and state.table[i] != NULL_BLOCK

    def blocks_needed(self, state, num_tokens, hit, total_computed):  # type: ignore[override]
        new = int(num_tokens % self.granule == 0 and not self._holds(state, num_tokens))
        live_hit = [b for b in hit if b != NULL_BLOCK]
        return new + (self.pool.count_free(live_hit) if live_hit else 0)

    def add_hit(self, state: GroupState, hit: Sequence[int], num_hit_tokens: int) -> None:
        live = [b for b in hit if b != NULL_BLOCK]
        if live:
            self.pool.touch(live)
        state.table.extend(hit)
        state.num_cached = len(state.table)

    def allocate(self, state: GroupState, num_tokens: int, take: Callable[[int], list[int]]) -> list[int]:
        if num_tokens % self.granule or self._holds(state, num_tokens):
            return []
        i = num_tokens // self.granule - 1
        table = state.table
        if len(table) <= i:
            table.extend([NULL_BLOCK] * (i + 1 - len(table)))
        blocks = take(1)
        table[i] = blocks[0]
        return blocks

    def remove_skipped(self, state: GroupState, num_computed: int, free: Callable[[list[int]], None]) -> None:
        table = state.table
        last = min(num_computed // self.granule, len(table))  # entries [0, last) are states already written
        latest = next((i for i in range(last - 1, state.retired - 1, -1) if table[i] != NULL_BLOCK), None)
        if latest is None:
            return
        freed = [table[i] for i in range(latest - 1, state.retired - 1, -1) if table[i] != NULL_BLOCK]
        for i in range(state.retired, latest):
            table[i] = NULL_BLOCK
        state.retired = latest
        if freed:
            free(freed)

    def latest(self, state: GroupState, num_computed: int) -> int | None:
        """Index of the latest state written (at or before `num_computed` TOKENS), or None."""
        table = state.table
        for i in range(min(num_computed // self.granule, len(table)) - 1, -1, -1):
            if table[i] != NULL_BLOCK:
                return i
        return None


class FineStateHashCache(HybridHashCache):
    """`hash` over full attention + mamba with states every `state_granule` tokens
    (module docstring)."""

    partial_hits = True

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        super().__init__(pool, config)
        granule = self.options["state_granule"]
        bs = self.block_size
        if not 0 < granule < bs or bs % granule:
            raise ConfigError("options.state_granule", f"{granule} must be a divisor of block_size {bs} smaller than it (TOKENS)")
        kinds = set(self.layout.kinds())
        if not kinds <= {FULL_ATTENTION, MAMBA} or MAMBA not in kinds:
            raise ConfigError(
                "options.state_granule",
                f"keeps finer states of a layout of full_attention and mamba groups (kinds: {', '.join(self.layout.kinds())})",
            )
        if self.state_interval % granule:
            raise ConfigError("options.state_interval", f"{self.state_interval} is not a multiple of state_granule {granule}")
        self.granule = granule
        managers: list[GroupManager] = []
        for i, g in enumerate(self.layout):
            managers.append(FineMambaGroup(g, i, pool, bs, granule) if g.kind == MAMBA else self.managers[i])
        self.managers = tuple(managers)
        self._full: tuple[FullAttentionGroup, ...] = tuple(m for m in managers if isinstance(m, FullAttentionGroup))
        self._fine: tuple[FineMambaGroup, ...] = tuple(m for m in managers if isinstance(m, FineMambaGroup))
        self._full_ids = tuple(m.index for m in self._full)
        self._granules = GranuleIndex(pool, 2 * pool.num_blocks * (bs // granule))

    @property
    def state_tokens(self) -> int:
        return self.granule

    @property
    def _block_keyed(self) -> tuple[GroupManager, ...]:
        return self._full

    # -- look-up --------------------------------------------------------------------
    def _granule_digests(self, tokens: Sequence[int], namespace: Namespace, start: int = 0, parent: bytes | None = None) -> bytes:
        """Packed hashes of the granules of `tokens` from granule `start` on (`parent`:
        the hash of granule start - 1)."""
        g = self.granule
        later = namespace_extra_keys(namespace, first_block=False)
        return chain_digests(
            tokens[start * g :], g, self._algorithm, parent if start else self._none_hash,
            later if start else namespace_extra_keys(namespace), later,
        )  # fmt: skip

    def _sources(self, rows: list[list[int]], p: int, granule_key: bytes) -> tuple[int, ...] | None:
        """Per full-attention group, a cached block holding the prefix's KV of the block
        that holds position `p` (TOKENS) up to p; None if a group has none."""
        i = p // self.block_size
        out = []
        for row, manager in zip(rows, self._full):
            block = row[i] if i < len(row) else self._granules.source(granule_key + manager.suffix)
            if block is None:
                return None
            out.append(block)
        return tuple(out)

    def _find_hit(self, tokens: Sequence[int], namespace: Namespace, digests: bytes, max_length: int) -> HitPlan:
        """The longest p <= max_length (a multiple of the granule) with a state cached
        in every mamba group, the chain of full blocks before it, and a source for the
        head of the block that holds it; and the junction: the longest prefix beyond it
        whose KV some cached block holds, to the granule."""
        bs, g, ds = self.block_size, self.granule, self._digest_size
        granules = self._granule_digests(tokens, namespace)
        num_blocks = min(max_length // bs, len(digests) // ds)
        rows = self._lookup.chain(digests[: num_blocks * ds], self._full_ids)
        top = min(max_length, (len(rows[0]) + 1) * bs - 1) // g * g
        lookup = self.pool.lookup
        hit, states, sources = 0, [], ()
        for p in range(top, 0, -g):
            key = granules[(p // g - 1) * ds : (p // g) * ds]
            found = [lookup(key + m.state_suffix) for m in self._fine]
            if None in found:
                continue
            if p % bs:
                src = self._sources(rows, p, key)
                if src is None:
                    continue
                sources = src
            hit, states = p, found
            break
        junction = 0
        for q in range(top, hit, -g):
            if q % bs == 0 or self._sources(rows, q, granules[(q // g - 1) * ds : (q // g) * ds]) is not None:
                junction = q
                break
        blocks: list[list[int]] = [[] for _ in self.managers]
        per_group = [NULL_BLOCK] * len(self.managers)
        for row, manager, source in zip(rows, self._full, sources or [NULL_BLOCK] * len(self._full)):
            blocks[manager.index] = row[: hit // bs]
            per_group[manager.index] = source
        for manager, state in zip(self._fine, states):
            blocks[manager.index] = [NULL_BLOCK] * (hit // g - 1) + [state]
        return HitPlan(blocks, hit, junction, tuple(per_group) if sources else (), granules)

    # -- caching ----------------------------------------------------------------------
    def _cache(self, request: HybridRequest, num_tokens: int) -> None:
        """Full-attention blocks as at the defaults, each indexed by its granules; then
        the states written up to `num_tokens` that are kept."""
        starts = [request.groups[m.index].num_cached or 0 for m in self._full]
        super()._cache(request, num_tokens)
        self._extend_granules(request, num_tokens)
        bs, g, ds = self.block_size, self.granule, self._digest_size
        per_block = bs // g
        for manager, start in zip(self._full, starts):
            state = request.groups[manager.index]
            for i in range(start, state.num_cached or 0):
                block = state.table[i]
                key = self.pool.key(block)
                if key is not None:  # inner granules only: the last is the whole block
                    first = i * per_block
                    keys = [bytes(request.granules[j * ds : (j + 1) * ds]) + manager.suffix for j in range(first, first + per_block - 1)]
                    self._granules.add(keys, block, key)
        kept = {(request.num_prompt - 1) // g * g, request.junction}
        for manager in self._fine:
            state = request.groups[manager.index]
            start = state.num_cached or 0
            stop = min(num_tokens // g, len(state.table))
            for i in range(start, stop):
                if state.table[i] != NULL_BLOCK and (self.dense or (i + 1) * g in kept):
                    self._key_state(request, manager, state, i)
            state.num_cached = max(start, num_tokens // g)

    def _key_state(self, request: HybridRequest, manager: FineMambaGroup, state: GroupState, i: int) -> None:
        block, ds = state.table[i], self._digest_size
        if self.pool.key(block) is None:
            self.pool.cache(block, bytes(request.granules[i * ds : (i + 1) * ds]) + manager.state_suffix)

    def _extend_granules(self, request: HybridRequest, num_tokens: int) -> None:
        g, ds = self.granule, self._digest_size
        have = len(request.granules) // ds
        if have < num_tokens // g:
            parent = bytes(request.granules[-ds:]) if have else None
            request.granules += self._granule_digests(request.tokens[: num_tokens // g * g], request.namespace, have, parent)

    def _retain(self, request: HybridRequest) -> None:
        """Key the last state the request wrote, and its partial last full-attention
        block (indexed by its granules), so its next turn finds both."""
        computed = request.num_computed
        bs, g, ds = self.block_size, self.granule, self._digest_size
        self._extend_granules(request, computed)
        for manager in self._fine:
            state = request.groups[manager.index]
            i = manager.latest(state, computed)
            if i is not None:
                self._key_state(request, manager, state, i)
        i, filled = divmod(computed, bs)
        if filled < g:
            return
        last = computed // g - 1
        for manager in self._full:
            table = request.groups[manager.index].table
            if i >= len(table) or self.pool.key(table[i]) is not None:
                continue
            key = bytes(request.granules[last * ds : (last + 1) * ds]) + _PARTIAL_MARK + manager.index.to_bytes(4, "big")
            self.pool.cache(table[i], key)
            first = i * (bs // g)
            keys = [bytes(request.granules[j * ds : (j + 1) * ds]) + manager.suffix for j in range(first, last + 1)]
            self._granules.add(keys, table[i], key)

    def _state_keys(self, request: HybridRequest, manager: GroupManager) -> list[tuple[int, bytes]]:
        g, ds = self.granule, self._digest_size
        self._extend_granules(request, request.num_computed)
        return [((j + 1) * g, bytes(request.granules[j * ds : (j + 1) * ds]) + manager.state_suffix)  # type: ignore[attr-defined]
                for j in range(request.num_computed // g)]  # fmt: skip

    # -- events -----------------------------------------------------------------------
    def _removed_events(self, keys: Sequence[bytes]) -> list:
        """BlockRemoved for vLLM's block hashes only (a state's or a partial block's key
        is not one: module docstring)."""
        vllm = len(self._none_hash) + 4
        return super()._removed_events([k for k in keys if len(k) <= vllm])

