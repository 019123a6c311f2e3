"""Tokenizers: byte-level BPE built from a GGUF file's metadata, and a byte tokenizer for
the tiny test model; both render chat messages with a Jinja chat template.

Owns text <-> token ids and chat templating. `SPMTokenizer` is llama.cpp's SentencePiece
tokenizer of a GGUF whose `tokenizer.ggml.model` is "llama" (Gemma's): spaces as U+2581,
the adjacent pair whose merge is a vocabulary piece with the highest score merged first
(leftmost on a tie), bytes with no piece as `<0xXX>` tokens; control and user-defined
tokens matched whole. `GGUFTokenizer` builds a Hugging Face
`tokenizers` byte-level BPE from `tokenizer.ggml.tokens` / `merges`, with llama.cpp's
pre-tokenizer for the file's `tokenizer.ggml.pre` ("smollm": every digit on its own,
then GPT-2's split, as SmolLM2's tokenizer.json does); control tokens (`token_type` 3,
e.g. `<|im_start|>`) are special: matched whole in the text, never split.

The chat template is the file's `tokenizer.chat_template` when it has one, else
`SMOLLM2_CHAT_TEMPLATE` (ChatML with SmolLM2's default system prompt, as in its
tokenizer_config.json). Templates run in Jinja's immutable sandbox, as Hugging Face's
`apply_chat_template` does, bounded in time and output (`chat_template`).

`max_chars_per_token` is the longest text one token can stand for (vLLM's
`tokenizer.max_chars_per_token`): a text of more than `n * max_chars_per_token`
characters has more than n tokens, which a server checks before tokenizing it.
Encoding and decoding are linear in the text and the ids.

Must never: download a tokenizer, or let a template reach Python objects (sandbox).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

from prefixcache.engine.chat_template import DEFAULT_MAX_CHARS, DEFAULT_TIMEOUT_S, render_chat

__all__ = ["Tokenizer", "GGUFTokenizer", "SPMTokenizer", "ByteTokenizer", "SMOLLM2_CHAT_TEMPLATE", "render_chat"]

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


class Tokenizer(ABC):
    """Text <-> token ids. `eos_token_id` ends generation, and so do `stop_token_ids`
    (a chat's end-of-turn token where it is not the eos); `chat_template` renders chats;
    `max_chars_per_token`: the most characters of text one token stands for."""

    eos_token_id: int
    stop_token_ids: tuple[int, ...] = ()
    #: The ids `skip_special_tokens` leaves out of a text (Hugging Face's special added
    #: tokens: a GGUF's control and user-defined tokens, the byte tokenizer's ChatML ones).
    special_ids: frozenset[int] = frozenset()
    chat_template: str
    vocab_size: int
    max_chars_per_token: int

    @abstractmethod
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` False: without the BOS a tokenizer
        puts first (Hugging Face's flag)."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of token ids `ids` (with `skip_special_tokens`, less `special_ids`'):
        their bytes (`token_bytes`) decoded as UTF-8, invalid bytes replaced by U+FFFD."""
        skip = self.special_ids if skip_special_tokens else ()
        return b"".join(self.token_bytes(t) for t in ids if t not in skip).decode("utf-8", errors="replace")

    @abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for: `decode(ids)` is the concatenation of
        its ids' bytes decoded as UTF-8 (invalid bytes replaced by U+FFFD), so text can
        be decoded incrementally, in time linear in the ids (`serve.responses`)."""

    @abstractmethod
    def token(self, token_id: int) -> str:
        """The vocabulary entry of one id as the tokenizer's `tokenizer.json`
        (`tokenizer_export`) names it: what `convert_ids_to_tokens` gives a client."""

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S, max_chars: int = DEFAULT_MAX_CHARS,
        variables: Mapping[str, Any] | None = None, continue_final_message: bool = False,
        template: str | None = None,
    ) -> list[int]:
        """Token ids of `messages` rendered with the chat template (`template`: another, a
        request's own; and `variables`, `continue_final_message`: `render_chat`), within
        `timeout_s` SECONDS and `max_chars` characters (`chat_template.ChatTemplateError`
        otherwise)."""
        template = self.chat_template if template is None else template
        return self.encode(render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                                       timeout_s=timeout_s, max_chars=max_chars, variables=variables,
                                       continue_final_message=continue_final_message))  # fmt: skip


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
        self.special_ids = frozenset(i for i, ty in enumerate(types) if ty in (3, 4))
        tok.add_special_tokens(special)
        self._tok = tok
        self.vocab_size = len(tokens)
        # Byte-level entries spell one byte per character, and a text has no more
        # characters than bytes: this bounds the text of any one token (vLLM's rule).
        self.max_chars_per_token = max(len(t) for t in tokens)
        self.eos_token_id = int(field("tokenizer.ggml.eos_token_id", 0))
        self.bos_token_id = field("tokenizer.ggml.bos_token_id")
        self.add_bos = bool(field("tokenizer.ggml.add_bos_token", False))
        self.chat_template = chat_template or field("tokenizer.chat_template") or SMOLLM2_CHAT_TEMPLATE
        alphabet = _byte_level_alphabet()
        # A byte-level entry spells its bytes one character each; an entry with other
        # characters (an added token) stands for its own UTF-8, as the ByteLevel decoder
        # renders it.
        self._bytes = [bytes(alphabet[c] for c in t) if all(c in alphabet for c in t) else t.encode("utf-8")
                       for t in tokens]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [int(self.bos_token_id), *ids]
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def token(self, token_id: int) -> str:
        """The vocabulary entry of one id (byte-level form, e.g. 'ĠParis')."""
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """The Hugging Face `tokenizer.json` of this tokenizer (`tokenizer_export`)."""
        return self._tok.to_str()


class SPMTokenizer(Tokenizer):
    """SentencePiece (llama.cpp's "llama" GGUF tokenizer) from `tokenizer.ggml.*` (module
    docstring). Encoding is O(n log n) in the text's characters."""

    def __init__(self, reader: Any, chat_template: str | None = None) -> None:
        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "llama":
            raise ValueError(f"SPMTokenizer reads 'llama' GGUF tokenizers, got {kind!r}")
        tokens: list[str] = field("tokenizer.ggml.tokens")
        self._tokens = tokens
        self._scores: list[float] = field("tokenizer.ggml.scores", [0.0] * len(tokens))
        types = field("tokenizer.ggml.token_type", [1] * len(tokens))
        self._types: list[int] = [int(t) for t in types]  # llama.cpp's: 1 normal, 3 control, 4 user-defined, 6 byte
        self._ids = {t: i for i, t in enumerate(tokens)}
        self._byte_ids = {int(t[3:5], 16): i for i, t in enumerate(tokens) if types[i] == 6 and len(t) == 6}
        special = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4) and t), key=len, reverse=True)
        self.special_ids = frozenset(i for i, ty in enumerate(types) if ty in (3, 4))
        self._split = re.compile("(" + "|".join(re.escape(t) for t in special) + ")") if special else None
        self._bytes = [self._piece_bytes(t, ty) for t, ty in zip(tokens, types)]
        self.vocab_size = len(tokens)
        self.max_chars_per_token = max(len(t) for t in tokens)
        self.eos_token_id = int(field("tokenizer.ggml.eos_token_id", 1))
        eot = field("tokenizer.ggml.eot_token_id", self._ids.get("<end_of_turn>"))  # llama.cpp's end of turn
        self.stop_token_ids = () if eot is None or int(eot) == self.eos_token_id else (int(eot),)
        self.bos_token_id = field("tokenizer.ggml.bos_token_id")
        self.add_bos = bool(field("tokenizer.ggml.add_bos_token", True))
        self.add_space_prefix = bool(field("tokenizer.ggml.add_space_prefix", False))
        self.chat_template = chat_template or field("tokenizer.chat_template") or SMOLLM2_CHAT_TEMPLATE

    @staticmethod
    def _piece_bytes(piece: str, kind: int) -> bytes:
        if kind == 6 and len(piece) == 6 and piece.startswith("<0x"):
            return bytes([int(piece[3:5], 16)])
        if kind == 3:  # control tokens print nothing
            return b""
        return piece.replace("\u2581", " ").encode("utf-8")

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            out.append(int(self.bos_token_id))
        parts = self._split.split(text) if self._split else [text]
        for i, part in enumerate(parts):
            if i % 2:
                out.append(self._ids[part])
            elif part:
                prefix = " " if self.add_space_prefix and i == 0 else ""
                out += self._encode_piece((prefix + part).replace(" ", "\u2581"))
        return out

    def _encode_piece(self, text: str) -> list[int]:
        """llama.cpp's `llm_tokenizer_spm`: merge the best-scoring adjacent pair until none
        merges into a piece; then each symbol is its piece, else its bytes."""
        import heapq

        syms = list(text)
        nxt = list(range(1, len(syms) + 1))
        prv = list(range(-1, len(syms) - 1))
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int) -> None:
            right = nxt[left]
            if right >= len(syms):
                return
            merged = syms[left] + syms[right]
            i = self._ids.get(merged)
            if i is not None:
                heapq.heappush(heap, (-self._scores[i], left, right, merged))

        for j in range(len(syms) - 1):
            push(j)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not syms[left] or not syms[right] or nxt[left] != right or syms[left] + syms[right] != merged:
                continue  # stale: one side merged since
            syms[left], syms[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] < len(syms):
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left])
            push(left)
        out: list[int] = []
        j = 0
        while j < len(syms):
            piece = syms[j]
            i = self._ids.get(piece)
            if i is not None:
                out.append(i)
            else:
                out += [self._byte_ids[b] for b in piece.encode("utf-8") if b in self._byte_ids]
            j = nxt[j]
        return out

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def token(self, token_id: int) -> str:
        """The piece as the GGUF names it (e.g. '▁Paris', '<0x0A>')."""
        return self._tokens[token_id]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: printable bytes stand for
    themselves, the other 68 for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(rest)}}


BYTE_CHARS = {b: c for c, b in _byte_level_alphabet().items()}
"""GPT-2's byte -> character table: how a byte-level vocabulary (and the exported
`tokenizer.json`, `tokenizer_export`) writes each byte."""


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
        # One pass over the text: the specials as alternatives of one pattern (re.split
        # keeps them, at the odd indices).
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.SPECIAL) + ")")
        self.eos_token_id = self._special["<|im_end|>"]
        self.special_ids = frozenset(self._special.values())
        self.chat_template = chat_template or SMOLLM2_CHAT_TEMPLATE
        self.max_chars_per_token = max(1, *(len(s) for s in self.SPECIAL))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []  # no BOS to add
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                out.append(self._special[part])
            elif part:
                out += part.encode("utf-8")
        return out

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 256:
            return bytes((token_id,))
        k = token_id - 256
        return (self.SPECIAL[k] if k < len(self.SPECIAL) else f"<|{token_id}|>").encode("utf-8")

    def token(self, token_id: int) -> str:
        """A byte as GPT-2's byte-level alphabet writes it ('Ġ' for a space), a special
        token as its text."""
        if token_id < 256:
            return BYTE_CHARS[token_id]
        return self.token_bytes(token_id).decode("utf-8")
