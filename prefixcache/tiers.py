"""A cache's lower tiers (host memory, disk) as its strategy uses them.

Owns `Tiers`: the native `TierManager` (csrc/tier_manager.h: slots, eviction orders,
write policies, the device mirror, the transfer log) built from `cache.tiers`, the cost
model that decides how much of a lower-tier hit an admission loads (`plan`), the KV
events of tier residency (vLLM's `BlockStored` / `BlockRemoved` with `medium` CPU or
STORAGE and `locality` LOCAL, real token ids and the namespace's extra keys), the
per-tier stats, and the hook a disk tier's reader plugs in (`verifier`: a block whose
checksum fails is a miss and a counted error, decided before the hit is).

Both built-in strategies use it the same way (docs/tiers.md): they report what the
device caches (`cached`), hits (`admitted`) and evicts (`evicted`); look a chain up
(`chain`), cut it with `plan`, and turn what they keep into loads (`pin`, then `load`
once the device blocks are allocated). A plugin backend does the same through this
class; nothing here knows which strategy calls it. A strategy that knows its prefix
without hashing it (a tree) may build it with `lineage`: the tier manager then names
the blocks the strategy caches (`cached_named`) and finds them through their parent's
name and their token ids (`follow`), compared in full, instead of by chained hash.

The cost model. Loading the lower-tier blocks of a hit's first c blocks costs, per tier
t used, latency_t + n_t x block_bytes / bandwidth_t; computing the prompt from block c
on costs (prompt tokens - c x block_size) / prefill_tokens_per_s. `plan` keeps the c
that minimises the sum (the longest on a tie), never cutting into the hit's leading
device blocks, which cost nothing: so no admission costs more, modelled, than
recomputing its whole prompt.

Must never: hold device block references, move data, or decide a device hit.
"""

from __future__ import annotations

import numbers
import struct
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from prefixcache._C import TierManager
from prefixcache.events import FULL_ATTENTION, BlockRemoved, BlockStored, EventLog, NullEventLog, event_extra_keys, event_lora
from prefixcache.hashing import namespace_extra_keys
from prefixcache.isolation import prune_at
from prefixcache.registry import resolve_eviction_policy
from prefixcache.stats import TierStats

if TYPE_CHECKING:
    from prefixcache._C import BlockPool, EvictionCandidate
    from prefixcache.config import CacheConfig
    from prefixcache.eviction import EvictionPolicy
    from prefixcache.protocol import Admission, Transfer

__all__ = ["Tiers", "LOCALITY", "DEVICE", "Location", "PolicyRank", "Verifier", "prefill_seconds_saved"]

LOCALITY = "LOCAL"
"""The `locality` of every tier event: our tiers are on the publishing machine (vLLM's Locality.LOCAL)."""
DEVICE = -1
"""The tier number of the device pool in locations and transfers."""

_FOLLOW_FIRST = 4  # BLOCKS `follow` reads first (then 4x as many each time the chain goes on)

Location = tuple[int, int]
"""(tier, id): a device block (tier -1) or a slot of `cache.tiers[tier]`."""
Verifier = Callable[[int, int, bytes], bool]
"""verifier(tier, slot, key): whether the block in that slot holds `key` and passes its
checksum (a disk tier's reader; called during `admit`, before the hit is decided)."""

_GROUP = 0
_FIRST = (-(2**63), -(2**63))  # below every key _native_key makes: what a failed ranking gets
_DOUBLE, _INT64 = struct.Struct("<d"), struct.Struct("<q")


def _ordered(x: Any) -> int:
    """A real number as an int64 in the same order (IEEE-754 bits, negatives flipped;
    compared as doubles, so ints past 2**53 may tie)."""
    if not isinstance(x, numbers.Real):
        raise TypeError(f"{x!r} is not a number")
    f = float(x) + 0.0  # -0.0 == 0.0
    if f != f:
        raise ValueError("NaN has no order")
    bits = _INT64.unpack(_DOUBLE.pack(f))[0]
    return bits if bits >= 0 else bits ^ 0x7FFF_FFFF_FFFF_FFFF


def _native_key(priority: Any) -> tuple[int, int]:
    """A policy's priority as the two int64s a tier orders by: a number, or a pair of numbers."""
    if isinstance(priority, (tuple, list)):
        if len(priority) == 2:
            return _ordered(priority[0]), _ordered(priority[1])
        if len(priority) == 1:
            return _ordered(priority[0]), 0
        raise TypeError(f"a tuple of {len(priority)} items")
    return _ordered(priority), 0


