"""What isolates requests from one another: a cache salt and a LoRA adapter.

Owns the namespace value types (`LoRA`, `Isolation`), the canonical form every backend
stores (`check_namespace`), the tagged hash extra keys a namespace puts into a block
chain (`extra_keys`, vLLM 0.33's `generate_block_hash_extra_keys`) and an exact,
injective string key for structures that compare namespaces by value (`exact_key`: the
radix tree's roots, the hash backend's verified hits).

A namespace is one of:

- `None`: no salt, no adapter (a namespace of its own);
- a `str`: a cache salt (vLLM `cache_salt`, SGLang `extra_key`);
- `Isolation(salt, lora)`: a salt (or None) and a LoRA adapter `LoRA(name, path, id)`.

`Isolation(salt="a")` without an adapter IS the salt "a": `check_namespace` reduces it to
the plain str, so the two share blocks and hash identically, and the plain-salt digests
stay byte for byte vLLM's. Two sources of isolation cannot collide because every extra
key is tagged: a salt is `("cache_salt", salt)` on a chain's first block, an adapter is
`("lora", name, path)` on every block (vLLM 0.33 puts the adapter on every block and the
salt on the first; the path is included so re-pointing a name at another adapter
does not reuse its KV). A salt equal to an adapter's name is a different key.

Must never: hash, touch a pool, or decide what is cached.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["LoRA", "Isolation", "Namespace", "check_namespace", "extra_keys", "exact_key", "exact_bytes",
           "SPARE_NAMESPACES", "prune_at"]

#: A cache's table keyed by namespace is pruned of the namespaces it no longer holds
#: when it has this many entries beyond twice those it kept last time: pruning scans
#: what the cache holds, so it runs once per that many new namespaces, and a stream of
#: one-request tenants costs bounded memory.
SPARE_NAMESPACES = 1024


def prune_at(kept: int) -> int:
    """The size at which a table keyed by namespace that kept `kept` entries at its last
    pruning (0: never pruned) is pruned next."""
    return 2 * kept + SPARE_NAMESPACES


def _check_text(value: object, what: str) -> str:
    """`value` if it is a str that UTF-8 can encode (no lone surrogates); else a clear error."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__} {value!r}")
    if value.isascii():  # the usual salt: nothing to encode
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be valid Unicode (a lone surrogate cannot be encoded), got {value!r}") from None
    return value


@dataclass(frozen=True)
class LoRA:
    """A LoRA adapter, by the name requests use and the path its weights load from.

    `id` is the adapter's integer id (vLLM's `lora_int_id`, an int >= 1) or None. It is
    a label for KV events (`BlockStored.lora_id`) only: isolation and hashing use the
    name and path, as vLLM's do, so it takes no part in equality either.
    """

    name: str
    path: str
    id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _check_text(self.name, "lora.name")
        _check_text(self.path, "lora.path")
        if self.id is not None and (isinstance(self.id, bool) or not isinstance(self.id, int) or self.id < 1):
            raise ValueError(f"lora.id must be an int >= 1 or None, got {self.id!r}")


@dataclass(frozen=True)
class Isolation:
    """A namespace with a LoRA adapter: `salt` (a str or None) and `lora`.

    `lora` may be given as a `(name, path)` pair or a `(name, path, id)` triple. Without an adapter, pass the salt
    itself (or None) as the namespace; `check_namespace` reduces `Isolation(salt)` to it.
    """

    salt: str | None = None
    lora: LoRA | None = None

    def __post_init__(self) -> None:
        if self.salt is not None:
            _check_text(self.salt, "namespace salt")
        lora = self.lora
        if isinstance(lora, tuple):
            if len(lora) not in (2, 3):
                raise ValueError(f"lora must be a LoRA, a (name, path) pair or a (name, path, id) triple, got {lora!r}")
            object.__setattr__(self, "lora", LoRA(*lora))
        elif lora is not None and not isinstance(lora, LoRA):
            raise TypeError(
                f"lora must be a LoRA, a (name, path) pair, a (name, path, id) triple or None, got {type(lora).__name__} {lora!r}"
            )


Namespace = str | Isolation | None
"""Tenant / adapter isolation key: requests in different namespaces never share a block."""


def check_namespace(namespace: object) -> Namespace:
    """The canonical form of `namespace`: None, a str salt, or an `Isolation` that has
    an adapter. TypeError / ValueError naming the field for anything else."""
    if namespace is None:
        return None
    if type(namespace) is str:
        return _check_text(namespace, "namespace")
    if isinstance(namespace, Isolation):
        return namespace if namespace.lora is not None else namespace.salt
    raise TypeError(f"namespace must be a str, an Isolation or None, got {type(namespace).__name__} {namespace!r}")


def extra_keys(namespace: Namespace, *, first_block: bool = True) -> tuple[tuple[str, ...], ...] | None:
    """The tagged extra keys one block of a chain carries for a canonical `namespace`.

    The adapter `("lora", name, path)` goes on every block, then the salt
    `("cache_salt", salt)` on the first block only, in vLLM 0.33's order; None when
    there are none (vLLM hashes None, not an empty tuple).
    """
    if namespace is None:
        return None
    if type(namespace) is str:
        return (("cache_salt", namespace),) if first_block else None
    keys: tuple[tuple[str, ...], ...] = (("lora", namespace.lora.name, namespace.lora.path),)
    if first_block and namespace.salt is not None:
        keys += (("cache_salt", namespace.salt),)
    return keys


def exact_key(namespace: Namespace) -> str | None:
    """An injective str key for a canonical `namespace` (None stays None).

    A salt is its own key, so plain namespaces read as themselves (`tree.namespaces()`
    lists "tenant-a"); the rare salt that starts with NUL is escaped as "\\0s" + salt,
    and a namespace with an adapter is "\\0l" + a JSON array of salt, name and path.
    The three forms cannot produce the same key.
    """
    if namespace is None:
        return None
    if type(namespace) is str:
        return namespace if not namespace.startswith("\0") else "\0s" + namespace
    lora = namespace.lora
    return "\0l" + json.dumps([namespace.salt, lora.name, lora.path], ensure_ascii=False)


def exact_bytes(namespace: Namespace) -> bytes:
    """`exact_key` as bytes (None is b"", any other key b"\\x01" + its UTF-8), for
    native code that compares namespaces byte for byte (`BlockContents`)."""
    if namespace is None:  # most requests: answered without a call, once per admission
        return b""
    key = exact_key(namespace)
    return b"" if key is None else b"\x01" + key.encode("utf-8")
