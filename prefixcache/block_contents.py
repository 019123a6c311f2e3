"""Exact block contents: the readable reference for `prefixcache._C.BlockContents`.

Owns the proof that a block found through a non-cryptographic hash really holds what a
request needs. A block's KV is a function of its namespace and of every token up to
its last one. Each recorded block points at an immutable content node: its own
`block_size` token ids (exact ids, never a hash), the node of the block before it in
the table of the request that computed it (None at the start of a chain), and there
the namespace. A node describes one computation forever: a block reused and recorded
again gets a new node, and the old one lives on while a child node refers to it.

A block h found under key i proves position i of a request when h's node holds the
request's block-i tokens and either i == 0 and the node starts a chain in the
request's namespace, or its parent is the node of the block proved at i - 1 (O(1),
the usual case), or the parent's ancestry spells the request's first i blocks in its
namespace, down to the start or to a node already proved (another request's copy of
the same prefix; O(i)). `lookup_chain` tries key i's holders earliest first; a key
with holders none of which proves its position stops the hit and reports `failed`.
A partial hit's source (`verify_head`: a copy of a cached block's first n tokens) is
proved the same way, at the position after the full hits, on its first n tokens.
Nodes never change, so a proof never depends on what a reused block holds now.

`BlockContents` (re-exported from the native core) is what the `hash` backend uses
when it verifies hits; `TrustingVerifier` answers the same calls when it trusts them (a
cryptographic hash: a hit is the pool's plain look-up, every proof holds, nothing is
recorded), so the backend calls one verifier without asking which. `PyBlockContents` is
the same semantics as `BlockContents` in plain Python (nodes are Python objects, kept
alive by Python's own reference counting). Tests drive both with the same operations
and require identical results.

Must never: hash, count block references, touch the free queue or the key index (it
reads the pool's index through `lookup` / `blocks_for`), or decide what is cached.
Namespaces are bytes compared exactly (`prefixcache.isolation.exact_bytes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixcache._C import BlockContents

__all__ = ["BlockContents", "PyBlockContents", "TrustingVerifier"]

_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


class _TrustedIndex(Protocol):
    def lookup_chain_packed(self, keys: bytes, key_size: int) -> list[int]: ...


class _KeyIndex(Protocol):
    num_blocks: int

    def lookup(self, key: bytes) -> int | None: ...

    def blocks_for(self, key: bytes) -> list[int]: ...


@dataclass(frozen=True, eq=False)
class _Node:
    """One computation of one block: compared by identity, never by value."""

    parent: _Node | None
    tokens: tuple[int, ...]
    namespace: bytes  # meaningful at a chain's start only


def _token_ids(tokens: Sequence[int], begin: int, count: int) -> tuple[list[int], int]:
    """tokens[begin:begin + count] (clipped), ids int64 cannot hold stored as 0 (as the
    native store does), and how many lead before the first of those. TypeError for
    anything but an int (bool included)."""
    if isinstance(tokens, (str, bytes)):
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    tokens = list(tokens)
    if not 0 <= begin <= len(tokens):
        raise IndexError(f"first token {begin} is outside the {len(tokens)} tokens")
    out = tokens[begin : begin + max(0, count)]
    representable = len(out)
    for i, t in enumerate(out):
        if type(t) is bool or not isinstance(t, int):
            raise TypeError(f"tokens[{begin + i}] must be an int, got {type(t).__name__}")
        if not _INT64[0] <= t <= _INT64[1]:
            representable = min(representable, i)
            out[i] = 0
    return out, representable


def _block_ids(blocks: Sequence[int]) -> list[int]:
    if isinstance(blocks, (str, bytes)):
        raise TypeError(f"blocks must be a sequence of ints, got {type(blocks).__name__}")
    out = list(blocks)
    for i, b in enumerate(out):
        if type(b) is bool or not isinstance(b, int):
            raise TypeError(f"blocks[{i}] must be an int, got {type(b).__name__}")
        if not _INT32[0] <= b <= _INT32[1]:
            raise IndexError(f"block id {b} is out of range")
    return out


def _check_bytes(value: object, what: str) -> bytes:
    if not isinstance(value, bytes):
        raise TypeError(f"{what} must be bytes, got {type(value).__name__}")
    return value


class TrustingVerifier:
    """`BlockContents`' calls for a hash whose hits are trusted (SHA-256: nobody finds a
    collision, and vLLM trusts it too): the pool's hits as they are, at no added cost."""

    __slots__ = ("pool",)

    def __init__(self, pool: _TrustedIndex) -> None:
        self.pool = pool

    def lookup_chain(
        self, keys: bytes, key_size: int, tokens: Sequence[int], namespace: bytes
    ) -> tuple[list[int], bool]:
        """(the pool's longest run of cached keys from the start, False): nothing refuted."""
        return self.pool.lookup_chain_packed(keys, key_size), False

    def record(
        self, parent: int, blocks: Sequence[int], tokens: Sequence[int], first_token: int, namespace: bytes
    ) -> None:
        """Nothing: a trusted hit needs no record of what a block holds."""

    def verify_table(self, table: Sequence[int], tokens: Sequence[int], namespace: bytes) -> int:
        """Every block proves its position: len(table)."""
        return len(table)

    def verify_head(self, block: int, proved: Sequence[int], tokens: Sequence[int], n: int, namespace: bytes) -> bool:
        """True, unless `block` is one of `proved`: under a trusted hash a block holds one
        position of a chain, so a source offered at the next one is the offer's mistake."""
        if block in proved:
            raise ValueError(f"a partial hit's source, block {block}, is one of the hit blocks {list(proved)}")
        return True

    def check_invariants(self) -> None:
        """Nothing is kept, so nothing can be broken."""


