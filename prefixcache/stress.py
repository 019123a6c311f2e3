"""Random workloads against any `PrefixCache`, with an exact, causal KV oracle.

Owns `PrefixShadow` (what each block's KV was computed from) and `stress()` (drives a
seeded stream of admit / append / commit / release / evict / reset operations through
a cache, many namespaces sharing the same token runs, under pool pressure, checking
every answer against the shadow and `check_invariants()` every `check_every`
operations). The soak (`benchmarks/soak.py`) and the forced-collision tests run it.

The oracle is causal, as attention is: the KV a block holds is a function of the
namespace (tenant, adapter) and of EVERY token up to the block's last, and the engine
computes block i attending to whatever blocks 0..i-1 of the request's table hold. So
the shadow derives a block's content from the content of the block before it in the
table that wrote it, never from the request's intentions: a hit on a block with the
right tokens after another prefix, in another namespace, or not yet written, is caught
the moment a request receives it. Nothing is hashed here; contents are compared exactly.

A backend whose class declares `partial_hits` may end a hit inside a block with one
copy `(src, dst, n)`: the source's first n slots must hold the request's next n tokens
at the same position, after its exact prefix, when admitted and again at the first
commit (when an engine copies); the request then computes on from there.

Must never: look inside a backend (it uses the protocol and the pool's reference
counts only), or depend on a strategy's hit counts or eviction order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.isolation import Isolation, LoRA, check_namespace
from prefixcache.protocol import PrefixCache

__all__ = ["PrefixShadow", "StressReport", "stress", "DEFAULT_NAMESPACES", "OPERATIONS"]

OPERATIONS = ("admit", "append", "commit", "release", "evict", "reset", "match")

DEFAULT_NAMESPACES: tuple[Any, ...] = (
    None,
    "tenant-a",
    "math",  # a salt spelled like the adapter below: must not share with it
    Isolation(None, LoRA("math", "/adapters/math")),
    Isolation("tenant-a", LoRA("math", "/adapters/math")),
    Isolation("tenant-a", LoRA("math", "/adapters/math-v2")),  # same name, other weights
    "\0l" + '[null, "math", "/adapters/math"]',  # a salt spelling the radix tree's key for the adapter
    "",
)
"""Namespaces chosen to collide if any source of isolation were mixed up."""


class _Garbage:
    """The content of a block computed on top of unknown KV: equal to nothing."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


class PrefixShadow:
    """`content[block] = (namespace, tokens up to the block's last)`, or None while the
    block is unwritten or partly written. Exact tuples, bounded by num_blocks."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.content: list[Any] = [None] * num_blocks

    def allocated(self, blocks: Sequence[int]) -> None:
        """`blocks` were handed out fresh: their old KV will be overwritten."""
        for b in blocks:
            self.content[b] = None

    def write(self, table: Sequence[int], namespace: Any, tokens: Sequence[int], start: int, stop: int) -> None:
        """The engine computed tokens[start:stop] (TOKENS) into `table`. A block full at
        `stop` holds the content of the block before it in `table` plus its own tokens."""
        bs = self.block_size
        for i in range(start // bs, -(-stop // bs)):
            block = table[i]
            if (i + 1) * bs > stop:
                self.content[block] = None  # partly written: never a valid hit
                continue
            own = tuple(tokens[i * bs : (i + 1) * bs])
            if i == 0:
                self.content[block] = (namespace, own)
                continue
            before = self.content[table[i - 1]]
            self.content[block] = (
                _Garbage() if before is None or isinstance(before, _Garbage) else (before[0], before[1] + own)
            )

    def check_head(self, block: int, namespace: Any, tokens: Sequence[int], num_tokens: int, what: str) -> None:
        """`block` holds tokens[:num_tokens] (TOKENS, ending inside it) for `namespace`
        at the same position: its first num_tokens % block_size slots are a partial hit."""
        bs = self.block_size
        held = self.content[block]
        stop = -(-num_tokens // bs) * bs
        if not (
            isinstance(held, tuple)
            and held[0] == namespace
            and len(held[1]) == stop
            and held[1][:num_tokens] == tuple(tokens[:num_tokens])
        ):
            raise AssertionError(
                f"{what}: partial-hit source {block} holds {held if held is None else 'other KV'}; the request "
                f"needs namespace {namespace!r}, tokens ...{tuple(tokens[stop - bs : num_tokens])} after "
                f"{stop - bs} others"
            )

    def check(self, table: Sequence[int], namespace: Any, tokens: Sequence[int], num_tokens: int, what: str) -> None:
        """Blocks of `table` covering tokens[:num_tokens] (whole blocks) must hold exactly
        `namespace` and the request's prefix through each block."""
        bs = self.block_size
        for i in range(num_tokens // bs):
            held = self.content[table[i]]
            expected = (namespace, tuple(tokens[: (i + 1) * bs]))
            if held != expected:
                shown = (
                    "unwritten KV"
                    if held is None
                    else "KV computed on unknown KV"
                    if isinstance(held, _Garbage)
                    else (f"namespace {held[0]!r}, tokens ...{held[1][-bs:]} after {len(held[1]) - bs} others")
                )
                raise AssertionError(
                    f"{what}: block #{i} = {table[i]} holds {shown}; the request needs namespace {namespace!r}, "
                    f"tokens ...{expected[1][-bs:]} after {i * bs} others"
                )


@dataclass
class StressReport:
    """What one `stress` run did. Counts are operations unless named tokens/blocks."""

    backend: str
    operations: int = 0
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))
    invariant_checks: int = 0
    admitted: int = 0
    refused: int = 0  # admit/append that returned None
    hit_tokens: int = 0
    prompt_tokens: int = 0
    copies: int = 0  # admissions whose hit ended inside a block (partial hits)
    evicted_blocks: int = 0
    resets: int = 0  # successful ones
    verify_failures: int = 0

    @property
    def ops_per_second(self) -> float:
        return self.operations / self.seconds if self.seconds else 0.0


