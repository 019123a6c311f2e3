"""The cluster KV index in scenarios: vLLM's hash forms, copies, clears, replicas coming and
going, bad input, and real replicas (both strategies) whose events it must mirror."""

from __future__ import annotations

import random

import pytest

from prefixcache import BlockRemoved, BlockStored, CacheConfig, build_cache
from prefixcache.cluster import KVIndex, PromptHasher, PromptHashes, block_hash_int
from prefixcache.events import AllBlocksCleared
from prefixcache.hashing import block_hashes

MASK = (1 << 64) - 1


def stored(*hashes, medium="GPU"):
    return BlockStored(tuple(hashes), None, (), 16, medium=medium)


def removed(*hashes, medium="GPU"):
    return BlockRemoved(tuple(hashes), medium=medium)


def index_of(*replicas):
    index = KVIndex()
    for r in replicas:
        index.add_replica(r)
    return index


def test_a_digest_and_its_vllm_int_form_are_one_hash():
    digest = bytes(range(32))
    as_int = int.from_bytes(digest, "big") & MASK  # vLLM's maybe_convert_block_hash
    assert block_hash_int(digest) == as_int == int.from_bytes(digest[-8:], "big")
    assert block_hash_int(as_int + (5 << 64)) == as_int  # an int's low 64 bits
    assert block_hash_int(-1) == MASK
    index = index_of("a")
    index.apply("a", [stored(digest)])
    assert index.longest_prefix([as_int]) == {"a": 1}
    index.apply("a", [removed(as_int)])
    assert index.longest_prefix([digest]) == {} and index.num_hashes == 0


def test_longest_prefix_per_replica_in_one_call():
    index = index_of("a", "b", "c")
    index.store("a", [1, 2, 3])
    index.store("b", [1, 2])
    index.store("c", [2, 3])  # no first block: holds no prefix of the chain
    assert index.longest_prefix([1, 2, 3, 4]) == {"a": 3, "b": 2}
    assert index.longest_prefix([2, 3]) == {"a": 2, "b": 1, "c": 2}  # a chain starting at block 2
    assert index.longest_prefix([]) == {}


def test_a_duplicate_store_keeps_the_block_until_its_last_copy_goes():
    index = index_of(0)
    index.apply(0, [stored(7), stored(7)])  # a block computed twice (vLLM caches both copies)
    assert (index.blocks(0), index.copies(0), index.copies_of(7, 0)) == (1, 2, 2)
    index.apply(0, [removed(7)])
    assert index.longest_prefix([7]) == {0: 1}  # one copy left
    index.apply(0, [removed(7), removed(7)])  # the last copy, then one never stored
    assert index.longest_prefix([7]) == {}
    assert index.counters == {"stored": 2, "removed": 2, "unknown_removed": 1, "cleared": 0, "skipped": 0}


def test_all_blocks_cleared_and_removing_a_replica_drop_only_its_blocks():
    index = index_of("a", "b")
    index.store("a", [1, 2])
    index.store("b", [1, 2, 3])
    index.apply("a", [AllBlocksCleared()])
    assert index.longest_prefix([1, 2, 3]) == {"b": 3} and index.blocks("a") == 0
    index.store("a", [1])
    assert index.remove_replica("b") == 3
    assert index.longest_prefix([1, 2, 3]) == {"a": 1}
    index.add_replica("c")  # reuses b's native slot: nothing of b's may show through
    assert index.blocks("c") == 0 and index.longest_prefix([1, 2, 3]) == {"a": 1}
    assert index.replicas == ("a", "c")
    index.check_invariants()


def test_events_of_another_medium_are_skipped_and_counted():
    index = index_of(0)
    index.apply(0, [stored(1, medium="CPU"), stored(1, medium=None), stored(2, medium="GPU")])
    assert index.longest_prefix([1, 2]) == {0: 2}
    assert index.counters["skipped"] == 1
    every = KVIndex(medium=None)
    every.add_replica(0)
    every.apply(0, [stored(1, medium="CPU")])
    assert every.longest_prefix([1]) == {0: 1}


