"""Several threads may call one cache (issue 16, item 6; docs/concurrency.md).

Each built-in cache holds one lock for the whole of each public call (`CallGuard`):
calls from other threads wait (with the GIL released), calls from inside a running one
are refused (tests/test_reentry.py). Without it, 8 threads corrupted both backends
(hash: "caller checked the pool has room" and leaked refs; radix: lock_ref errors).
The driver is benchmarks/bench_threads.py's `hammer`: here 8 threads x 1,500 calls per
arm, interleaved at a 1 µs switch interval; the benchmark's soak runs 8 x 10^5.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path

import pytest

import prefixcache
from prefixcache.config import CacheConfig
from prefixcache.eviction import LRU

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_threads.py"
INSIDE = threading.Event()


class Slow(LRU):
    """A Python LRU that says it has started, then sleeps (releasing the GIL)."""

    native = None

    def priority(self, candidate):
        INSIDE.set()
        time.sleep(0.05)
        return super().priority(candidate)


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        spec = importlib.util.spec_from_file_location("bench_threads", BENCH)
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_threads"] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH.parent))
        sys.modules.pop("bench_threads", None)


@pytest.mark.parametrize("arm", ["hash/lru", "hash/python lru", "radix/lru", "radix/python lru"])
def test_eight_threads_share_one_cache(bench, arm):
    backend, eviction = bench.ARMS[arm]
    cache = prefixcache.build_cache(CacheConfig(backend=backend, block_size=4, num_blocks=96, eviction=eviction))
    bench.hammer(cache, threads=8, ops=1_500, seed=0)


def test_another_thread_waits_for_a_call_in_a_callback(bench):
    """A thread calling while another is inside a slow callback (which releases the GIL)
    waits for that call to end: it is not refused, and it sees the finished call."""
    inside, order = INSIDE, []
    inside.clear()
    cache = prefixcache.build_cache(CacheConfig(backend="radix", block_size=1, num_blocks=8, eviction=f"{__name__}:Slow"))
    for i in range(3):
        cache.admit(i, [10 * i, 10 * i + 1])
        cache.commit(i, 2)
        cache.release(i)
    evicting = threading.Thread(target=lambda: order.append(("evict", cache.evict(8))))
    evicting.start()
    assert inside.wait(5)
    order.append(("stats", cache.stats().evictions))  # waits for the eviction to finish
    evicting.join()
    assert order == [("evict", 6), ("stats", 6)]


def test_the_guard_says_who_holds_it():
    cache = prefixcache.build_cache(CacheConfig(block_size=2, num_blocks=4))
    guard = cache._call_guard
    assert guard.name == "HashCache" and not guard.held
    with guard:
        assert guard.held
        with pytest.raises(RuntimeError, match=r"HashCache.stats\(\) was called while HashCache.with\(\) is running"):
            cache.stats()
    assert not guard.held and cache.stats().queries == 0
