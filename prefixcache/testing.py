"""The conformance kit: the protocol's rules as tests any `PrefixCache` can be run against.

Owns the checks of DESIGN.md's seven rules (deterministic scenarios) and a hypothesis
state machine that drives random request sequences through a backend while keeping a
*KV shadow*: for every block it records which (namespace, token) each slot holds, as a
real engine's KV writes would. The shadow is the oracle that works for any strategy:

- a hit must point at blocks whose shadow equals the request's own prompt and
  namespace (rules 1 and 6: a hit is real KV of the same tokens; namespaces isolate);
- a backend that declares `partial_hits` may end a hit inside a block: the shadow
  applies `Admission.copies` as an engine would, at the request's first commit (so the
  source must stay intact until then: it is checked at every step), and only then is
  the hit's KV checked; any other backend must return whole-block hits and no copies;
- a block the request is about to write must not be in any other live request's table
  (rule 3: nothing pinned is reused);
- a refused `admit`/`append` leaves pool and tables exactly as they were (rule 2);
- after every release, evicting everything returns every block to the pool (rule 7).

One line for a plugin author::

    prefixcache.testing.check_backend(MyCache)            # or "my_pkg.mod:MyCache"

or, to have pytest collect the state machine as a test::

    TestMyCache = prefixcache.testing.conformance_test_case(MyCache)

Must never: assume a particular strategy's hit counts or eviction order. It checks
rules, not policies. Requires `hypothesis` (the `dev` extra).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache._C import BlockPool
from prefixcache.config import CacheConfig
from prefixcache.protocol import Admission, PrefixCache
from prefixcache.registry import available_backends, resolve_backend

__all__ = ["check_backend", "check_admission", "conformance_test_case", "CacheFactory", "KVShadow", "RULE_CHECKS"]

CacheFactory = Callable[[int, int], PrefixCache]
"""(block_size, num_blocks) -> a fresh cache on a fresh pool."""


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
                # Not importable by path: build it directly, the config names a stand-in.
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
        return cls(BlockPool(num_blocks), cfg)

    return build


# ------------------------------------------------------------------------ the KV shadow


@dataclass
class KVShadow:
    """What each block's KV would hold: `slots[block][i] = (namespace, token)` or None."""

    block_size: int
    num_blocks: int
    slots: list[list[tuple[Any, int] | None]] = field(init=False)

    def __post_init__(self) -> None:
        self.slots = [[None] * self.block_size for _ in range(self.num_blocks)]

    def write(self, table: Sequence[int], namespace: Any, tokens: Sequence[int], start: int, stop: int) -> None:
        """The engine computed tokens[start:stop] into `table` (positions are TOKENS)."""
        for pos in range(start, stop):
            self.slots[table[pos // self.block_size]][pos % self.block_size] = (namespace, tokens[pos])

    def check(self, table: Sequence[int], namespace: Any, tokens: Sequence[int], stop: int, what: str) -> None:
        """tokens[:stop] must be exactly what `table` holds for `namespace`."""
        for pos in range(stop):
            block = table[pos // self.block_size]
            held = self.slots[block][pos % self.block_size]
            if held != (namespace, tokens[pos]):
                raise AssertionError(
                    f"{what}: token {pos} is served from block {block} slot {pos % self.block_size}, "
                    f"which holds {held!r}, not {(namespace, tokens[pos])!r}"
                )

    def check_block(self, block: int, namespace: Any, tokens: Sequence[int], what: str) -> None:
        """Block `block`'s first len(tokens) slots hold `tokens` for `namespace`."""
        self.check([block], namespace, tokens, len(tokens), what)

    def copy(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """The engine copied the first n slots of src into dst, for each (src, dst, n)."""
        for src, dst, n in copies:
            self.slots[dst][:n] = self.slots[src][:n]


def check_admission(
    cache: PrefixCache, adm: Admission, tokens: Sequence[int], expected_hit: int, what: str
) -> None:
    """Rule 1 on one admission: the hit is what match(tokens[:-1]) said, capped, and whole
    blocks unless the class declares `partial_hits`, in which case any partial block comes
    with exactly one well-formed copy into the request's own block."""
    bs = cache.block_size
    hit = adm.num_cached_tokens
    assert hit == expected_hit, f"{what}: admit hit {hit} tokens, match(tokens[:-1]) says {expected_hit}"
    assert 0 <= hit <= len(tokens) - 1, f"{what}: hit {hit} for {len(tokens)} tokens"
    assert len(adm.block_table) == math.ceil(len(tokens) / bs), f"{what}: table of {len(adm.block_table)} blocks"
    if not type(cache).partial_hits:
        assert hit % bs == 0, f"{what}: hit {hit} is not whole blocks of {bs} (the class has no partial_hits)"
        assert not adm.copies, f"{what}: copies {adm.copies} from a class without partial_hits"
        return
    if hit % bs == 0:
        assert not adm.copies, f"{what}: copies {adm.copies} but the hit {hit} is whole blocks"
        return
    assert len(adm.copies) == 1, f"{what}: a hit ending inside a block needs one copy, got {adm.copies}"
    src, dst, n = adm.copies[0]
    assert dst == adm.block_table[hit // bs], f"{what}: copy into {dst}, but the partial block is {adm.block_table[hit // bs]}"
    assert n == hit % bs, f"{what}: copies {n} tokens, the hit ends {hit % bs} into its block"
    assert src not in adm.block_table, f"{what}: copy source {src} is in the request's own table"


def _pool_state(cache: PrefixCache, live: Sequence[Hashable]) -> tuple:
    pool = cache.pool
    return (
        pool.free_queue(),
        [pool.ref_count(b) for b in range(pool.num_blocks)],
        pool.num_cached,
        {rid: tuple(cache.block_table(rid)) for rid in live},
    )


def _release_all_and_drain(cache: PrefixCache, live: Sequence[Hashable]) -> None:
    """Rule 7: release everything; then nothing is pinned and evicting frees every block."""
    for rid in list(live):
        cache.release(rid)
    cache.check_invariants()
    cache.evict(cache.pool.num_blocks)
    cache.check_invariants()
    assert cache.pool.num_free == cache.pool.num_blocks, (
        f"after releasing every request and evicting everything, {cache.pool.num_pinned} blocks are still pinned"
    )
    assert cache.reset() is True, "reset() with no live request must succeed"


# ------------------------------------------------------------------- deterministic rules


def rule_admit_hit_is_capped_whole_blocks(make: CacheFactory, bs: int) -> None:
    """Rule 1: the hit is the cached prefix capped at len-1, whole blocks, real KV."""
    cache = make(bs, 32)
    shadow = KVShadow(bs, 32)
    prompt = list(range(100, 100 + 3 * bs + 1))
    adm = cache.admit("a", prompt)
    assert adm is not None and adm.num_cached_tokens == 0
    assert len(adm.block_table) == math.ceil(len(prompt) / bs)
    shadow.write(adm.block_table, None, prompt, 0, len(prompt))
    cache.commit("a", len(prompt))
    cache.release("a")
    probes = [prompt, prompt[: 3 * bs], prompt[: 2 * bs + 1], prompt + [7, 8], prompt[: 2 * bs] + [5] * bs]
    probes.append(prompt[: 2 * bs + bs // 2] + [5] * bs)  # half of block 2 matches: a partial hit if offered
    for probe in probes:
        expected = cache.match(probe[:-1]).num_tokens
        adm = cache.admit("b", probe)
        assert adm is not None
        check_admission(cache, adm, probe, expected, "admit")
        shadow.copy(adm.copies)
        shadow.check(adm.block_table, None, probe, adm.num_cached_tokens, "admit")
        cache.release("b")
    _release_all_and_drain(cache, [])


def rule_refusal_changes_nothing(make: CacheFactory, bs: int) -> None:
    """Rule 2: an admit or append that cannot fit returns None and changes nothing."""
    num_blocks = 8
    cache = make(bs, num_blocks)
    first = list(range(10, 10 + 5 * bs))
    adm = cache.admit("a", first)
    assert adm is not None
    cache.commit("a", len(first))
    before = _pool_state(cache, ["a"])
    stats_before = cache.stats()
    assert cache.admit("big", list(range(500, 500 + 4 * bs))) is None
    assert _pool_state(cache, ["a"]) == before, "a refused admit changed the pool or a block table"
    assert cache.append("a", list(range(900, 900 + 4 * bs))) is None
    assert _pool_state(cache, ["a"]) == before, "a refused append changed the pool or a block table"
    assert cache.stats().hits == stats_before.hits
    with_room = cache.append("a", [1])
    assert with_room is not None and len(cache.block_table("a")) == 5 + len(with_room)
    _release_all_and_drain(cache, ["a"])


def rule_lifecycle_errors(make: CacheFactory, bs: int) -> None:
    """Rule 5 and the argument checks: bad ids and counts raise, and change nothing."""
    cache = make(bs, 16)
    tokens = list(range(1, 2 * bs + 2))
    assert cache.admit("r", tokens) is not None
    for call in (
        lambda: cache.admit("r", tokens),  # already live
        lambda: cache.admit("s", []),  # empty prompt
        lambda: cache.commit("r", len(tokens) + 1),
        lambda: cache.commit("r", -1),
    ):
        try:
            call()
        except ValueError:
            pass
        else:
            raise AssertionError("expected ValueError")
    cache.commit("r", bs)
    try:
        cache.commit("r", bs - 1)
    except ValueError:
        pass
    else:
        raise AssertionError("commit must not go backwards")
    cache.release("r")
    for call in (
        lambda: cache.release("r"),
        lambda: cache.release("never"),
        lambda: cache.block_table("r"),
        lambda: cache.append("r", [1]),
        lambda: cache.commit("r", 1),
    ):
        try:
            call()
        except KeyError:
            pass
        else:
            raise AssertionError("expected KeyError for a released or unknown request")
    _release_all_and_drain(cache, [])


def rule_namespaces_isolate(make: CacheFactory, bs: int) -> None:
    """Requests in different namespaces never share a block: the same prompt misses in
    every other namespace, and any later hit is that namespace's own KV."""
    cache = make(bs, 32)
    shadow = KVShadow(bs, 32)
    prompt = list(range(40, 40 + 3 * bs + 1))
    for ns in ("a", "b", None):
        adm = cache.admit(ns, prompt, namespace=ns)
        assert adm is not None and adm.num_cached_tokens == 0, f"namespace {ns!r} hit another's blocks"
        shadow.write(adm.block_table, ns, prompt, 0, len(prompt))
        cache.commit(ns, len(prompt))
        cache.release(ns)
    for ns in ("a", "b", None):
        expected = cache.match(prompt[:-1], namespace=ns).num_tokens
        adm = cache.admit("again", prompt, namespace=ns)
        assert adm is not None
        check_admission(cache, adm, prompt, expected, f"admit in namespace {ns!r}")
        shadow.copy(adm.copies)
        shadow.check(adm.block_table, ns, prompt, adm.num_cached_tokens, f"admit in namespace {ns!r}")
        cache.release("again")
    _release_all_and_drain(cache, [])


def rule_reset_refuses_while_live(make: CacheFactory, bs: int) -> None:
    cache = make(bs, 16)
    prompt = list(range(1, 2 * bs + 2))
    cache.admit("r", prompt)
    cache.commit("r", len(prompt))
    before = _pool_state(cache, ["r"])
    assert cache.reset() is False
    assert _pool_state(cache, ["r"]) == before
    _release_all_and_drain(cache, ["r"])
    assert cache.admit("r", prompt).num_cached_tokens == 0, "reset must drop every cached block"


def rule_copy_sources_stay_pinned(make: CacheFactory, bs: int) -> None:
    """Partial hits: a copy's source survives until the request's first commit, even if
    another request then takes every free block and writes into them."""
    if bs < 2:
        return
    cache = make(bs, 8)
    shadow = KVShadow(bs, 8)
    first = list(range(60, 60 + 2 * bs + 1))
    adm = cache.admit("a", first)
    assert adm is not None
    shadow.write(adm.block_table, None, first, 0, len(first))
    cache.commit("a", len(first))
    cache.release("a")
    probe = first[: bs + bs // 2] + [5] * bs  # block 1 matches for half its tokens
    adm = cache.admit("b", probe)
    assert adm is not None
    check_admission(cache, adm, probe, cache.match(probe[:-1]).num_tokens, "admit of b")
    if adm.copies:
        filler = list(range(900, 900 + cache.pool.num_free * bs))
        other = cache.admit("c", filler) if filler else None
        if other is not None:
            shadow.copy(other.copies)
            shadow.write(other.block_table, None, filler, other.num_cached_tokens, len(filler))
            cache.commit("c", len(filler))
    shadow.copy(adm.copies)  # b's first forward pass
    shadow.check(adm.block_table, None, probe, adm.num_cached_tokens, "b after another request ran")
    _release_all_and_drain(cache, [rid for rid in ("b", "c") if _is_live(cache, rid)])


def _expect_error(kind: type[Exception], field: str, call: Callable[[], Any], what: str) -> None:
    """`call()` must raise `kind` with a message that names `field`."""
    try:
        call()
    except kind as err:
        if field not in str(err):
            raise AssertionError(f"{what}: the {kind.__name__} does not name {field!r}: {err}") from None
    except Exception as err:  # noqa: BLE001 -- any other kind is the finding
        raise AssertionError(f"{what}: expected {kind.__name__} naming {field!r}, got {type(err).__name__}: {err}")
    else:
        raise AssertionError(f"{what}: expected {kind.__name__} naming {field!r}, nothing was raised")


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
    behave exactly as the same list. `evict` takes an int >= 0: TypeError for another
    type, ValueError below 0, naming `num_blocks`."""
    cache = make(bs, 16)
    prompt = list(range(1, 2 * bs + 2))
    assert cache.admit("r", prompt) is not None
    cache.commit("r", bs)
    before = _pool_state(cache, ["r"])
    for bad in BAD_TOKEN_SEQUENCES:
        for name, call in (
            ("match", lambda: cache.match(bad)),
            ("admit", lambda: cache.admit("s", bad)),
            ("append", lambda: cache.append("r", bad)),
        ):
            _expect_error(TypeError, "tokens", call, f"{name}({bad!r})")
    for bad, i in BAD_TOKEN_IDS:
        tail = [*prompt, *bad]  # the bad id after the hashed blocks, where only a check finds it
        for name, call, field in (
            ("match", lambda: cache.match(bad), f"tokens[{i}]"),
            ("admit", lambda: cache.admit("s", bad), f"tokens[{i}]"),
            ("admit", lambda: cache.admit("s", tail), f"tokens[{len(prompt) + i}]"),
            ("append", lambda: cache.append("r", bad), f"tokens[{i}]"),
        ):
            _expect_error(TypeError, field, call, f"{name} of {bad!r}")
    assert _pool_state(cache, ["r"]) == before, "a refused token argument changed the pool or a block table"
    cache.commit("r", len(prompt))  # the request is intact
    for bad, kind in ((1.5, TypeError), ("2", TypeError), (True, TypeError), (None, TypeError), (-1, ValueError)):
        _expect_error(kind, "num_blocks", lambda: cache.evict(bad), f"evict({bad!r})")
    cache.release("r")
    _release_all_and_drain(cache, [])
    _numpy_tokens_are_ints(make, bs)


def _numpy_tokens_are_ints(make: CacheFactory, bs: int) -> None:
    """numpy int arrays (int32, int64) and lists of numpy integers give exactly what the
    same list gives. Skipped without numpy."""
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
        cache.commit("a", len(prompt))
        assert cache.append("a", form[:2]) is not None
        cache.commit("a", len(prompt) + 2)
        cache.release("a")
        second = cache.admit("b", form)
        results.append((first, second, cache.match(form), cache.block_table("b")))
        _release_all_and_drain(cache, ["b"])
    assert all(r == results[0] for r in results), f"numpy tokens behave differently from a list: {results}"


def _is_live(cache: PrefixCache, request_id: Hashable) -> bool:
    try:
        cache.block_table(request_id)
    except KeyError:
        return False
    return True


RULE_CHECKS: tuple[Callable[[CacheFactory, int], None], ...] = (
    rule_admit_hit_is_capped_whole_blocks,
    rule_copy_sources_stay_pinned,
    rule_refusal_changes_nothing,
    rule_lifecycle_errors,
    rule_namespaces_isolate,
    rule_reset_refuses_while_live,
    rule_bad_tokens_are_refused,
)


# ---------------------------------------------------------------------- state machine


def _prompts(bs: int) -> st.SearchStrategy[list[int]]:
    """Prompts from a few shared prefixes plus random tails: lots of partial sharing."""
    prefixes = [list(range(1000 * i, 1000 * i + 3 * bs + i)) for i in range(1, 4)]
    return st.builds(
        lambda p, cut, tail: p[:cut] + tail,
        st.sampled_from(prefixes),
        st.integers(0, 3 * bs + 3),
        st.lists(st.integers(0, 3), max_size=2 * bs),
    ).filter(bool)


def conformance_test_case(
    backend: type[PrefixCache] | str | CacheFactory,
    *,
    block_size: int = 2,
    num_blocks: int = 12,
    max_examples: int = 60,
    steps: int = 40,
    **config: Any,
) -> type:
    """A `unittest.TestCase` class (collected by pytest) running the KV-shadow state machine."""
    make = _factory(backend, **config)
    bs = block_size

    class Conformance(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.cache = make(bs, num_blocks)
            self.shadow = KVShadow(bs, num_blocks)
            self.live: dict[int, dict[str, Any]] = {}
            self.next_id = 0

        def state(self) -> tuple:
            return _pool_state(self.cache, list(self.live))

        @rule(tokens=_prompts(bs), namespace=st.sampled_from([None, "t1"]))
        def admit(self, tokens: list[int], namespace: str | None) -> None:
            expected = self.cache.match(tokens[:-1], namespace=namespace).num_tokens
            before = self.state()
            rid = self.next_id
            self.next_id += 1
            adm = self.cache.admit(rid, tokens, namespace=namespace)
            if adm is None:
                assert self.state() == before, "a refused admit changed the pool or a block table"
                return
            hit = adm.num_cached_tokens
            check_admission(self.cache, adm, tokens, expected, f"admit of request {rid}")
            assert list(adm.block_table) == list(self.cache.block_table(rid))
            # An engine copies at the request's first forward pass, which may come after
            # other admissions: the copies are applied at its first commit.
            self.live[rid] = {"tokens": list(tokens), "ns": namespace, "computed": hit, "copies": adm.copies}
            self.check_live(rid, f"admit of request {rid}")

        def check_live(self, rid: int, what: str) -> None:
            """A live request's computed KV is in its table; a pending copy's source still
            holds the tokens the copy stands for."""
            req = self.live[rid]
            table, tokens, copies = self.cache.block_table(rid), req["tokens"], req["copies"]
            whole = req["computed"] // bs * bs if copies else req["computed"]
            self.shadow.check(table, req["ns"], tokens, whole, what)
            for src, _, n in copies:
                self.shadow.check_block(src, req["ns"], tokens[whole : whole + n], f"{what}: copy source {src}")

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def commit(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            req = self.live[rid]
            n = data.draw(st.integers(req["computed"], len(req["tokens"])))
            table = list(self.cache.block_table(rid))
            self.shadow.copy(req["copies"])  # the engine's first forward pass starts with the copies
            req["copies"] = ()
            others = {b for other, r in self.live.items() if other != rid for b in self.cache.block_table(other)}
            for pos in range(req["computed"], n):
                block = table[pos // bs]
                assert block not in others, (
                    f"request {rid} writes token {pos} into block {block}, which another live request holds"
                )
            self.shadow.write(table, req["ns"], req["tokens"], req["computed"], n)
            self.cache.commit(rid, n)
            req["computed"] = n

        @precondition(lambda self: self.live)
        @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=2 * bs + 1))
        def append(self, data: st.DataObject, extra: list[int]) -> None:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            before = self.state()
            added = self.cache.append(rid, extra)
            if added is None:
                assert self.state() == before, "a refused append changed the pool or a block table"
                return
            req = self.live[rid]
            req["tokens"] += extra
            assert len(self.cache.block_table(rid)) == math.ceil(len(req["tokens"]) / bs)

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            rid = data.draw(st.sampled_from(sorted(self.live)))
            self.cache.release(rid)
            del self.live[rid]
            try:
                self.cache.release(rid)
            except KeyError:
                pass
            else:
                raise AssertionError("releasing twice must raise KeyError")

        @rule(n=st.integers(0, 6))
        def evict(self, n: int) -> None:
            freed = self.cache.evict(n)
            assert freed >= 0

        @rule(tokens=_prompts(bs), namespace=st.sampled_from([None, "t1"]))
        def match_is_pure(self, tokens: list[int], namespace: str | None) -> None:
            before, stats = self.state(), self.cache.stats()
            m = self.cache.match(tokens, namespace=namespace)
            assert len(m.block_ids) == math.ceil(m.num_tokens / bs) and m.num_tokens <= len(tokens)
            if not type(self.cache).partial_hits:
                assert m.num_tokens % bs == 0, f"match of {m.num_tokens} tokens is not whole blocks"
            self.shadow.check(m.block_ids, namespace, tokens, m.num_tokens, "match")
            assert self.state() == before and self.cache.stats() == stats, "match() changed state"

        @rule()
        def reset(self) -> None:
            before = self.state()
            ok = self.cache.reset()
            if self.live:
                assert ok is False and self.state() == before
            else:
                assert ok is True

        @invariant()
        def consistent(self) -> None:
            if not hasattr(self, "cache"):
                return
            self.cache.check_invariants()
            for rid, req in self.live.items():
                assert len(self.cache.block_table(rid)) == math.ceil(len(req["tokens"]) / bs)
                self.check_live(rid, f"live request {rid}")

        def teardown(self) -> None:
            if hasattr(self, "cache"):
                _release_all_and_drain(self.cache, list(self.live))

    Conformance.TestCase.settings = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
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
    failure (with the state machine's report). Prints nothing when all pass."""
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
            raise AssertionError(f"conformance state machine failed at block_size={bs}:\n{failure}")
