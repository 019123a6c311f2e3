"""The conformance kit's rules for hybrid layouts: what every group of a hit must hold.

Owns `HybridShadow`, the causal oracle of a hybrid cache (what each group's block holds,
derived from the request that wrote it, as `prefixcache.testing.KVShadow` does for one
group), the three rules it checks (`HYBRID_RULES`), and `check_hybrid_backend`, which
drives seeded random sequences of admissions, commits at the checkpoints, decode
appends, releases and evictions through any backend that caches hybrid layouts and
raises a `RuleViolation` naming the first rule a hit breaks:

- "every group": a hit is valid for every group: in each attention group, every block
  a query past the hit reads holds the KV of the request's own prefix (its tokens up to
  the block's end, in its namespace); in each mamba group, the hit ends on a state;
- "window": a sliding-window or chunked-local hit hands the request no block outside
  the window of its first query (those entries are `NULL_BLOCK`: nothing the request
  will read, nothing pinned for it);
- "state": a state restored is the state saved: the mamba block a hit of h tokens
  starts from holds the state after exactly the request's first h tokens, saved by a
  commit that landed there (entry i of a mamba table stands for (i + 1) *
  `cache.state_tokens` tokens).

A hit that ends inside a block (a backend with `partial_hits`) must come with a copy
(`Admission.copies`) for each attention group, from a block that holds the request's
prefix through the hit, into the request's own block at that index ("every group").

A block's content is what an engine would have written: attention K/V of the tokens a
commit covers (a block holds the prefix through its last slot once it is full), a
recurrent state when a commit lands on the end of the block. Nothing is hashed.

Must never: look inside a backend (tables, `Admission`, the pool's reference counts
only), or assume which blocks a strategy keeps: it checks what a hit uses.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from prefixcache._C import BlockPool
from prefixcache.config import CacheConfig
from prefixcache.config_checks import check_cache_config
from prefixcache.layout import CHUNKED_LOCAL_ATTENTION, MAMBA, NULL_BLOCK, SLIDING_WINDOW, LayerGroup, Layout
from prefixcache.protocol import PrefixCache
from prefixcache.registry import resolve_backend
from prefixcache.testing import RuleViolation

__all__ = ["HYBRID_RULES", "HybridRuleViolation", "HybridShadow", "check_hybrid_backend", "HybridFactory", "LAYOUTS"]

HYBRID_RULES = {
    "every group": "a hit is valid for every group: each block a query past it reads holds the request's own "
    "prefix, and each mamba group has the state it ends on",
    "window": "a sliding-window or chunked-local hit hands the request no block outside its first query's window",
    "state": "a state restored is the state saved: after exactly the request's first hit tokens, in its namespace",
}
"""The hybrid rules, by the name every failure message starts with (`RuleViolation`)."""

HybridFactory = Callable[[int, int, tuple[LayerGroup, ...]], PrefixCache]
"""(block_size, num_blocks, layout) -> a fresh cache on a fresh pool."""


class HybridShadow:
    """What each group's blocks hold: `content[group][block]` is `(namespace, tokens)`,
    the prefix whose KV (attention) or state (mamba) the block holds, or absent."""

    def __init__(self, layout: Sequence[LayerGroup], block_size: int, state_tokens: int | None = None) -> None:
        self.layout = Layout(layout)
        self.bs = block_size
        self.step = state_tokens or block_size  # TOKENS per mamba table entry
        self.content: list[dict[int, tuple]] = [{} for _ in self.layout]

    def allocated(self, tables: Sequence[Sequence[int]], before: Sequence[Sequence[int]], *, hit: int = 0) -> None:
        """Blocks newly in a table, past an admission's `hit` TOKENS (its hit blocks),
        hold nothing yet: a fresh allocation."""
        for g, (group, table, old) in enumerate(zip(self.layout, tables, before)):
            seen = set(old)
            for b in table[hit // (self.step if group.kind == MAMBA else self.bs) :]:
                if b != NULL_BLOCK and b not in seen:
                    self.content[g].pop(b, None)

    def repointed(self, tables: Sequence[Sequence[int]], before: Sequence[Sequence[int]], namespace: Any,
                  tokens: Sequence[int], stop: int, what: str) -> None:  # fmt: skip
        """A commit of the first `stop` tokens may re-point a computed full block of an
        attention group to another that holds the same prefix (radix frees the request's
        copy of a block the tree already had, as SGLang): that block must hold it."""
        bs = self.bs
        for g, (group, table, old) in enumerate(zip(self.layout, tables, before)):
            if group.kind == MAMBA:
                continue
            for i in range(min(len(table), len(old), stop // bs)):
                block = table[i]
                if block != NULL_BLOCK and block != old[i]:
                    held = self.content[g].get(block)
                    if held != (namespace, tuple(tokens[: (i + 1) * bs])):
                        _fail("every group", what, f"group {g} ({group.kind}) block #{i} re-pointed to block {block}, "
                                                   f"which holds {_describe(held)}")  # fmt: skip

    def committed(self, tables: Sequence[Sequence[int]], namespace: Any, tokens: Sequence[int], start: int, stop: int) -> None:
        """A commit of [start, stop): attention blocks it fills hold the prefix through
        their end; a mamba block on which `stop` ends holds the state after `stop`."""
        bs = self.bs
        for g, (group, table) in enumerate(zip(self.layout, tables)):
            if group.kind == MAMBA:
                i = stop // self.step - 1
                if stop % self.step == 0 and 0 <= i < len(table) and table[i] != NULL_BLOCK:
                    self.content[g][table[i]] = (namespace, tuple(tokens[:stop]))
                continue
            for i in range(start // bs, -(-stop // bs)):
                if i < len(table) and table[i] != NULL_BLOCK:
                    end = min((i + 1) * bs, stop)
                    self.content[g][table[i]] = (namespace, tuple(tokens[:end]))

    def copied(self, tables: Sequence[Sequence[int]], copies: Sequence[tuple[int, int, int]], namespace: Any,
               tokens: Sequence[int], hit: int, what: str) -> None:
        """A hit inside a block: each attention group copies the head of a block that
        holds the request's prefix through the hit into its own block at that index."""
        i = hit // self.bs
        by_dst = {dst: (src, n) for src, dst, n in copies}
        for g, (group, table) in enumerate(zip(self.layout, tables)):
            if group.kind == MAMBA or not hit % self.bs:
                continue
            dst = table[i] if i < len(table) else NULL_BLOCK
            if dst not in by_dst or by_dst[dst][1] != hit % self.bs:
                _fail("every group", what, f"a hit of {hit} tokens ends inside block #{i} of group {g} ({group.kind}) "
                                           f"but copies {list(copies)} fill no block there")  # fmt: skip
            src = by_dst[dst][0]
            held = self.content[g].get(src)
            if held is None or held[0] != namespace or tuple(held[1][:hit]) != tuple(tokens[:hit]) or len(held[1]) < hit:
                _fail("every group", what, f"group {g} ({group.kind}) copies block {src}, which holds {_describe(held)}, "
                                           f"not the request's first {hit} tokens")  # fmt: skip
            self.content[g][dst] = (namespace, tuple(tokens[:hit]))

    def check_hit(self, tables: Sequence[Sequence[int]], namespace: Any, tokens: Sequence[int], hit: int, what: str) -> None:
        bs = self.bs
        for g, (group, table) in enumerate(zip(self.layout, tables)):
            if group.kind == MAMBA:
                if hit == 0:
                    continue
                i = hit // self.step - 1
                block = table[i] if 0 <= i < len(table) else NULL_BLOCK
                if block == NULL_BLOCK:
                    _fail("every group", what, f"a hit of {hit} tokens but group {g} (mamba) has no state at block #{i}")
                held = self.content[g].get(block)
                if held != (namespace, tuple(tokens[:hit])):
                    _fail("state", what, f"group {g} (mamba) block {block} holds the state after {_describe(held)}, "
                                         f"not after the request's first {hit} tokens")  # fmt: skip
                continue
            first = group.skipped_tokens(hit) // bs if group.kind in (SLIDING_WINDOW, CHUNKED_LOCAL_ATTENTION) else 0
            for i in range(hit // bs):
                block = table[i] if i < len(table) else NULL_BLOCK
                if i < first:
                    if block != NULL_BLOCK:
                        _fail("window", what, f"group {g} ({group.kind}) hands block {block} (#{i}), outside the window "
                                              f"of position {hit}, which reads from token {group.skipped_tokens(hit)}")  # fmt: skip
                    continue
                want = (namespace, tuple(tokens[: (i + 1) * bs]))
                held = self.content[g].get(block) if block != NULL_BLOCK else None
                if held != want:
                    _fail("every group", what, f"group {g} ({group.kind}) block {block} (#{i}) holds {_describe(held)}, "
                                               f"not the request's first {(i + 1) * bs} tokens")  # fmt: skip


def _describe(held: Any) -> str:
    if held is None:
        return "nothing written"
    namespace, tokens = held
    return f"{len(tokens)} tokens {list(tokens[-4:])} (namespace {namespace!r})"


class HybridRuleViolation(RuleViolation):
    """A backend broke hybrid rule `rule` (a key of `HYBRID_RULES`); a `RuleViolation`."""

    def __init__(self, rule: str, what: str, detail: str) -> None:
        self.rule = rule
        AssertionError.__init__(self, f"{rule} ({HYBRID_RULES[rule]}) broken: {what}: {detail}")


def _fail(rule: str, what: str, detail: str) -> None:
    raise HybridRuleViolation(rule, what, detail)


def _default_factory(backend: type[PrefixCache] | str) -> HybridFactory:
    def build(block_size: int, num_blocks: int, layout: tuple[LayerGroup, ...]) -> PrefixCache:
        config = CacheConfig(block_size=block_size, num_blocks=num_blocks, layout=layout)
        if isinstance(backend, str):
            config = config.replace(backend=backend)
            check_cache_config(config)
            return resolve_backend(backend)(BlockPool(num_blocks), config)
        return backend(BlockPool(num_blocks), config)

    return build


LAYOUTS: tuple[tuple[LayerGroup, ...], ...] = (
    (LayerGroup("full_attention"), LayerGroup("sliding_window", window=24)),
    (LayerGroup("full_attention"), LayerGroup("chunked_local_attention", chunk=32)),
    (LayerGroup("full_attention"), LayerGroup("mamba")),
    (LayerGroup("full_attention"), LayerGroup("sliding_window", window=24), LayerGroup("mamba")),
)
"""The layouts `check_hybrid_backend` drives by default (block size 8)."""


def check_hybrid_backend(
    backend: type[PrefixCache] | str | HybridFactory,
    *,
    layouts: Sequence[tuple[LayerGroup, ...]] = LAYOUTS,
    seeds: Sequence[int] = range(6),
    steps: int = 60,
    block_size: int = 8,
    num_blocks: int = 48,
) -> None:
    """Drive seeded random traffic through `backend` for each layout and seed; raise
    `RuleViolation` naming the first hybrid rule a hit breaks (module docstring)."""
    make = backend if callable(backend) and not isinstance(backend, type) else _default_factory(backend)  # type: ignore[arg-type]
    for layout in layouts:
        for seed in seeds:
            _drive(make(block_size, num_blocks, tuple(layout)), layout, random.Random(seed), steps, block_size)


def _drive(cache: PrefixCache, layout, rng: random.Random, steps: int, bs: int) -> None:
    shadow = HybridShadow(layout, bs, cache.state_tokens)
    live: dict[Hashable, list] = {}  # id -> [tokens, namespace, computed]
    prompts: list[list[int]] = []
    n = 0

    def tables(rid: Hashable) -> tuple:
        return tuple(tuple(t) for t in cache.block_tables(rid))

    def commit(rid: Hashable, stop: int) -> None:
        tokens, namespace, start = live[rid]
        before = tables(rid)
        cache.commit(rid, stop)
        live[rid][2] = stop
        shadow.committed(before, namespace, tokens, start, stop)
        after = tables(rid)
        shadow.repointed(after, before, namespace, tokens, stop, f"commit of {rid} ({stop} tokens)")
        shadow.allocated(after, before, hit=stop)

    for _ in range(steps):
        op = rng.random()
        if op < 0.45 or not live:
            namespace = rng.choice([None, None, "t1"])
            if prompts and rng.random() < 0.7:
                base = rng.choice(prompts)
                tokens = base[: rng.randint(1, len(base))] + [rng.randrange(64) for _ in range(rng.randint(1, 20))]
            else:
                tokens = [rng.randrange(64) for _ in range(rng.randint(1, 60))]
            prompts.append(tokens)
            rid = f"r{n}"
            n += 1
            adm = cache.admit(rid, tokens, namespace=namespace)
            if adm is None:
                continue
            live[rid] = [list(tokens), namespace, adm.num_cached_tokens]
            got = tables(rid)
            what = f"admit of {rid} ({len(tokens)} tokens)"
            shadow.check_hit(got, namespace, tokens, adm.num_cached_tokens, what)
            shadow.allocated(got, [()] * len(got), hit=adm.num_cached_tokens)
            shadow.copied(got, adm.copies, namespace, tokens, adm.num_cached_tokens, what)
            for c in adm.checkpoints:
                commit(rid, c)
                if cache.append(rid, []) is None:
                    break
            else:
                commit(rid, len(tokens))
        elif op < 0.7:
            rid = rng.choice(list(live))
            tokens, _, computed = live[rid]
            if computed < len(tokens):
                continue
            token = rng.randrange(64)
            before = tables(rid)
            if cache.append(rid, [token]) is None:
                continue
            tokens.append(token)
            shadow.allocated(tables(rid), before)
            commit(rid, len(tokens))
        elif op < 0.95:
            rid = rng.choice(list(live))
            cache.release(rid)
            del live[rid]
        else:
            cache.evict(rng.randint(1, 8))
        cache.check_invariants()
    for rid in list(live):
        cache.release(rid)
    cache.check_invariants()
    # A tree that holds its cached blocks (radix) lets go of them when it evicts everything.
    cache.evict(cache.pool.num_blocks)
    cache.check_invariants()
    if cache.pool.num_pinned:
        raise RuleViolation("rule 7", "after every release and evicting everything", f"{cache.pool.num_pinned} blocks still pinned")
