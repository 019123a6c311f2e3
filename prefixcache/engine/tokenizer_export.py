"""An engine model's tokenizer as Hugging Face files, for clients that tokenize.

Owns `export_tokenizer`: `tokenizer.json` (the `tokenizers` library's format) and
`tokenizer_config.json` (what `transformers.AutoTokenizer` reads: the class, special
tokens, chat template, context length) for "tiny", "smollm2" or a .gguf path, so that
benchmark clients (aiperf, guidellm, vLLM's and SGLang's `bench serve`) count and make
tokens exactly as the engine does: `prefixcache tokenizer MODEL --out DIR`.

- A GGUF model's tokenizer is already a `tokenizers` byte-level BPE
  (`GGUFTokenizer.to_json`): written as it is.
- A SentencePiece GGUF (llama.cpp's "llama" tokenizer: Gemma) becomes what transformers'
  own conversion makes of a SentencePiece BPE model: a BPE over the same pieces whose merges
  are every split of a piece into two pieces, ranked by the merged piece's score (the
  highest-scoring merge first, as `SPMTokenizer` merges), `<0xXX>` byte fallback, spaces
  as "▁" (and one prepended where the file says `add_space_prefix`), control and
  user-defined tokens matched whole. Control tokens print nothing in the engine's
  decode: a client decodes with `skip_special_tokens=True` for the same text.
- The tiny model's `ByteTokenizer` (UTF-8 bytes as ids 0..255, then ChatML's three
  special tokens) is written as a byte-level BPE with no merges: each byte its own
  token through GPT-2's byte-to-character table, the special tokens matched whole. Its
  ids 259..319 (the model's vocabulary is padded past the tokenizer's, which the tiny
  model never emits, `loader.TINY_OUTPUT_IDS`) are left out, as real models pad their
  embeddings past their tokenizers.

Must never: download anything, or write a file that does not load (each is written to
a temporary name, read back with `tokenizers`, then renamed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from prefixcache.engine.loader import load_model_config, load_tokenizer
from prefixcache.engine.tokenizer import BYTE_CHARS, ByteTokenizer, GGUFTokenizer, SPMTokenizer, Tokenizer

__all__ = ["export_tokenizer", "tokenizer_json", "tokenizer_config", "FILES"]

FILES = ("tokenizer.json", "tokenizer_config.json")


def _byte_tokenizer_json(tokenizer: ByteTokenizer) -> str:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    table = pre_tokenizers.ByteLevel.alphabet()  # the 256 characters GPT-2 maps bytes to
    byte_char = BYTE_CHARS
    assert sorted(table) == sorted(byte_char.values())
    vocab = {byte_char[b]: b for b in range(256)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ByteTokenizer.SPECIAL])
    return hf.to_str()


def _spm_tokenizer_json(tokenizer: SPMTokenizer) -> str:
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    pieces, scores, types = tokenizer._tokens, tokenizer._scores, tokenizer._types
    vocab = {p: i for i, p in enumerate(pieces)}
    mergeable = {i for i, t in enumerate(types) if t == 1}  # normal pieces; control, user and byte tokens never merge
    merges = []
    for i in mergeable:
        piece = pieces[i]
        for cut in range(1, len(piece)):
            left, right = vocab.get(piece[:cut]), vocab.get(piece[cut:])
            if left in mergeable and right in mergeable:
                merges.append((-scores[i], i, left, right))
    merges.sort()
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[(pieces[a], pieces[b]) for _, _, a, b in merges],
                                byte_fallback=True, fuse_unk=False))  # fmt: skip
    steps = [normalizers.Replace(" ", "\u2581")]
    if tokenizer.add_space_prefix:
        steps.insert(0, normalizers.Prepend(" "))
    hf.normalizer = normalizers.Sequence(steps)
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens([AddedToken(p, special=True, normalized=False) for p, t in zip(pieces, types) if t == 3 and p])
    hf.add_tokens([AddedToken(p, special=False, normalized=False) for p, t in zip(pieces, types) if t == 4 and p])
    if tokenizer.add_bos and tokenizer.bos_token_id is not None:
        bos = pieces[int(tokenizer.bos_token_id)]
        hf.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                          special_tokens=[(bos, int(tokenizer.bos_token_id))])  # fmt: skip
    return hf.to_str()


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """`tokenizer.json` of an engine tokenizer (module docstring)."""
    if isinstance(tokenizer, GGUFTokenizer):
        return tokenizer.to_json()
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_tokenizer_json(tokenizer)
    if isinstance(tokenizer, SPMTokenizer):
        return _spm_tokenizer_json(tokenizer)
    raise ValueError(f"no tokenizer.json export for a {type(tokenizer).__name__} (GGUF files and the tiny models have one)")


def tokenizer_config(tokenizer: Tokenizer, hf: Any, model_max_length: int) -> dict[str, Any]:
    """`tokenizer_config.json`: `transformers.PreTrainedTokenizerFast` over `tokenizer.json`,
    its special tokens by name, the chat template, the context (TOKENS). No clean-up of
    spaces on decode: the text must be the engine's."""
    bos_id = getattr(tokenizer, "bos_token_id", None)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": hf.id_to_token(tokenizer.eos_token_id),
        "pad_token": hf.id_to_token(tokenizer.eos_token_id),
        "bos_token": hf.id_to_token(int(bos_id)) if bos_id is not None else None,
        "add_bos_token": bool(getattr(tokenizer, "add_bos", False)),
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": tokenizer.chat_template,
    }
    return config


def export_tokenizer(model: str, out: str | Path, *, chat_template: str | None = None) -> list[Path]:
    """Write `FILES` for engine model `model` ("tiny", "smollm2" or a .gguf path) into
    folder `out` (created); the paths written. `ValueError` / `FileNotFoundError` (one
    line) for a model that does not load."""
    tokenizer = load_tokenizer(model, chat_template=chat_template)
    context = load_model_config(model).max_position
    from tokenizers import Tokenizer as HFTokenizer

    text = tokenizer_json(tokenizer)
    hf = HFTokenizer.from_str(text)  # it must load before anything is written
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.dumps(tokenizer_config(tokenizer, hf, context), indent=2, ensure_ascii=False) + "\n"
    written = []
    for name, content in zip(FILES, (text, config)):
        path = folder / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(content, encoding="utf-8")
        os.replace(tmp, path)
        written.append(path)
    HFTokenizer.from_file(str(written[0]))
    return written
