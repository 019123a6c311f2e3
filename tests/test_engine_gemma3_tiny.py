"""A Gemma 3 GGUF written here (random weights, 6 layers, a 12-token window, a small
SentencePiece vocabulary): the loader reads the architecture, derives the cache layout
from it, the decoder equals a dense Gemma 3 forward, and cached runs equal uncached ones
past the window. No download: the file is generated in a temporary directory.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F

from prefixcache.config import CacheConfig
from prefixcache.engine import GenerationRequest, load_model
from prefixcache.engine.batch import SeqChunk
from prefixcache.engine.exactness import compare_trace, engines_for, random_trace
from prefixcache.engine.gemma3 import GEMMA3_CHAT_TEMPLATE, Gemma3Model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, WINDOW, THETA = 64, 2, 1, 64, 96, 6, 12, 1000.0
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = {"\u2581": -1.0, "ab": -2.0, "bc": -3.0, "\u2581t": -4.0, "th": -5.0, "he": -6.0, "\u2581the": -7.0}
PIECES.update({chr(c): -20.0 for c in range(ord("a"), ord("z") + 1)})


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    tokens = SPECIAL + [f"<0x{b:02X}>" for b in range(256)] + list(PIECES)
    scores = [0.0] * (len(SPECIAL) + 256) + list(PIECES.values())
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(PIECES)
    return tokens, scores, types


def write_gemma3_gguf(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A `gemma3` GGUF at `path`, linear weights in Q8_0 as llama.cpp would store them;
    returns the tensors written, by GGUF name (fp32, before quantization)."""
    import gguf

    tokens, scores, types = vocabulary()
    g = torch.Generator().manual_seed(seed)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_sliding_window(WINDOW)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    written: dict[str, torch.Tensor] = {}

    def put(name: str, shape: tuple[int, ...], scale: float, around: float = 0.0) -> None:
        t = torch.randn(shape, generator=g) * scale + around
        a = t.numpy().astype(np.float32)
        if a.ndim == 2 and name != "token_embd.weight":
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            t = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy())
        else:
            w.add_tensor(name, a)
        written[name] = t

    put("token_embd.weight", (len(tokens), HIDDEN), 0.5)
    put("output_norm.weight", (HIDDEN,), 0.1, 1.0)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        for name, shape in {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN), "attn_output": (HIDDEN, q),
                            "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}.items():
            put(f"blk.{i}.{name}.weight", shape, 0.15)
        for name, shape in {"attn_norm": (HIDDEN,), "post_attention_norm": (HIDDEN,), "ffn_norm": (HIDDEN,),
                            "post_ffw_norm": (HIDDEN,), "attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)}.items():
            put(f"blk.{i}.{name}.weight", shape, 0.1, 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    return path, write_gemma3_gguf(path)


@pytest.fixture(scope="module")
def loaded(gguf_file):
    return load_model(str(gguf_file[0]))


def dense_logits(t: dict[str, torch.Tensor], ids: list[int], *, window: int | None = WINDOW) -> torch.Tensor:
    """Gemma 3 written out densely (Hugging Face's `Gemma3ForCausalLM`, norms stored with
    the 1 added): every position's logits. `window=None` drops the sliding window."""
    n = len(ids)

    def norm(x, wt):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * wt

    def rope(x, base):  # x: [n, heads, d], halves rotated
        inv = 1.0 / (base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
        ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
        cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]
        half = torch.cat([-x[..., HEAD_DIM // 2 :], x[..., : HEAD_DIM // 2]], -1)
        return x * cos + half * sin

    pos = torch.arange(n)
    causal = pos[None, :] <= pos[:, None]
    x = t["token_embd.weight"][ids] * HIDDEN**0.5
    for i in range(LAYERS):
        p = {k.split(".")[2]: v for k, v in t.items() if k.startswith(f"blk.{i}.")}
        local = (i + 1) % 6 != 0
        h = norm(x, p["attn_norm"])
        q = norm((h @ p["attn_q"].T).view(n, HEADS, HEAD_DIM), p["attn_q_norm"])
        k = norm((h @ p["attn_k"].T).view(n, KV_HEADS, HEAD_DIM), p["attn_k_norm"])
        v = (h @ p["attn_v"].T).view(n, KV_HEADS, HEAD_DIM)
        base = 10_000.0 if local else THETA
        q, k = rope(q, base), rope(k, base)
        mask = causal & (pos[None, :] > pos[:, None] - window) if local and window else causal
        k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           scale=HEAD_DIM**-0.5).transpose(0, 1).reshape(n, -1)
        x = x + norm(o @ p["attn_output"].T, p["post_attention_norm"])
        h = norm(x, p["ffn_norm"])
        m = (F.gelu(h @ p["ffn_gate"].T, approximate="tanh") * (h @ p["ffn_up"].T)) @ p["ffn_down"].T
        x = x + norm(m, p["post_ffw_norm"])
    return norm(x, t["output_norm.weight"]) @ t["token_embd.weight"].T


def test_the_loader_derives_the_layout_and_the_tokenizer_from_the_file(loaded):
    assert [(g.kind, g.window, g.layers) for g in loaded.layout] == [("full_attention", None, 1), ("sliding_window", WINDOW, 5)]
    tok = loaded.tokenizer
    assert tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.stop_token_ids == (5,)  # <end_of_turn> ends a turn
    assert tok.chat_template == GEMMA3_CHAT_TEMPLATE  # the file has none
    ids = tok.encode("<start_of_turn>the abc é")
    assert ids[:2] == [2, 4]  # <bos>, then the control token matched whole
    assert tok.decode(ids) == "the abc é"  # control tokens print nothing
    pieces = [tok._tokens[i] for i in tok.encode("abc bc")[1:]]
    # The best-scoring merge first ("ab" over "bc"); bytes for a character with no piece.
    assert pieces == ["ab", "c", "\u2581", "bc"]
    assert [tok._tokens[i] for i in tok.encode("é")[1:]] == ["<0xC3>", "<0xA9>"]
    assert tok.encode("abc bc", add_special_tokens=False) == tok.encode("abc bc")[1:]  # no <bos>: vLLM's flag


def test_the_decoder_equals_a_dense_gemma3_forward(gguf_file, loaded):
    """Chunks on a shuffled block table, prompt past the window: each chunk's last
    logits equal the dense model's, and differ from a dense model without the window
    (so the window is what the kernel applied)."""
    _, tensors = gguf_file
    model = Gemma3Model(loaded.weights)
    model.allocate_kv(48, 4)
    ids = random.Random(1).choices(range(len(loaded.tokenizer._tokens)), k=41)
    table = torch.randperm(48, generator=torch.Generator().manual_seed(2))[:11].tolist()
    want, unwindowed = dense_logits(tensors, ids), dense_logits(tensors, ids, window=None)
    for a, b in ((0, 13), (13, 30), (30, 31), (31, 41)):
        got = model.forward(model.plan([SeqChunk(ids[a:b], a, table, True)]))[0]
        torch.testing.assert_close(got, want[b - 1], rtol=1e-4, atol=1e-4)
    assert (got - unwindowed[40]).abs().max() > 1e-2


def test_a_step_of_several_chunks_computes_what_each_chunk_alone_does(loaded):
    """Three requests' chunks in one step (own tables, a prompt past the window, the
    local group's blocks before the window dropped, a one-token decode): the logits
    equal, bit for bit, those of the same chunks run one a step."""
    from prefixcache.layout import NULL_BLOCK

    vocab = len(loaded.tokenizer._tokens)
    rng = random.Random(7)
    ids = [rng.choices(range(vocab), k=k) for k in (20, 9, 31)]
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(3)).tolist()
    tables = [blocks[0:5], blocks[5:8], blocks[8:16]]
    # The third request's local layers no longer read blocks 0-2 once its queries start at 28.
    late = (tables[2], [NULL_BLOCK] * 3 + tables[2][3:])
    steps = [
        [SeqChunk(ids[0][:12], 0, tables[0], True), SeqChunk(ids[1][:9], 0, tables[1], True),
         SeqChunk(ids[2][:28], 0, tables[2], False)],
        [SeqChunk(ids[0][12:20], 12, tables[0], True), SeqChunk(ids[2][28:31], 28, tables[2], True, late)],
        [SeqChunk(ids[2][30:31], 30, tables[2], True, late)],
    ]
    batched, alone = Gemma3Model(loaded.weights), Gemma3Model(loaded.weights)
    batched.allocate_kv(64, 4)
    alone.allocate_kv(64, 4)
    for step in steps[:2]:
        got = batched.forward(batched.plan(step))
        want = [alone.forward(alone.plan([ch])) for ch in step]
        assert torch.equal(got, torch.cat(want))
    assert torch.equal(batched.kv[0], alone.kv[0]) and torch.equal(batched.kv[-1], alone.kv[-1])
    # A decode step recomputing the last position reads the same KV on both.
    assert torch.equal(batched.forward(batched.plan(steps[2])), alone.forward(alone.plan(steps[2])))
    with pytest.raises(ValueError, match="chunk 1: group 1 table"):
        batched.plan([steps[0][0], SeqChunk(ids[2][:4], 0, tables[2], True, late)])


def test_cached_runs_equal_uncached_past_the_window_while_the_pool_evicts(loaded):
    cached, uncached = engines_for(loaded, CacheConfig(block_size=4, num_blocks=60), max_num_batched_tokens=32)
    assert cached.config.cache.layout == loaded.layout
    story = random.Random(5).choices(range(6, 280), k=40)
    waves = [[GenerationRequest(prompt=[2] + story, max_tokens=3, keep_first_logits=True, request_id=r, ignore_eos=True)]
             for r in ("a", "b", "c")]
    r = compare_trace(cached, uncached, waves, logits_atol=0.0)
    assert r.difference is None, r.difference
    assert r.hit_tokens >= 2 * 36  # the third sighting hits all but the last block (vLLM's sparse retention)
    hits = evictions = 0
    for seed in (3, 4):
        r = compare_trace(cached, uncached, random_trace(random.Random(seed), loaded.weights.config.vocab_size, max_prompt=60),
                          logits_atol=0.0)
        assert r.difference is None, r.difference
        hits, evictions = hits + r.hit_tokens, evictions + r.evictions
    assert hits > 0 and evictions > 0


def test_the_cli_sizes_it_and_exports_its_tokenizer(gguf_file, tmp_path, capsys):
    from prefixcache.cli import main

    path = str(gguf_file[0])
    (tmp_path / "e.yaml").write_text(f"cache: {{block_size: 16, num_blocks: 64}}\nengine: {{model: {path}}}\n")
    assert main(["validate", str(tmp_path / "e.yaml")]) == 0
    (tmp_path / "small.yaml").write_text(f"cache: {{block_size: 16, num_blocks: 64}}\nengine: {{model: {path}, max_memory_bytes: 4096}}\n")
    assert main(["validate", str(tmp_path / "small.yaml")]) == 2  # sized from the file's gemma3 geometry
    assert "6 layers" in capsys.readouterr().err
    assert main(["tokenizer", path, "--out", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "tok" / "tokenizer.json").is_file() and (tmp_path / "tok" / "tokenizer_config.json").is_file()


# Pieces, characters with no piece (byte fallback), spaces and control tokens, mixed.
TEXT = st.lists(st.sampled_from([*"abcdefghthe  \n", "é", "€", "<start_of_turn>", "<end_of_turn>", "the", " the", "ab"]),
                max_size=30).map("".join)


@pytest.fixture(scope="module")
def exported(gguf_file, tmp_path_factory):
    from tokenizers import Tokenizer as HFTokenizer

    from prefixcache.engine.tokenizer_export import export_tokenizer

    written = export_tokenizer(str(gguf_file[0]), tmp_path_factory.mktemp("tok"))
    return HFTokenizer.from_file(str(written[0]))


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_the_exported_tokenizer_encodes_and_decodes_as_the_engine(loaded, exported, text):
    """The SentencePiece export (a BPE whose merges rank by the merged piece's score) makes
    the engine's ids for any text, and a client decoding with skip_special_tokens gets the
    engine's text."""
    ids = loaded.tokenizer.encode(text)
    assert exported.encode(text).ids == ids
    assert exported.decode(ids, skip_special_tokens=True) == loaded.tokenizer.decode(ids)


def test_it_serves_chats_over_http_with_its_layout_and_template(gguf_file, loaded):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from serve_cases import in_engine, running

    path = str(gguf_file[0])
    with running(loaded, "hash", model=path, block_size=4, num_blocks=96) as replica:
        assert in_engine(replica, lambda e: e.config.cache.layout) == loaded.layout
        c = openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        messages = [{"role": "user", "content": "the abc " * 6}]
        first, second = (c.chat.completions.create(model=path, messages=messages, max_tokens=4) for _ in range(2))
    prompt = loaded.tokenizer.encode("<start_of_turn>user\n" + ("the abc " * 6).strip() + "<end_of_turn>\n<start_of_turn>model\n")
    assert first.usage.prompt_tokens == len(prompt)  # Gemma's turns, the tokenizer's <bos> in front
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.choices[0].message.content == first.choices[0].message.content
    # A completion with add_special_tokens false (vLLM's field) is its prompt without the <bos>.
    with running(loaded, "hash", model=path, block_size=4, num_blocks=96) as replica:
        c = openai.OpenAI(base_url=replica.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
        bare, with_bos = (c.completions.create(model=path, prompt="the abc", max_tokens=1,
                                               extra_body={"add_special_tokens": flag}) for flag in (False, True))
    assert (bare.usage.prompt_tokens, with_bos.usage.prompt_tokens) == (len(loaded.tokenizer.encode("the abc")) - 1,
                                                                         len(loaded.tokenizer.encode("the abc")))
