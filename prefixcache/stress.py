"""Random workloads against any `PrefixCache`, every answer checked by the conformance kit.

Owns `stress()`: a seeded stream of admit / append / commit / release / evict / reset /
match operations, many namespaces sharing the same token runs, under pool pressure,
driven through `prefixcache.testing.CheckedCache`, the kit's one operation model and
causal KV oracle (so the soak, the kit's state machine and its rule checks hold a
backend to the same rules, with the same messages), with `check_invariants()` and
every live request re-checked every `check_every` operations. The soak
(`benchmarks/soak.py`) and the forced-collision tests run it.

Must never: check anything itself (the kit does), or depend on a strategy's hit counts
or eviction order.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.isolation import Isolation, LoRA, check_namespace
from prefixcache.protocol import PrefixCache
from prefixcache.testing import CheckedCache

__all__ = ["StressReport", "stress", "DEFAULT_NAMESPACES", "OPERATIONS"]

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
    check_events: bool | None = None,
    progress: Callable[[StressReport], None] | None = None,
) -> StressReport:
    """Drive `operations` random protocol calls through `cache` (fresh, nothing live)
    and check every answer; raise `prefixcache.testing.RuleViolation` at the first
    wrong one (naming the rule).

    Prompts are one of `num_prefixes` shared token runs (the same runs in every
    namespace), whole or cut at a random length, plus a random tail from a
    `vocab`-token alphabet, so equal blocks abound within and across namespaces.
    Namespaces are drawn with halving odds (the first most often), so some hit a lot
    and the rest still meet the same tokens. At most `max_live` requests are live; the
    pool should be small enough that admissions get refused. `check_events` (default:
    the cache's `enable_events`) also holds the KV events to what match finds.
    """
    rng = random.Random(seed)
    bs = cache.block_size
    namespaces = [check_namespace(ns) for ns in namespaces]
    ns_odds = [0.5**i for i in range(len(namespaces))]
    checked = CheckedCache(cache, check_events=check_events)
    live = checked.live
    prefix_len = max_prompt_blocks * bs
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    report = StressReport(type(cache).__name__)
    next_id = 0
    before = cache.stats()
    # Stats restart at every successful reset: carry what they had counted.
    carried = {"evictions": -before.evictions, "verify_failures": -before.verify_failures}

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
        if checked.admit(rid, tokens, namespace=ns) is None and live:
            release()  # pool pressure: make room as a scheduler would

    def append() -> None:
        checked.append(rng.choice(list(live)), [rng.randrange(vocab) for _ in range(rng.randint(1, 2 * bs))])

    def commit() -> None:
        rid = rng.choice(list(live))
        checked.commit(rid, rng.randint(live[rid].computed, len(live[rid].tokens)))

    def release() -> None:
        checked.release(rng.choice(list(live)))

    def evict() -> None:
        checked.evict(rng.randint(0, 4))

    def reset() -> None:
        if rng.random() < 0.5:  # a drained engine, so some resets succeed
            while live:
                release()
        counted = cache.stats()
        if checked.reset():
            report.resets += 1
            carried["evictions"] += counted.evictions
            carried["verify_failures"] += counted.verify_failures

    def match() -> None:
        ns = rng.choices(namespaces, ns_odds)[0]
        checked.match(rng.choice(prefixes)[: rng.randint(1, prefix_len)], namespace=ns)

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
            checked.check()
            if progress is not None:
                report.operations, report.seconds = step, time.perf_counter() - start
                progress(report)
    checked.check()
    for rid in list(live):
        checked.release(rid)
    checked.check()
    report.operations = operations
    report.seconds = time.perf_counter() - start
    report.invariant_checks = checked.invariant_checks
    report.admitted, report.refused = checked.admitted, checked.refused
    report.hit_tokens, report.prompt_tokens, report.copies = checked.hit_tokens, checked.prompt_tokens, checked.copies
    stats = cache.stats()
    report.evicted_blocks = stats.evictions + carried["evictions"]
    report.verify_failures = stats.verify_failures + carried["verify_failures"]
    return report