def test_past_64_replicas_the_masks_span_words():
    index = index_of(*range(130))
    for r in (0, 63, 64, 129):
        index.store(r, list(range(r + 1)))
    assert index.longest_prefix(list(range(200))) == {0: 1, 63: 64, 64: 65, 129: 130}
    index.remove_replica(64)
    assert index.longest_prefix([0, 1]) == {0: 1, 63: 2, 129: 2}
    index.check_invariants()


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda ix: ix.apply("z", []), KeyError, "not in the index"),
        (lambda ix: ix.apply("a", [stored(1), "BlockStored"]), TypeError, "events[1]"),
        (lambda ix: ix.apply("a", [stored(1), stored(2, 3.0)]), TypeError, "events[1].block_hashes[1]"),
        (lambda ix: ix.store("a", [True]), TypeError, "hashes[0]"),
        (lambda ix: ix.store("a", b"\x00" * 8), TypeError, "sequence of block hashes"),
        (lambda ix: ix.add_replica("a"), ValueError, "already"),
        (lambda ix: ix.remove_replica(["unhashable"]), KeyError, "not in the index"),
        (lambda ix: ix.longest_prefix(PromptHashes(b"\x00" * 12, 8)), ValueError, "digest_size"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(call, error, words):
    index = index_of("a")
    index.store("a", [9])
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        call(index)
    assert index.longest_prefix([9, 1]) == {"a": 1} and index.copies("a") == 1  # nothing applied
    index.check_invariants()


def test_memory_is_reported_and_grows_with_the_table():
    index = index_of(0, 1)
    small = index.memory_bytes
    index.store(0, list(range(10_000)))
    index.store(1, list(range(10_000)))  # the same hashes: one slot each, two bits
    assert index.num_hashes == 10_000 and index.num_pairs == 20_000
    assert small < index.memory_bytes < 40 * 20_000


def replay(cache, requests, index, replica, rng):
    """Run `requests` (prompts) through `cache`, feeding its events into `index` after
    every call, and after each one check the index against the cache itself."""
    hasher = PromptHasher.of(cache.config)
    for k, prompt in enumerate(requests):
        admission = cache.admit(k, prompt)
        if admission is None:
            continue
        cache.commit(k, len(prompt))
        index.apply(replica, cache.drain_events())
        cache.release(k)
        index.apply(replica, cache.drain_events())
        probe = requests[rng.randrange(len(requests))]
        bs = cache.config.block_size
        depth = index.longest_prefix(hasher(probe)).get(replica, 0)
        # The cache's own look-up: the same whole blocks, capped at len - 1 tokens.
        assert cache.match(probe).num_tokens == min(depth * bs, (len(probe) - 1) // bs * bs), (k, probe[:4])


@pytest.mark.parametrize("backend", ["hash", "radix"])
def test_the_index_mirrors_a_real_replica_under_eviction(backend):
    """A small pool under pressure: every prefix the index reports is one the cache hits."""
    rng = random.Random(1)
    heads = [[rng.randrange(1000) for _ in range(48)] for _ in range(6)]
    requests = [heads[rng.randrange(6)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 40))]
                for _ in range(120)]
    cache = build_cache(CacheConfig(backend=backend, block_size=8, num_blocks=40))
    index = index_of(0)
    replay(cache, requests, index, 0, rng)
    assert cache.stats().evictions > 0 and index.counters["removed"] > 0
    index.check_invariants()


def test_both_strategies_index_the_same_chain():
    """A radix replica reports the chained hashes a hash replica does: one index serves both."""
    prompt = list(range(100, 150))
    index = index_of("hash", "radix")
    for backend in ("hash", "radix"):
        cache = build_cache(CacheConfig(backend=backend, block_size=16, num_blocks=16))
        cache.admit(0, prompt, namespace="tenant")
        cache.commit(0, len(prompt))
        cache.release(0)
        index.apply(backend, cache.drain_events())
    chain = block_hashes(prompt, 16, namespace="tenant")
    assert index.longest_prefix(chain) == {"hash": 3, "radix": 3}
    assert index.longest_prefix(block_hashes(prompt, 16)) == {}  # another namespace: another chain
    assert index.longest_prefix(PromptHasher(16)(prompt, "tenant")) == {"hash": 3, "radix": 3}