class PolicyRank:
    """A lower tier's order from a policy without a native one: its `priority()` once per
    candidate, as `_native_key`. It runs inside a native tier call that cannot stop
    part-way, so a priority that raises, or is not a number or a pair of numbers, ranks
    the slot first and is kept in `errors` (the first one) for `Tiers` to raise at the
    next admission. It holds the error list, not the `Tiers`: the native manager holds
    it, and a cycle through native code would never be collected."""

    __slots__ = ("policy", "where", "errors")

    def __init__(self, policy: EvictionPolicy, where: str, errors: list[Exception]) -> None:
        self.policy = policy
        self.where = where
        self.errors = errors

    def __call__(self, candidate: EvictionCandidate) -> tuple[int, int]:
        try:
            return _native_key(self.policy.priority(candidate))
        except Exception as err:  # noqa: BLE001 (re-raised by Tiers at the next admission)
            if not self.errors:
                failure = RuntimeError(
                    f"{self.where}: policy {self.policy.name or type(self.policy).__name__!r} failed to rank a "
                    f"block ({type(err).__name__}: {err}); a lower tier's priority() must return a number or a "
                    "pair of numbers. The block was ranked first."
                )
                failure.__cause__ = err
                self.errors.append(failure)
            return _FIRST


class Tiers:
    """The lower tiers of one cache (module docstring). `block_bytes` is the KV a block
    holds in BYTES (the cost model's; the engine sets its model's)."""

    def __init__(
        self,
        config: CacheConfig,
        num_device_blocks: int,
        key_size: int,
        events: EventLog | NullEventLog,
        *,
        lineage: bool = False,
        token_bytes: int = 8,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.specs = config.tiers
        self.media = tuple(t.event_medium for t in config.tiers)
        self.policies = tuple(resolve_eviction_policy(t.eviction or config.eviction)() for t in config.tiers)
        #: What a policy without a native order raised while ranking (`PolicyRank`), until raised.
        self._policy_errors: list[Exception] = []
        # A disk tier keeps what it loads: its file outlives the process, and a restart finds it.
        native_tiers = [
            (t.num_blocks, t.write, t.hits_to_enter,
             p.native or PolicyRank(p, f"tiers[{i}].eviction", self._policy_errors), p.leaves_only,
             p.native_params(), t.medium == "DISK", t.store_threshold, t.reuse_slots)
            for i, (t, p) in enumerate(zip(config.tiers, self.policies, strict=True))
        ]  # fmt: skip
        # Token ids travel with blocks for events, for a disk file's records, and for
        # lineage, which finds a block by comparing them.
        keep_tokens = lineage or events.enabled or any(t.medium == "DISK" for t in config.tiers)
        # Token ids are kept as wide as the strategy keeps them (`token_bytes`: 4 or 8).
        self.native = TierManager(num_device_blocks, self.block_size, key_size, native_tiers, keep_tokens, events.enabled,
                                  lineage, token_bytes)  # fmt: skip
        self.keep_tokens = keep_tokens
        self._events = events
        self.block_bytes = config.cost_model.bytes_per_token * self.block_size
        self.prefill_s_per_token = 1.0 / config.cost_model.prefill_tokens_per_s
        self._load_s = [self.block_bytes / (t.gbps * 1e9) for t in config.tiers]
        self._latency_s = [t.latency_s for t in config.tiers]
        self.verifier: Verifier | None = None
        # Events only: namespace <-> the tag its blocks carry natively (0: no namespace).
        self._namespaces: list[Hashable] = [None]
        self._tags: dict[Hashable, int] = {None: 0}
        self._free_tags: list[int] = []
        self._tags_limit = prune_at(0)
        n = len(config.tiers)
        self._hit_tokens = [0] * n
        self._loaded_tokens = [0] * n

    @property
    def num_tiers(self) -> int:
        return len(self.specs)

    def set_block_bytes(self, block_bytes: int) -> None:
        """The KV BYTES a block really holds (an engine's model), unless the cost model
        names `kv_bytes_per_token`: what loads cost and what `bytes_written` counts."""
        if self.config.cost_model.kv_bytes_per_token is None:
            self.block_bytes = block_bytes
            self._load_s = [block_bytes / (t.gbps * 1e9) for t in self.specs]

    # -- the device side --------------------------------------------------------------
    def tag(self, namespace: Hashable) -> int:
        """The small int a namespace travels as, for its events' extra keys (0 without
        events: nothing reads it). A tag no block carries any more is given out again, so
        the table follows what the cache holds, not every namespace it has seen."""
        if not self._events.enabled:
            return 0
        tag = self._tags.get(namespace)
        if tag is None:
            if len(self._tags) >= self._tags_limit:
                self._forget_tags()
            if self._free_tags:
                tag = self._free_tags.pop()
                self._namespaces[tag] = namespace
            else:
                tag = len(self._namespaces)
                self._namespaces.append(namespace)
            self._tags[namespace] = tag
        return tag

    def _forget_tags(self) -> None:
        """Drop the namespaces no block or pending record carries (one native scan of the
        tiers' slots, amortized: the limit doubles past what stays)."""
        in_use = set(self.native.tags_in_use())
        in_use.add(0)
        self._tags = {ns: t for ns, t in self._tags.items() if t in in_use}
        self._free_tags = [t for t in range(len(self._namespaces) - 1, 0, -1) if t not in in_use]
        for t in self._free_tags:
            self._namespaces[t] = None
        self._tags_limit = prune_at(len(self._tags))

    def cached(
        self,
        blocks: Sequence[int],
        keys: bytes | bytearray,
        parent: bytes | None,
        tokens: Sequence[int] | None,
        depth: int,
        request_tokens: int,
        namespace: Hashable,
    ) -> None:
        """Device blocks `blocks` now hold the packed chain `keys` after `parent` (None:
        a chain start), with `tokens` (block_size ids each; None when tokens are not
        kept). Write-through tiers copy them now."""
        self.native.device_cached(blocks, keys, parent, tokens if self.keep_tokens else None, depth, request_tokens,
                                  self.tag(namespace))
        self.flush_events()

    def cached_named(
        self,
        blocks: Sequence[int],
        parent: bytes,
        tokens: Sequence[int],
        depth: int,
        request_tokens: int,
        namespace: Hashable,
    ) -> None:
        """Lineage: `cached`, the blocks named here (a block the tiers hold after the same
        parent with the same tokens takes that copy's name, any other a fresh one);
        `parent` names the block before the first (`new_name()` for a chain's root)."""
        self.native.device_cached_named(blocks, parent, tokens, depth, request_tokens, self.tag(namespace))
        self.flush_events()

    def new_name(self) -> bytes:
        """Lineage: a name never given before (a chain's root)."""
        return self.native.new_name()

    def device_key(self, block: int) -> bytes:
        """The key (with lineage, the name) the device block `block` is cached under."""
        key = self.native.device_key(block)
        if key is None:
            raise KeyError(f"device block {block} is not cached in the tiers' mirror")
        return key

    def admitted(self, num_tokens: int, hit_blocks: Sequence[int], request_tokens: int) -> int:
        """An admission of `num_tokens` TOKENS (whole blocks) whose hit is the device
        blocks `hit_blocks` (loaded ones included): hit counts, selective copies; returns
        the request's chain depth (what its blocks are cached with)."""
        depth = self.native.admitted(num_tokens, hit_blocks, request_tokens)
        self.flush_events()
        return depth

    def evicted(self, blocks: Sequence[int]) -> None:
        """Device blocks no longer cached, their KV intact until reused: demoted by the
        tiers' write policies (the engine copies them before the next forward pass)."""
        self.native.device_evicted(blocks)
        self.flush_events()

    def dropped(self, blocks: Sequence[int]) -> None:
        """Device blocks forgotten without demotion (a duplicate a strategy frees)."""
        self.native.device_dropped(blocks)

    def evicted_keys(self, keys: Sequence[bytes], pool: BlockPool) -> None:
        """Demote the device blocks that held `keys` and no longer do (an explicit
        eviction that dropped keys and left the blocks, KV intact, in the free queue)."""
        blocks = [b for k in keys for b in self.native.device_holders(k) if pool.key(b) != k]
        if blocks:
            self.evicted(blocks)

    # -- look-up and the cost model ---------------------------------------------------
    def chain(self, pool: BlockPool | None, keys: bytes | bytearray, start: int, stop: int) -> list[Location]:
        """Where blocks start..stop of a packed chain are (`pool` caches: the device;
        else a tier), up to the first held nowhere. First raises what a tier's Python
        policy raised since the last call (every admission and match that reaches the
        tiers calls this before it changes anything)."""
        self.raise_policy_error()
        return self.native.chain(pool, keys, start, stop)

    def follow(self, parent: bytes, tokens: Sequence[int]) -> tuple[list[Location], bytes]:
        """Lineage only: where the whole blocks of `tokens` after the block named `parent`
        are in the tiers, up to the first held nowhere (each found by its parent's name
        and its token ids, compared in full), and their names packed. Raises a policy's
        failure first, as `chain` does."""
        self.raise_policy_error()
        # In growing chunks: a chain usually stops within a block or two, and the native
        # call reads every id it is given.
        bs, key_size = self.block_size, self.native.key_size
        found, names = self.native.follow(parent, tokens[: _FOLLOW_FIRST * bs])
        at, step = _FOLLOW_FIRST * bs, 4 * _FOLLOW_FIRST * bs
        while len(found) * bs == at and at < len(tokens):
            more, keys = self.native.follow(names[-key_size:], tokens[at : at + step])
            found += more
            names += keys
            at, step = at + step, 4 * step
        return found, names

    def raise_policy_error(self) -> None:
        """Raise (once) the first failure of a tier's Python policy since the last call:
        a RuntimeError naming `tiers[i].eviction`, caused by what the policy raised."""
        if self._policy_errors:
            raise self._policy_errors.pop()

    def plan(self, locations: Sequence[Location], first: int, num_prompt_tokens: int) -> int:
        """How many blocks of `locations` (the hit's blocks from block `first` of the
        prompt, on the device or in a tier) an admission uses: the prefix that minimises
        modelled load time plus compute time of the rest of the prompt of
        `num_prompt_tokens` TOKENS (module docstring)."""
        bs = self.block_size
        best_c, best = 0, (num_prompt_tokens - first * bs) * self.prefill_s_per_token
        used = [0] * self.num_tiers
        load = 0.0
        for c, (tier, _) in enumerate(locations, 1):
            if tier != DEVICE:
                if not used[tier]:
                    load += self._latency_s[tier]
                used[tier] += 1
                load += self._load_s[tier]
            cost = load + (num_prompt_tokens - (first + c) * bs) * self.prefill_s_per_token
            if cost <= best:
                best_c, best = c, cost
        return best_c

    def usable(self, locations: Sequence[Location], first: int, num_prompt_tokens: int) -> int:
        """How many blocks of `locations` an admission loads or keeps: `plan`'s choice, cut
        at the first block the verifier refuses and planned again over what is left."""
        if not locations:
            return 0
        use = self.plan(locations, first, num_prompt_tokens)
        ok = self.verified(locations[:use])
        return use if ok == use else self.plan(locations[:ok], first, num_prompt_tokens)

    def verified(self, locations: Sequence[Location]) -> int:
        """How many leading `locations` pass the verifier (none set: all). A slot whose
        store the engine has not run yet is not loadable (its data is not there); a slot
        that fails is dropped from its tier and counted as an error."""
        verify = self.verifier
        if verify is None:
            return len(locations)
        native = self.native
        for i, (tier, slot) in enumerate(locations):
            if tier == DEVICE or self.specs[tier].medium != "DISK":
                continue
            if native.pending(tier, slot):
                return i
            if not verify(tier, slot, native.slot_key(tier, slot)):
                native.drop(tier, slot, False)
                self.flush_events()
                return i
        return len(locations)

    def count_hit(self, locations: Sequence[Location], loaded: int) -> None:
        """Count a hit's lower-tier blocks per tier (the first `loaded` of `locations` were loaded)."""
        bs = self.block_size
        for i, (tier, _) in enumerate(locations):
            if tier != DEVICE:
                self._hit_tokens[tier] += bs
                if i < loaded:
                    self._loaded_tokens[tier] += bs

    # -- loads ------------------------------------------------------------------------
    def pin(self, slots: Sequence[Location]) -> None:
        """Keep these slots while the admission allocates (a demotion must not reuse them)."""
        self.native.pin(slots)

    def unpin(self, slots: Sequence[Location]) -> None:
        self.native.unpin(slots)

    def load(self, sources: Sequence[Location], dst: Sequence[int], *, promote: bool = True) -> None:
        """Record the loads of pinned `sources` into device blocks `dst` and promote them
        (out of an on_evict tier, refreshed in an inclusive one); with `promote` false
        they stay pinned where they are until `finish_loads` (a strategy whose device
        copy is not hittable yet)."""
        self.native.load(sources, dst, promote)
        self.flush_events()

    def finish_loads(self, sources: Sequence[Location]) -> None:
        """Promote sources a `load(..., promote=False)` kept."""
        self.native.finish_loads(sources)
        self.flush_events()

    def persist(self) -> int:
        """Copy into each DISK tier every block held above it and not in it (the device's
        cached blocks first), at most the tier's size: what a graceful shutdown writes so a
        restart on the file finds whole chains. Returns the BLOCKS stored; their transfers
        wait in `drain_transfers()`, their events are recorded."""
        n = sum(self.native.persist(t) for t, spec in enumerate(self.specs) if spec.medium == "DISK")
        self.flush_events()
        return n

    def drain_transfers(self) -> list[Transfer]:
        """The transfers since the last drain, in order (`PrefixCache.drain_transfers`)."""
        flat = iter(self.native.drain_transfers())
        return list(zip(flat, flat, flat, flat))

    def discard_transfers(self) -> int:
        """Drop the transfers recorded so far (a replay that moves no data); returns how many."""
        return len(self.native.drain_transfers()) // 4

    # -- events, stats, reset -----------------------------------------------------------
    def flush_events(self) -> None:
        """Turn the native residency records into KV events, in order."""
        if not self._events.enabled:
            return
        for stored, tier, key, parent, tokens, tag in self.native.drain_records():
            medium = self.media[tier]
            if not stored:
                self._events.record(BlockRemoved((key,), medium=medium, group_idx=_GROUP, locality=LOCALITY))
                continue
            namespace = self._namespaces[tag]
            lora_id, lora_name = event_lora(namespace)
            extra = event_extra_keys(namespace_extra_keys(namespace, first_block=parent is None))
            self._events.record(
                BlockStored(
                    block_hashes=(key,),
                    parent_block_hash=parent,
                    token_ids=tuple(tokens),
                    block_size=self.block_size,
                    lora_id=lora_id,
                    medium=medium,
                    lora_name=lora_name,
                    extra_keys=(extra,),
                    group_idx=_GROUP,
                    kv_cache_spec_kind=FULL_ATTENTION,
                    locality=LOCALITY,
                )
            )

    def stats(self) -> tuple[TierStats, ...]:
        out = []
        for t, spec in enumerate(self.specs):
            c = self.native.counters(t)
            out.append(
                TierStats(
                    medium=spec.event_medium,
                    hit_tokens=self._hit_tokens[t],
                    loaded_tokens=self._loaded_tokens[t],
                    loads=c["loads"],
                    stores=c["stores"],
                    evictions=c["evictions"],
                    demotions=c["demotions"],
                    refused=c["refused"],
                    errors=c["errors"],
                    filtered=c["filtered"],
                    bytes_written=c["stores"] * self.block_bytes,
                    used_blocks=self.native.num_used(t),
                )
            )
        return tuple(out)

    def reset(self) -> None:
        """Every tier emptied (a cache reset, which records AllBlocksCleared itself)."""
        self.native.reset()
        self._hit_tokens = [0] * self.num_tiers
        self._loaded_tokens = [0] * self.num_tiers

    def check_invariants(self, pool: BlockPool | None) -> None:
        self.raise_policy_error()
        self.native.check_invariants(pool)


def prefill_seconds_saved(config: CacheConfig, admission: Admission) -> float:
    """SECONDS of prefill an admission saves under `config.cost_model`: its hit's compute
    time, less the time its loads take (each tier's latency once, plus its blocks'
    bytes over its bandwidth). Never negative for a hit the cost model chose."""
    cost = config.cost_model
    saved = admission.num_cached_tokens / cost.prefill_tokens_per_s
    if not admission.loads:
        return saved
    block_bytes = cost.bytes_per_token * config.block_size
    per_tier: dict[int, int] = {}
    for tier, _, _ in admission.loads:
        per_tier[tier] = per_tier.get(tier, 0) + 1
    for tier, n in per_tier.items():
        spec = config.tiers[tier]
        saved -= spec.latency_s + n * block_bytes / (spec.gbps * 1e9)
    return saved


def token_block_ids(tokens: Sequence[int], start: int, stop: int) -> Sequence[int] | None:
    """tokens[start:stop] as int64 ids (what a tier keeps), or None if one is beyond int64
    (a request's `array('q')` slices as it is; a list of ints is checked)."""
    part = tokens[start:stop]
    if isinstance(part, array):
        return part
    try:
        return array("q", part)
    except OverflowError:
        return None
