"""Tokenizers: byte-level BPE built from a GGUF file's metadata, and a byte tokenizer for
the tiny test model; both render chat messages with a Jinja chat template.

Owns text <-> token ids and chat templating. `GGUFTokenizer` builds a Hugging Face
`tokenizers` byte-level BPE from `tokenizer.ggml.tokens` / `merges`, with llama.cpp's
pre-tokenizer for the file's `tokenizer.ggml.pre` ("smollm": every digit on its own,
then GPT-2's split, as SmolLM2's tokenizer.json does); control tokens (`token_type` 3,
e.g. `<|im_start|>`) are special: matched whole in the text, never split.

The chat template is the file's `tokenizer.chat_template` when it has one, else
`SMOLLM2_CHAT_TEMPLATE` (ChatML with SmolLM2's default system prompt, as in its
tokenizer_config.json). Templates run in Jinja's immutable sandbox, as Hugging Face's
`apply_chat_template` does.

Must never: download a tokenizer, or let a template reach Python objects (sandbox).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

__all__ = ["Tokenizer", "GGUFTokenizer", "ByteTokenizer", "SMOLLM2_CHAT_TEMPLATE", "render_chat"]

SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# llama.cpp's pre-tokenizer split for `tokenizer.ggml.pre` values whose BPE is GPT-2's
# byte-level one. Each entry: individual digits first or not.
_GPT2_PRE = {"smollm": True, "gpt-2": False, "gpt2": False, "default": False}

Message = Mapping[str, str]


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template)


def render_chat(template: str, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
    """`messages` ([{"role": ..., "content": ...}, ...]) through a Jinja chat template."""
    if not messages:
        raise ValueError("messages: a chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] must be a mapping with string 'role' and 'content', got {m!r}")
    return _compile(template).render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt)


class Tokenizer(ABC):
    """Text <-> token ids. `eos_token_id` ends generation; `chat_template` renders chats."""

    eos_token_id: int
    chat_template: str
    vocab_size: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids `ids`."""

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of `messages` rendered with the chat template."""
        return self.encode(render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt))


class GGUFTokenizer(Tokenizer):
    """Byte-level BPE from a GGUF file's `tokenizer.ggml.*` metadata (a `gguf.GGUFReader`)."""

    def __init__(self, reader: Any, chat_template: str | None = None) -> None:
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"only byte-level BPE ('gpt2') GGUF tokenizers are supported, got {kind!r}")
        pre = field("tokenizer.ggml.pre", "default")
        if pre not in _GPT2_PRE:
            raise ValueError(f"tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(_GPT2_PRE)}")
        tokens: list[str] = field("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
        types = field("tokenizer.ggml.token_type", [1] * len(tokens))
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        tok = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _GPT2_PRE[pre]:
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        # Control (3) and user-defined (4) tokens are matched whole, as llama.cpp does.
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        tok.add_special_tokens(special)
        self._tok = tok
        self.vocab_size = len(tokens)
        self.eos_token_id = int(field("tokenizer.ggml.eos_token_id", 0))
        self.bos_token_id = field("tokenizer.ggml.bos_token_id")
        self.add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
        self.chat_template = chat_template or field("tokenizer.chat_template") or SMOLLM2_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [int(self.bos_token_id), *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def token(self, token_id: int) -> str:
        """The vocabulary entry of one id (byte-level form, e.g. 'ĠParis')."""
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The Hugging Face `tokenizer.json` of this tokenizer (`tokenizer_export`)."""
        return self._tok.to_str()


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, plus ChatML's three special tokens (256..258).

    For the tiny random model: every string round-trips, so the CLI and chat paths run
    on it without a real vocabulary."""

    SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

    def __init__(self, vocab_size: int, chat_template: str | None = None) -> None:
        if vocab_size < 256 + len(self.SPECIAL):
            raise ValueError(f"vocab_size must be >= {256 + len(self.SPECIAL)} for ByteTokenizer, got {vocab_size}")
        self.vocab_size = vocab_size
        self._special = {s: 256 + i for i, s in enumerate(self.SPECIAL)}
        self.eos_token_id = self._special["<|im_end|>"]
        self.chat_template = chat_template or SMOLLM2_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            for s, sid in self._special.items():
                if text.startswith(s, i):
                    out.append(sid)
                    i += len(s)
                    break
            else:
                j = min((k for k in (text.find(s, i) for s in self._special) if k >= 0), default=len(text))
                out += text[i:j].encode("utf-8")
                i = j
        return out

    def decode(self, ids: Sequence[int]) -> str:
        out, buf = [], bytearray()
        for t in ids:
            if t < 256:
                buf.append(t)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            out.append(self.SPECIAL[t - 256] if t - 256 < len(self.SPECIAL) else f"<|{t}|>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)
