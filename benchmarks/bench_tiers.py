"""Lower tiers on the Mooncake conversation trace (block 512, prompts only): capacity,
write policies, tier eviction policies, disk bytes, and what the bookkeeping costs.

Every figure is a replay through the A/B runner (`prefixcache.ab.replay_arm`) of the
trace, next to the infinite-cache ceiling and Belady at the same total capacity
(`prefixcache.workloads`), measured in one run on this machine. Sections:

  capacity  flat 3M tokens vs device 1M + host 2M (on_evict; write_through beside it),
            both strategies, the same policy (LRU); radix's tiers keyed by hash (events
            on) beside its lineage keys, request by request; device 3M + host 30M vs the ceiling.
            Targets: tiered on_evict within 0.01 of flat 3M; 3M + 30M >= 0.95 x ceiling.
  policy    device 1M + host 2M under lru, gslru and chain (ours) on the host tier,
            against Belady at 3M. Target: >= 0.25. And the host tier's gslru decided
            in Python (bench_policy's PythonGSLRU): the same hits as native.
  disk      device 1M + host 2M + disk 8M (7 GB/s): a write_through disk against on_evict
            disks with min_hits 0, 1, 2 (Dynamo's frequency filter) and store_threshold 2
            (reuse trackers of 4x, 2x and 1x the disk's blocks) and 3. Target: <= 25% of
            write_through's bytes written for <= 0.01 hit-ratio loss.
  cost      the replay with a host tier against the same replay without (events off, so
            radix keys its tiers by lineage and hashes nothing): `--repeat` runs of each,
            alternating, the ratio of the fastest of each side and the ratios' range over
            the rounds (this VM's speed moves by a third between runs: one pair would
            read 1.2x to 2x for the same code), and the tier manager alone per block moved
            (a device -> host demotion with a host eviction, and a load back; the
            demotion again with the host tier's LRU decided in Python), and the tiered
            radix replay once more with each tier-manager call timed.
            Targets: <= 1.5x; <= 1 us per block moved.

    python benchmarks/bench_tiers.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        [--sections capacity policy disk cost] [--repeat 5]

Never commit the trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from bench_policy import PythonGSLRU, PythonLRU  # noqa: E402

from prefixcache.ab import ArmResult, replay_arm
from prefixcache.config import CacheConfig
from prefixcache.tier_config import TierConfig
from prefixcache.tiers import PolicyRank, Tiers
from prefixcache.workloads import BlockPlan, belady, infinite_cache, read_mooncake

B = 512
M = 1_000_000


def blocks(tokens: int) -> int:
    return tokens // B


def arm(backend: str, device_tokens: int, *tiers: TierConfig, eviction: str = "lru") -> CacheConfig:
    return CacheConfig(backend=backend, block_size=B, num_blocks=blocks(device_tokens), eviction=eviction,
                       enable_events=False, tiers=tuple(tiers))  # fmt: skip


def host(tokens: int, **kw: object) -> TierConfig:
    return TierConfig("CPU", blocks(tokens), **kw)  # type: ignore[arg-type]


def load() -> str:
    return "load " + " ".join(open("/proc/loadavg").read().split()[:3])


def row(name: str, r: ArmResult, extra: str = "") -> None:
    tiers = " ".join(f"{t.medium}: hit {t.loaded_tokens / sum(r.hits.prompt_tokens):.4f} "
                     f"loads {t.loads:,} written {t.bytes_written / 1e12:.2f} TB"
                     + (f" filtered {t.filtered:,}" if t.filtered else "") for t in r.tiers)  # fmt: skip
    print(f"  {name:<34} {r.hit_ratio:.4f} / {r.last_half_hit_ratio:.4f}  {r.wall_s:6.1f} s  {tiers} {extra}",
          flush=True)


def capacity(workload, plan) -> None:
    ceiling = infinite_cache(plan)
    print(f"\n== capacity ({load()}); ceiling {ceiling.hit_ratio:.4f}, Belady at 3M "
          f"{belady(plan, blocks(3 * M)).hit_ratio:.4f} (whole trace / last 50%)")
    for backend in ("hash", "radix"):
        flat = replay_arm(workload, "flat", arm(backend, 3 * M))
        row(f"{backend} flat 3M", flat)
        tiered = replay_arm(workload, "tiered", arm(backend, 1 * M, host(2 * M)))
        gap = flat.hit_ratio - tiered.hit_ratio
        row(f"{backend} device 1M + host 2M on_evict", tiered,
            f"| vs flat {-gap:+.4f} -> {'ok' if abs(gap) <= 0.01 else 'NOT within 0.01'}")
        if backend == "radix":  # events on: the same tiers keyed by hash, not by lineage
            hashed = replay_arm(workload, "hashed", dataclasses.replace(arm(backend, 1 * M, host(2 * M)),
                                                                        enable_events=True))  # fmt: skip
            same = hashed.hits.hit_tokens == tiered.hits.hit_tokens
            row("radix the same, keyed by hash", hashed,
                f"| {'every request hits as with lineage' if same else 'NOT the hits lineage finds'}")
        through = replay_arm(workload, "write_through", arm(backend, 1 * M, host(2 * M, write="write_through")))
        row(f"{backend} device 1M + host 2M write_through", through, f"| vs flat {through.hit_ratio - flat.hit_ratio:+.4f}")
        big = replay_arm(workload, "big", arm(backend, 3 * M, host(30 * M)))
        share = big.hit_ratio / ceiling.hit_ratio
        row(f"{backend} device 3M + host 30M", big, f"| {share:.3f} of the ceiling -> {'ok' if share >= 0.95 else 'NOT >= 0.95'}")


def policy(workload, plan) -> None:
    b = belady(plan, blocks(3 * M))
    print(f"\n== tier eviction at device 1M + host 2M ({load()}); Belady at 3M {b.hit_ratio:.4f}; target >= 0.25")
    for backend in ("hash", "radix"):
        for dev, tier in (("lru", "lru"), ("lru", "gslru"), ("lru", "chain"), ("gslru", "gslru"), ("gslru", "chain"),
                          ("chain", "chain")):  # fmt: skip
            r = replay_arm(workload, f"{dev}/{tier}", arm(backend, 1 * M, host(2 * M, eviction=tier), eviction=dev))
            row(f"{backend} device {dev}, host {tier}", r, "" if r.hit_ratio >= 0.25 else "| below 0.25")
            if (dev, tier) == ("lru", "gslru"):
                native = r
        # The same host policy decided in Python: priority() once per block the tier ranks.
        PythonGSLRU.calls = 0
        r = replay_arm(workload, "lru/gslru (python)",
                       arm(backend, 1 * M, host(2 * M, eviction="bench_policy:PythonGSLRU")))  # fmt: skip
        same = "the same hits as native" if r.hit_ratio == native.hit_ratio and r.tiers == native.tiers else "DIFFERS"
        row(f"{backend} device lru, host gslru in Python", r,
            f"| {same}; {PythonGSLRU.calls:,} priority() calls, {r.wall_s:.1f} s against {native.wall_s:.1f} s")


def disk(workload, plan, path: Path) -> None:
    # 7 GB/s (a PCIe Gen4 NVMe drive's reads): at the default 2 GB/s a 512-token block of an 8B
    # model (64 MiB) loads slower than it computes, and the cost model declines every disk hit.
    print(f"\n== disk (7 GB/s) below device 1M + host 2M: 8M tokens ({load()}); target <= 25% of write_through's "
          "bytes for <= 0.01 loss")
    def against(r: ArmResult, base: ArmResult) -> str:
        ratio = r.tiers[1].bytes_written / base.tiers[1].bytes_written
        loss = base.hit_ratio - r.hit_ratio
        verdict = "ok" if ratio <= 0.25 and loss <= 0.01 else "not both"
        return f"| disk bytes {ratio:.1%} of write_through, loss {loss:+.4f} -> {verdict}"

    results = {}
    disk = dict(num_blocks=blocks(8 * M), path=str(path), bandwidth_gbps=7.0)
    for name, d in (("write_through", TierConfig("DISK", write="write_through", **disk)),
                    ("on_evict", TierConfig("DISK", **disk)),
                    ("on_evict min_hits 1", TierConfig("DISK", min_hits=1, **disk)),
                    ("on_evict min_hits 2", TierConfig("DISK", min_hits=2, **disk)),
                    ("on_evict store_threshold 2", TierConfig("DISK", store_threshold=2, **disk)),
                    ("on_evict store_threshold 2, tracker 2x", TierConfig("DISK", store_threshold=2,
                                                                          reuse_tracker_size=2 * disk["num_blocks"], **disk)),
                    ("on_evict store_threshold 2, tracker 1x", TierConfig("DISK", store_threshold=2,
                                                                          reuse_tracker_size=disk["num_blocks"], **disk)),
                    ("on_evict store_threshold 3", TierConfig("DISK", store_threshold=3, **disk))):  # fmt: skip
        r = results[name] = replay_arm(workload, name, arm("hash", 1 * M, host(2 * M), d))
        row(f"hash disk {name}", r, against(r, results["write_through"]))
    # radix: the same keys, write_through against the filter that meets the target on hash
    base = replay_arm(workload, "write_through", arm("radix", 1 * M, host(2 * M), TierConfig("DISK", write="write_through", **disk)))
    row("radix disk write_through", base, "")
    r = replay_arm(workload, "st2", arm("radix", 1 * M, host(2 * M), TierConfig("DISK", store_threshold=2, **disk)))
    row("radix disk on_evict store_threshold 2", r, against(r, base))


def cost(workload, repeat: int) -> None:
    print(f"\n== cost ({load()}; {repeat} rounds, flat and tiered alternating)")
    for backend in ("hash", "radix"):
        walls: dict[str, list[float]] = {"flat": [], "tiered": []}
        cpus: dict[str, list[float]] = {"flat": [], "tiered": []}
        for _ in range(repeat):
            for name, config in (("flat", arm(backend, 3 * M)), ("tiered", arm(backend, 1 * M, host(2 * M)))):
                c0 = time.process_time()
                result = replay_arm(workload, name, config)
                cpus[name].append(time.process_time() - c0)
                walls[name].append(result.wall_s)
                if name == "flat":
                    flat = result
                else:
                    tiered = result
        ratio = min(walls["tiered"]) / min(walls["flat"])
        cpu_ratio = min(cpus["tiered"]) / min(cpus["flat"])
        rounds = [t / f for t, f in zip(walls["tiered"], walls["flat"])]
        moved = sum(t.stores + t.loads for t in tiered.tiers)
        extra = sum(tiered.bookkeeping_us) - sum(flat.bookkeeping_us)
        print(f"  {backend}: flat 3M {min(walls['flat']):.2f} s wall / {min(cpus['flat']):.2f} s CPU (fastest of "
              f"{repeat}), device 1M + host 2M {min(walls['tiered']):.2f} s / {min(cpus['tiered']):.2f} s -> "
              f"{ratio:.2f}x wall, {cpu_ratio:.2f}x CPU ({'ok' if max(ratio, cpu_ratio) <= 1.5 else 'NOT within 1.5x'}"
              f"; round by round {min(rounds):.2f}-{max(rounds):.2f}x); {moved:,} blocks moved; the cache calls' "
              f"extra time (last round) {extra / 1e6:.2f} s = {extra / moved:.2f} us per block moved", flush=True)
    native_calls(workload)
    from prefixcache._C import TierManager

    n, per = 20_000, 20
    keys = [os.urandom(32 * per) for _ in range(n)]
    root = os.urandom(32)
    ids = list(range(per))

    def demotions(eviction) -> tuple[TierManager, float]:
        """us of CPU per block demoted with a host eviction (each round: 20 blocks cached, then evicted)."""
        manager = TierManager(2000, B, 32, [(4000, "on_evict", 0, eviction, False, {}, False, 0, 0)], False, False)
        t0 = time.process_time()
        for k in keys:
            manager.device_cached(ids, k, root, None, 0, 0, 0)
            manager.device_evicted(ids)
            manager.drain_transfers()
        return manager, (time.process_time() - t0) / (n * per) * 1e6

    manager, demote = demotions("lru")
    _, in_python = demotions(PolicyRank(PythonLRU(), "bench", []))
    t0 = time.process_time()
    for k in keys[:2000]:
        manager.device_dropped(ids)
        manager.device_cached(ids, k, root, None, 0, 0, 0)
        manager.device_evicted(ids)
        where = [manager.locate(k[i * 32 : (i + 1) * 32]) for i in range(per)]
        manager.pin(where)
        manager.load(where, ids)
        manager.drain_transfers()
    round_trip = (time.process_time() - t0) / (2000 * per) * 1e6
    print(f"  tier manager alone (CPU time): {demote:.2f} us per block demoted (with a host eviction), "
          f"{round_trip:.2f} us per block demoted and loaded back (Python calls included) -> "
          f"{'ok' if demote <= 1.0 else 'NOT <= 1 us'}; with the host tier's LRU in Python "
          f"(one priority() call per block stored): {in_python:.2f} us per block demoted")


class _Timed:
    """A tier manager whose every method call adds its wall time to `spent[name]`."""

    def __init__(self, native: object, spent: dict[str, float]) -> None:
        self._native, self._spent = native, spent

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._native, name)
        if not callable(attr):
            return attr

        def timed(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t0

        return timed


def native_calls(workload) -> None:
    """The tiered radix replay once more with every tier-manager call timed: where the
    time above the flat replay goes (native calls against the Python around them; the
    timing adds a little to the replay's wall)."""
    spent: dict[str, float] = {}
    built = Tiers.__init__

    def timed_init(self, *args, **kwargs) -> None:
        built(self, *args, **kwargs)
        self.native = _Timed(self.native, spent)

    Tiers.__init__ = timed_init
    try:
        tiered = replay_arm(workload, "tiered", arm("radix", 1 * M, host(2 * M)))
    finally:
        Tiers.__init__ = built
    top = sorted(spent.items(), key=lambda kv: -kv[1])
    print(f"  radix tier-manager calls (one timed replay, {tiered.wall_s:.2f} s): {sum(spent.values()):.2f} s in all; "
          + ", ".join(f"{name} {s:.3f} s" for name, s in top[:4]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, required=True, help="the Mooncake conversation trace (JSONL)")
    parser.add_argument("--sections", nargs="+", default=["capacity", "policy", "disk", "cost"],
                        choices=["capacity", "policy", "disk", "cost"])  # fmt: skip
    parser.add_argument("--repeat", type=int, default=5, help="cost: rounds of the flat and tiered replays")
    parser.add_argument("--disk-path", type=Path, default=Path("/tmp/prefixcache-bench.tier"),
                        help="a DISK tier's path (only named: the replay writes no file)")
    args = parser.parse_args()
    print(f"# tiers benchmark, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()}, Python {platform.python_version()}, "
          f"{load()}")
    print(f"# command: python {shlex.join(sys.argv)}")
    t0 = time.perf_counter()
    workload = read_mooncake(args.trace, block_size=B, outputs=False)
    plan = BlockPlan.of(workload, B)
    for section in args.sections:
        if section == "capacity":
            capacity(workload, plan)
        elif section == "policy":
            policy(workload, plan)
        elif section == "disk":
            disk(workload, plan, args.disk_path)
        else:
            cost(workload, args.repeat)
    print(f"\n# {time.perf_counter() - t0:.0f} s in all, {load()}")


if __name__ == "__main__":
    main()
