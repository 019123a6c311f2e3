"""Fuzz harness: the protocol surface of both backends, with hostile arguments.

Each input picks a backend (`hash` under SHA-256 or verified xxhash, `radix`), a block
size and a small pool, then makes protocol calls whose arguments are often wrong:
request ids that are live or unknown, token ids beyond int32 / int64 or not ints,
empty prompts, namespaces that are odd strings (lone surrogates, NULs, an adapter's
tree key), adapters, commits backwards or past the end, evictions of negative or huge
counts. Every call must return or raise ValueError / TypeError / KeyError; a call that
raises must change nothing (pool, block tables, stats); `check_invariants()` must pass
after every call.

    python fuzz/fuzz_backends.py -max_total_time=600
"""

from __future__ import annotations

from harness import main
from reader import EDGE_INTS, Reader

import prefixcache
from prefixcache.config import CacheConfig, HashConfig
from prefixcache.isolation import Isolation, LoRA
from prefixcache.testing import pool_state

ALLOWED = (ValueError, TypeError, KeyError)
ARMS = [("hash", "sha256_cbor"), ("hash", "xxhash"), ("radix", "sha256_cbor")]


def namespace(r: Reader):
    kind = r.int(0, 5)
    if kind == 0:
        return None
    if kind == 1:
        return r.text(6)
    if kind == 2:
        return Isolation(r.choice([None, "a", r.text(4)]), LoRA(r.text(4), r.text(4)))
    if kind == 3:
        return r.choice([3, b"a", ("x", "y")])
    return r.choice(["a", "b"])


def tokens(r: Reader, max_len: int):
    out = [r.token(3) for _ in range(r.int(0, max_len))]
    if out and r.int(0, 15) == 0:
        out[r.int(0, len(out) - 1)] = r.choice([True, 1.5, "7", None, 2**70])
    return out


def count(r: Reader):
    return r.choice([*EDGE_INTS, True, 1.0, "2"]) if r.int(0, 15) == 0 else r.int(0, 12)


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    backend, algorithm = r.choice(ARMS)
    bs = r.int(1, 4)
    cache = prefixcache.build_cache(
        CacheConfig(backend=backend, block_size=bs, num_blocks=r.int(4, 16), hash=HashConfig(algorithm))
    )
    live: dict[int, int] = {}  # request id -> tokens so far

    def rid() -> int:
        return r.int(0, 4)

    while not r.exhausted:
        op = r.int(0, 7)
        before = (pool_state(cache, list(live)), cache.stats())
        try:
            if op <= 1:
                i, toks = rid(), tokens(r, 3 * bs + 2)
                if cache.admit(i, toks, namespace=namespace(r)) is not None:
                    live[i] = len(toks)
            elif op == 2:
                i, toks = rid(), tokens(r, 2 * bs)
                if cache.append(i, toks) is not None:
                    live[i] += len(toks)
            elif op == 3:
                i = rid()
                cache.commit(i, count(r) if i not in live or r.int(0, 3) == 0 else r.int(0, live[i]))
            elif op == 4:
                i = rid()
                cache.release(i)
                del live[i]
            elif op == 5:
                cache.evict(count(r))
            elif op == 6:
                cache.match(tokens(r, 3 * bs), namespace=namespace(r))
            else:
                if cache.reset():
                    assert not live
        except ALLOWED:
            after = (pool_state(cache, list(live)), cache.stats())
            assert after == before, f"a call that raised changed the cache: {before} -> {after}"
        cache.check_invariants()
    for i in list(live):
        cache.release(i)
    cache.check_invariants()


if __name__ == "__main__":
    main(test_one_input)
