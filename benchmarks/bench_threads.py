"""Threads and the per-cache lock: its uncontended cost, and a soak.

Owns two measurements and the threaded driver tests/test_threads.py runs small:

  lock cost  The same requests through a built-in cache and through the same class with
             every guarded method replaced by the function it wraps (`__wrapped__`: no
             lock, no re-entry check), rounds alternating, best of `--repeat`: µs per
             request and the ratio. Two shapes per backend: the A/B runner's request
             (admit, commit the prompt, append the whole output, commit, release: 5
             calls) and a decoding request (admit, commit, then 32 steps of
             append([t]) + commit(n): 67 calls). Target: <= 1.03x. Also the guard's
             cost per call, on a method that does nothing, in ns.
  soak       `hammer`: 8 threads share one cache, each doing random protocol calls on
             its own requests (prompts share 4 prefixes, 2 namespaces; small pool, so
             admissions evict and are refused), with a tiny thread switch interval so
             calls interleave as much as Python allows. Every call's answer must be one
             the protocol allows; afterwards everything is released, `check_invariants`
             passes, everything evicts and no block stays pinned.

    python benchmarks/bench_threads.py [--repeat 5] [--requests 2000]
    python benchmarks/bench_threads.py --soak --ops 100000     # 8 threads x 10^5 per backend arm
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Callable
from pathlib import Path

from prefixcache import build_cache
from prefixcache._C import BlockPool, CallGuard, InvariantError
from prefixcache.backends.hash import HashCache
from prefixcache.backends.radix import RadixCache
from prefixcache.config import CacheConfig
from prefixcache.eviction import LRU
from prefixcache.protocol import PrefixCache, guarded

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402



class PythonLRU(LRU):
    """LRU ranked in Python (no native order): the backends call it back mid-call."""

    native = None


PYTHON_LRU = f"{__name__}:PythonLRU"  # by path, as a user names a plugin: nothing is registered
ARMS = {  # (backend, eviction): a native order and a Python-ranked one per backend
    "hash/lru": ("hash", "lru"),
    "hash/python lru": ("hash", PYTHON_LRU),
    "radix/lru": ("radix", "lru"),
    "radix/python lru": ("radix", PYTHON_LRU),
}


def unguarded(cls: type[PrefixCache]) -> type[PrefixCache]:
    """`cls` with each guarded method replaced by the function it wraps: the cache
    without its lock, for the side-by-side cost (never for use)."""
    plain = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            if type(attr).__name__ == "GuardedMethod":
                plain[name] = attr.__wrapped__
    return type(f"Unguarded{cls.__name__}", (cls,), plain)


# ------------------------------------------------------------------------ lock cost


def requests(rng: random.Random, n: int, block_size: int) -> list[tuple[array, array]]:
    """(prompt, output) pairs: 8 shared system prompts of 4-16 blocks, a user part, an output."""
    systems = [array("q", range(s * 10_000, s * 10_000 + rng.randint(4, 16) * block_size)) for s in range(8)]
    out = []
    for i in range(n):
        user = array("q", (rng.randrange(50_000) for _ in range(rng.randint(8, 200))))
        output = array("q", (rng.randrange(50_000) for _ in range(rng.randint(16, 128))))
        out.append((systems[i % 8] + user, output))
    return out


def run_ab_shape(cache: PrefixCache, reqs: list[tuple[array, array]]) -> None:
    for i, (prompt, output) in enumerate(reqs):
        cache.admit(i, prompt)
        cache.commit(i, len(prompt))
        cache.append(i, output)
        cache.commit(i, len(prompt) + len(output))
        cache.release(i)


def run_decode_shape(cache: PrefixCache, reqs: list[tuple[array, array]]) -> None:
    for i, (prompt, output) in enumerate(reqs):
        cache.admit(i, prompt)
        n = len(prompt)
        cache.commit(i, n)
        for t in output[:32]:
            cache.append(i, [t])
            n += 1
            cache.commit(i, n)
        cache.release(i)


class _Noop:
    """Only the guard: the same no-op method guarded and plain, to time one call of each."""

    def __init__(self) -> None:
        self._call_guard = CallGuard("Noop")

    @guarded
    def guarded(self, request_id):
        return None

    def plain(self, request_id):
        return None


def per_call_ns(repeat: int, calls: int = 200_000) -> tuple[float, float]:
    """(ns per guarded no-op call, ns per the plain one), best of `repeat`."""
    obj = _Noop()
    best = [float("inf"), float("inf")]
    for _ in range(repeat):
        for i, call in enumerate((obj.guarded, obj.plain)):
            started = time.perf_counter()
            for _ in range(calls):
                call(1)
            best[i] = min(best[i], (time.perf_counter() - started) / calls * 1e9)
    return best[0], best[1]


def lock_cost(repeat: int, num_requests: int) -> None:
    reqs = requests(random.Random(0), num_requests, 16)
    shapes: dict[str, Callable] = {"A/B request (5 calls)": run_ab_shape, "decoding request (67 calls)": run_decode_shape}
    classes = {"hash": HashCache, "radix": RadixCache}
    best: dict[tuple[str, str, bool], float] = {}
    for _ in range(repeat):
        for backend, cls in classes.items():
            for shape, run in shapes.items():
                for locked in (True, False):  # alternating, within each round
                    config = CacheConfig(backend=backend, block_size=16, num_blocks=4096, enable_events=False)
                    klass = cls if locked else unguarded(cls)
                    cache = klass(BlockPool(config.num_blocks), config)
                    started = time.perf_counter()
                    run(cache, reqs)
                    us = (time.perf_counter() - started) / len(reqs) * 1e6
                    key = (backend, shape, locked)
                    best[key] = min(best.get(key, float("inf")), us)
    print("\n| backend | request shape | µs with the lock | µs without | ratio | target <= 1.03 |")
    print("|---|---|---:|---:|---:|---|")
    for backend in classes:
        for shape in shapes:
            on, off = best[(backend, shape, True)], best[(backend, shape, False)]
            print(f"| {backend} | {shape} | {on:.1f} | {off:.1f} | {on / off:.3f} | {'met' if on <= 1.03 * off else 'NOT met'} |")
    on, off = per_call_ns(repeat)
    print(f"# one call of a no-op method: {on:.0f} ns guarded, {off:.0f} ns plain (+{on - off:.0f} ns a call: "
          "one C call layer, an attribute look-up, a compare-and-swap and a store)")


# ------------------------------------------------------------------------ soak


def hammer(cache: PrefixCache, *, threads: int = 8, ops: int = 1000, seed: int = 0, live_per_thread: int = 3) -> None:
    """`threads` threads make `ops` random protocol calls each on `cache`; raises
    AssertionError naming the first wrong answer (with its traceback), or if after
    every thread's requests are released the cache is inconsistent or keeps a pin."""
    bs = cache.block_size
    prefixes = [array("q", range(p * 1000, p * 1000 + 3 * bs)) for p in range(4)]
    failures: list[str] = []
    start = threading.Barrier(threads)

    def worker(k: int) -> None:
        rng = random.Random(seed * 1_000 + k)
        live: dict[tuple[int, int], list[int]] = {}  # rid -> [tokens so far, committed]
        serial = 0
        start.wait()
        try:
            for _ in range(ops):
                op = rng.random()
                rid = rng.choice(list(live)) if live else None
                if rid is None or (op < 0.3 and len(live) < live_per_thread):
                    rid, serial = (k, serial), serial + 1
                    prompt = prefixes[rng.randrange(4)] + array("q", (rng.randrange(64) for _ in range(rng.randint(1, 2 * bs))))
                    adm = cache.admit(rid, prompt, namespace=rng.choice((None, "tenant")))
                    if adm is not None:
                        assert adm.num_cached_tokens < len(prompt) and len(adm.block_table) == -(-len(prompt) // bs)
                        live[rid] = [len(prompt), adm.num_cached_tokens]
                    elif live:
                        cache.release(live.popitem()[0])  # no room: make some
                elif op < 0.5:
                    total, done = live[rid]
                    live[rid][1] = rng.randint(done, total)
                    cache.commit(rid, live[rid][1])
                elif op < 0.65:
                    new = [rng.randrange(64) for _ in range(rng.randint(0, bs + 1))]
                    if cache.append(rid, new) is not None:
                        live[rid][0] += len(new)
                elif op < 0.85:
                    cache.release(rid)
                    del live[rid]
                elif op < 0.9:
                    m = cache.match(prefixes[rng.randrange(4)], namespace=rng.choice((None, "tenant")))
                    assert m.num_tokens % bs == 0 and len(m.block_ids) == m.num_tokens // bs
                elif op < 0.95:
                    assert cache.evict(rng.randint(0, 4)) >= 0
                elif op < 0.99:
                    assert len(cache.block_table(rid)) * bs >= live[rid][0]
                    cache.stats()
                else:
                    cache.check_invariants()
            for rid in list(live):
                cache.release(rid)
                del live[rid]
        except BaseException:  # any error is a wrong answer: no call here may raise
            failures.append(f"thread {k}:\n{traceback.format_exc()}")

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave calls as finely as the interpreter allows
    try:
        pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not failures, failures[0]
    try:
        cache.check_invariants()
        cache.evict(cache.pool.num_blocks)
        cache.check_invariants()
    except InvariantError as err:
        raise AssertionError(f"after {threads} threads x {ops} calls: {err}") from None
    assert cache.pool.num_free == cache.pool.num_blocks, f"{cache.pool.num_pinned} blocks still pinned"


def soak(ops: int, threads: int) -> None:
    print("\n| arm | threads x calls | seconds | calls/s | result |")
    print("|---|---|---:|---:|---|")
    for name, (backend, eviction) in ARMS.items():
        cache = build_cache(CacheConfig(backend=backend, block_size=4, num_blocks=96, eviction=eviction))
        started = time.perf_counter()
        hammer(cache, threads=threads, ops=ops, seed=1)
        seconds = time.perf_counter() - started
        print(f"| {name} | {threads} x {ops:,} | {seconds:.1f} | {threads * ops / seconds:,.0f} | invariants hold, nothing pinned |",
              flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--requests", type=int, default=2000, help="requests per lock-cost round")
    parser.add_argument("--soak", action="store_true", help="run the threaded soak instead of the lock cost")
    parser.add_argument("--ops", type=int, default=100_000, help="calls per thread in the soak")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args(argv)
    print(f"# bench_threads  {datetime.date.today()}  {cpu_model()} x{os.cpu_count()}  Python {platform.python_version()}")
    print(f"# command: python benchmarks/bench_threads.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    if args.soak:
        soak(args.ops, args.threads)
    else:
        lock_cost(args.repeat, args.requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
