"""Exact block contents (hit verification): scenarios on both stores, then the native
store against the Python reference under random operations with colliding keys.

Keys here are chosen by the test, not hashed, so collisions are forced at will: the
pool indexes whatever key a block is given, and the store must prove or refute each
holder from exact contents alone.
"""

from __future__ import annotations

import random
import zlib

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixcache import BlockPool
from prefixcache.block_contents import BlockContents, PyBlockContents

BS = 2
NS = b"\x01tenant"
STORES = [BlockContents, PyBlockContents]


def chain(store, pool, blocks, tokens, keys, ns=NS, parent=-1, first_token=0):
    """Record `blocks` as one request's consecutive blocks and index them under `keys`."""
    store.record(parent, blocks, tokens, first_token, ns)
    for b, k in zip(blocks, keys):
        pool.cache(b, k)


@pytest.fixture(params=STORES, ids=["native", "python"])
def make(request):
    def build(num_blocks=16):
        pool = BlockPool(num_blocks)
        pool.allocate(num_blocks)  # cache() needs blocks in use; refcounts do not matter here
        return pool, request.param(pool, BS)

    return build


def test_an_exact_chain_is_proved(make):
    pool, store = make()
    chain(store, pool, [3, 4, 5], [1, 2, 3, 4, 5, 6], [b"k0", b"k1", b"k2"])
    assert store.lookup_chain(b"k0k1k2", 2, [1, 2, 3, 4, 5, 6, 7], NS) == ([3, 4, 5], False)
    assert store.lookup_chain(b"k0k1", 2, [1, 2, 3, 4], NS) == ([3, 4], False)
    assert store.verify_table([3, 4, 5], [1, 2, 3, 4, 5, 6], NS) == 3
    assert [store.depth(b) for b in (3, 4, 5, 6)] == [1, 2, 3, 0]
    assert store.tokens(4) == [3, 4] and store.tokens(6) == []
    assert store.num_nodes == 3
    store.check_invariants()


def test_a_colliding_key_is_a_counted_miss(make):
    pool, store = make()
    chain(store, pool, [3, 4], [1, 2, 3, 4], [b"k0", b"k1"])
    # Same keys, other tokens in block 1: the hit stops at 1 and says it was refuted.
    assert store.lookup_chain(b"k0k1", 2, [1, 2, 9, 4], NS) == ([3], True)
    # Other tokens in block 0: nothing proved at all.
    assert store.lookup_chain(b"k0k1", 2, [0, 2, 3, 4], NS) == ([], True)
    # A key with no holder is a plain miss, not a refutation.
    assert store.lookup_chain(b"k0zz", 2, [1, 2, 3, 4], NS) == ([3], False)


def test_namespace_is_part_of_the_proof(make):
    pool, store = make()
    chain(store, pool, [3, 4], [1, 2, 3, 4], [b"k0", b"k1"], ns=b"\x01a")
    assert store.lookup_chain(b"k0k1", 2, [1, 2, 3, 4], b"\x01b") == ([], True)
    assert store.lookup_chain(b"k0k1", 2, [1, 2, 3, 4], b"") == ([], True)
    assert store.lookup_chain(b"k0k1", 2, [1, 2, 3, 4], b"\x01a") == ([3, 4], False)


def test_same_tokens_after_another_prefix_are_refuted(make):
    """Block 1 of [A, B] and of [C, B] hold the same tokens but not the same KV."""
    pool, store = make()
    chain(store, pool, [0, 1], [7, 7, 5, 5], [b"c0", b"k1"])  # [C, B], cached first under k1
    chain(store, pool, [2, 3], [1, 1, 5, 5], [b"a0", b"k1"])  # [A, B], same key for B
    assert pool.blocks_for(b"k1") == [1, 3]
    # Earliest holder 1 follows C: refuted; the next holder 3 follows A: proved.
    assert store.lookup_chain(b"a0k1", 2, [1, 1, 5, 5], NS) == ([2, 3], False)
    # If only the impostor holds k1, the hit stops and counts.
    pool.uncache(3)
    assert store.lookup_chain(b"a0k1", 2, [1, 1, 5, 5], NS) == ([2], True)


