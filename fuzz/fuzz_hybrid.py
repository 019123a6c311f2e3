"""Fuzz harness: both strategies over hybrid layouts, driven as an engine would and not.

Each input picks a strategy (`hash`: vLLM's hybrid manager, its native hit finder and
admission; `radix`: SGLang's unified tree), a layout of full attention with a sliding
window, a Mamba state or both (and, for `hash`, chunked local attention; for `radix`,
SGLang's chunked prefill or not, and a state cap or not), a block size and a small pool,
then makes protocol calls: admissions of shared and hostile prompts, the engine's
prefill (a commit at each `Admission.checkpoints` entry, `append(r, [])` for the next
chunk, retried when it waits), decode steps of one or a few tokens with their commits,
commits anywhere, releases, evictions, look-ups and resets. Every call must return or
raise ValueError / TypeError / KeyError, and a call that raises those must change
nothing (pool, block tables); a commit past a checkpoint whose next chunk finds no room
raises RuntimeError, as documented, having cached what it computed.
`check_invariants()` must pass after every call, and once every request is released no
block is held by one.

    python fuzz/fuzz_hybrid.py -max_total_time=600
"""

from __future__ import annotations

from harness import main
from reader import EDGE_INTS, Reader

import prefixcache
from prefixcache.config import CacheConfig
from prefixcache.errors import ConfigError
from prefixcache.layout import LayerGroup
from prefixcache.testing import pool_state

ALLOWED = (ValueError, TypeError, KeyError)
FULL = LayerGroup("full_attention")
MAMBA = LayerGroup("mamba")


def layout(r: Reader, backend: str) -> tuple[LayerGroup, ...]:
    window = LayerGroup("sliding_window", window=r.int(2, 24))
    kinds = [(FULL, window), (FULL, MAMBA), (FULL, window, MAMBA)]
    if backend == "hash":
        kinds.append((FULL, LayerGroup("chunked_local_attention", chunk=r.choice([4, 8, 12]))))
    return r.choice(kinds)


def build(r: Reader):
    backend = r.choice(["hash", "radix"])
    groups = layout(r, backend)
    bs = r.choice([1, 2, 4])
    if backend == "hash":
        options = r.choice([{}, {"retention": "dense"}, {"no_tail_cliff": True}, {"retention": "dense", "state_interval": 2 * bs}])
    else:
        options = {"mamba_chunk": 2 * bs, "mamba_track_interval": 4 * bs, "state_cap": r.choice([0, 0, 1, 2])} \
            if MAMBA in groups else {}  # fmt: skip
        options["chunked_prefill_size"] = r.choice([0, 0, 2 * bs, 3 * bs])  # SGLang's chunked prefill
        options["no_tail_cliff"] = r.choice([False, True])
    config = CacheConfig(backend=backend, block_size=bs, num_blocks=r.int(12, 72), layout=groups, options=options)
    try:
        return prefixcache.build_cache(config)
    except ConfigError:
        return None  # a pool too small for the layout's budgets: refused at build, by name


def tokens(r: Reader, max_len: int) -> list:
    out = [r.token(3) for _ in range(r.int(0, max_len))]
    if out and r.int(0, 15) == 0:
        out[r.int(0, len(out) - 1)] = r.choice([True, 1.5, "7", None, 2**70])
    return out


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    cache = build(r)
    if cache is None:
        return
    bs = cache.block_size
    live: dict[int, list[int]] = {}  # request id -> [tokens so far, committed, next checkpoint index]
    checkpoints: dict[int, tuple[int, ...]] = {}

    def rid() -> int:
        return r.int(0, 3)

    while not r.exhausted:
        op = r.int(0, 9)
        before = pool_state(cache, list(live))
        try:
            if op <= 1:
                i, toks = rid(), tokens(r, 6 * bs + 3)
                adm = cache.admit(i, toks, namespace=r.choice([None, None, "a"]))
                if adm is not None:
                    live[i], checkpoints[i] = [len(toks), adm.num_cached_tokens, 0], tuple(adm.checkpoints)
            elif op <= 3 and live:  # the engine's next step for one request
                i = r.choice(sorted(live))
                n, done, k = live[i]
                if k < len(checkpoints[i]):
                    if done < checkpoints[i][k]:
                        cache.commit(i, checkpoints[i][k])
                        live[i][1] = checkpoints[i][k]
                    if cache.append(i, []) is not None:  # the next chunk (None: it waits; retried later)
                        live[i][2] = k + 1
                elif done < n:
                    cache.commit(i, n)
                    live[i][1] = n
                else:
                    new = [r.token(3) for _ in range(r.choice([1, 1, 1, 2, 3]))]
                    if cache.append(i, new) is not None:
                        cache.commit(i, n + len(new))
                        live[i][0] = live[i][1] = n + len(new)
            elif op == 4:
                i, toks = rid(), tokens(r, 2 * bs)
                if cache.append(i, toks) is not None:
                    live[i][0] += len(toks)
            elif op == 5:
                i = rid()
                if i in live and r.int(0, 3):
                    n = r.int(live[i][1], live[i][0])
                else:
                    n = r.choice([*EDGE_INTS, True, 1.0, "2", 0])
                cache.commit(i, n)
                live[i][1] = n
            elif op == 6:
                i = rid()
                cache.release(i)
                del live[i]
            elif op == 7:
                cache.evict(r.choice([*EDGE_INTS, True, "2"]) if r.int(0, 7) == 0 else r.int(0, 12))
            elif op == 8:
                cache.match(tokens(r, 6 * bs), namespace=r.choice([None, "a", 3]))
            else:
                if cache.reset():
                    assert not live
        except ALLOWED:
            assert pool_state(cache, list(live)) == before, "a call that raised changed the cache"
        except RuntimeError as e:
            # A commit past a checkpoint without room for the next chunk (or before it
            # was allocated): documented, and it kept what it computed, how far the
            # harness does not know (a later commit below that is a ValueError).
            assert op == 5 or op <= 3, e
            assert "checkpoint" in str(e) or "not allocated yet" in str(e), e
        cache.check_invariants()
    for i in list(live):
        cache.release(i)
    cache.check_invariants()
    if cache.name == "hash":  # radix's tree owns what it caches (its invariants account for it)
        held = [b for b in range(cache.pool.num_blocks) if cache.pool.ref_count(b)]
        assert not held, f"blocks still held after every request was released: {held}"


if __name__ == "__main__":
    main(test_one_input)
