"""The service model by hand: KV bytes per token and capacity from a model and a device,
a step's roofline (decode slowing with the batch's contexts, prefill's attention term),
a step over an engine's chunks, the speedup ratio, the router's closed-form estimate, the
lower-tier seam, presets and bad values."""

from __future__ import annotations

import pytest

from prefixcache.service_model import DEVICES, GIB, MODELS, DeviceSpec, ModelSpec, ServiceModel
from prefixcache.config import ConfigError

H100 = ServiceModel()


def test_an_8b_model_on_one_h100_by_hand():
    spec = MODELS["llama-3.1-8b"]
    assert spec.kv_bytes_per_token == 2 * 32 * 1024 * 2 == 131_072  # K and V, 32 layers, 8 KV heads x 128, bf16
    assert H100.spec == spec and H100.hardware == DEVICES["h100"]
    free = 81_559 / 1024 * GIB * 0.9 - 8.03e9 * 2 - 3 * GIB
    assert H100.capacity_tokens() == int(free // 131_072)
    assert 430_000 < H100.capacity_tokens() < 450_000  # an 8B model's KV in one H100's memory
    h200 = ServiceModel(device="h200")
    assert h200.capacity_tokens() == int((143_771 / 1024 * GIB * 0.9 - 8.03e9 * 2 - 3 * GIB) // 131_072)
    assert ServiceModel(gpu_memory_utilization=0.5).capacity_tokens() < H100.capacity_tokens()


def test_a_step_is_a_roofline_over_weights_plus_kv_read_and_compute():
    weights = 8.03e9 * 2 / (3.35e12 * 0.8)
    assert H100.weights_s == pytest.approx(weights)
    # one request decoding over 1k tokens of context: memory-bound, the weights' read and its KV
    one = H100.decode_step_s(1, 1000)
    assert one == pytest.approx(5e-4 + weights + 1000 * 131_072 / (3.35e12 * 0.8))
    # the batch's contexts grow the step: 64 requests over 10k tokens each
    batch = H100.decode_step_s(64, 64 * 10_000)
    assert batch == pytest.approx(5e-4 + weights + 640_000 * 131_072 / (3.35e12 * 0.8), rel=1e-9)
    assert batch > 5 * one
    # a full prefill chunk is compute-bound: 8,192 tokens at 2 x 8.03e9 FLOPs, half of 989 TFLOP/s
    chunk = H100.step_s(8192, 8192 * 8193 / 2, 8192)
    assert chunk == pytest.approx(5e-4 + (8192 * 2 * 8.03e9 + 4 * 32 * 4096 * 8192 * 8193 / 2) / (989e12 * 0.5))


def test_attention_adds_about_140_percent_to_an_85k_prompt():
    linear = H100.token_s * 85_000
    attention = H100.pair_s * 85_000 * 85_001 / 2
    assert attention / linear == pytest.approx(1.39, abs=0.01)
    # the estimate: the prompt in 8,192-token steps, attention included
    assert H100.prefill_s(85_000) == pytest.approx(85_000 / 8192 * 5e-4 + linear + attention, rel=1e-9)
    # a cached prefix moves the rest of the prompt to later positions: more attention per token
    assert H100.prefill_s(1000, start=50_000) > H100.prefill_s(1000)
    # decodes sharing the steps leave fewer tokens a step for the prompt
    assert H100.prefill_s(8192, decode_requests=4096) > H100.prefill_s(8192)
    assert H100.prefill_s(0) == 0.0


def test_lower_tier_loads_cost_their_bytes_over_the_host_link():
    assert H100.load_s(0) == 0.0
    assert H100.load_s(1000) == pytest.approx(1000 * 131_072 / 64e9)
    assert H100.step_s(1, 1000, 1000, loaded_tokens=1000) == pytest.approx(H100.decode_step_s(1, 1000) + H100.load_s(1000))


def test_a_step_over_chunks_counts_each_chunks_tokens_pairs_and_kv():
    # a 100-token chunk from position 400 and two decodes at contexts 50 and 70
    chunks = [(400, 100), (50, 1), (70, 1)]
    tokens, pairs, kv = 102, 100 * 400 + 100 * 101 // 2 + 51 + 71, 500 + 51 + 71
    assert H100.chunks_s(chunks) == H100.step_s(tokens, pairs, kv)
    assert H100.chunks_s([]) == H100.step_s(0, 0, 0) == pytest.approx(5e-4 + H100.weights_s)
    # a cached prefix is work not done: the same prompt's tail alone is a shorter step
    assert H100.chunks_s([(1024, 64)]) < H100.chunks_s([(0, 1088)])


def test_the_speedup_ratio_divides_every_time_and_leaves_ratios_alone():
    slow = ServiceModel(speedup_ratio=0.05)
    for a, b in ((slow.chunks_s([(400, 100), (50, 1)]), H100.chunks_s([(400, 100), (50, 1)])),
                 (slow.prefill_s(5000, start=1000, decode_requests=8), H100.prefill_s(5000, start=1000, decode_requests=8)),
                 (slow.decode_step_s(16, 16_000), H100.decode_step_s(16, 16_000)), (slow.load_s(512), H100.load_s(512)),
                 (slow.overhead_s, H100.step_overhead_s)):
        assert a == pytest.approx(b / 0.05, rel=1e-12)
    assert slow.capacity_tokens() == H100.capacity_tokens()  # memory is not time
    for bad in (0, -1, float("inf")):
        with pytest.raises(ConfigError) as err:
            ServiceModel(speedup_ratio=bad)
        assert err.value.path == "speedup_ratio"


def test_presets_and_bad_values():
    assert ServiceModel(model=ModelSpec(), device=DeviceSpec()) == H100
    with pytest.raises(ConfigError, match="unknown device 'b200'; known: h100, h200"):
        ServiceModel(device="b200")
    with pytest.raises(ConfigError, match="unknown model"):
        ServiceModel(model="llama-70b")
    for bad, key in (({"mfu": 0.0}, "mfu"), ({"max_num_seqs": 0}, "max_num_seqs"), ({"reserved_gib": -1}, "reserved_gib"),
                     ({"step_overhead_s": float("inf")}, "step_overhead_s")):
        with pytest.raises(ConfigError) as err:
            ServiceModel(**bad)
        assert err.value.path == key
    with pytest.raises(ConfigError) as err:
        ModelSpec(layers=0)
    assert err.value.path == "layers"
    with pytest.raises(ConfigError, match="no room for KV"):
        ServiceModel(device=DeviceSpec(memory_gib=16)).capacity_tokens()