def test_a_copy_of_the_prefix_is_proved_through_its_ancestry(make):
    pool, store = make()
    tokens = [1, 2, 3, 4, 5, 6]
    chain(store, pool, [0, 1, 2], tokens, [b"k0", b"k1", b"k2"])  # copy A
    chain(store, pool, [5, 6, 7], tokens, [b"k0", b"k1", b"k2"])  # copy B, same keys
    pool.uncache(1)
    pool.uncache(2)  # A's tail evicted: k0 -> 0 (A), k1 -> 6, k2 -> 7 (B)
    assert store.lookup_chain(b"k0k1k2", 2, tokens, NS) == ([0, 6, 7], False)
    # B's head is reused for something else: B's tail still proves, from its own record.
    store.record(-1, [5], [9, 9], 0, NS)
    assert store.lookup_chain(b"k0k1k2", 2, tokens, NS) == ([0, 6, 7], False)
    assert store.num_nodes == 3 + 3 + 1  # B's old head node lives on under 6
    # Once nothing refers to them, old nodes are gone.
    store.record(-1, [6, 7], [9, 9, 9, 9], 0, NS)
    assert store.num_nodes == 3 + 1 + 2
    store.check_invariants()


def test_a_partial_source_is_proved_on_its_head_after_the_proved_hits(make):
    pool, store = make()
    chain(store, pool, [0, 1, 2], [1, 2, 3, 4, 5, 6], [b"k0", b"k1", b"k2"])  # A
    chain(store, pool, [3, 4], [7, 7, 3, 9], [b"c0", b"k1"])  # C: [3, 9] after another prefix
    assert store.verify_head(1, [0], [1, 2, 3, 0], 1, NS)  # head [3] after A's block 0
    assert not store.verify_head(1, [0], [1, 2, 3, 0], 2, NS)  # [3, 4] is not [3, 0]
    assert not store.verify_head(4, [0], [1, 2, 3, 0], 1, NS)  # [3] after [7, 7]: other KV
    assert store.verify_head(0, [], [1, 9], 1, NS) and not store.verify_head(0, [], [1, 9], 1, b"")
    assert not store.verify_head(3, [], [1, 9], 1, NS)
    assert not store.verify_head(2, [0], [1, 2, 5], 1, NS)  # block 2 is at position 2, not 1
    assert store.verify_head(2, [0, 1], [1, 2, 3, 4, 5, 6], 2, NS)  # n == block_size: a full proof
    # The same prefix computed on other blocks: proved through the source's ancestry.
    chain(store, pool, [5, 6], [1, 2, 3, 4], [b"k0", b"k1"])
    assert store.verify_head(2, [5, 6], [1, 2, 3, 4, 5], 1, NS)
    assert not store.verify_head(1, [0], [1, 2, 2**70], 1, NS)  # an id int64 cannot hold
    assert not store.verify_head(1, [0], [1, 2], 1, NS)  # fewer tokens than the proof reads
    for bad, err in (((99, [0]), IndexError), ((1, [-1]), IndexError), ((1, ["x"]), TypeError)):
        with pytest.raises(err):
            store.verify_head(*bad, [1, 2, 3], 1, NS)
    for n in (0, 3, -1, 2**70):
        with pytest.raises((ValueError, OverflowError)):
            store.verify_head(1, [0], [1, 2, 3, 4], n, NS)
    with pytest.raises(TypeError):
        store.verify_head(1, [0], [1, 2, 3], 1, "ns")


def test_a_block_recorded_after_itself_proves_nothing(make):
    pool, store = make()
    chain(store, pool, [0], [1, 2], [b"k0"])
    store.record(0, [0], [1, 2, 3, 4], 2, NS)  # a nonsensical table [0, 0]
    assert store.lookup_chain(b"k0", 2, [3, 4], NS) == ([], True)
    assert store.verify_table([0, 0], [1, 2, 3, 4], NS) == 0
    assert store.depth(0) == 2
    store.check_invariants()


def test_ids_beyond_int32_widen_and_beyond_int64_are_never_proved(make):
    pool, store = make()
    big = [2**40, -(2**40), 2**70, 5, 6, 7]
    assert not store.wide
    chain(store, pool, [0, 1, 2], big, [b"k0", b"k1", b"k2"])
    assert store.wide
    assert store.tokens(0) == [2**40, -(2**40)]
    # Block 1 holds an id int64 cannot represent: no node, never proved, nor what follows.
    assert store.depth(1) == 0 and store.depth(2) == 0
    assert store.lookup_chain(b"k0k1k2", 2, big, NS) == ([0], False)
    assert store.verify_table([0, 1, 2], big, NS) == 1
    store.record(2, [3], [1, 2], 0, NS)  # following a block without a node: no node either
    assert store.depth(3) == 0


