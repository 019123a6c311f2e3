"""Time to first token when a 2,048-token prefix comes from the host tier or the disk tier,
against a device hit and no cache, on the real SmolLM2-135M (CPU, fp32), outputs compared.

One request: a 2,048-token prefix + a 64-token question, 8 tokens out, greedy. Arms:
  uncached  engine.prefix_caching false (same pool, no hits)
  device    the prefix was computed by an earlier request and is still in the device pool
  host      it was pushed out of the device pool (by a 2,112-token filler request that
            needs the whole pool) into a host tier (`medium: CPU`), and is loaded back
  disk      the same with a disk tier (`medium: DISK`) instead: read from the file,
            checksum verified, loaded
  restart   a new engine on the disk tier's file (the index rebuilt from it): the first
            request after the restart
The question differs from the warming request's, so every arm computes it (64 tokens +
the last prefix token's block). Each arm is a fresh engine on the shared loaded model;
arms run in turn, `--repeats` times; TTFT is the median. Every arm's output tokens must
equal the uncached ones (greedy); the benchmark fails otherwise.

    python benchmarks/bench_tier_ttft.py [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from prefixcache.config import CacheConfig  # noqa: E402
from prefixcache.engine import Engine, EngineConfig, GenerationRequest, ServingConfig, load_model  # noqa: E402
from prefixcache.tier_config import TierConfig  # noqa: E402

BS = 16
PREFIX, QUESTION, OUT = 2048, 64, 8
DEVICE_BLOCKS = 140  # one 2,112 + 8-token request (133 blocks) and a little: a filler evicts the prefix


def load() -> str:
    return "load " + " ".join(open("/proc/loadavg").read().split()[:3])


def engine(model, *tiers: TierConfig, caching: bool = True) -> Engine:
    cache = CacheConfig(block_size=BS, num_blocks=DEVICE_BLOCKS, tiers=tiers)
    return Engine(ServingConfig(cache, EngineConfig(model="smollm2", prefix_caching=caching, max_num_batched_tokens=4096)),
                  model=model)  # fmt: skip


def ask(e: Engine, prompt: list[int]):
    out = e.generate([GenerationRequest(prompt=prompt, max_tokens=OUT, ignore_eos=True)])[0]
    m = out.metrics
    return out.token_ids, m.first_token_s - m.arrival_s, m.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# tier TTFT benchmark, {time.strftime('%Y-%m-%d %H:%M')}: {cpu_model()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}, {args.threads} threads, {load()}")
    print(f"# command: python {shlex.join(sys.argv)}")
    model = load_model("smollm2", seed=0)
    vocab = model.weights.config.vocab_size
    prefix = [(i * 7919 + 13) % (vocab - 1000) + 500 for i in range(PREFIX)]
    warm = prefix + [(i * 31 + 7) % 4000 + 600 for i in range(QUESTION)]
    asked = prefix + [(i * 17 + 3) % 4000 + 900 for i in range(QUESTION)]
    filler = [(i * 104729 + 1) % (vocab - 1000) + 700 for i in range(PREFIX + QUESTION)]
    ttft: dict[str, list[float]] = {a: [] for a in ("uncached", "device", "host", "disk", "restart")}
    cached: dict[str, int] = {}
    want = None
    with tempfile.TemporaryDirectory() as folder:
        for r in range(args.repeats):
            path = str(Path(folder) / f"kv{r}.tier")
            e = engine(model, caching=False)
            want, t, cached["uncached"] = ask(e, asked)
            ttft["uncached"].append(t)
            e = engine(model)
            ask(e, warm)
            got, t, cached["device"] = ask(e, asked)
            ttft["device"].append(t)
            assert got == want, "device hit changed the output"
            for arm, tier in (("host", TierConfig("CPU", 256)), ("disk", TierConfig("DISK", 256, path=path))):
                e = engine(model, tier)
                ask(e, warm)
                ask(e, filler)  # needs the whole pool: the prefix goes down
                got, t, cached[arm] = ask(e, asked)
                ttft[arm].append(t)
                assert got == want, f"{arm} hit changed the output"
                e.close()
            # The disk arm's file holds the prefix's records (a load leaves them in place).
            e = engine(model, TierConfig("DISK", 256, path=path))
            restored = e.kv_tiers.restored
            got, t, cached["restart"] = ask(e, asked)
            ttft["restart"].append(t)
            assert got == want, "a hit after the restart changed the output"
            e.close()
            print(f"  repeat {r}: " + ", ".join(f"{a} {v[-1] * 1000:.0f} ms" for a, v in ttft.items())
                  + f" (restored {restored} blocks; {load()})", flush=True)
    base = statistics.median(ttft["uncached"])
    print(f"\n{'arm':<10} {'TTFT p50 ms':>12} {'vs uncached':>12} {'cached tokens':>14}")
    for arm, values in ttft.items():
        med = statistics.median(values)
        print(f"{arm:<10} {med * 1000:>12.0f} {med / base:>11.2f}x {cached[arm]:>14,}")
    print(f"outputs identical in every arm and repeat ({OUT} greedy tokens); {load()}")


if __name__ == "__main__":
    main()