@dataclass
class _Live:
    tokens: list[int]
    namespace: Any
    computed: int
    copy_source: int | None = None  # a partial hit's source, until the first commit copies it


def stress(
    cache: PrefixCache,
    *,
    operations: int,
    seed: int = 0,
    check_every: int = 1000,
    namespaces: Sequence[Any] = DEFAULT_NAMESPACES,
    max_live: int = 8,
    vocab: int = 4,
    num_prefixes: int = 6,
    max_prompt_blocks: int = 8,
    progress: Callable[[StressReport], None] | None = None,
) -> StressReport:
    """Drive `operations` random protocol calls through `cache` (fresh, nothing live)
    and check every answer; raise AssertionError / InvariantError at the first wrong one.

    Prompts are one of `num_prefixes` shared token runs (the same runs in every
    namespace), whole or cut at a random length, plus a random tail from a
    `vocab`-token alphabet, so equal blocks abound within and across namespaces.
    Namespaces are drawn with halving odds (the first most often), so some hit a lot
    and the rest still meet the same tokens. At most `max_live` requests are live; the
    pool should be small enough that admissions get refused.
    """
    rng = random.Random(seed)
    bs = cache.block_size
    pool = cache.pool
    namespaces = [check_namespace(ns) for ns in namespaces]
    ns_odds = [0.5**i for i in range(len(namespaces))]
    shadow = PrefixShadow(bs, pool.num_blocks)
    prefix_len = max_prompt_blocks * bs
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    live: dict[Hashable, _Live] = {}
    report = StressReport(type(cache).__name__)
    next_id = 0
    before = cache.stats()
    # Stats restart at every successful reset: carry what they had counted.
    carried = {"evictions": -before.evictions, "verify_failures": -before.verify_failures}

    def check_live() -> None:
        cache.check_invariants()
        for rid, r in live.items():
            table = cache.block_table(rid)
            assert len(table) == -(-len(r.tokens) // bs), (
                f"request {rid}: {len(table)} blocks for {len(r.tokens)} tokens"
            )
            shadow.check(table, r.namespace, r.tokens, r.computed, f"live request {rid}")
        report.invariant_checks += 1

    def admit() -> None:
        nonlocal next_id
        if len(live) >= max_live:
            release()
        ns = rng.choices(namespaces, ns_odds)[0]
        cut = prefix_len if rng.random() < 0.5 else rng.randint(0, prefix_len)
        tokens = rng.choice(prefixes)[:cut] + [
            rng.randrange(vocab) for _ in range(rng.randint(0 if cut else 1, 3 * bs))
        ]
        rid, next_id = next_id, next_id + 1
        adm = cache.admit(rid, tokens, namespace=ns)
        if adm is None:
            report.refused += 1
            if live:
                release()  # pool pressure: make room as a scheduler would
            return
        hit, what = adm.num_cached_tokens, f"admit of request {rid} (namespace {ns!r})"
        assert 0 <= hit <= len(tokens) - 1, f"admit {rid}: hit {hit} of {len(tokens)} tokens"
        assert hit % bs == 0 or type(cache).partial_hits, f"admit {rid}: hit {hit} is not whole blocks"
        assert len(adm.block_table) == -(-len(tokens) // bs)
        source = adm.copies[0][0] if len(adm.copies) == 1 else None
        expected = ((source, adm.block_table[hit // bs], hit % bs),) if hit % bs else ()
        assert adm.copies == expected and source not in adm.block_table, f"{what}: hit {hit}, copies {adm.copies}"
        shadow.check(adm.block_table, ns, tokens, hit, what)
        if source is not None:
            shadow.check_head(source, ns, tokens, hit, what)
            report.copies += 1
        shadow.allocated(adm.block_table[hit // bs :])
        live[rid] = _Live(list(tokens), ns, hit, source)
        report.admitted += 1
        report.hit_tokens += hit
        report.prompt_tokens += len(tokens)

    def append() -> None:
        rid = rng.choice(list(live))
        r = live[rid]
        more = [rng.randrange(vocab) for _ in range(rng.randint(1, 2 * bs))]
        new = cache.append(rid, more)
        if new is None:
            report.refused += 1
            return
        shadow.allocated(new)
        r.tokens += more

    def commit() -> None:
        rid = rng.choice(list(live))
        r = live[rid]
        n = rng.randint(r.computed, len(r.tokens))
        table = cache.block_table(rid)
        if r.copy_source is not None:  # the engine copies now: the source must still hold it
            shadow.check_head(r.copy_source, r.namespace, r.tokens, r.computed, f"copy for request {rid}")
            r.copy_source = None
        for i in range(r.computed // bs, -(-n // bs)):
            assert pool.ref_count(table[i]) == 1, (
                f"request {rid} writes into block {table[i]}, which something else holds "
                f"(ref {pool.ref_count(table[i])})"
            )
        shadow.write(table, r.namespace, r.tokens, r.computed, n)
        cache.commit(rid, n)
        r.computed = n
        # A backend may re-point the table at equal blocks it already had (radix).
        shadow.check(cache.block_table(rid), r.namespace, r.tokens, n, f"commit of request {rid}")

    def release() -> None:
        rid = rng.choice(list(live))
        cache.release(rid)
        del live[rid]

    def evict() -> None:
        freed = cache.evict(rng.randint(0, 4))
        assert freed >= 0

    def reset() -> None:
        if rng.random() < 0.5:  # a drained engine, so some resets succeed
            while live:
                release()
        counted = cache.stats()
        ok = cache.reset()
        assert ok == (not live), f"reset() returned {ok} with {len(live)} live requests"
        if ok:
            report.resets += 1
            carried["evictions"] += counted.evictions
            carried["verify_failures"] += counted.verify_failures

    def match() -> None:
        ns = rng.choices(namespaces, ns_odds)[0]
        tokens = rng.choice(prefixes)[: rng.randint(1, prefix_len)]
        m = cache.match(tokens, namespace=ns)
        shadow.check(m.block_ids, ns, tokens, m.num_tokens, f"match in namespace {ns!r}")
        if m.num_tokens % bs:
            shadow.check_head(m.block_ids[m.num_tokens // bs], ns, tokens, m.num_tokens, f"match in namespace {ns!r}")

    actions = {
        "admit": admit,
        "append": append,
        "commit": commit,
        "release": release,
        "evict": evict,
        "reset": reset,
        "match": match,
    }
    weights = {"admit": 30, "append": 15, "commit": 30, "release": 12, "evict": 6, "reset": 1, "match": 6}
    names, odds = list(weights), list(weights.values())
    needs_live = {"append", "commit", "release"}
    start = time.perf_counter()
    for step in range(1, operations + 1):
        op = rng.choices(names, odds)[0]
        if op in needs_live and not live:
            op = "admit"
        actions[op]()
        report.counts[op] += 1
        if step % check_every == 0:
            check_live()
            if progress is not None:
                report.operations, report.seconds = step, time.perf_counter() - start
                progress(report)
    check_live()
    for rid in list(live):
        cache.release(rid)
    live.clear()
    check_live()
    report.operations = operations
    report.seconds = time.perf_counter() - start
    stats = cache.stats()
    report.evicted_blocks = stats.evictions + carried["evictions"]
    report.verify_failures = stats.verify_failures + carried["verify_failures"]
    return report