class PyBlockContents:
    """`BlockContents` in plain Python (see the module docstring)."""

    def __init__(self, pool: _KeyIndex, block_size: int) -> None:
        if not 1 <= block_size <= 1 << 24:
            raise ValueError(f"block_size must be in [1, 16777216], got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = pool.num_blocks
        self.wide = False  # whether the native store would have widened to int64
        self._node: list[_Node | None] = [None] * self.num_blocks

    def _check_id(self, block_id: int, what: str) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"{what}: block id {block_id} is out of range [0, {self.num_blocks})")
        return block_id

    @property
    def num_nodes(self) -> int:
        """Content nodes alive: those of blocks and their ancestors."""
        alive: set[int] = set()
        for node in self._node:
            while node is not None and id(node) not in alive:
                alive.add(id(node))
                node = node.parent
        return len(alive)

    # -- recording ----------------------------------------------------------------------
    def record(
        self, parent: int, blocks: Sequence[int], tokens: Sequence[int], first_token: int, namespace: bytes
    ) -> None:
        """`blocks` now hold tokens[first_token : first_token + len(blocks) * block_size];
        blocks[0] follows `parent` (-1: it starts a chain in `namespace`)."""
        ids = _block_ids(blocks)
        bs = self.block_size
        toks, representable = _token_ids(tokens, first_token, len(ids) * bs)
        namespace = _check_bytes(namespace, "namespace")
        if parent != -1:
            self._check_id(parent, "record: parent")
        for b in ids:
            self._check_id(b, "record")
        if len(toks) != len(ids) * bs:
            raise ValueError(f"record: {len(ids)} blocks need {len(ids) * bs} tokens, got {len(toks)}")
        provable = representable // bs
        prev = None if parent == -1 else self._node[parent]
        if parent != -1 and prev is None:
            provable = 0  # follows a block that cannot be proved
        self.wide = self.wide or any(not _INT32[0] <= t <= _INT32[1] for t in toks[: provable * bs])
        for i, b in enumerate(ids):
            self._node[b] = (
                _Node(prev, tuple(toks[i * bs : (i + 1) * bs]), namespace if prev is None else b"")
                if i < provable
                else None
            )
            prev = self._node[b]

    # -- proofs -------------------------------------------------------------------------
    def _proves(
        self, h: int, i: int, proved: Sequence[int], tokens: list[int], namespace: bytes, head: int | None = None
    ) -> bool:
        """h proves position i (its first `head` tokens; default the whole block)."""
        bs = self.block_size
        head = bs if head is None else head
        node = self._node[h]
        if node is None or list(node.tokens[:head]) != tokens[i * bs : i * bs + head]:
            return False
        if i == 0:
            return node.parent is None and node.namespace == namespace
        p = node.parent
        for j in range(i - 1, -1, -1):
            if p is None:
                return False
            if p is self._node[proved[j]]:
                return True
            if list(p.tokens) != tokens[j * bs : (j + 1) * bs]:
                return False
            if j == 0:
                return p.parent is None and p.namespace == namespace
            p = p.parent
        return False  # unreachable: the loop returns at j == 0

    def lookup_chain(
        self, keys: bytes, key_size: int, tokens: Sequence[int], namespace: bytes
    ) -> tuple[list[int], bool]:
        """(blocks, failed): the proved hits among the packed keys' holders."""
        keys = _check_bytes(keys, "keys")
        num_keys = len(keys) // key_size if key_size > 0 else 0
        toks, representable = _token_ids(tokens, 0, num_keys * self.block_size)
        toks = toks[:representable]
        namespace = _check_bytes(namespace, "namespace")
        if key_size < 1 or len(keys) % key_size:
            raise ValueError(
                f"lookup_chain: key_size must be >= 1 and divide the {len(keys)} key bytes, got {key_size}"
            )
        out: list[int] = []
        for i in range(min(num_keys, len(toks) // self.block_size)):
            key = keys[i * key_size : (i + 1) * key_size]
            first = self.pool.lookup(key)
            if first is None:
                break
            holders = [first, *(h for h in self.pool.blocks_for(key) if h != first)]  # earliest first
            found = next((h for h in holders if self._proves(h, i, out, toks, namespace)), None)
            if found is None:
                return out, True
            out.append(found)
        return out, False

    def verify_table(self, table: Sequence[int], tokens: Sequence[int], namespace: bytes) -> int:
        """How many leading blocks of a request's table prove its first blocks."""
        ids = _block_ids(table)
        toks, representable = _token_ids(tokens, 0, len(ids) * self.block_size)
        namespace = _check_bytes(namespace, "namespace")
        for b in ids:
            self._check_id(b, "verify_table")
        n = min(len(ids), representable // self.block_size)
        return next((i for i in range(n) if not self._proves(ids[i], i, ids[:i], toks, namespace)), n)

    def verify_head(self, block: int, proved: Sequence[int], tokens: Sequence[int], n: int, namespace: bytes) -> bool:
        """Whether `block` holds the request's next n tokens (1 <= n <= block_size) as
        its head, computed after exactly its proved hits `proved`: a partial hit's source."""
        ids = _block_ids(proved)
        if type(n) is bool or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        need = len(ids) * self.block_size + min(max(n, 0), self.block_size)
        toks, representable = _token_ids(tokens, 0, need)
        namespace = _check_bytes(namespace, "namespace")
        self._check_id(block, "verify_head")
        for b in ids:
            self._check_id(b, "verify_head: proved")
        if not 1 <= n <= self.block_size:
            raise ValueError(f"verify_head: n must be in [1, {self.block_size}], got {n}")
        if representable < need:
            return False
        return self._proves(block, len(ids), ids, toks, namespace, n)

    # -- inspection ---------------------------------------------------------------------
    def tokens(self, block_id: int) -> list[int]:
        node = self._node[self._check_id(block_id, "tokens")]
        return [] if node is None else list(node.tokens)

    def depth(self, block_id: int) -> int:
        node, d = self._node[self._check_id(block_id, "depth")], 0
        while node is not None:
            node, d = node.parent, d + 1
        return d

    def check_invariants(self) -> None:
        """Nothing to check: Python's reference counting keeps exactly the live nodes."""
