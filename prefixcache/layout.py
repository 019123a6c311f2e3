"""A model's cache layout: the layer groups whose KV (or state) a prefix cache keeps.

Owns `LayerGroup` (one group of layers that share a kind of cache: `full_attention`,
`sliding_window` with its `window`, `chunked_local_attention` with its `chunk`, or
`mamba`, a recurrent state per request), the kind names (vLLM 0.33's
`kv_cache_spec_kind`), `Layout` (the checked tuple of groups a cache is built with) and
the arithmetic every part reads from it: which tokens a group still reads at a position
(`skipped_tokens`), how many trailing blocks a sliding-window hit needs
(`window_blocks`), and what a cached token costs per group in bytes.

YAML, the same keys for every strategy (`cache.layout`)::

    cache:
      block_size: 16
      num_blocks: 4096
      layout:
        - {kind: full_attention, layers: 6, bytes_per_token: 4096}
        - {kind: sliding_window, window: 512, layers: 20, bytes_per_token: 4096}
        - {kind: mamba, layers: 24, state_bytes: 2097152}

No layout, or one whose groups are all `full_attention`, is the single-group cache every
backend has always been (`Layout.hybrid` is False, and nothing downstream changes).

Must never: import a backend, the registry or the engine, or decide what a strategy
caches (the backends do, each as its reference system does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prefixcache.errors import ConfigError, short_repr

__all__ = [
    "FULL_ATTENTION",
    "SLIDING_WINDOW",
    "CHUNKED_LOCAL_ATTENTION",
    "MAMBA",
    "KINDS",
    "LayerGroup",
    "Layout",
    "NULL_BLOCK",
    "check_layout",
]

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
MAMBA = "mamba"
KINDS = (FULL_ATTENTION, SLIDING_WINDOW, CHUNKED_LOCAL_ATTENTION, MAMBA)
"""The kinds a group may have: vLLM 0.33's `KVCacheSpecKind` values of the same caches."""
Kind = Literal["full_attention", "sliding_window", "chunked_local_attention", "mamba"]

NULL_BLOCK = -1
"""A block-table entry that holds nothing: a block a group no longer reads (outside its
window, before its chunk, a recurrent state that was not kept). vLLM's null block."""

