"""The conformance kit: the protocol's rules as checks any `PrefixCache` can be run against.

Owns the one operation model every check drives (`CheckedCache`), the one causal KV
oracle it keeps (`KVShadow`), the KV-event consumer it checks events with
(`EventView`), the deterministic rule scenarios (`RULE_CHECKS`) and a hypothesis state
machine over random request sequences. `prefixcache.stress` (the soak) drives the same
`CheckedCache` from a seeded random stream.

The oracle is causal, as attention is. The KV a block holds is a function of the
namespace (tenant, adapter) and of EVERY token up to the block's last slot, and an engine
computes block i attending to whatever blocks 0..i-1 of the request's table hold. So the
shadow derives a block's content from the content of the block before it in the table of
the request that wrote it, never from the request's intentions: a hit on a block with the
right tokens after another prefix, in another namespace, partly written, never written,
or reused since it held the prefix is caught the moment a request receives it, and the
failure names the rule it breaks. Nothing is hashed; contents are compared exactly.

Every failure is a `RuleViolation` (an `AssertionError`) whose message starts with the
rule (`RULES`): "rule 6 (a hit is the KV of ...) broken: admit of request 3: ...".

- rule 1: admit's hit equals `match(tokens[:-1])` (0 with `read_cache=False`), capped at len - 1, whole blocks unless
  the class declares `partial_hits`, and covers only blocks that were computed;
- rule 2: a refused `admit`/`append` leaves pool and tables exactly as they were;
- rule 3: a block a request is about to write is no other live request's, and a copy's
  source stays intact until the request's first commit;
- rule 4: only full, computed blocks become hittable (a hit on a partly written block);
- rule 5: releasing twice is a `KeyError`;
- rule 6: every hit block holds the request's own prefix, in its namespace;
- rule 7: after every release, evicting everything returns every block to the pool;
- namespaces, partial hits, purity of `match`, `reset`, bad input, and KV events: every
  block a hit or match uses was announced by a `BlockStored` (chained by parent hash,
  with the request's tokens) and not removed since, and once everything is evicted the
  events announce nothing.

One line for a plugin author::

    prefixcache.testing.check_backend(MyCache)            # or "my_pkg.mod:MyCache"

or, to have pytest collect the state machine as a test::

    TestMyCache = prefixcache.testing.conformance_test_case(MyCache)

Must never: look inside a backend (it uses the protocol and the pool's reference counts
only), or assume a particular strategy's hit counts or eviction order: it checks rules,
not policies. Requires `hypothesis` (the `dev` extra) for the state machine only.
"""

from __future__ import annotations

import math
import re
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from prefixcache._C import BlockPool
from prefixcache.config import CacheConfig
from prefixcache.config_checks import check_cache_config
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.isolation import check_namespace
from prefixcache.layout import Layout
from prefixcache.protocol import Admission, Match, PrefixCache, skips_reading
from prefixcache.registry import available_backends, resolve_backend

__all__ = [
    "check_backend",
    "check_admission",
    "conformance_test_case",
    "CacheFactory",
    "CheckedCache",
    "EventView",
    "KVShadow",
    "LiveRequest",
    "RULES",
    "RULE_CHECKS",
    "RuleViolation",
    "big_ids_are_stored_or_refused",
    "pool_state",
]

CacheFactory = Callable[[int, int], PrefixCache]
"""(block_size, num_blocks) -> a fresh cache on a fresh pool."""

RULES: dict[str, str] = {
    "rule 1": "admit's hit is the longest cached prefix, match(tokens[:-1]), capped at len(tokens) - 1, "
    "in whole blocks, over blocks that were computed",
    "rule 2": "a refused admit or append returns None and changes nothing",
    "rule 3": "nothing pinned by a live request is evicted or reused",
    "rule 4": "commit makes only full, computed blocks hittable",
    "rule 5": "releasing twice, or an unknown id, is a KeyError",
    "rule 6": "a hit is the KV of the request's own prefix: every token before it, in its namespace",
    "rule 7": "after every release nothing is pinned, and evicting everything frees every block",
    "namespaces": "requests in different namespaces never share a block",
    "partial hits": "a hit ends inside a block only with partial_hits, through one copy from a source outside "
    "the request's table into its own block",
    "tables": "a live request's block table covers its tokens: ceil(len(tokens) / block_size) blocks",
    "match is pure": "match pins nothing, changes no recency and counts no stats",
    "reset": "reset() is False and changes nothing while a request is live, True otherwise",
    "bad input": "a bad argument is a TypeError or ValueError naming it, and changes nothing",
    "events": "KV events announce what match finds: every block a hit uses was stored (chained by parent "
    "hash, with the request's tokens) and not removed since; nothing is left once everything is evicted",
    "invariants": "check_invariants() holds after every call",
    "commit_and_append": "commit_and_append(r, n, tokens) is commit(r, n) then append(r, tokens); a refused "
    "append leaves the commit done",
    "valid calls": "a call with valid arguments returns its answer; it never raises",
    "tiers": "a hit spans tiers up to the first block held nowhere; admit's hit is match's minus what it "
    "declines, its loads go into its own hit blocks, and data moves only by the transfers it reports",
}
"""The rules the kit checks, by the name every failure message starts with."""


class RuleViolation(AssertionError):
    """A backend broke `rule` (a key of `RULES`): the message says the rule, the call and
    what was wrong."""

    def __init__(self, rule: str, what: str, detail: str) -> None:
        self.rule = rule
        super().__init__(f"{rule} ({RULES[rule]}) broken: {what}: {detail}")


def _violate(rule: str, what: str, detail: str) -> NoReturn:
    """Raise the `RuleViolation`. Every violation is raised here, on one line, so that
    hypothesis sees one kind of failure and shrinks toward the simplest broken rule."""
    raise RuleViolation(rule, what, detail) from None


def _factory(backend: type[PrefixCache] | str | CacheFactory, **config: Any) -> CacheFactory:
    """Normalize a class, a backend spec or a factory into a CacheFactory."""
    if isinstance(backend, str):
        spec = backend
    elif isinstance(backend, type) and issubclass(backend, PrefixCache):
        # `name` is inherited by subclasses, so only trust it if it resolves to this class.
        if backend.name and backend.name in available_backends() and resolve_backend(backend.name) is backend:
            spec = backend.name
        else:
            spec = f"{backend.__module__}:{backend.__qualname__}"
            if "<locals>" in spec:
                # Not importable by path: build it directly, the config names a stand-in
                # (so it is not checked against it; the class parses its own options).
                cls = backend

                def build_local(block_size: int, num_blocks: int) -> PrefixCache:
                    cfg = CacheConfig(block_size=block_size, num_blocks=num_blocks, **config)
                    return cls(BlockPool(num_blocks), cfg)

                return build_local
    else:
        return backend  # already a factory

    cls = resolve_backend(spec)

    def build(block_size: int, num_blocks: int) -> PrefixCache:
        cfg = CacheConfig(backend=spec, block_size=block_size, num_blocks=num_blocks, **config)
        check_cache_config(cfg)
        return cls(BlockPool(num_blocks), cfg)

    return build


# ------------------------------------------------------------------------ the KV shadow


