"""Random event streams through the cluster KV index and its Python twin.

`prefixcache.cluster.KVIndex` (the native table under its replica-id mapping) and
`tests/reference/kv_index.ReferenceKVIndex` get the same random operations: replicas
added and removed (slots reused, past 64 replicas so the bitmask spans words), stores
and removals of the same hash as an int and as digests, duplicate copies, clears, KV
events of several media, bad events. After every step both must give the same answers,
counts and errors, and the native index must pass its invariant check.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from reference.kv_index import ReferenceKVIndex

from prefixcache.cluster import KVIndex, PromptHashes
from prefixcache.events import AllBlocksCleared, BlockRemoved, BlockStored

REPLICAS = ["a", "b", 3, ("c", 1)]


def digest(low: int, width: int = 32, head: int = 0xAB) -> bytes:
    """A digest whose low 64 bits are `low`: the index must take it for the int `low`."""
    return bytes([head]) * (width - 8) + low.to_bytes(8, "big")


# Six distinct hashes, each in several spellings.
HASHES = st.sampled_from(
    [0, 1, 2, 3, 4, 2**63 + 5, 2**64 + 1, -1, digest(2), digest(3, head=0x01), digest(4, width=16),
     (2**63 + 5).to_bytes(8, "big"), b"\x01"]
)
chains = st.lists(HASHES, max_size=6)
media = st.sampled_from(["GPU", "CPU", None])
events = st.lists(
    st.one_of(
        st.builds(lambda h, m: BlockStored(tuple(h), None, (), 16, medium=m), chains, media),
        st.builds(lambda h, m: BlockRemoved(tuple(h), medium=m), chains, media),
        st.builds(lambda m: AllBlocksCleared(medium=m), media),
    ),
    max_size=5,
)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.native = KVIndex()
        self.model = ReferenceKVIndex()
        self.bulk = 0

    def both(self, op: str, *args):
        results = []
        for index in (self.native, self.model):
            try:
                results.append(("ok", getattr(index, op)(*args)))
            except (KeyError, ValueError, TypeError) as err:
                results.append((type(err), None))
        assert results[0] == results[1], (op, args, results)
        return results[0]

    @rule(replica=st.sampled_from(REPLICAS))
    def add_replica(self, replica):
        self.both("add_replica", replica)

    @precondition(lambda self: self.bulk < 2)
    @rule()
    def add_many_replicas(self):
        for k in range(40):
            self.both("add_replica", f"bulk{self.bulk}/{k}")
        self.bulk += 1

    @rule(replica=st.sampled_from(REPLICAS + ["bulk0/39", "bulk1/7"]))
    def remove_replica(self, replica):
        self.both("remove_replica", replica)

    @rule(replica=st.sampled_from(REPLICAS + ["bulk1/39"]), hashes=chains)
    def store(self, replica, hashes):
        self.both("store", replica, hashes)

    @rule(replica=st.sampled_from(REPLICAS), hashes=chains)
    def remove(self, replica, hashes):
        self.both("remove", replica, hashes)

    @rule(replica=st.sampled_from(REPLICAS))
    def clear(self, replica):
        self.both("clear", replica)

    @rule(replica=st.sampled_from(REPLICAS + ["bulk0/3"]), batch=events)
    def apply(self, replica, batch):
        self.both("apply", replica, batch)

    @rule(replica=st.sampled_from(REPLICAS), batch=events, bad=st.sampled_from([1.5, True, "x", None]))
    def apply_bad_event(self, replica, batch, bad):
        """A bad hash anywhere in the batch: TypeError (KeyError for an unknown replica), nothing applied."""
        self.both("apply", replica, [*batch, BlockStored((0, bad), None, (), 16)])

    @rule(hashes=chains)
    def longest_prefix(self, hashes):
        self.both("longest_prefix", hashes)

    @rule(lows=st.lists(st.integers(0, 5), max_size=5))
    def longest_prefix_packed(self, lows):
        """Packed 32-byte digests (a prompt's chain) against the same chain as ints."""
        packed = PromptHashes(b"".join(digest(low) for low in lows), 32)
        assert self.native.longest_prefix(packed) == self.model.longest_prefix(lows)

    @rule(h=HASHES, replica=st.sampled_from(REPLICAS))
    def copies_of(self, h, replica):
        self.both("copies_of", h, replica)

    @invariant()
    def same_counts(self):
        assert self.native.replicas == tuple(self.model.replicas)
        for r in self.model.replicas:
            assert (self.native.blocks(r), self.native.copies(r)) == (self.model.blocks(r), self.model.copies(r)), r
        assert (self.native.num_hashes, self.native.num_pairs) == (self.model.num_hashes, self.model.num_pairs)
        assert self.native.counters == dict(self.model.counters)
        self.native.check_invariants()


IndexMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestKVIndexMatchesReference = IndexMachine.TestCase
