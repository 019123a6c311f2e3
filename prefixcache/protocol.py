"""The `PrefixCache` protocol: the one interface every caching strategy implements.

Owns the abstract class the engine, the A/B runner and the conformance kit talk to,
and its value types (`Match`, `Admission`; `CacheStats` and the `KVEvent` family are
defined in `stats` and `events` and re-exported here). Counts are in TOKENS unless a
name says blocks.

Must never: import a backend, the engine or the experiment layer. Data flows down.

Rules every implementation obeys (the conformance kit tests each one):

1. `admit` returns `Admission(block_table, num_cached_tokens)`. The hit is the longest
   cached prefix, capped at `len(tokens) - 1` (the last prompt token is always
   computed, so its logits exist), and is a whole number of blocks. Hit blocks are
   pinned; blocks for the rest of the prompt are allocated. The hit equals
   `match(tokens[:-1]).num_tokens`. (A backend whose class declares `partial_hits =
   True` may also hit part of a block; see "Partial hits" below.)
   `admit(..., read_cache=False)` reads nothing: the hit is 0 tokens (no lower tier is
   read, no partial hit copied), no query is counted in `stats()`, and the request's
   blocks are cached on commit as any request's. vLLM's `skip_reading_prefix_cache`
   and SGLang's `logprob_start_len` 0: an engine asks for it for a request that needs
   the logits of every prompt position (prompt logprobs). A backend offers it by
   accepting the keyword; every built-in one does.
2. `admit` and `append` are atomic: when there is no room even after evicting
   everything evictable they return `None` and change nothing.
3. Nothing pinned by a live request is ever evicted or reused.
4. `commit` makes the request's full, computed blocks available to later
   `match`/`admit` calls. A block computed twice (same content) is handled as the
   reference system does: `hash` indexes both copies (vLLM), `radix` frees the
   request's copy (SGLang).
   `commit_and_append(r, n, tokens)` is `commit(r, n)` then `append(r, tokens)`, in one
   call where a backend offers it (an engine's decode step makes both).
5. `release` caches the request's full computed blocks, unpins everything, and frees
   what is not cached (partial tail blocks, duplicates). Releasing twice, or an unknown
   id, raises `KeyError`.
6. The KV of a cached prefix is bit-identical to recomputing it: caching never changes
   model output.
7. After every request is released no block is pinned, and every block is free or
   cached; `check_invariants` verifies this and the backend's own structure.
8. A cache is never re-entered from its own callbacks (an eviction policy, a hook, a
   token object's `tolist`/`__index__`, a request id's `__hash__`): such a call raises
   `RuntimeError` and changes nothing. Several threads may call one cache: its calls
   run one at a time. The built-in backends get both from `guarded` on each public
   method (one `CallGuard` per cache, docs/concurrency.md).

Partial hits (copy-on-write), for classes that declare `partial_hits = True` only:
the hit may end inside a block, as TensorRT-LLM reuses the matching head of the first
block that differs. Then `num_cached_tokens` need not be a multiple of the block
size, and `Admission.copies` lists `(src_block, dst_block, num_tokens)` triples: the
engine copies the KV of the first `num_tokens` slots of `src_block` into the same
slots of `dst_block` (every layer, K and V) BEFORE it computes anything for the
request, then computes from token `num_cached_tokens` on, as usual. `dst_block` is
the request's own block at index `num_cached_tokens // block_size` of its table;
`src_block` is a cached block the request keeps pinned until its first `commit` or
its `release`, whichever comes first, so nothing can overwrite it before the copy.
`match` reports such a hit the same way: `num_tokens` counts the partial tokens and
`block_ids` ends with the source block. Backends without the flag never return
copies, and every hit of theirs is whole blocks.

Lower tiers (`cache.tiers`: host memory, disk; docs/tiers.md), for caches built with
them; without tiers none of this applies and every field below is empty:

T1. A hit may span tiers. `match` and `admit` find the longest prefix cached on ANY tier:
    the chain of blocks stops at the first block held nowhere, and `Match.num_tokens`
    counts it all. `Match.tiers[i]` says where block i is (-1: the device pool; t >= 0:
    `cache.tiers[t]`, the numbering every tier number here uses); `Match.block_ids[i]`
    is then its device block or its slot in that tier.
T2. `Admission.loads` lists `(tier, slot, dst_block)` triples (tier as in T1): the
    engine copies the KV of that slot into the request's own `dst_block` (every layer,
    K and V) BEFORE it computes anything, as it applies `copies`; `dst_block` is the
    request's block at that position. The KV it loads is exactly what was stored there:
    the KV of the same prefix, computed on the device and moved down.
T3. `admit`'s hit is `match(tokens[:-1])` after `usable_hit`, minus
    `Admission.declined_tokens`: where the cost model (`cache.cost_model`) says
    computing the rest of a lower-tier hit is cheaper than loading it, or a disk block
    failed its checksum, admit starts computing there and says how many tokens it gave
    up. No admission costs more, modelled, than computing its whole prompt.
    `Admission.tier_hits` gives the hit's TOKENS per tier (device first).
T4. Data moves only where `drain_transfers()` says: `(src_tier, src, dst_tier, dst)`
    quadruples in the order they must run (tier -1 is the device pool, t >= 0 is
    `cache.tiers[t]`), loads among them. An engine runs every transfer drained before
    the forward pass that follows; a block is copied down only once the pass that
    computed it has finished (it is stored when its commit reports it, or when it is
    evicted, both after that pass). A cache without tiers returns `[]`.
T5. Rules 1-8 hold as they are for the device pool; `stats().tiers` counts each tier's
    hits, loads, stores, evictions and bytes written; KV events name each block's
    medium (`GPU`, `CPU`, `STORAGE`; `locality` LOCAL on a tier's).
Hybrid layouts (`CacheConfig.layout` with a group that is not full attention): each
group has its own block table (`block_tables(request_id)`, `Admission.group_tables`, in
layout order), where `NULL_BLOCK` (-1) marks a block the group does not hold: one a
sliding-window or chunked-local group no longer reads, a recurrent state (mamba) not
kept. Block i of a mamba group's table holds the state after exactly (i + 1) *
`state_tokens` tokens (the block size, unless the backend keeps finer states); the
engine writes it when a commit lands there, reads it back at a hit. `block_table` is the first group's table. The hit is valid for every group.
`Admission.checkpoints` lists prompt positions (TOKENS, increasing, past the hit, before
the prompt's end) where the engine ends a prefill chunk and commits, so that a state
exists there (vLLM's scheduler splits a Mamba prefill so; SGLang checkpoints at the
branching point) or a chunk is published (SGLang's chunked prefill); each such commit
may extend the tables to the next checkpoint, and
`append(request_id, [])` retries the extension when the pool had no room (None: still
none). A single-group cache lists none and has one table.

Extension hooks: `usable_hit` decides how much of the longest cached prefix a hit
uses; the built-in backends call it in both `match` and `admit`, so the two agree for
any override. `option_defaults` declares the `options:` a class accepts (YAML
`cache.options`) and `option_choices` the allowed values of those that have a fixed
set; `parse_options` checks both, when a `CacheConfig` is checked
(`prefixcache.config_checks`: at load time, naming the file and key, and in
`build_cache`) and again in `PrefixCache.__init__`, which keeps the result in
`self.options`. A class that declares no options accepts none.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from array import array
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, TypeVar

from prefixcache._C import CallGuard, token_array, token_list
from prefixcache._C import guarded as _guarded
from prefixcache.errors import ConfigError, did_you_mean
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from prefixcache.isolation import Isolation, LoRA, Namespace
from prefixcache.stats import CacheStats

if TYPE_CHECKING:
    from prefixcache._C import BlockPool
    from prefixcache.config import CacheConfig

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "PrefixCache",
    "Match",
    "Admission",
    "Copy",
    "Load",
    "Transfer",
    "CacheStats",
    "KVEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "Namespace",
    "skips_reading",
    "Isolation",
    "LoRA",
    "as_tokens",
    "token_buffer",
    "BlockIds",
    "guarded",
]



class BlockIds(array):
    """A block table as the built-in backends hand it out: block ids in one int32 buffer
    (`array('i')`: 4 bytes an id, copied with one memcpy, read in place by native code and
    numpy), equal to any sequence holding the same ids, e.g. `BlockIds([3, 4]) == (3, 4)`.
    Immutable by convention: a backend hands out a copy."""

    def __new__(cls, ids: Iterable[int] = ()) -> BlockIds:
        if type(ids) is list:
            # A backend's table: read natively into int32, then one memcpy (array() alone
            # converts id by id: 34 us for a 2,176-block table against 5). Anything it
            # refuses goes to array(), which words its own error as before.
            try:
                ids = token_array(ids, "ids", 4)
            except (TypeError, ValueError):
                pass
        return array.__new__(cls, "i", ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, array):
            return array.__eq__(self, other)
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __getitem__(self, index):  # type: ignore[override]
        out = array.__getitem__(self, index)
        return BlockIds(out) if isinstance(index, slice) else out

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"BlockIds({self.tolist()})"

    def __reduce__(self) -> tuple:
        return (BlockIds, (self.tolist(),))


@dataclass(frozen=True)
class Match:
    """A look-up result: the first `num_tokens` tokens are cached in `block_ids`
    (token i in slot i % block_size of block_ids[i // block_size]). With lower tiers,
    `tiers[i]` is where block i is (-1: the device pool; t >= 0: `cache.tiers[t]`, and
    block_ids[i] is its slot there); empty for a cache without tiers."""

    num_tokens: int
    block_ids: Sequence[int]
    tiers: tuple[int, ...] = ()


Copy = tuple[int, int, int]
"""(src_block, dst_block, num_tokens): copy the KV of the first `num_tokens` slots of
`src_block` into `dst_block` before computing the request (partial hits only)."""


Load = tuple[int, int, int]
"""(tier, slot, dst_block): load the KV of slot `slot` of `cache.tiers[tier]` into the
request's `dst_block` before computing the request."""

Transfer = tuple[int, int, int, int]
"""(src_tier, src, dst_tier, dst): copy one block's KV; tier -1 is the device pool, t >= 0
is `cache.tiers[t]` (`PrefixCache.drain_transfers`)."""


@dataclass(frozen=True)
class Admission:
    """An admitted request: its block table (blocks for the whole prompt, in order) and
    how many leading prompt tokens are already computed (a multiple of the block size,
    except for backends with `partial_hits`). `copies` are KV copies the engine does
    before computing the request (empty unless the backend has `partial_hits`).
    With lower tiers: `loads` (rule T2), `tier_hits` (TOKENS of the hit per tier,
    device first) and `declined_tokens` (rule T3); empty and 0 otherwise."""

    block_table: Sequence[int]  # BlockIds in the built-in backends
    num_cached_tokens: int
    copies: tuple[Copy, ...] = ()
    loads: tuple[Load, ...] = ()
    tier_hits: tuple[int, ...] = ()
    declined_tokens: int = 0
    #: Hybrid layouts: TOKEN positions where the engine ends a prefill chunk and commits
    #: (module docstring, "Hybrid layouts"); empty for a single-group cache.
    checkpoints: tuple[int, ...] = ()
    #: Hybrid layouts: each group's block table, in layout order (`block_table` is the
    #: first); empty for a single-group cache, whose one table serves every layer.
    group_tables: tuple[Sequence[int], ...] = ()


def as_tokens(tokens: Sequence[int], what: str = "tokens", *, copy: bool = False) -> list[int]:
    """Token ids as a list of Python ints: `tokens` itself if it already is one (unless
    `copy`), else a new list (from a tuple, a numpy int array, anything with `tolist()`;
    numpy integers become ints). TypeError naming `what` and the allowed values for
    anything else, a bool id included (`prefixcache._C.token_list`, one pass in C++)."""
    return token_list(tokens, what, copy)


def token_buffer(tokens: Sequence[int], what: str = "tokens", *, itemsize: int = 8) -> array | list[int]:
    """Token ids in a typed buffer of our own, read once in C++ (`prefixcache._C.token_array`)
    from any buffer of integers (numpy int arrays, `array('i'/'q')`, an integer memoryview)
    or sequence of ints: `array('q')` (itemsize 8) or `array('i')` (itemsize 4, ValueError
    naming an id beyond int32). With itemsize 8, ids beyond int64 (valid Python ints, which
    only CBOR bignums hash) come back as a list of ints instead. TypeError naming `what`
    for anything else, a bool id included."""
    out = token_array(tokens, what, itemsize)
    return token_list(tokens, what, True) if out is None else out


def guarded(method: F) -> F:
    """Decorator for a cache's public methods (rule 8): each call holds the cache's
    `CallGuard` (`self._call_guard`, made by `PrefixCache.__init__`) from start to end,
    so calls from other threads wait, and a call from inside a running one (a callback)
    raises `RuntimeError` before it changes anything. A method that calls another
    guarded method of its own cache raises too: call the undecorated internals instead.
    Costs one C call layer (`prefixcache._C.guarded`); name, docstring and signature
    are the method's."""
    return functools.update_wrapper(_guarded(method), method)  # type: ignore[return-value]


def skips_reading(cache: PrefixCache) -> bool:
    """Whether `cache.admit` takes `read_cache` (rule 1: an admission that reads nothing)."""
    try:
        return "read_cache" in inspect.signature(cache.admit).parameters
    except (TypeError, ValueError):  # a callable without a signature offers nothing we can see
        return False


class PrefixCache(ABC):
    """A prefix-caching strategy over a shared `BlockPool` (see the module docstring).

    Lifecycle of a request: `admit` -> (`commit` / `append` ...) -> `release`.
    A request's tokens are its prompt followed by everything appended; `commit(n)`
    says the KV of `tokens[:n]` is written. Each instance has a `CallGuard`; the
    built-in backends decorate their public methods with `guarded`, so they may be
    called from several threads and refuse re-entry from callbacks (rule 8). A
    subclass that adds or overrides a public method decorates it too if it must run
    under the guard.
    """

    #: Name under which the class is registered (set by `register_backend`).
    name: ClassVar[str] = ""
    #: True if hits may end inside a block, with `Admission.copies` (module docstring).
    partial_hits: ClassVar[bool] = False
    #: Bytes per token id the cache keeps (8: int64, 4: int32). A caller that builds token
    #: buffers anyway (the A/B runner expanding a workload) builds them this wide, so the
    #: cache's own copy is one memcpy; any width is accepted.
    token_itemsize: ClassVar[int] = 8
    #: The token ids (inclusive bounds) the class stores; None: any int. A caller that
    #: makes token ids (a workload) checks them against it before the run.
    token_id_range: ClassVar[tuple[int, int] | None] = None
    #: The `options:` this class accepts, with their defaults (subclasses add theirs;
    #: a value must have its default's type, ints accepted for floats).
    option_defaults: ClassVar[Mapping[str, Any]] = {}
    #: For options with a fixed set of values: option -> the allowed values.
    option_choices: ClassVar[Mapping[str, Sequence[Any]]] = {}
    #: Whether the class caches a hybrid `CacheConfig.layout` (a group that is not full
    #: attention); one that does not refuses such a config with a ConfigError.
    supports_layout: ClassVar[bool] = False

    def __init__(self, pool: BlockPool, config: CacheConfig) -> None:
        if pool.num_blocks != config.num_blocks:
            raise ValueError(
                f"pool has {pool.num_blocks} blocks but config.num_blocks is {config.num_blocks}"
            )
        self._call_guard = CallGuard(type(self).__name__)  # rule 8: see `guarded`
        self.pool = pool
        self.config = config
        self.block_size = config.block_size
        self.options: Mapping[str, Any] = self.parse_options(config.options)
        if not self.supports_layout and config.groups.hybrid:
            raise ConfigError(
                "layout",
                f"backend {type(self).__qualname__} does not cache hybrid layouts (kinds: "
                f"{', '.join(config.groups.kinds())}); the built-in hash does",
            )

    @classmethod
    def _merged(cls, attribute: str) -> dict[str, Any]:
        """A class attribute mapping merged over the MRO (subclasses win)."""
        out: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            out.update(getattr(klass, attribute, {}) or {})
        return out

    @classmethod
    def check_layout(cls, config: CacheConfig, options: Mapping[str, Any]) -> None:
        """ConfigError (naming the key) unless this class builds `config.layout` with the
        parsed `options`; run at config load (`check_cache_config`), so a combination a
        strategy does not build is refused before any cache is. Default: nothing more
        than `__init__` checks."""

    @classmethod
    def parse_options(cls, given: Mapping[str, Any], backend: str | None = None) -> dict[str, Any]:
        """`given` over the declared defaults; ConfigError (path `options.<key>`) for an
        unknown key, a value not among `option_choices`, or a value of the wrong type.
        `backend` names the class in messages (default: its qualified name)."""
        label = backend or cls.__qualname__
        defaults = cls._merged("option_defaults")
        choices = cls._merged("option_choices")
        out = dict(defaults)
        for key, value in given.items():
            if key not in defaults:
                allowed = ", ".join(sorted(defaults)) or "none"
                raise ConfigError(f"options.{key}", f"unknown option for backend {label}; allowed: {allowed}"
                                  + did_you_mean(key, defaults))
            if key in choices:
                if not any(type(value) is type(c) and value == c for c in choices[key]):
                    raise ConfigError(
                        f"options.{key}",
                        f"{value!r} is not allowed for backend {label}; allowed values: "
                        + ", ".join(map(str, choices[key])),
                    )
                out[key] = value
                continue
            default = defaults[key]
            ok = isinstance(value, type(default)) and not (isinstance(value, bool) and not isinstance(default, bool))
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                ok, value = True, float(value)
            if default is not None and not ok:
                raise ConfigError(
                    f"options.{key}", f"must be {type(default).__name__} (default {default!r}), got {value!r}"
                )
            out[key] = value
        return out

    # -- extension hooks -----------------------------------------------------------------
    def usable_hit(self, tokens: Sequence[int], num_tokens: int, namespace: Namespace = None) -> int:
        """Matching-policy hook: of the longest cached prefix of `tokens`, `num_tokens`
        TOKENS in whole blocks, how many a hit uses: a multiple of the block size in
        [0, num_tokens]. The built-in backends apply it in `match` and in `admit` (there
        after the len - 1 cap), so `admit` hit == `match(tokens[:-1])` for any override.
        Default: all of it."""
        return num_tokens

    def checked_usable_hit(self, tokens: Sequence[int], num_tokens: int, namespace: Namespace = None) -> int:
        """`usable_hit`, with a clear error if an override breaks its contract."""
        keep = self.usable_hit(tokens, num_tokens, namespace)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep % self.block_size or not 0 <= keep <= num_tokens:
            raise ValueError(
                f"{type(self).__qualname__}.usable_hit returned {keep!r}: must be a multiple of "
                f"block_size {self.block_size} in [0, {num_tokens}]"
            )
        return keep

    # -- look-up (pure: pins nothing, changes no recency, counts no stats) ----------
    @abstractmethod
    def match(self, tokens: Sequence[int], *, namespace: Namespace = None) -> Match:
        """Longest cached prefix of `tokens` (whole blocks; NOT capped at len - 1)."""

    # -- request lifecycle -------------------------------------------------------------
    @abstractmethod
    def admit(
        self, request_id: Hashable, tokens: Sequence[int], *, namespace: Namespace = None
    ) -> Admission | None:
        """Start a request: pin its cached prefix, allocate blocks for the rest of the
        prompt. None (nothing changed) if the pool cannot make room. `ValueError` for an
        empty prompt or a request id already live. An implementation may accept
        `read_cache: bool = True` (rule 1: False hits nothing)."""

    @abstractmethod
    def append(self, request_id: Hashable, tokens: Sequence[int]) -> list[int] | None:
        """Add tokens (decode output, the next chunk); returns the block ids newly added
        to the block table (possibly empty), or None (nothing changed) if no room."""

    @abstractmethod
    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        """The KV of `tokens[:num_computed_tokens]` is written; its full blocks become
        hittable. `num_computed_tokens` never decreases and is at most the token count."""

    def commit_and_append(
        self, request_id: Hashable, num_computed_tokens: int, tokens: Sequence[int]
    ) -> list[int] | None:
        """A decode step's two calls in one: `commit(request_id, num_computed_tokens)`
        (the KV of `tokens[:num_computed_tokens]` is written), then `append(request_id,
        tokens)` (the tokens sampled next); returns what `append` returns. A refused
        append (None) leaves the commit done. vLLM's `allocate_slots` likewise caches a
        step's full blocks and allocates its new slots in one call. This default makes
        the two calls; `hash` does both in one guarded call."""
        self.commit(request_id, num_computed_tokens)
        return self.append(request_id, tokens)

    @abstractmethod
    def release(self, request_id: Hashable) -> None:
        """The request finished or was aborted: cache its full computed blocks, unpin
        everything, free the rest. `KeyError` for an unknown or released id."""

    @abstractmethod
    def block_table(self, request_id: Hashable) -> Sequence[int]:
        """Block ids of a live request, in token order. `KeyError` if not live."""

    @property
    def state_tokens(self) -> int:
        """TOKENS per entry of a mamba group's table (module docstring, "Hybrid
        layouts"): `block_size`, unless the backend keeps states at finer positions."""
        return self.block_size

    def block_tables(self, request_id: Hashable) -> tuple[Sequence[int], ...]:
        """Each layout group's block table, in layout order (module docstring, "Hybrid
        layouts"). Default: the one table, for the one group."""
        return (self.block_table(request_id),)

    # -- maintenance ---------------------------------------------------------------------
    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Free at least `num_blocks` unpinned cached blocks if there are that many;
        returns the number of blocks actually freed (may exceed the request)."""

    @abstractmethod
    def reset(self) -> bool:
        """Drop every cached block. False (nothing changed) if any block is pinned."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Counters since construction or the last successful `reset`."""

    @abstractmethod
    def drain_events(self) -> list[KVEvent]:
        """KV events since the last drain, oldest first."""

    def drain_transfers(self) -> list[Transfer]:
        """The block copies recorded since the last drain, in the order an engine runs
        them, before its next forward pass (rule T4). Default: none (no lower tiers)."""
        return []

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise `InvariantError` (an `AssertionError`) naming the first broken invariant
        of the backend's structure or of the pool."""