def test_bad_arguments_raise_and_change_nothing(make):
    pool, store = make(4)
    with pytest.raises(IndexError):
        store.record(4, [1], [1, 2], 0, NS)
    with pytest.raises(IndexError):
        store.record(-1, [4], [1, 2], 0, NS)
    with pytest.raises(ValueError, match="need 4 tokens"):
        store.record(-1, [0, 1], [1, 2, 3], 0, NS)
    with pytest.raises(IndexError):
        store.record(-1, [0], [1, 2], 3, NS)
    with pytest.raises(TypeError):
        store.record(-1, [0], [1, "x"], 0, NS)
    with pytest.raises(TypeError):
        store.record(-1, [0], [1, True], 0, NS)
    with pytest.raises(TypeError):
        store.record(-1, [0], [1, 2], 0, "ns")
    with pytest.raises(ValueError, match="key_size"):
        store.lookup_chain(b"abc", 2, [1, 2], NS)
    with pytest.raises(IndexError):
        store.verify_table([9], [1, 2], NS)
    assert store.num_nodes == 0 and all(store.depth(b) == 0 for b in range(4))
    with pytest.raises(ValueError):
        type(store)(pool, 0)
    store.check_invariants()


# -------------------------------------------------------- native vs reference, randomly


def weak_key(ns: bytes, prefix: tuple) -> bytes:
    """A content key with only three values: almost every look-up meets impostors."""
    i = zlib.crc32(repr((ns, prefix)).encode()) % 3
    return b"xyz"[i : i + 1]


