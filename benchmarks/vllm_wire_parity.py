"""KV events on the wire: ours against vLLM 0.33's own encoder and ZeroMQ publisher.

Replays one deterministic workload (shared system prompts, a cache salt on some
requests, a LoRA adapter with an int id on others, a pool small enough to evict, a reset
at the end) through vLLM 0.33's `KVCacheManager` with
events on, and through our `hash` backend, taking each side's events after every
request as one engine step would. Then, for every step:

1. byte parity: vLLM's batch encoded by vLLM's own msgspec encoder
   (`KVEventBatch(ts, events, data_parallel_rank=0)`, what its publisher sends) equals
   our batch encoded by `prefixcache.event_wire.encode_batch`, byte for byte;
2. stream parity: vLLM's real `ZmqEventPublisher` (PUB + ROUTER replay on loopback)
   publishes its batches, and our `EventSubscriber`, joining late with `start_seq=0`,
   receives all of them in order, the missed head through vLLM's replay socket, and
   decodes each into events equal to our backend's (hashes in vLLM's int form).

    python benchmarks/vllm_wire_parity.py --vllm-dir ~/.cache/prefixcache/vllm-0.33.0

Needs pyzmq and msgspec (`pip install -e '.[events]'`). See vllm_v1_core.py for how
vLLM's modules are imported (the wheel is downloaded once, ~336 MB, nothing committed).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_v1_core  # noqa: E402

BLOCK_SIZE = 16


LORA = ("adapter-1", "/adapters/1", 3)  # name, path, int id


class LoRARequest:
    """The fields of vLLM's `LoRARequest` its block hasher and block pool read."""

    def __init__(self, name: str, path: str, adapter_id: int) -> None:
        self.lora_name = self.name = name
        self.lora_path = self.path = path
        self.adapter_id = self.lora_int_id = adapter_id


def workload(seed: int = 0, n: int = 120) -> list[tuple[list[int], list[int], str | None, bool]]:
    """(prompt, output, cache salt, LoRA?) tuples: 3 system prompts, unique questions,
    some salted, some through an adapter."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32_000) for _ in range(160)] for _ in range(3)]
    out = []
    for _ in range(n):
        prompt = rng.choice(systems) + [rng.randrange(32_000) for _ in range(rng.randint(8, 80))]
        output = [rng.randrange(32_000) for _ in range(rng.randint(4, 40))]
        out.append((prompt, output, "tenant-a" if rng.random() < 0.25 else None, rng.random() < 0.2))
    return out


def vllm_steps(core, reqs, num_blocks: int, concurrency: int) -> list[list]:
    """vLLM's events, one list per request (admission, decode, the releases it caused)."""
    mgr = core.make_manager(num_blocks + 1, enable_events=True)
    live: deque = deque()
    steps = []
    for i, (prompt, output, salt, lora) in enumerate(reqs):
        request = core.Request(str(i), prompt, core.block_hasher, cache_salt=salt)
        if lora:  # hash again, now through the adapter
            request.lora_request = LoRARequest(*LORA)
            request.block_hashes.clear()
            request.update_block_hashes()
        while True:
            blocks, num_hit, _ = mgr.get_computed_blocks(request)
            if mgr.allocate_slots(request, len(prompt) - num_hit, num_hit, blocks) is not None or not live:
                break
            mgr.free(live.popleft())
        request.num_computed_tokens = len(prompt)
        for token in output[:-1]:
            request.append_output_token_ids([token])
            while mgr.allocate_slots(request, 1) is None:
                mgr.free(live.popleft())
            request.num_computed_tokens += 1
        live.append(request)
        if len(live) > concurrency:
            mgr.free(live.popleft())
        steps.append(mgr.take_events())
    while live:
        mgr.free(live.popleft())
    assert mgr.reset_prefix_cache()
    steps.append(mgr.take_events())
    return steps