class _Garbage:
    """The content of a block computed on top of KV that was not its prefix: equal to nothing."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return "KV computed on top of another prefix's KV"


GARBAGE = _Garbage()
Content = tuple[Any, tuple[int, ...]]  # (namespace, every token from position 0 through the block's last written slot)


class KVShadow:
    """What each block's KV holds, derived causally (module docstring).

    `content[block]` is None while the block is unwritten since it was handed out,
    `GARBAGE` if it was computed on top of KV that is not its prefix, else
    `(namespace, prefix)`: the namespace and every token from position 0 through the
    block's last written slot (a full block at chain position i has (i + 1) *
    block_size of them). `held_before[block]` is what the block held when it was last
    handed out fresh, so a block served after its reuse is named as such. Exact tuples,
    bounded by num_blocks times the longest prompt.
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.content: list[Content | _Garbage | None] = [None] * num_blocks
        self.held_before: list[Content | _Garbage | None] = [None] * num_blocks
        #: (tier, slot) -> what that slot of a lower tier holds (rule T2: what was moved there)
        self.tier_content: dict[tuple[int, int], Content | _Garbage | None] = {}

    def transfer(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None:
        """The engine copied one block's KV (tier -1: the device pool), as drained from
        the cache (rule T4): the destination holds exactly what the source held."""
        held = self.content[src] if src_tier < 0 else self.tier_content.get((src_tier, src))
        if dst_tier < 0:
            if self.content[dst] is not None:
                self.held_before[dst] = self.content[dst]
            self.content[dst] = held
        else:
            self.tier_content[(dst_tier, dst)] = held

    def held(self, tier: int, block: int) -> Content | _Garbage | None:
        """What a device block (tier -1) or a tier slot holds."""
        return self.content[block] if tier < 0 else self.tier_content.get((tier, block))

    def allocated(self, blocks: Iterable[int]) -> None:
        """`blocks` were handed out fresh: the KV they held will be overwritten."""
        for b in blocks:
            if self.content[b] is not None:
                self.held_before[b] = self.content[b]
            self.content[b] = None

    def write(self, table: Sequence[int], namespace: Any, tokens: Sequence[int], start: int, stop: int) -> None:
        """The engine computed tokens[start:stop] (TOKENS) into `table`: each slot
        attends to the slots before it in its block and to the blocks before it in
        `table`, whatever those hold."""
        bs = self.block_size
        for i in range(start // bs, -(-stop // bs)):
            block = table[i]
            lo, hi = max(start, i * bs), min(stop, (i + 1) * bs)
            if lo > i * bs:  # the block's own earlier slots: written by this request, or copied in
                base, need = self.content[block], lo
            elif i:
                base, need = self.content[table[i - 1]], i * bs
            else:
                base, need = (namespace, ()), 0
            if isinstance(base, tuple) and len(base[1]) == need:
                self.content[block] = (base[0], base[1] + tuple(tokens[lo:hi]))
            else:
                self.content[block] = GARBAGE

    def copy(self, src: int, dst: int, num_tokens: int) -> None:
        """The engine copied the slots of `src` up to position `num_tokens` (TOKENS,
        ending inside the block) into `dst` (a partial hit's copy)."""
        held = self.content[src]
        self.content[dst] = (held[0], held[1][:num_tokens]) if isinstance(held, tuple) else GARBAGE

    def check(
        self, table: Sequence[int], namespace: Any, tokens: Sequence[int], num_tokens: int, what: str,
        tiers: Sequence[int] = (),
    ) -> None:
        """Blocks of `table` covering tokens[:num_tokens] (its whole blocks) hold exactly
        `namespace` and the request's prefix through each block. `tiers[i]` (a match
        with lower tiers): where block i is, -1 the device, else table[i] is a slot."""
        bs = self.block_size
        for i in range(num_tokens // bs):
            tier = tiers[i] if tiers else -1
            held = self.held(tier, table[i])
            expected = (namespace, tuple(tokens[: (i + 1) * bs]))
            if held != expected:
                if tier >= 0:
                    _violate("rule 6", what, f"block #{i} in slot {table[i]} of tier {tier} holds "
                             f"{_describe(held, bs)}; the request needs namespace {namespace!r}, "
                             f"tokens ...{expected[1][i * bs :]} after {i * bs} others")  # fmt: skip
                self._fail(table[i], i, held, expected, what)

    def check_tail(self, block: int, namespace: Any, tokens: Sequence[int], num_tokens: int, what: str) -> None:
        """A live request's own partly computed block holds exactly tokens[:num_tokens]."""
        held = self.content[block]
        expected = (namespace, tuple(tokens[:num_tokens]))
        if held != expected:
            self._fail(block, num_tokens // self.block_size, held, expected, what)

    def check_head(
        self, block: int, namespace: Any, tokens: Sequence[int], num_tokens: int, what: str, rule: str = "rule 6"
    ) -> None:
        """`block` holds tokens[:num_tokens] (TOKENS, ending inside it) for `namespace`
        at the same chain position: its first num_tokens % block_size slots can be a
        partial hit's copy source. `rule` is the one a failure names."""
        bs = self.block_size
        held = self.content[block]
        i = num_tokens // bs
        prefix = tuple(tokens[:num_tokens])
        if (
            isinstance(held, tuple)
            and held[0] == namespace
            and len(held[1]) >= num_tokens
            and (len(held[1]) - 1) // bs == i
            and held[1][:num_tokens] == prefix
        ):
            return
        if isinstance(held, tuple) and held[0] != namespace and held[1][:num_tokens] == prefix:
            rule = "namespaces"
        _violate(
            rule,
            what,
            f"partial-hit source {block} holds {_describe(held, bs)}; the request needs namespace {namespace!r}, "
            f"tokens ...{prefix[i * bs :]} after {i * bs} others",
        )

    def _fail(self, block: int, i: int, held: Any, expected: Content, what: str) -> NoReturn:
        bs = self.block_size
        namespace, prefix = expected
        where = f"block #{i} = {block} holds {_describe(held, bs)}"
        need = f"the request needs namespace {namespace!r}, tokens ...{prefix[i * bs :]} after {i * bs} others"
        if isinstance(held, tuple):
            held_ns, held_prefix = held
            if i * bs < len(held_prefix) < len(prefix) and held == (namespace, prefix[: len(held_prefix)]):
                _violate("rule 4", what, f"{where}: only {len(held_prefix) - i * bs} of its {bs} tokens were computed")
        if self.held_before[block] == expected:
            _violate("rule 6", what, f"{where}: it held that prefix, but was evicted and reused since")
        if held is None:
            _violate("rule 1", what, f"{where}: nothing was computed into it since it was handed out")
        if isinstance(held, tuple):
            if held_prefix == prefix:
                _violate("namespaces", what, f"{where}; {need}")
            if held_prefix[-bs:] == prefix[i * bs :]:
                _violate("rule 6", what, f"{where}: the same tokens after another prefix; {need}")
        _violate("rule 6", what, f"{where}; {need}")


def _describe(held: Any, block_size: int) -> str:
    if held is None:
        return "unwritten KV"
    if isinstance(held, _Garbage):
        return repr(held)
    namespace, prefix = held
    start = (len(prefix) - 1) // block_size * block_size
    return f"namespace {namespace!r}, tokens ...{prefix[start:]} after {start} others"


# ------------------------------------------------------------------------ the event view


class EventView:
    """What a KV-event consumer (a KV-aware router's index) knows: each block hash
    announced by `BlockStored` and not since removed, counted per copy and per medium
    (a block computed twice is stored twice and removed once per copy; a block demoted
    to a lower tier is removed from `GPU` and stored on `CPU` or `STORAGE`), with the
    parent hash and tokens it was announced with."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.count: Counter[Any] = Counter()  # (medium, hash) -> copies
        self._total: Counter[Any] = Counter()  # hash -> copies on every medium
        self._contents: dict[Any, set[tuple[Any, tuple[int, ...]]]] = {}
        self._by_content: dict[tuple[Any, tuple[int, ...]], set[Any]] = {}

    def consume(self, events: Iterable[Any], what: str) -> None:
        bs = self.block_size
        for event in events:
            if isinstance(event, BlockStored):
                tokens = tuple(event.token_ids)
                if len(tokens) != len(event.block_hashes) * bs:
                    _violate(
                        "events", what, f"a BlockStored of {len(event.block_hashes)} blocks carries {len(tokens)} tokens"
                    )
                parent = event.parent_block_hash
                for j, h in enumerate(event.block_hashes):
                    content = (parent, tokens[j * bs : (j + 1) * bs])
                    self.count[(event.medium, h)] += 1
                    self._total[h] += 1
                    self._contents.setdefault(h, set()).add(content)
                    self._by_content.setdefault(content, set()).add(h)
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    key = (event.medium, h)
                    if self.count[key] <= 0:
                        _violate("events", what, f"BlockRemoved of hash {h!r} on {event.medium}, which no BlockStored "
                                 "holds there")  # fmt: skip
                    self.count[key] -= 1
                    self._total[h] -= 1
                    if not self.count[key]:
                        del self.count[key]
                    if not self._total[h]:
                        del self._total[h]
                        for content in self._contents.pop(h):
                            self._by_content[content].discard(h)
            elif isinstance(event, AllBlocksCleared):
                self.count.clear()
                self._total.clear()
                self._contents.clear()
                self._by_content.clear()

    def announced(self, tokens: Sequence[int], num_blocks: int) -> int:
        """How many of the first `num_blocks` blocks of `tokens` a consumer can find:
        a chain of stored hashes from a chain start, each with the block's tokens."""
        bs = self.block_size
        frontier: set[Any] = {None}
        for i in range(num_blocks):
            own = tuple(tokens[i * bs : (i + 1) * bs])
            frontier = {h for parent in frontier for h in self._by_content.get((parent, own), ())}
            if not frontier:
                return i
        return num_blocks

    @property
    def num_stored(self) -> int:
        """Block copies announced and not removed, on every medium."""
        return sum(self.count.values())

    def num_stored_on(self, medium: str) -> int:
        """Block copies announced on `medium` (GPU: the device pool) and not removed."""
        return sum(n for (m, _), n in self.count.items() if m == medium)


# --------------------------------------------------------------------- the operation model


@dataclass
class LiveRequest:
    """The kit's view of a live request. `copy` is a partial hit's (src, dst, n) until
    the request's first commit, when the engine copies; `table` its block table as the
    cache last reported it (re-read after every call on the request and by `check`)."""

    tokens: list[int]
    namespace: Any
    computed: int
    copy: tuple[int, int, int] | None = None
    table: list[int] = field(default_factory=list)  # as the cache last reported it


def pool_state(cache: PrefixCache, request_ids: Iterable[Hashable]) -> tuple:
    """What a refused or failed call must leave as it was: the pool's free queue, every
    block's ref count, its cached count, and the block tables of `request_ids`."""
    pool, table = cache.pool, cache.block_table
    return (
        pool.free_queue(),
        list(map(pool.ref_count, range(pool.num_blocks))),
        pool.num_cached,
        [tuple(table(rid)) for rid in request_ids],
    )


def check_admission(
    cache: PrefixCache, adm: Admission, tokens: Sequence[int], expected_hit: int, what: str
) -> None:
    """Rule 1 on one admission's shape: the hit is what match(tokens[:-1]) said, capped,
    and whole blocks unless the class declares `partial_hits`, in which case any partial
    block comes with exactly one well-formed copy into the request's own block."""
    bs = cache.block_size
    hit = adm.num_cached_tokens
    declined = adm.declined_tokens
    if not isinstance(declined, int) or declined < 0 or declined % bs or declined > expected_hit:
        _violate("tiers", what, f"declined_tokens {declined!r} is not whole blocks of the {expected_hit}-token match")
    if hit != expected_hit - declined:
        _violate("rule 1", what, f"admit hit {hit} tokens (declining {declined}), match(tokens[:-1]) says {expected_hit}")
    _check_loads(cache, adm, what)
    if not 0 <= hit <= len(tokens) - 1:
        _violate("rule 1", what, f"hit {hit} tokens of a {len(tokens)}-token prompt")
    if len(adm.block_table) != math.ceil(len(tokens) / bs):
        _violate("tables", what, f"{len(adm.block_table)} blocks for {len(tokens)} tokens")
    if len(set(adm.block_table)) != len(adm.block_table):
        _violate("tables", what, f"a block appears twice in {adm.block_table}")
    if not type(cache).partial_hits:
        if hit % bs:
            _violate("partial hits", what, f"hit {hit} is not whole blocks of {bs} (no partial_hits)")
        if adm.copies:
            _violate("partial hits", what, f"copies {adm.copies} from a class without partial_hits")
        return
    if hit % bs == 0:
        if adm.copies:
            _violate("partial hits", what, f"copies {adm.copies} but the hit {hit} is whole blocks")
        return
    if len(adm.copies) != 1:
        _violate("partial hits", what, f"a hit ending inside a block needs one copy, got {adm.copies}")
    src, dst, n = adm.copies[0]
    if dst != adm.block_table[hit // bs]:
        _violate("partial hits", what, f"copy into {dst}, but the partial block is {adm.block_table[hit // bs]}")
    if n != hit % bs:
        _violate("partial hits", what, f"copies {n} tokens, the hit ends {hit % bs} into its block")
    if src in adm.block_table:
        _violate("partial hits", what, f"copy source {src} is in the request's own table")


def _check_loads(cache: PrefixCache, adm: Admission, what: str) -> None:
    """Rule T2's shape: each load goes into one of the request's own hit blocks, once;
    a cache without tiers loads nothing and declines nothing."""
    bs = cache.block_size
    tiers = getattr(getattr(cache, "config", None), "tiers", ())
    if not tiers:
        if adm.loads or adm.declined_tokens or adm.tier_hits:
            _violate("tiers", what, f"a cache without tiers returned loads {adm.loads}, tier_hits {adm.tier_hits}, "
                     f"declined {adm.declined_tokens}")  # fmt: skip
        return
    hit_blocks = set(adm.block_table[: adm.num_cached_tokens // bs])
    dsts = [dst for _, _, dst in adm.loads]
    if len(set(dsts)) != len(dsts) or not set(dsts) <= hit_blocks:
        _violate("tiers", what, f"loads {adm.loads} must go into distinct blocks of the hit {sorted(hit_blocks)}")
    for tier, slot, _ in adm.loads:
        if not 0 <= tier < len(tiers) or not 0 <= slot < tiers[tier].num_blocks:
            _violate("tiers", what, f"load from slot {slot} of tier {tier}: no such slot")
    if adm.tier_hits and sum(adm.tier_hits) != adm.num_cached_tokens:
        _violate("tiers", what, f"tier_hits {adm.tier_hits} do not add up to the hit {adm.num_cached_tokens}")


class _What:
    """A call's description for a failure message, formatted only if one is raised
    (a namespace's repr costs more than the check)."""

    __slots__ = ("args", "text")

    def __init__(self, text: str, *args: Any) -> None:
        self.text, self.args = text, args

    def __str__(self) -> str:
        return self.text.format(*self.args)


class CheckedCache:
    """A cache driven as an engine drives it, every answer checked against the causal
    `KVShadow` (and, with `check_events`, the `EventView`): the one operation model of
    the kit's rule checks, its state machine and `prefixcache.stress`.

    Each protocol call goes to the cache and is then checked; `commit(rid, n)` first
    writes tokens[computed:n] into the shadow as the engine's forward pass would
    (applying a partial hit's copy first). `check()` runs `check_invariants()` and
    re-checks every live request's KV; `drain()` releases everything and checks rule 7.
    `check_events` defaults to the cache config's `enable_events`.
    """

    def __init__(self, cache: PrefixCache, *, check_events: bool | None = None) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.pool = cache.pool
        self.shadow = KVShadow(cache.block_size, cache.pool.num_blocks)
        if check_events is None:
            check_events = bool(getattr(getattr(cache, "config", None), "enable_events", False))
        self.events = EventView(cache.block_size) if check_events else None
        self.live: dict[Hashable, LiveRequest] = {}
        self.admitted = self.refused = self.hit_tokens = self.prompt_tokens = self.copies = 0
        self.invariant_checks = 0

    # -- the protocol, checked -------------------------------------------------------------
    def admit(self, request_id: Hashable, tokens: Sequence[int], *, namespace: Any = None, **kwargs: Any) -> Admission | None:
        cache, bs = self.cache, self.block_size
        ns = check_namespace(namespace)
        what = _What("admit of request {!r} (namespace {!r})", request_id, ns)
        reads = kwargs.get("read_cache", True) is not False
        expected = self._call(what, cache.match, tokens[:-1], namespace=namespace).num_tokens if reads else 0
        queries = cache.stats().queries
        before = self.state(recorded=True)
        adm = self._call(what, cache.admit, request_id, tokens, namespace=namespace, **kwargs)
        moved = self._moved(what)
        if adm is None:
            self.refused += 1
            if self.state() != before or moved:
                _violate("rule 2", what, "a refused admit changed the pool, a block table, or moved data")
            return None
        check_admission(cache, adm, tokens, expected, what)
        if not reads and (adm.loads or adm.copies or cache.stats().queries != queries):
            _violate("rule 1", what, "an admit with read_cache=False read the cache (a load, a copy or a counted query)")
        self._check_not_held(request_id, [dst for _, _, dst in adm.loads], what, "loads into block")
        table = list(adm.block_table)
        if list(cache.block_table(request_id)) != table:
            _violate("tables", what, f"block_table() is {cache.block_table(request_id)}, admit said {table}")
        hit = adm.num_cached_tokens
        self.shadow.check(table, ns, tokens, hit, what)
        copy = adm.copies[0] if adm.copies else None
        if copy is not None:
            self.shadow.check_head(copy[0], ns, tokens, hit, what)
            self.copies += 1
        fresh = table[hit // bs :]
        self._check_not_held(request_id, fresh, what, "hands out block")
        self.shadow.allocated(fresh)
        self.live[request_id] = LiveRequest(list(tokens), ns, hit, copy, table)
        self._check_announced(tokens, hit // bs, what)
        self.admitted += 1
        self.hit_tokens += hit
        self.prompt_tokens += len(tokens)
        return adm

    def append(self, request_id: Hashable, tokens: Sequence[int]) -> list[int] | None:
        req = self.live[request_id]
        what = _What("append to request {!r}", request_id)
        before = self.state(recorded=True)
        added = self._call(what, self.cache.append, request_id, tokens)
        moved = self._moved(what)
        if added is None:
            self.refused += 1
            if self.state() != before or moved:
                _violate("rule 2", what, "a refused append changed the pool, a block table, or moved data")
            return None
        req.tokens += list(tokens)
        table = list(self.cache.block_table(request_id))
        if len(table) != math.ceil(len(req.tokens) / self.block_size) or (added and table[-len(added) :] != list(added)):
            _violate("tables", what, f"table {table} for {len(req.tokens)} tokens; append returned {added}")
        self._check_not_held(request_id, added, what, "hands out block")
        self.shadow.allocated(added)
        req.table = table
        return added

    def commit(self, request_id: Hashable, num_computed_tokens: int) -> None:
        req, bs = self.live[request_id], self.block_size
        n = num_computed_tokens
        what = _What("commit of request {!r} to {} tokens", request_id, n)
        table = list(self.cache.block_table(request_id))
        if req.copy is not None:  # the engine's first forward pass starts with the copy
            src, dst, _ = req.copy
            self.shadow.check_head(src, req.namespace, req.tokens, req.computed, f"{what}: the copy", rule="rule 3")
            self.shadow.copy(src, dst, req.computed)
            req.copy = None
        writes = table[req.computed // bs : -(-n // bs)]
        self._check_not_held(request_id, writes, what, "writes into block")
        for block in writes:
            if self.pool.ref_count(block) != 1:
                _violate(
                    "rule 3", what, f"the request writes into block {block}, which something else holds too "
                    f"(ref count {self.pool.ref_count(block)})"
                )
        self.shadow.write(table, req.namespace, req.tokens, req.computed, n)
        self._call(what, self.cache.commit, request_id, n)
        self._moved(what)
        req.computed = n
        # A backend may re-point the table at equal blocks it already had (radix).
        req.table = list(self.cache.block_table(request_id))
        self.shadow.check(req.table, req.namespace, req.tokens, n, what)

    def release(self, request_id: Hashable) -> None:
        self._call(f"release of request {request_id!r}", self.cache.release, request_id)
        self._moved(f"release of request {request_id!r}")
        del self.live[request_id]
        try:
            self.cache.release(request_id)
        except KeyError:
            return
        _violate("rule 5", f"release of request {request_id!r}", "releasing it again raised nothing")

    def evict(self, num_blocks: int) -> int:
        freed = self._call(f"evict({num_blocks})", self.cache.evict, num_blocks)
        self._moved(f"evict({num_blocks})")
        if isinstance(freed, bool) or not isinstance(freed, int) or freed < 0:
            _violate("bad input", f"evict({num_blocks})", f"returned {freed!r}, not a count of blocks")
        return freed

    def reset(self) -> bool:
        before = self.state()
        ok = self._call("reset()", self.cache.reset)
        self._moved("reset()")
        if ok:
            self.shadow.tier_content.clear()
        if ok is not (not self.live):
            _violate("reset", "reset()", f"returned {ok!r} with {len(self.live)} live requests")
        if not ok and self.state() != before:
            _violate("reset", "reset()", "a refused reset changed the pool or a block table")
        return ok

    def match(self, tokens: Sequence[int], *, namespace: Any = None) -> Match:
        cache, bs = self.cache, self.block_size
        ns = check_namespace(namespace)
        what = _What("match in namespace {!r}", ns)
        before, stats = self.state(recorded=True), cache.stats()
        m = self._call(what, cache.match, tokens, namespace=namespace)
        if self.state() != before or cache.stats() != stats or self._moved(what):
            _violate("match is pure", what, "match() changed the pool, a block table or the stats, or moved data")
        if len(m.block_ids) != math.ceil(m.num_tokens / bs) or m.num_tokens > len(tokens):
            _violate("rule 1", what, f"{m} for {len(tokens)} tokens")
        if m.num_tokens % bs and not type(cache).partial_hits:
            _violate("partial hits", what, f"match of {m.num_tokens} tokens is not whole blocks")
        if m.tiers and len(m.tiers) != len(m.block_ids):
            _violate("tiers", what, f"{m}: one tier per block")
        self.shadow.check(m.block_ids, ns, tokens, m.num_tokens, what, m.tiers)
        if m.num_tokens % bs:
            self.shadow.check_head(m.block_ids[-1], ns, tokens, m.num_tokens, what)
        self._check_announced(tokens, m.num_tokens // bs, what)
        return m

    # -- whole-cache checks ----------------------------------------------------------------
    def state(self, *, recorded: bool = False) -> tuple:
        """`pool_state` of the cache and its live requests; with `recorded`, their tables
        as last reported (what a call is checked to leave as it was)."""
        if not recorded:
            return pool_state(self.cache, self.live)
        pool = self.pool
        return (pool.free_queue(), list(map(pool.ref_count, range(pool.num_blocks))), pool.num_cached,
                [tuple(req.table) for req in self.live.values()])

    def check(self) -> None:
        """`check_invariants()`, then every live request: its table covers its tokens,
        its computed KV is in its table, a pending copy's source is intact."""
        try:
            self.cache.check_invariants()
        except AssertionError as err:
            _violate("invariants", "check_invariants()", f"{type(err).__name__}: {err}")
        bs = self.block_size
        for rid, req in self.live.items():
            what = _What("live request {!r}", rid)
            table = req.table = list(self.cache.block_table(rid))
            if len(table) != math.ceil(len(req.tokens) / bs):
                _violate("tables", what, f"{len(table)} blocks for {len(req.tokens)} tokens")
            self.shadow.check(table, req.namespace, req.tokens, req.computed, what)
            if req.copy is not None:
                self.shadow.check_head(req.copy[0], req.namespace, req.tokens, req.computed, what, rule="rule 3")
            elif req.computed % bs:
                self.shadow.check_tail(table[req.computed // bs], req.namespace, req.tokens, req.computed, what)
        if self.events is not None:
            self.events.consume(self.cache.drain_events(), "the event stream")
        self.invariant_checks += 1

    def drain(self) -> None:
        """Rule 7: release everything; then nothing is pinned, evicting frees every
        block, the events announce nothing, and reset succeeds."""
        for rid in list(self.live):
            self.release(rid)
        self.check()
        cache, pool = self.cache, self.pool
        cache.evict(pool.num_blocks)
        self.check()
        if pool.num_free != pool.num_blocks:
            _violate(
                "rule 7", "after releasing every request and evicting everything", f"{pool.num_pinned} blocks are pinned"
            )
        on_device = self.events.num_stored_on("GPU") if self.events is not None else 0
        if on_device:
            _violate(
                "events", "after every block was evicted", f"the events still announce {on_device} "
                "stored block(s) on the device (a BlockRemoved missing)"
            )
        self.reset()
        if self.events is not None:
            self.events.consume(self.cache.drain_events(), "reset()")
            if self.events.num_stored:
                _violate("events", "after reset()", f"the events still announce {self.events.num_stored} blocks")

    # -- helpers --------------------------------------------------------------------------
    def _moved(self, what: Any) -> int:
        """Apply the transfers the last call reported to the shadow, in order (the engine
        runs them before its next forward pass); returns how many there were."""
        transfers = self._call(what, self.cache.drain_transfers)
        for t in transfers:
            self.shadow.transfer(*t)
        return len(transfers)

    @staticmethod
    def _call(what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A protocol call with valid arguments: an exception from it is a violation."""
        try:
            return method(*args, **kwargs)
        except RuleViolation:
            raise
        except Exception as err:  # noqa: BLE001 -- whatever it is, a valid call must not raise it
            _violate("valid calls", what, f"raised {type(err).__name__}: {err}")

    def _check_not_held(self, request_id: Hashable, blocks: Sequence[int], what: str, verb: str) -> None:
        """Rule 3: `blocks` (fresh, or about to be written) are in no other live
        request's table and are no pending copy's source."""
        if not blocks:
            return
        mine = set(blocks)
        for rid, req in self.live.items():
            if rid == request_id:
                continue
            held = [*req.table, req.copy[0]] if req.copy is not None else req.table
            if not mine.isdisjoint(held):
                block = next(b for b in blocks if b in held)
                _violate("rule 3", what, f"the request {verb} {block}, which live request {rid!r} holds")

    def _check_announced(self, tokens: Sequence[int], num_blocks: int, what: str) -> None:
        if self.events is None or not num_blocks:
            return
        self.events.consume(self.cache.drain_events(), what)
        found = self.events.announced(tokens, num_blocks)
        if found < num_blocks:
            _violate(
                "events", what, f"the hit uses {num_blocks} blocks, but the KV events announce only the first {found} "
                "(block hashes chained by parent, with these tokens, stored and not removed)"
            )


# ------------------------------------------------------------------- deterministic rules


def _run(checked: CheckedCache, rid: Hashable, tokens: Sequence[int], namespace: Any = None) -> Admission:
    """Admit, compute the whole prompt, release: what a finished request leaves cached."""
    adm = checked.admit(rid, tokens, namespace=namespace)
    assert adm is not None, f"request {rid!r} of {len(tokens)} tokens did not fit an empty pool"
    checked.commit(rid, len(tokens))
    checked.release(rid)
    return adm


def rule_admit_hit_is_capped_whole_blocks(make: CacheFactory, bs: int) -> None:
    """Rule 1: the hit is the cached prefix capped at len-1, whole blocks, real KV."""
    checked = CheckedCache(make(bs, 32))
    prompt = list(range(100, 100 + 3 * bs + 1))
    assert _run(checked, "a", prompt).num_cached_tokens == 0
    probes = [prompt, prompt[: 3 * bs], prompt[: 2 * bs + 1], prompt + [7, 8], prompt[: 2 * bs] + [5] * bs]
    probes.append(prompt[: 2 * bs + bs // 2] + [5] * bs)  # half of block 2 matches: a partial hit if offered
    for probe in probes:
        checked.admit("b", probe)
        checked.release("b")
        checked.match(probe)
    checked.drain()


def rule_hits_are_causal(make: CacheFactory, bs: int) -> None:
    """Rule 6: a block's KV depends on every token before it. With blocks A, B, C cached
    as A+B+C, a prompt B+C must miss (B was computed after A), A+C must stop after A,
    and a prefix one namespace cached after another's first block is not the other's."""
    checked = CheckedCache(make(bs, 32))
    a, b, c = ([base + j for j in range(bs)] for base in (300, 400, 500))
    _run(checked, "abc", [*a, *b, *c, 9])
    for probe in ([*b, *c, 9], [*a, *c, 9], [*c, *c, 9], [*a, *a, *b, 9]):
        checked.match(probe)
        checked.admit("probe", probe)
        checked.commit("probe", len(probe))
        checked.release("probe")
    # Namespaces: t2 caches A+C; t1 caches A+B; t2's A+B must not get t1's B.
    _run(checked, "t2", [*a, *c, 9], "t2")
    _run(checked, "t1", [*a, *b, 9], "t1")
    checked.match([*a, *b, 9], namespace="t2")
    checked.admit("t2-ab", [*a, *b, 9], namespace="t2")
    checked.release("t2-ab")
    checked.drain()


def rule_evicted_blocks_are_not_served(make: CacheFactory, bs: int) -> None:
    """Rules 1, 4 and 6: once a cached block is evicted and reused for other tokens, the
    prefix it held is a miss; a block its owner computed only in part is no hit."""
    checked = CheckedCache(make(bs, 4))
    first = list(range(700, 700 + 2 * bs + 1))
    _run(checked, "first", first)
    _run(checked, "filler", list(range(800, 800 + 4 * bs)))  # every block of the pool: the first's are reused
    checked.match(first)
    _run(checked, "again", first)
    checked.drain()
    if bs == 1:
        return
    checked = CheckedCache(make(bs, 8))
    owner = list(range(900, 900 + 3 * bs))
    checked.admit("owner", owner)
    checked.commit("owner", bs + 1)  # block 0 computed, block 1 only in part
    checked.match(owner)
    checked.admit("reader", owner)
    checked.release("reader")
    checked.release("owner")
    checked.match(owner)
    checked.drain()


def rule_refusal_changes_nothing(make: CacheFactory, bs: int) -> None:
    """Rule 2: an admit or append that cannot fit returns None and changes nothing."""
    checked = CheckedCache(make(bs, 8))
    first = list(range(10, 10 + 5 * bs))
    assert checked.admit("a", first) is not None
    checked.commit("a", len(first))
    stats_before = checked.cache.stats()
    if checked.admit("big", list(range(500, 500 + 4 * bs))) is not None:
        _violate("rule 2", "admit of 4 blocks with 3 free", "it was admitted")
    if checked.append("a", list(range(900, 900 + 4 * bs))) is not None:
        _violate("rule 2", "append of 4 blocks with 3 free", "it was accepted")
    if checked.cache.stats().hits != stats_before.hits:
        _violate("rule 2", "a refused admit", "counted hits")
    with_room = checked.append("a", [1])
    assert with_room is not None and len(checked.cache.block_table("a")) == 5 + len(with_room)
    checked.drain()


def _expect(kind: type[Exception], rule: str, call: Callable[[], Any], what: str, field: str | None = None) -> None:
    """`call()` must raise `kind` (with a message naming `field`, if given)."""
    wanted = f"{kind.__name__}" + (f" naming {field!r}" if field else "")
    try:
        call()
    except kind as err:
        if field is not None and field not in str(err):
            _violate(rule, what, f"the {kind.__name__} does not name {field!r}: {err}")
    except Exception as err:  # noqa: BLE001 -- any other kind is the finding
        _violate(rule, what, f"expected {wanted}, got {type(err).__name__}: {err}")
    else:
        _violate(rule, what, f"expected {wanted}, nothing was raised")


def _expect_returns(call: Callable[[], Any], what: str) -> Any:
    """`call()` must not raise: a valid argument of an accepted type."""
    try:
        return call()
    except Exception as err:  # noqa: BLE001 -- any exception is the finding
        _violate("bad input", what, f"a valid argument was refused: {type(err).__name__}: {err}")


def rule_lifecycle_errors(make: CacheFactory, bs: int) -> None:
    """Rule 5 and the argument checks: bad ids and counts raise, and change nothing."""
    cache = make(bs, 16)
    tokens = list(range(1, 2 * bs + 2))
    assert cache.admit("r", tokens) is not None
    for what, call in (
        ("admit of a live id", lambda: cache.admit("r", tokens)),
        ("admit of an empty prompt", lambda: cache.admit("s", [])),
        ("commit beyond the tokens", lambda: cache.commit("r", len(tokens) + 1)),
        ("commit of -1 tokens", lambda: cache.commit("r", -1)),
    ):
        _expect(ValueError, "bad input", call, what)
    cache.commit("r", bs)
    _expect(ValueError, "bad input", lambda: cache.commit("r", bs - 1), "commit going backwards")
    cache.release("r")
    for what, call in (
        ("release twice", lambda: cache.release("r")),
        ("release of an unknown id", lambda: cache.release("never")),
        ("block_table of a released id", lambda: cache.block_table("r")),
        ("append to a released id", lambda: cache.append("r", [1])),
        ("commit of a released id", lambda: cache.commit("r", 1)),
    ):
        _expect(KeyError, "rule 5", call, what)
    CheckedCache(cache).drain()


def rule_namespaces_isolate(make: CacheFactory, bs: int) -> None:
    """Requests in different namespaces never share a block: the same prompt misses in
    every other namespace, and any later hit is that namespace's own KV."""
    checked = CheckedCache(make(bs, 32))
    prompt = list(range(40, 40 + 3 * bs + 1))
    for ns in ("a", "b", None):
        adm = _run(checked, ns, prompt, ns)
        if adm.num_cached_tokens:
            _violate("namespaces", f"admit in namespace {ns!r}", f"hit {adm.num_cached_tokens} tokens "
                                "another namespace cached")
    for ns in ("a", "b", None):
        checked.admit("again", prompt, namespace=ns)
        checked.release("again")
        checked.match(prompt, namespace=ns)
    checked.drain()


def rule_reset_refuses_while_live(make: CacheFactory, bs: int) -> None:
    checked = CheckedCache(make(bs, 16))
    prompt = list(range(1, 2 * bs + 2))
    checked.admit("r", prompt)
    checked.commit("r", len(prompt))
    checked.reset()
    checked.release("r")
    checked.reset()
    adm = checked.admit("r", prompt)
    if adm.num_cached_tokens:
        _violate("reset", "admit after reset()", f"hit {adm.num_cached_tokens} tokens: reset kept blocks")
    checked.drain()


def rule_copy_sources_stay_pinned(make: CacheFactory, bs: int) -> None:
    """Partial hits: a copy's source survives until the request's first commit, even if
    another request then takes every free block and writes into them."""
    if bs < 2:
        return
    checked = CheckedCache(make(bs, 8))
    first = list(range(60, 60 + 2 * bs + 1))
    _run(checked, "a", first)
    probe = first[: bs + bs // 2] + [5] * bs  # block 1 matches for half its tokens
    adm = checked.admit("b", probe)
    assert adm is not None
    if adm.copies:
        filler = list(range(900, 900 + checked.pool.num_free * bs))
        if filler and checked.admit("c", filler) is not None:
            checked.commit("c", len(filler))
    checked.commit("b", len(probe))  # b's first forward pass: the copy, then the rest
    checked.drain()


def rule_events_agree_with_match(make: CacheFactory, bs: int) -> None:
    """KV events: each block a hit or match uses was announced stored (parent-chained,
    with its tokens) and not removed; after evicting everything nothing is announced;
    after reset neither. Skipped for a cache built with `enable_events: false`."""
    cache = make(bs, 6)
    if not getattr(cache.config, "enable_events", False):
        return
    checked = CheckedCache(cache, check_events=True)
    prompt = list(range(200, 200 + 3 * bs + 1))
    _run(checked, "a", prompt)
    checked.match(prompt)
    adm = checked.admit("b", prompt[: 2 * bs] + [1] * bs)  # extends a's first two blocks
    checked.commit("b", 3 * bs)
    checked.release("b")
    checked.match(prompt[: 2 * bs] + [1] * bs)
    assert adm is not None
    _run(checked, "c", list(range(600, 600 + 5 * bs)))  # forces evictions: BlockRemoved
    checked.match(prompt)
    checked.check()
    _run(checked, "d", prompt)
    checked.reset()
    checked.check()
    if checked.events.num_stored:
        _violate("events", "after reset()", f"the events still announce {checked.events.num_stored} blocks")
    checked.drain()


# Token arguments every backend must refuse with a TypeError naming `tokens` (not a
# sequence) or `tokens[i]` (an id that is a bool or not an integer): never accepted
# now to fail later, never a crash.
BAD_TOKEN_SEQUENCES: tuple[Any, ...] = (None, 5, "abc", b"ab", {1, 2})
BAD_TOKEN_IDS: tuple[tuple[list[Any], int], ...] = (
    ([1, 2, None], 2),
    ([1.0, 2.0], 0),
    ([1, 2, 5.5], 2),
    ([1, "7"], 1),
    ([True, 1], 0),  # a bool is an int to Python, but a bug as a token
)


def rule_bad_tokens_are_refused(make: CacheFactory, bs: int) -> None:
    """Bad input: `match`, `admit` and `append` refuse token arguments that are not a
    sequence of int ids with a TypeError naming the field (`tokens` / `tokens[i]`), at
    the call (also ids in an unhashed tail, or appended ones), and change nothing: the
    request still commits. numpy int arrays and numpy integer ids count as ints: they
    behave exactly as the same list. Ids beyond int32 or int64 are stored or refused
    by name (`big_ids_are_stored_or_refused`). `evict` takes an int >= 0: TypeError for another
    type, ValueError below 0, naming `num_blocks`."""
    cache = make(bs, 16)
    checked = CheckedCache(cache)
    prompt = list(range(1, 2 * bs + 2))
    assert checked.admit("r", prompt) is not None
    checked.commit("r", bs)
    before = checked.state()
    for bad in BAD_TOKEN_SEQUENCES:
        for name, call in (
            ("match", lambda: cache.match(bad)),
            ("admit", lambda: cache.admit("s", bad)),
            ("append", lambda: cache.append("r", bad)),
        ):
            _expect(TypeError, "bad input", call, f"{name}({bad!r})", "tokens")
    for bad, i in BAD_TOKEN_IDS:
        tail = [*prompt, *bad]  # the bad id after the hashed blocks, where only a check finds it
        for name, call, where in (
            ("match", lambda: cache.match(bad), f"tokens[{i}]"),
            ("admit", lambda: cache.admit("s", bad), f"tokens[{i}]"),
            ("admit", lambda: cache.admit("s", tail), f"tokens[{len(prompt) + i}]"),
            ("append", lambda: cache.append("r", bad), f"tokens[{i}]"),
        ):
            _expect(TypeError, "bad input", call, f"{name} of {bad!r}", where)
    if checked.state() != before:
        _violate("bad input", "a refused token argument", "changed the pool or a block table")
    checked.commit("r", len(prompt))  # the request is intact
    for bad, kind in ((1.5, TypeError), ("2", TypeError), (True, TypeError), (None, TypeError), (-1, ValueError)):
        _expect(kind, "bad input", lambda: cache.evict(bad), f"evict({bad!r})", "num_blocks")
    checked.drain()
    _numpy_tokens_are_ints(make, bs)
    big_ids_are_stored_or_refused(make, bs)


# Ids beyond int32 and int64, both signs: a backend stores them (`hash`: CBOR bignums) or
# refuses them by name (`radix`: int32), at the call.
BIG_TOKEN_IDS: tuple[int, ...] = (2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**70)


def big_ids_are_stored_or_refused(make: CacheFactory, bs: int) -> None:
    """An id beyond int32 or int64 in `match`, `admit` or `append` is either stored (the
    call answers, and the request goes on: it commits what it holds and releases) or
    refused with a ValueError naming `tokens[i]` that changes nothing (pool, tables);
    never another error. Any layout: a prefill commits at `Admission.checkpoints`."""

    def prefill(cache: PrefixCache, rid: str, adm: Admission, n: int) -> None:
        for c in adm.checkpoints:
            cache.commit(rid, c)
            cache.append(rid, [])
        cache.commit(rid, n)

    for big in BIG_TOKEN_IDS:
        cache = make(bs, 64)
        prompt = list(range(1, 2 * bs + 2))
        adm = cache.admit("r", prompt)
        assert adm is not None
        prefill(cache, "r", adm, len(prompt))
        for name, tokens in (("match", [1, big]), ("admit", [1, big, 2]), ("append", [big])):
            before = pool_state(cache, ["r"])
            what = f"{name} of an id {big}"
            try:
                if name == "match":
                    cache.match(tokens)
                elif name == "admit":
                    got = cache.admit("s", tokens)
                    if got is not None:
                        prefill(cache, "s", got, len(tokens))
                        cache.release("s")
                elif cache.append("r", tokens) is not None:
                    cache.commit("r", len(prompt) + 1)
            except ValueError as err:
                where = f"tokens[{tokens.index(big)}]"
                if where not in str(err):
                    _violate("bad input", what, f"the ValueError does not name {where!r}: {err}")
                if pool_state(cache, ["r"]) != before:
                    _violate("bad input", what, "was refused and changed the pool or a block table")
            except Exception as err:  # noqa: BLE001 -- any other kind is the finding
                _violate("bad input", what, f"expected it stored or a ValueError naming it, got {type(err).__name__}: {err}")
        cache.release("r")
        cache.check_invariants()


def _numpy_tokens_are_ints(make: CacheFactory, bs: int) -> None:
    """numpy int arrays (int32, int64) and lists of numpy integers give exactly what the
    same list gives, and `commit` takes a numpy integer count. Skipped without numpy."""
    try:
        import numpy as np
    except ImportError:
        return
    prompt = list(range(7, 7 + 3 * bs + 1))
    forms = (prompt, np.array(prompt, dtype=np.int64), np.array(prompt, dtype=np.int32), [np.int64(t) for t in prompt])
    results = []
    for form in forms:
        cache = make(bs, 16)
        first = cache.admit("a", form)
        assert first is not None
        count = type(form[0])(len(prompt))  # a numpy integer where the tokens are numpy
        _expect_returns(lambda: cache.commit("a", count), f"commit of {type(count).__name__} {count}")
        assert cache.append("a", form[:2]) is not None
        cache.commit("a", len(prompt) + 2)
        cache.release("a")
        second = cache.admit("b", form)
        results.append((first, second, cache.match(form), cache.block_table("b")))
        cache.release("b")
        CheckedCache(cache).drain()
    if not all(r == results[0] for r in results):
        _violate("bad input", "numpy token ids", f"behave differently from a list: {results}")


def rule_commit_and_append_is_both_calls(make: CacheFactory, bs: int) -> None:
    """`commit_and_append(r, n, tokens)` against `commit(r, n)` then `append(r, tokens)` on
    a twin cache, decoding until the pool refuses: the same answers, block tables, stats
    and hits, and the refused step's commit done (its blocks hittable)."""
    fused, split = make(bs, 6), make(bs, 6)
    prompt = list(range(1, 2 * bs + 2))
    for cache in (fused, split):
        if cache.admit("r", prompt) is None:
            _violate("valid calls", "admit of 3 blocks into 6 free", "it was refused")
    tokens, n = list(prompt), len(prompt)
    for step in range(8 * bs):
        new = [5000 + step]
        what = f"commit_and_append of request 'r' to {n} tokens, then {new}"
        got = fused.commit_and_append("r", n, new)
        split.commit("r", n)
        want = split.append("r", new)
        if (got is None) != (want is None) or list(fused.block_table("r")) != list(split.block_table("r")):
            _violate("commit_and_append", what, f"returned {got} and table {list(fused.block_table('r'))}; the two "
                     f"calls gave {want} and {list(split.block_table('r'))}")  # fmt: skip
        if got is None:
            break
        tokens += new
        n += 1
    else:
        _violate("rule 2", f"{8 * bs} appended tokens into 6 blocks", "no append was refused")
    probe = [*tokens, 1]
    # The twin's hit is the reference, not n // bs blocks: a backend may refuse a short
    # hit (`usable_hit`, a matching policy), and commit() is what defines the answer.
    hits = fused.match(probe).num_tokens, split.match(probe).num_tokens
    if hits[0] != hits[1]:
        _violate("commit_and_append", "match after a refused step", f"hits {hits}: the commit of {n} tokens "
                 "was not done as commit() does it")  # fmt: skip
    if fused.stats() != split.stats():
        _violate("commit_and_append", "the decode", f"stats {fused.stats()} differ from the two calls' {split.stats()}")
    for cache in (fused, split):
        cache.release("r")
        cache.check_invariants()


def rule_lower_tiers_serve_demoted_kv(make: CacheFactory, bs: int) -> None:
    """Tiers (rules T1, T2): a prefix evicted from the device and found in a lower tier
    is matched there, and admit loads exactly the KV that was moved down (the shadow
    follows every reported transfer), or declines it. Skipped without tiers."""
    cache = make(bs, 4)
    if not getattr(getattr(cache, "config", None), "tiers", ()):
        return
    checked = CheckedCache(cache)
    first = list(range(100, 100 + 2 * bs + 1))
    _run(checked, "first", first)
    _run(checked, "filler", list(range(1000, 1000 + 4 * bs)))  # every device block reused
    found = checked.match(first)
    adm = _run(checked, "again", first)
    if found.num_tokens >= 2 * bs and adm.num_cached_tokens + adm.declined_tokens < 2 * bs:
        _violate("tiers", "admit after the prefix moved down", f"match found {found.num_tokens} tokens, admit "
                 f"hit {adm.num_cached_tokens} and declined {adm.declined_tokens}")  # fmt: skip
    _run(checked, "again2", first[: 2 * bs] + [7] * bs)  # shares the loaded prefix, now on the device
    checked.drain()


def rule_an_admission_that_reads_nothing_hits_nothing(make: CacheFactory, bs: int) -> None:
    """Rule 1, `read_cache=False` (backends that take it): a cached prompt admitted again
    hits nothing, reads no tier, counts no query, and what it computes is cached as any
    request's: the prompt hits afterwards."""
    checked = CheckedCache(make(bs, 32))
    if not skips_reading(checked.cache):
        return
    prompt = list(range(2000, 2000 + 3 * bs + 1))
    _run(checked, "first", prompt)
    before = checked.match(prompt[:-1]).num_tokens
    again = checked.admit("unread", prompt, read_cache=False)
    assert again is not None, "a 4-block prompt did not fit a 32-block pool"
    checked.commit("unread", len(prompt))
    checked.release("unread")
    hybrid = Layout(getattr(getattr(checked.cache, "config", None), "layout", ())).hybrid
    if not hybrid and checked.match(prompt[:-1]).num_tokens < before:
        # Full attention keeps what was cached (hash both copies, radix the first); a hybrid
        # layout's states and windows may be retained elsewhere, so only the reader is checked.
        _violate("rule 1", "match after an unread admission", f"the prompt hit {before} tokens before it, fewer after")
    _run(checked, "reader", prompt)  # whatever it hits is checked to be the prompt's KV
    checked.drain()


RULE_CHECKS: tuple[Callable[[CacheFactory, int], None], ...] = (
    rule_admit_hit_is_capped_whole_blocks,
    rule_hits_are_causal,
    rule_evicted_blocks_are_not_served,
    rule_copy_sources_stay_pinned,
    rule_refusal_changes_nothing,
    rule_lifecycle_errors,
    rule_namespaces_isolate,
    rule_reset_refuses_while_live,
    rule_events_agree_with_match,
    rule_bad_tokens_are_refused,
    rule_commit_and_append_is_both_calls,
    rule_lower_tiers_serve_demoted_kv,
    rule_an_admission_that_reads_nothing_hits_nothing,
)


# ---------------------------------------------------------------------- state machine


def _prompts(bs: int) -> Any:
    """Prompts with lots of partial sharing: a few shared prefixes cut anywhere plus a
    random tail, or words of whole blocks from a three-block alphabet (so the same
    block's tokens recur after different prefixes) plus a short tail."""
    import hypothesis.strategies as st

    prefixes = [list(range(1000 * i, 1000 * i + 3 * bs + i)) for i in range(1, 4)]
    words = [list(range(100 * j, 100 * j + bs)) for j in range(1, 4)]
    shared = st.builds(
        lambda p, cut, tail: p[:cut] + tail,
        st.sampled_from(prefixes),
        st.integers(0, 3 * bs + 3),
        st.lists(st.integers(0, 3), max_size=2 * bs),
    )
    worded = st.builds(
        lambda chosen, tail: [t for w in chosen for t in words[w]] + tail,
        st.lists(st.integers(0, 2), min_size=1, max_size=4),
        st.lists(st.integers(0, 3), max_size=bs),
    )
    return st.one_of(shared, worded).filter(bool)


NAMESPACES = (None, "t1")
"""The namespaces the state machine uses (None is a namespace of its own)."""


def conformance_test_case(
    backend: type[PrefixCache] | str | CacheFactory,
    *,
    block_size: int = 2,
    num_blocks: int = 16,
    max_examples: int = 60,
    steps: int = 40,
    **config: Any,
) -> type:
    """A `unittest.TestCase` class (collected by pytest) running the `CheckedCache`
    state machine: random admit / append / commit / release / evict / match / reset."""
    import hypothesis.strategies as st
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, multiple, precondition, rule

    make = _factory(backend, **config)
    bs = block_size
    namespaces = st.sampled_from(NAMESPACES)

    class Conformance(RuleBasedStateMachine):
        prompts = Bundle("prompts")

        @initialize(target=prompts, warm=st.lists(st.tuples(_prompts(bs), namespaces), max_size=6))
        def start(self, warm: list[tuple[list[int], str | None]]) -> Any:
            """A fresh cache, warmed by a few finished requests, so hits come early."""
            self.checked = CheckedCache(make(bs, num_blocks))
            self.next_id = 0
            self.failed = False
            self.recent: deque[list[int]] = deque(maxlen=4)  # the latest prompts admitted
            for tokens, namespace in warm:
                self.recent.append(tokens)
                with self.step():
                    if self.checked.admit(self.next_id, tokens, namespace=namespace) is not None:
                        self.checked.commit(self.next_id, len(tokens))
                        self.checked.release(self.next_id)
                self.next_id += 1
            return multiple(*(tokens for tokens, _ in warm))

        @contextmanager
        def step(self) -> Iterator[None]:
            """A failed step skips the teardown's drain: its own failure is the report."""
            try:
                yield
            except BaseException:
                self.failed = True
                raise

        @rule(target=prompts, tokens=_prompts(bs), namespace=namespaces)
        def admit(self, tokens: list[int], namespace: str | None) -> list[int]:
            with self.step():
                self.checked.admit(self.next_id, tokens, namespace=namespace)
            self.next_id += 1
            self.recent.append(tokens)
            return tokens

        @rule(prompt=prompts, namespace=namespaces, tail=st.lists(st.integers(0, 3), max_size=bs),
              read=st.sampled_from([True, True, True, False]))
        def admit_again(self, prompt: list[int], namespace: str | None, tail: list[int], read: bool) -> None:
            """An earlier prompt again, in either namespace, perhaps longer: hits (or,
            now and then, reads nothing, where the backend offers it)."""
            with self.step():
                if read or not skips_reading(self.checked.cache):
                    self.checked.admit(self.next_id, prompt + tail, namespace=namespace)
                else:
                    self.checked.admit(self.next_id, prompt + tail, namespace=namespace, read_cache=False)
            self.next_id += 1
            self.recent.append(prompt + tail)

        @precondition(lambda self: self.checked.live)
        @rule(data=st.data())
        def commit(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(sorted(self.checked.live)))
            req = self.checked.live[rid]
            n = data.draw(st.integers(req.computed, len(req.tokens)))
            with self.step():
                self.checked.commit(rid, n)

        @precondition(lambda self: self.checked.live)
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            """A request computes its whole prompt and ends: what leaves blocks cached."""
            rid = data.draw(st.sampled_from(sorted(self.checked.live)))
            with self.step():
                self.checked.commit(rid, len(self.checked.live[rid].tokens))
                self.checked.release(rid)

        @precondition(lambda self: self.checked.live)
        @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=2 * bs + 1))
        def append(self, data: st.DataObject, extra: list[int]) -> None:
            rid = data.draw(st.sampled_from(sorted(self.checked.live)))
            with self.step():
                self.checked.append(rid, extra)

        @precondition(lambda self: self.checked.live)
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(sorted(self.checked.live)))
            with self.step():
                self.checked.release(rid)

        @rule(n=st.integers(0, 6))
        def evict(self, n: int) -> None:
            with self.step():
                self.checked.evict(n)

        @rule(tokens=_prompts(bs), namespace=namespaces)
        def match(self, tokens: list[int], namespace: str | None) -> None:
            with self.step():
                self.checked.match(tokens, namespace=namespace)

        @rule()
        def reset(self) -> None:
            with self.step():
                self.checked.reset()

        @invariant()
        def consistent(self) -> None:
            """Invariants and every live request's KV; then the latest prompts, probed in
            every namespace (match is pure), so a wrong block is found as soon as the
            cache holds one, whoever would have asked for it."""
            if hasattr(self, "checked"):
                with self.step():
                    self.checked.check()
                    for tokens in self.recent:
                        for namespace in NAMESPACES:
                            self.checked.match(tokens, namespace=namespace)

        def teardown(self) -> None:
            if hasattr(self, "checked") and not self.failed:
                self.checked.drain()

    Conformance.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
    )
    return Conformance.TestCase


def check_backend(
    backend: type[PrefixCache] | str | CacheFactory,
    *,
    block_sizes: Sequence[int] = (1, 4),
    max_examples: int = 60,
    **config: Any,
) -> None:
    """Run every rule check and the state machine against `backend`; raise on the first
    failure (a `RuleViolation` from a rule check, or an AssertionError whose first line
    is the state machine's violation, followed by its replayable steps). Prints nothing
    when all pass."""
    import io
    import unittest

    make = _factory(backend, **config)
    for bs in block_sizes:
        for check in RULE_CHECKS:
            check(make, bs)
        case = conformance_test_case(make, block_size=bs, max_examples=max_examples)
        report = io.StringIO()  # unittest's "Ran 1 test ... OK" is noise on success
        runner = unittest.TextTestRunner(stream=report, verbosity=0)
        result = runner.run(unittest.defaultTestLoader.loadTestsFromTestCase(case))
        if not result.wasSuccessful():
            failure = (result.failures or result.errors)[0][1]
            raised = re.findall(r"^[A-Za-z_][\w.]*: .*$", failure, re.MULTILINE)
            first = raised[-1] if raised else failure.strip().splitlines()[-1]
            raise AssertionError(f"conformance state machine failed at block_size={bs}: {first}\n{failure}")