# Keys of a group that only some kinds take, and which.
_KIND_KEYS = {"window": SLIDING_WINDOW, "chunk": CHUNKED_LOCAL_ATTENTION, "state_bytes": MAMBA, "slots": MAMBA}


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one kind of cache.

    kind:            full_attention | sliding_window | chunked_local_attention | mamba
    window:          sliding_window: TOKENS a query attends to, itself included (a query
                     at position p reads positions p - window + 1 .. p), as vLLM's
                     `sliding_window` and Hugging Face's `sliding_window`
    chunk:           chunked_local_attention: TOKENS per attention chunk (a query at p
                     reads p // chunk * chunk .. p), vLLM's `attention_chunk_size`
    layers:          how many layers the group has (scales bytes)
    bytes_per_token: attention kinds: KV BYTES one token costs in ONE layer of the group
                     (K and V, every head); 0 = not given (A/B reports then leave bytes out)
    state_bytes:     mamba: BYTES of one layer's recurrent state (conv + SSM); 0 = not given
    slots:           mamba, `radix` only: recurrent states its state pool holds (SGLang's
                     separate Mamba pool, `max_mamba_cache_size`), each taking
                     `Layout.state_blocks` blocks of num_blocks (one unless the layout
                     gives state_bytes and bytes_per_token); 0 = SGLang's
                     `mamba_full_memory_ratio` 0.9 (the states' blocks : the other
                     blocks = 0.9 : 1)
    pool_ratio:      sliding_window, `radix` only: the sliding-window pool's size as a
                     fraction of the full-attention pool's (SGLang's
                     `swa_full_tokens_ratio`, default 0.8); the two split what the
                     states leave of num_blocks
    """

    kind: Kind
    window: int | None = None
    chunk: int | None = None
    layers: int = 1
    bytes_per_token: int = 0
    state_bytes: int = 0
    slots: int = 0
    pool_ratio: float = 0.8

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError("kind", f"{short_repr(self.kind)} is not allowed; allowed values: {', '.join(KINDS)}")
        for key, kind in _KIND_KEYS.items():
            value = getattr(self, key)
            if self.kind != kind and value not in (None, 0):
                raise ConfigError(key, f"only a {kind} group takes {key}; this group is {self.kind}")
        need = {SLIDING_WINDOW: "window", CHUNKED_LOCAL_ATTENTION: "chunk"}.get(self.kind)
        if need is not None and getattr(self, need) is None:
            raise ConfigError(need, f"a {self.kind} group needs {need} (TOKENS, an integer >= 1)")
        for key in ("window", "chunk"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(key, f"must be an integer >= 1 (TOKENS), got {short_repr(value)}")
        for key, least in (("layers", 1), ("bytes_per_token", 0), ("state_bytes", 0), ("slots", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(key, f"must be an integer >= {least}, got {short_repr(value)}")
        if self.kind == MAMBA and self.bytes_per_token:
            raise ConfigError("bytes_per_token", "a mamba group keeps a state per request, not KV per token: give state_bytes")
        if isinstance(self.pool_ratio, bool) or not isinstance(self.pool_ratio, (int, float)) or not 0 < self.pool_ratio <= 1:
            raise ConfigError("pool_ratio", f"must be a number in (0, 1], got {short_repr(self.pool_ratio)}")
        if self.kind != SLIDING_WINDOW and self.pool_ratio != 0.8:
            raise ConfigError("pool_ratio", f"only a {SLIDING_WINDOW} group takes pool_ratio; this group is {self.kind}")

    # -- what a group reads ------------------------------------------------------------
    @property
    def spec(self) -> tuple:
        """What makes two groups' caches interchangeable: the kind and its extent."""
        return (self.kind, self.window, self.chunk)

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading TOKENS the next query (at position `num_computed`) no longer reads:
        vLLM's `get_num_skipped_tokens` of the group's manager (a mamba group needs only
        the state after the last token)."""
        if self.kind == SLIDING_WINDOW:
            return max(0, num_computed - self.window + 1)  # type: ignore[operator]
        if self.kind == CHUNKED_LOCAL_ATTENTION:
            return num_computed // self.chunk * self.chunk  # type: ignore[operator]
        if self.kind == MAMBA:
            return num_computed - 1
        return 0

    def window_blocks(self, block_size: int) -> int:
        """sliding_window: trailing BLOCKS a hit must find cached, the ones that hold the
        window's `window - 1` earlier tokens (vLLM: ceil((window - 1) / block_size))."""
        return -(-(self.window - 1) // block_size)  # type: ignore[operator]

    def bytes_per_cached_token(self, block_size: int) -> float:
        """BYTES a token cached in this group costs (all its layers): KV for attention
        kinds; a state's bytes spread over the block it stands for, for mamba. 0 when
        the layout does not give sizes."""
        if self.kind == MAMBA:
            return self.layers * self.state_bytes / block_size
        return float(self.layers * self.bytes_per_token)


class Layout(tuple):
    """The checked groups of a cache, in the order the YAML lists them (a group's index
    is its `group_idx` in KV events and in `PrefixCache.block_tables`). An empty layout
    is one full-attention group."""

    def __new__(cls, groups: Sequence[LayerGroup] = ()) -> Layout:
        return tuple.__new__(cls, tuple(groups) or (LayerGroup(FULL_ATTENTION),))

    @property
    def hybrid(self) -> bool:
        """Whether any group is not full attention (else every backend is as it always was)."""
        return any(g.kind != FULL_ATTENTION for g in self)

    @property
    def has_mamba(self) -> bool:
        return any(g.kind == MAMBA for g in self)

    def kinds(self) -> tuple[str, ...]:
        return tuple(g.kind for g in self)

    def state_blocks(self, block_size: int) -> int:
        """BLOCKS of the pool one recurrent state takes where states have a pool of their
        own (`radix`, as SGLang's Mamba pool): a layer's `state_bytes` over what a block
        of `block_size` TOKENS costs a full-attention layer (`bytes_per_token`), rounded
        up; 1 unless the layout gives both sizes. At the block vLLM would raise its page
        to (one state per page) it is 1; at a smaller block a state costs what its bytes
        cost, not one small block."""
        state = max((g.state_bytes for g in self if g.kind == MAMBA), default=0)
        kv = max((g.bytes_per_token for g in self if g.kind == FULL_ATTENTION), default=0)
        if not state or not kv:
            return 1
        return max(1, -(-state // (block_size * kv)))


def check_layout(groups: Sequence[LayerGroup]) -> None:
    """ConfigError (path `layout`) for a list of groups no strategy builds: a layout
    needs a full_attention group, the one that reads every token and that every hit is
    checked against first (vLLM's hybrid coordinator puts it first; SGLang's
    UnifiedRadixCache keeps FULL as its base component). What each kind requires of its
    own keys is checked by `LayerGroup`."""
    if not isinstance(groups, tuple):
        raise ConfigError("layout", f"must be a list of groups, got {short_repr(groups)}")
    if groups and not any(g.kind == FULL_ATTENTION for g in groups):
        raise ConfigError(
            "layout",
            "needs a full_attention group: every hit is checked against the group that reads every token "
            f"(kinds given: {', '.join(g.kind for g in groups)})",
        )