class ContentsMachine(RuleBasedStateMachine):
    """Both stores see the same records on twin pools, each block indexed under
    `weak_key` of its true content, as a backend with a terrible hash would. Chains
    start fresh or extend a recorded block; look-ups replay a recorded prefix (or a
    mutation of it) in some namespace. Every answer must agree, and every proved hit
    must truly hold the request's namespace and prefix (tracked here exactly)."""

    NUM_BLOCKS = 16

    def __init__(self) -> None:
        super().__init__()
        self.pools = [BlockPool(self.NUM_BLOCKS), BlockPool(self.NUM_BLOCKS)]
        for pool in self.pools:
            pool.allocate(self.NUM_BLOCKS)
        self.stores = [BlockContents(self.pools[0], BS), PyBlockContents(self.pools[1], BS)]
        self.truth: dict[int, tuple] = {}  # block -> (namespace, prefix tokens through it)
        self.proved = self.copies = self.refuted = self.heads = 0

    def both(self, name: str, *args):
        results = []
        for store in self.stores:
            try:
                results.append(("ok", getattr(store, name)(*args)))
            except (ValueError, IndexError, TypeError) as err:
                results.append((type(err).__name__, None))
        assert results[0] == results[1], f"{name}{args}: native {results[0]} != python {results[1]}"
        return results[0]

    def prefix_of(self, base: int, ns: bytes) -> tuple[int, bytes, tuple]:
        """Extend the chain ending at `base` if it is known and short, else start one in `ns`."""
        if base >= 0 and base in self.truth and len(self.truth[base][1]) <= 3 * BS:
            return base, self.truth[base][0], self.truth[base][1]
        return -1, ns, ()

    @rule(
        base=st.integers(-1, NUM_BLOCKS - 1),
        blocks=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=3, unique=True),
        tokens=st.lists(st.integers(0, 1), min_size=6, max_size=6),
        ns=st.sampled_from([b"", b"\x01a"]),
    )
    def record(self, base, blocks, tokens, ns):
        parent, ns, prefix = self.prefix_of(base, ns)
        tokens = tokens[: len(blocks) * BS]
        status, _ = self.both("record", parent, blocks, tokens, 0, ns)
        if status != "ok":
            return
        for i, b in enumerate(blocks):
            prefix += tuple(tokens[i * BS : (i + 1) * BS])
            self.truth[b] = (ns, prefix)
            for pool in self.pools:
                pool.uncache(b)
                pool.cache(b, weak_key(ns, prefix))

    @rule(block=st.integers(0, NUM_BLOCKS - 1))
    def uncache(self, block):
        for pool in self.pools:
            pool.uncache(block)

    @rule(
        base=st.integers(-1, NUM_BLOCKS - 1),
        extra=st.lists(st.integers(0, 1), max_size=4),
        flip=st.integers(-1, 7),
        ns=st.sampled_from([b"", b"\x01a"]),
    )
    def lookup(self, base, extra, flip, ns):
        cached = [b for b in sorted(self.truth) if self.pools[0].key(b) is not None]
        _, ns, prefix = self.prefix_of(cached[base % len(cached)] if base >= 0 and cached else -1, ns)
        tokens = list(prefix) + extra
        if 0 <= flip < len(tokens):
            tokens[flip] ^= 1
        n = len(tokens) // BS
        keys = b"".join(weak_key(ns, tuple(tokens[: (i + 1) * BS])) for i in range(n))
        _, (blocks, failed) = self.both("lookup_chain", keys, 1, tokens, ns)
        for i, b in enumerate(blocks):
            expected = (ns, tuple(tokens[: (i + 1) * BS]))
            assert self.truth.get(b) == expected, f"proved block {b} at {i} holds {self.truth.get(b)}, not {expected}"
        self.proved += len(blocks)
        # A copy: proved through its ancestry (computed after another block than the one before it here).
        nodes = self.stores[1]._node
        self.copies += any(nodes[b].parent is not nodes[blocks[i - 1]] for i, b in enumerate(blocks) if i)
        self.refuted += failed

    @rule(
        table=st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=4),
        tokens=st.lists(st.integers(0, 1), min_size=8, max_size=8),
        ns=st.sampled_from([b"", b"\x01a"]),
    )
    def verify(self, table, tokens, ns):
        _, n = self.both("verify_table", table, tokens, ns)
        for i in range(n):
            assert self.truth.get(table[i]) == (ns, tuple(tokens[: (i + 1) * BS]))
        # The proved run may end in a partial hit: a source whose head is the next token.
        _, head = self.both("verify_head", table[-1], table[:n], tokens, 1, ns)
        if head:
            truth = self.truth.get(table[-1])
            assert truth is not None and truth[0] == ns and truth[1][: n * BS + 1] == tuple(tokens[: n * BS + 1])
            assert len(truth[1]) == (n + 1) * BS
            self.heads += 1

    @invariant()
    def same_descriptors(self):
        native, python = self.stores
        native.check_invariants()
        python.check_invariants()
        assert native.num_nodes == python.num_nodes
        for b in range(self.NUM_BLOCKS):
            assert native.depth(b) == python.depth(b)
            assert native.tokens(b) == python.tokens(b)


ContentsMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestContentsAgainstModel = ContentsMachine.TestCase


def test_long_random_walk_never_proves_a_wrong_block():
    """20k seeded operations, the state machine's checks, far longer runs; it must
    prove many hits (including copies proved through their ancestry), not just refuse."""
    rng = random.Random(7)
    machine = ContentsMachine()
    n = ContentsMachine.NUM_BLOCKS
    for _ in range(20_000):
        op = rng.random()
        ns = rng.choice([b"", b"\x01a"])
        base = rng.randint(-1, n - 1)
        if op < 0.4:
            tokens = [rng.randrange(2) for _ in range(6)]
            machine.record(base, rng.sample(range(n), rng.randint(1, 3)), tokens, ns)
        elif op < 0.5:
            machine.uncache(rng.randrange(n))
        elif op < 0.9:
            extra = [rng.randrange(2) for _ in range(rng.randint(0, 4))]
            flip = rng.randint(-1, 7) if rng.random() < 0.3 else -1
            machine.lookup(base, extra, flip, ns)
        else:
            table = [rng.randrange(n) for _ in range(rng.randint(1, 4))]
            machine.verify(table, [rng.randrange(2) for _ in range(8)], ns)
        if rng.random() < 0.01:
            machine.same_descriptors()
    machine.same_descriptors()
    counts = (machine.proved, machine.copies, machine.refuted, machine.heads)
    assert machine.proved > 5_000 and machine.copies > 50 and machine.refuted > 500 and machine.heads > 20, counts
