"""Why `kv_events` routes where it does: every decision of one kv_events arm on a Mooncake
trace, recorded and taken apart.

Replays the trace through N replicas (configs/cluster_mooncake.yaml) with a kv_events
router that records, for each request, the candidates' load columns, the KV index's
overlaps and its choice. Reports:

- moved: requests sent to a replica holding fewer of their blocks than another one
  did, and, against the best such holder (the cheapest), what outweighed the cache
  credit (weight x the blocks given up): the holder's larger prefill backlog
  (weight x its extra prefill tokens / B), its extra active blocks, or neither alone;
- a_w (the prompt's blocks already among a replica's active blocks, which Dynamo does not
  add again): how many decisions see different a_w on different replicas, and how many
  would have picked another replica without it (a_w = 0, the accounting before Dynamo's
  was matched). The active blocks and a_w the router saw are checked against a rebuild
  from where each request went, when it arrived and when it finished.

    python benchmarks/cluster_decisions.py --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        [--replicas 8] [--weight 1] [--temperature 0]

Never commit the traces themselves.
"""

from __future__ import annotations

import argparse
import heapq
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache.cluster import KVIndex  # noqa: E402
from prefixcache.cluster.config import RouterSpec, load_cluster_config  # noqa: E402
from prefixcache.cluster.routers.kv_events import KVEventsRouter  # noqa: E402
from prefixcache.cluster.simulate import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class RecordingKVEvents(KVEventsRouter):
    """kv_events, keeping what it saw and chose (the class attribute `decisions`)."""

    decisions: list[tuple] = []

    def choose_replicas(self, candidates, request):
        ranked = super().choose_replicas(candidates, request)
        overlaps = candidates.by_position(self.index.longest_prefix(request.hashes))
        active = self.context.active
        shared = candidates.by_position(active.longest_prefix(request.hashes)) if len(request.hashes) else {}
        RecordingKVEvents.decisions.append((
            self.context.clock(), request.num_prompt_tokens, request.hashes.digests(),
            candidates.prefill_tokens.tolist(), candidates.active_blocks.tolist(), overlaps, ranked[0][0], shared))
        return ranked


def active_overlaps(decisions: list[tuple], finished: list[float]) -> list[dict[int, int]]:
    """a_w of every decision: the leading blocks of its prompt among the active blocks of
    each replica, rebuilt from when each request was routed and finished. Checks on the
    way that the rebuilt active blocks are the `active_blocks` column the router saw."""
    active = KVIndex()
    for rid in range(len(decisions[0][4])):
        active.add_replica(rid)
    ends: list[tuple[float, int]] = []
    out = []
    for j, (at, _, digests, _, seen, _, chose, shared) in enumerate(decisions):
        # Completions at a time come before arrivals; 1 ns absorbs the rounding of
        # arrival + TTFT + decode against the simulation's own sum.
        while ends and ends[0][0] <= at + 1e-9:
            _, i = heapq.heappop(ends)
            active.remove(decisions[i][6], decisions[i][2])
        rebuilt = [active.blocks(rid) for rid in range(len(seen))]
        if rebuilt != seen:
            raise RuntimeError(f"request {j}: active blocks rebuilt {rebuilt}, the router saw {seen}")
        rebuilt_a = active.longest_prefix(digests) if digests else {}
        if {r: a for r, a in rebuilt_a.items() if a} != {r: a for r, a in shared.items() if a}:
            raise RuntimeError(f"request {j}: a_w rebuilt {rebuilt_a}, the router saw {shared}")
        out.append(rebuilt_a)
        active.store(chose, digests)
        heapq.heappush(ends, (finished[j], j))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True, help="a Mooncake JSONL trace")
    parser.add_argument("--config", default=str(ROOT / "configs" / "cluster_mooncake.yaml"))
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--weight", type=float, default=1.0, help="kv_events overlap_score_weight")
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%d')}  {platform.node()}  {cpu_model()}  python {platform.python_version()}")
    print(f"# python benchmarks/cluster_decisions.py {shlex.join(sys.argv[1:])}")
    config = load_cluster_config(args.config, trace=args.trace)
    workload = config.workload.build()
    spec = RouterSpec(f"{RecordingKVEvents.__module__}:RecordingKVEvents",
                      {"overlap_score_weight": args.weight, "temperature": args.temperature})
    RecordingKVEvents.decisions = []
    run = simulate(workload, config, "kv_events", spec, args.replicas)
    decisions = RecordingKVEvents.decisions
    if run.rejected:
        raise SystemExit(f"{len(run.rejected)} requests were rejected: the a_w rebuild needs every request to run")
    bs, w = config.block_size, args.weight
    actives = active_overlaps(decisions, list(run.finish_s))

    moved = differs = flips = 0
    by_cause = {"prefill backlog": 0, "active blocks": 0, "neither alone": 0}
    totals = {"credit": 0.0, "prefill": 0.0, "active": 0.0}
    for (_, p, digests, pf, ab, o, chose, _), a in zip(decisions, actives, strict=True):
        n, f = len(pf), len(digests)

        def cost(i, exact=True):
            return w * max((pf[i] + p) / bs - o.get(i, 0), 0) + ab[i] + f - (a.get(i, 0) if exact else 0)

        if len({a.get(i, 0) for i in range(n)}) > 1:
            differs += 1
            approx, exact = [cost(i, False) for i in range(n)], [cost(i) for i in range(n)]
            if {i for i in range(n) if approx[i] == min(approx)} != {i for i in range(n) if exact[i] == min(exact)}:
                flips += 1
        best = max(o.values(), default=0)
        if o.get(chose, 0) < best:
            moved += 1
            holder = min((i for i in range(n) if o.get(i, 0) == best), key=cost)
            credit = w * (best - o.get(chose, 0))
            backlog = w * (pf[holder] - pf[chose]) / bs
            blocks = ab[holder] - ab[chose]
            by_cause["prefill backlog" if backlog > credit else "active blocks" if blocks > credit
                     else "neither alone"] += 1
            totals["credit"] += credit
            totals["prefill"] += backlog
            totals["active"] += blocks

    total = len(decisions)
    print(f"kv_events weight {w:g} temperature {args.temperature:g}, N={args.replicas}: hit ratio {run.hit_ratio:.4f}, "
          f"TTFT p99 {run.ttft_p99_s:.3f} s; {total:,} decisions")
    print(f"  moved off the longest-prefix holder: {moved:,} ({moved / total:.1%})")
    for cause, count in by_cause.items():
        print(f"    the holder's {cause} outweighed the credit: {count:,} ({count / max(moved, 1):.1%} of moves)"
              if cause != "neither alone" else f"    neither alone: {count:,} ({count / max(moved, 1):.1%} of moves)")
    if moved:
        print(f"    per move, in blocks: credit given up {totals['credit'] / moved:.1f}, the holder's extra prefill "
              f"term {totals['prefill'] / moved:.1f}, its extra active blocks {totals['active'] / moved:.1f}")
    print(f"  a_w differs between replicas: {differs:,} decisions ({differs / total:.1%}); "
          f"without it the lowest cost would move in {flips:,} ({flips / total:.2%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