def our_steps(reqs, num_blocks: int, concurrency: int) -> list[list]:
    """The same calls through our hash backend: one event list per request."""
    import prefixcache
    from prefixcache.config import CacheConfig
    from prefixcache.isolation import Isolation, LoRA

    cache = prefixcache.build_cache(CacheConfig(backend="hash", block_size=BLOCK_SIZE, num_blocks=num_blocks))
    live: deque = deque()
    steps = []
    for i, (prompt, output, salt, lora) in enumerate(reqs):
        namespace = Isolation(salt, LoRA(*LORA)) if lora else salt
        while cache.admit(i, prompt, namespace=namespace) is None:
            cache.release(live.popleft())
        cache.commit(i, len(prompt))
        for n, token in enumerate(output[:-1], len(prompt) + 1):
            while cache.append(i, [token]) is None:
                cache.release(live.popleft())
            cache.commit(i, n)
        live.append(i)
        if len(live) > concurrency:
            cache.release(live.popleft())
        steps.append(cache.drain_events())
    while live:
        cache.release(live.popleft())
    assert cache.reset()
    steps.append(cache.drain_events())
    cache.check_invariants()
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-dir", type=Path, required=True, help="cache directory for the vLLM 0.33.0 wheel")
    parser.add_argument("--num-blocks", type=int, default=96, help="our pool (vLLM's has one more: its null block)")
    parser.add_argument("--concurrency", type=int, default=3)
    args = parser.parse_args()

    core = vllm_v1_core.load(args.vllm_dir, BLOCK_SIZE, real_events=True)
    import msgspec
    import zmq
    from vllm.distributed import kv_events as vk

    from prefixcache.event_subscriber import EventSubscriber
    from prefixcache.event_wire import decode_batch, encode_batch, external_block_hash

    reqs = workload()
    theirs = vllm_steps(core, reqs, args.num_blocks, args.concurrency)
    ours = our_steps(reqs, args.num_blocks, args.concurrency)
    assert len(theirs) == len(ours)
    kinds = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0, "BlockStored with lora_id": 0}

    # 1. byte parity of every non-empty step
    encoder = msgspec.msgpack.Encoder()
    batches = []
    for step, (v, o) in enumerate(zip(theirs, ours)):
        if len(v) != len(o):
            print(f"step {step}: vLLM has {len(v)} events, ours {len(o)}")
            return 1
        if not v:
            continue
        ts = 1_700_000_000.0 + step
        vllm_bytes = encoder.encode(vk.KVEventBatch(ts=ts, events=v, data_parallel_rank=0))
        our_bytes = encode_batch(o, ts=ts, data_parallel_rank=0)
        if vllm_bytes != our_bytes:
            print(f"step {step}: payloads differ\n  vLLM: {msgspec.msgpack.decode(vllm_bytes)}\n  ours: "
                  f"{msgspec.msgpack.decode(our_bytes)}")
            return 1
        batches.append((step, v, o))
        for e in o:
            kinds[type(e).__name__] += 1
            kinds["BlockStored with lora_id"] += getattr(e, "lora_id", None) == LORA[2]
    print(f"byte parity: {len(batches)} batches, {kinds} identical to vLLM's encoder")

    # 2. vLLM's publisher -> our subscriber; the subscriber joins after the first half
    publisher = vk.ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                     buffer_steps=len(batches) + 1)
    pub_endpoint = publisher._pub.getsockopt_string(zmq.LAST_ENDPOINT)
    replay_endpoint = publisher._replay.getsockopt_string(zmq.LAST_ENDPOINT)
    half = len(batches) // 2
    for _, v, _ in batches[:half]:
        publisher.publish(vk.KVEventBatch(ts=time.time(), events=v))
    deadline = time.monotonic() + 10
    while publisher._event_queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.01)  # vLLM's publisher thread has no flush(): wait for its queue to empty
    received = []
    with EventSubscriber(pub_endpoint, replay_endpoint=replay_endpoint, start_seq=0) as sub:
        time.sleep(0.3)  # ZeroMQ's slow joiner: let the subscription reach the PUB socket
        for _, v, _ in batches[half:]:
            publisher.publish(vk.KVEventBatch(ts=time.time(), events=v))
        while len(received) < len(batches) and time.monotonic() < deadline:
            received += sub.poll(0.5)
        gaps = list(sub.gaps)
    publisher.shutdown()
    if [b.seq for b in received] != list(range(len(batches))):
        print(f"stream parity: got sequence numbers {[b.seq for b in received]}, wanted 0..{len(batches) - 1}")
        return 1
    replayed = sum(b.replayed for b in received)
    for b, (step, _, o) in zip(received, batches):
        want = decode_batch(encode_batch(o, ts=b.batch.ts, data_parallel_rank=0)).events
        if b.batch.events != want:
            print(f"stream parity: step {step} decoded differently\n  got:  {b.batch.events}\n  want: {want}")
            return 1
    sample = next(e for _, _, o in batches for e in o if type(e).__name__ == "BlockStored")
    print(f"stream parity: {len(received)} batches from vLLM's ZmqEventPublisher decoded equal to ours, "
          f"{replayed} of them through its replay socket (gaps {[(g.first, g.last, g.recovered) for g in gaps]}); "
          f"e.g. hash {sample.block_hashes[0].hex()[:16]}... -> {external_block_hash(sample.block_hashes[0])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
