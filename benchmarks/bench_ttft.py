"""Time to first token with and without prefix caching, on the real SmolLM2-135M, CPU.

Three arms share one loaded model and the same pool geometry: `none` (engine
`prefix_caching: false`: same pool, same scheduler, no hits), `hash` and `radix`.

Part 1, shared system prompt (the workloads package's `shared_prefix`: one group, a
2,048-token system prompt + 64-token questions, 16 requests):
  sequential  requests arrive one at a time (each after the previous one finished), so
              TTFT is prefill latency without queueing. The three arms are interleaved
              request by request (rotating which goes first) so machine noise hits
              them alike. Target: TTFT p50 cached <= 0.15x uncached.
  burst       all 16 arrive at once (continuous batching, 2,048-token step budget):
              TTFT includes queueing behind other prefills.
  inbatch     the same burst with a system prompt shorter than the step budget
              (`--inbatch-system`, 512 tokens), so that several requests could compute it
              side by side in one step: each cached arm with `in_batch_prefix_tokens` 0
              (off) and 32 (the default: a request waits for the running prefill of the
              prefix it shares, then hits it).
Part 2, no sharing (`no_sharing`: every prompt distinct, 0% hits): throughput with the
cache on vs off, fresh engines per repeat, arms interleaved in rotating order, repeated;
reports the median and spread of wall and process CPU time of each arm relative to
`none` in the same repeat, and the time spent inside cache calls (the bookkeeping the
cache adds, measured directly). Target: overhead < 0.5%.
Part 3 (`--parts logprobs`, not run by default): the no-sharing workload with
`--logprobs-output` tokens each, asking for no logprobs, the drawn token's, the top 5
and the top 20: what computing and keeping them costs a decode-heavy run.

    python benchmarks/bench_ttft.py [--threads 2] [--parts sequential,burst,inbatch,nohit,logprobs]
                                    [--repeats 5] [--json FILE]

OMP_WAIT_POLICY defaults to PASSIVE here (set before torch loads): on a shared 2-core
machine, spinning OpenMP threads slow a busy neighbour's and our steps by 10-20x.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from prefixcache.config import CacheConfig  # noqa: E402
from prefixcache.engine import Engine, EngineConfig, GenerationRequest, ServingConfig, load_model  # noqa: E402
from prefixcache.engine.metrics import format_table  # noqa: E402
from prefixcache.percentiles import percentile  # noqa: E402
from prefixcache.workloads import no_sharing, shared_prefix  # noqa: E402

ARMS = ("none", "hash", "radix")


def make_engine(model, arm: str, *, block_size: int, num_blocks: int, budget: int, max_tokens: int,
                in_batch: int = 32) -> Engine:
    cache = CacheConfig(backend="hash" if arm == "none" else arm, block_size=block_size, num_blocks=num_blocks)
    engine = EngineConfig(
        model="smollm2", prefix_caching=arm != "none", max_num_batched_tokens=budget, max_num_seqs=16, max_tokens=max_tokens,
        in_batch_prefix_tokens=in_batch,
    )
    return Engine(ServingConfig(cache, engine), model=model)


def warm_up(engine: Engine) -> None:
    """One short request so thread pools and allocators are warm, then clean counters."""
    engine.generate([GenerationRequest(prompt=[100, 200, 300], max_tokens=2, namespace="warm-up")])
    engine.reset_stats()


def requests_of(workload, vocab: int, max_tokens: int) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=[t % vocab for t in r.prompt.tolist()], max_tokens=max_tokens) for r in workload.requests]


def arm_row(arm: str, outs, wall_s: float, stats, base_ttft: float | None) -> list[object]:
    ttfts = [o.metrics.ttft_s for o in outs]
    hit = [o.metrics.ttft_s for o in outs if o.metrics.cached_tokens > 0]
    p50 = percentile(ttfts, 50)
    return [
        arm,
        round(p50 * 1000, 1),
        "1.00x" if base_ttft is None else f"{p50 / base_ttft:.3f}x",
        round(percentile(hit, 50) * 1000, 1) if hit else None,
        stats.prefill_tokens_computed,
        stats.prefill_tokens_saved,
        round(wall_s, 2),
    ]


HEAD = ["arm", "TTFT p50 ms", "vs none", "TTFT p50 of hits ms", "prefill computed", "prefill saved", "total s"]


def part_sequential(model, args, reqs) -> tuple[str, dict]:
    engines = {a: make_engine(model, a, block_size=args.block_size, num_blocks=args.num_blocks, budget=args.budget,
                              max_tokens=args.output) for a in ARMS}
    for e in engines.values():
        warm_up(e)
    outs: dict[str, list] = {a: [] for a in ARMS}
    wall = dict.fromkeys(ARMS, 0.0)
    for i, r in enumerate(reqs):
        order = ARMS[i % 3:] + ARMS[: i % 3]
        for a in order:
            t0 = time.perf_counter()
            outs[a] += engines[a].generate([r])
            wall[a] += time.perf_counter() - t0
        print(f"  sequential request {i + 1}/{len(reqs)}: " + ", ".join(
            f"{a} {outs[a][-1].metrics.ttft_s * 1000:.0f} ms" for a in ARMS), file=sys.stderr, flush=True)
    same = all(o.token_ids == n.token_ids for a in ARMS for o, n in zip(outs[a], outs["none"]))
    base = percentile([o.metrics.ttft_s for o in outs["none"]], 50)
    rows = [arm_row(a, outs[a], wall[a], engines[a].stats(), None if a == "none" else base) for a in ARMS]
    for e in engines.values():
        e.check_invariants()
    result = {"rows": rows, "same_outputs": same, "ttft_s": {a: [o.metrics.ttft_s for o in outs[a]] for a in ARMS}}
    return format_table(HEAD, rows) + f"\n\nGreedy outputs identical across arms: {same}", result


def run_burst(model, args, reqs, arm: str, label: str, **engine_args):
    """`reqs` all at once through a fresh, warmed-up engine of `arm`: (outputs, wall s, stats)."""
    engine = make_engine(model, arm, block_size=args.block_size, num_blocks=args.num_blocks, budget=args.budget,
                         max_tokens=args.output, **engine_args)
    warm_up(engine)
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - t0
    print(f"  {label}: {wall:.1f} s", file=sys.stderr, flush=True)
    engine.check_invariants()
    stats = engine.stats()
    del engine
    gc.collect()
    return outs, wall, stats


def part_burst(model, args, reqs) -> tuple[str, dict]:
    rows, outs_by = [], {}
    base = None
    for a in ARMS:
        outs, wall, stats = run_burst(model, args, reqs, a, f"burst {a}")
        outs_by[a] = outs
        rows.append(arm_row(a, outs, wall, stats, base))
        if a == "none":
            base = percentile([o.metrics.ttft_s for o in outs], 50)
    same = all(o.token_ids == n.token_ids for a in ARMS for o, n in zip(outs_by[a], outs_by["none"]))
    return format_table(HEAD, rows) + f"\n\nGreedy outputs identical across arms: {same}", {"rows": rows, "same_outputs": same}


def part_inbatch(model, args, reqs) -> tuple[str, dict]:
    """A burst whose shared prefix fits the step budget several times: cached arms with and
    without waiting for a running prefill (`in_batch_prefix_tokens` 0 / 32)."""
    head = ["arm", "in_batch_prefix_tokens", "TTFT p50 ms", "TTFT p90 ms", "TTFT max ms", "prefill computed",
            "waits (steps)", "total s"]
    rows, tokens = [], {}
    for a in ("hash", "radix"):
        for in_batch in (0, 32):
            outs, wall, st = run_burst(model, args, reqs, a, f"inbatch {a} {in_batch}", in_batch=in_batch)
            ttft = [o.metrics.ttft_s * 1000 for o in outs]
            rows.append([a, in_batch, round(percentile(ttft, 50), 1), round(percentile(ttft, 90), 1), round(max(ttft), 1),
                         st.prefill_tokens_computed, st.prefix_waits, round(wall, 2)])
            tokens[a, in_batch] = [o.token_ids for o in outs]
    same = len({tuple(map(tuple, t)) for t in tokens.values()}) == 1
    text = format_table(head, rows) + f"\n\nGreedy outputs identical across arms: {same}"
    return text, {"rows": rows, "same_outputs": same}


def no_sharing_run(model, args, output: int) -> tuple[list[GenerationRequest], int]:
    """The no-sharing workload's requests (`output` TOKENS each) and a pool that holds them all."""
    wl = no_sharing(args.nohit_requests, args.nohit_prompt, output, seed=0)
    reqs = requests_of(wl, model.weights.config.vocab_size, output)
    return reqs, args.nohit_requests * -(-(args.nohit_prompt + output) // args.block_size) + 8


def part_nohit(model, args) -> tuple[str, dict]:
    reqs, num_blocks = no_sharing_run(model, args, args.nohit_output)
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    cpu: dict[str, list[float]] = {a: [] for a in ARMS}
    cache_s: dict[str, list[float]] = {a: [] for a in ARMS}
    tokens = 0
    for rep in range(args.repeats):
        order = ARMS[rep % 3:] + ARMS[: rep % 3]
        for a in order:
            engine = make_engine(model, a, block_size=args.block_size, num_blocks=num_blocks, budget=args.budget,
                                 max_tokens=args.nohit_output)
            warm_up(engine)
            t0, c0 = time.perf_counter(), time.process_time()
            outs = engine.generate(reqs)
            times[a].append(time.perf_counter() - t0)
            cpu[a].append(time.process_time() - c0)
            stats = engine.stats()
            assert stats.prefill_tokens_saved == 0, "the no-sharing workload must not hit"
            cache_s[a].append(stats.cache_s)
            tokens = stats.prompt_tokens + stats.output_tokens
            del engine, outs
            gc.collect()
        print(f"  no-hit repeat {rep + 1}/{args.repeats}: " + ", ".join(f"{a} {times[a][-1]:.2f} s" for a in ARMS),
              file=sys.stderr, flush=True)
    def vs_none(a: str, series: dict[str, list[float]]) -> tuple[str, str]:
        if a == "none":
            return "-", "-"
        r = [x / n - 1 for x, n in zip(series[a], series["none"])]
        return f"{statistics.median(r) * 100:+.2f}%", f"{min(r) * 100:+.2f}% .. {max(r) * 100:+.2f}%"

    rows = []
    for a in ARMS:
        med = statistics.median(times[a])
        rows.append([
            a,
            round(med, 3),
            round(tokens / med, 1),
            *vs_none(a, times),
            round(statistics.median(cpu[a]), 3),
            *vs_none(a, cpu),
            round(statistics.median(cache_s[a]) * 1000, 2),
            f"{statistics.median(cache_s[a]) / med * 100:.4f}%",
        ])
    head = ["arm", "wall s (median)", "tokens/s", "wall vs none (median)", "spread (min .. max)", "CPU s (median)",
            "CPU vs none (median)", "spread (min .. max)", "in cache calls ms", "cache calls / wall"]
    return format_table(head, rows), {"rows": rows, "times": times, "cpu": cpu, "cache_s": cache_s}


LOGPROB_ARMS = (None, 0, 5, 20)


def part_logprobs(model, args) -> tuple[str, dict]:
    """What returning logprobs costs: the no-sharing workload on `hash`, each request asking
    for none, the drawn token's, or the top 5 / 20, fresh engines per repeat, arms
    interleaved in rotating order. The time inside the engine's logprobs computation is
    measured directly (a wrapper around it), so the share it takes of the run does not
    drown in the machine's noise as a difference of wall times would."""
    import dataclasses

    import prefixcache.engine.engine as engine_module

    base, num_blocks = no_sharing_run(model, args, args.logprobs_output)
    times: dict[object, list[float]] = {k: [] for k in LOGPROB_ARMS}
    inside: dict[object, list[float]] = {k: [] for k in LOGPROB_ARMS}
    tokens: dict[object, list[list[int]]] = {}
    computed = engine_module.token_logprobs
    spent = [0.0]

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return computed(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    engine_module.token_logprobs = timed
    try:
        for rep in range(args.repeats):
            shift = rep % len(LOGPROB_ARMS)
            for k in LOGPROB_ARMS[shift:] + LOGPROB_ARMS[:shift]:
                engine = make_engine(model, "hash", block_size=args.block_size, num_blocks=num_blocks,
                                     budget=args.budget, max_tokens=args.logprobs_output)
                warm_up(engine)
                reqs = [dataclasses.replace(r, logprobs=k) for r in base]
                spent[0] = 0.0
                t0 = time.perf_counter()
                outs = engine.generate(reqs)
                times[k].append(time.perf_counter() - t0)
                inside[k].append(spent[0])
                tokens[k] = [o.token_ids for o in outs]
                assert all((o.logprobs is None) == (k is None) for o in outs)
                del engine, outs
                gc.collect()
            print(f"  logprobs repeat {rep + 1}/{args.repeats}: " +
                  ", ".join(f"{k} {times[k][-1]:.2f} s" for k in LOGPROB_ARMS), file=sys.stderr, flush=True)
    finally:
        engine_module.token_logprobs = computed
    rows = []
    for k in LOGPROB_ARMS:
        shares = [i / w for i, w in zip(inside[k], times[k])]
        rows.append(["none" if k is None else k, round(statistics.median(times[k]), 3),
                     round(statistics.median(inside[k]) * 1000, 1), f"{statistics.median(shares) * 100:.2f}%",
                     f"{min(shares) * 100:.2f}% .. {max(shares) * 100:.2f}%"])
    same = len({tuple(map(tuple, t)) for t in tokens.values()}) == 1
    head = ["logprobs", "wall s (median)", "in logprobs ms (median)", "share of wall (median)", "spread (min .. max)"]
    return (format_table(head, rows) + f"\n\nGreedy outputs identical across arms: {same}",
            {"rows": rows, "times": times, "inside": inside})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="sequential,burst,inbatch,nohit")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--system", type=int, default=2048, help="shared system prompt, TOKENS")
    p.add_argument("--question", type=int, default=64, help="question, TOKENS")
    p.add_argument("--output", type=int, default=16, help="output per request, TOKENS")
    p.add_argument("--inbatch-system", type=int, default=512, help="the inbatch part's system prompt, TOKENS")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--num-blocks", type=int, default=0, help="pool size (0: enough for every request at once)")
    p.add_argument("--nohit-requests", type=int, default=8)
    p.add_argument("--nohit-prompt", type=int, default=256)
    p.add_argument("--nohit-output", type=int, default=16)
    p.add_argument("--logprobs-output", type=int, default=64, help="the logprobs part's output per request, TOKENS")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    per_request = args.system + args.question + args.output
    if not args.num_blocks:
        args.num_blocks = args.requests * -(-per_request // args.block_size) + 16
    parts = args.parts.split(",")

    t0 = time.perf_counter()
    model = load_model("smollm2")
    print(f"# bench_ttft: {datetime.date.today()}, {platform.machine()} {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"# SmolLM2-135M-Instruct Q4_1 -> fp32 (loaded in {time.perf_counter() - t0:.1f} s), context length "
          f"{model.weights.config.max_position} tokens; block_size {args.block_size}, pool {args.num_blocks} blocks, "
          f"step budget {args.budget} tokens")
    out: dict = {"args": vars(args)}
    vocab = model.weights.config.vocab_size
    wl = shared_prefix(1, args.requests, args.system, args.question, args.output, seed=0)
    reqs = requests_of(wl, vocab, args.output)
    if "sequential" in parts:
        text, out["sequential"] = part_sequential(model, args, reqs)
        print(f"\n## Shared {args.system}-token system prompt + {args.question}-token questions, {args.requests} requests, "
              f"{args.output} output tokens each, arriving one at a time\n\n{text}", flush=True)
    if "burst" in parts:
        text, out["burst"] = part_burst(model, args, reqs)
        print(f"\n## The same {args.requests} requests arriving at once\n\n{text}", flush=True)
    if "inbatch" in parts:
        short = requests_of(shared_prefix(1, args.requests, args.inbatch_system, args.question, args.output, seed=0),
                            vocab, args.output)
        text, out["inbatch"] = part_inbatch(model, args, short)
        print(f"\n## A {args.inbatch_system}-token system prompt + {args.question}-token questions, {args.requests} "
              f"requests at once (several prompts fit one {args.budget}-token step)\n\n{text}", flush=True)
    if "nohit" in parts:
        text, out["nohit"] = part_nohit(model, args)
        print(f"\n## No sharing (0% hits): {args.nohit_requests} distinct {args.nohit_prompt}-token prompts, "
              f"{args.nohit_output} output tokens each, all at once; {args.repeats} repeats, arms interleaved\n\n{text}",
              flush=True)
    if "logprobs" in parts:
        text, out["logprobs"] = part_logprobs(model, args)
        print(f"\n## Logprobs: {args.nohit_requests} distinct {args.nohit_prompt}-token prompts, {args.logprobs_output} "
              f"output tokens each, all at once, on hash; {args.repeats} repeats, arms interleaved\n\n{text}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
