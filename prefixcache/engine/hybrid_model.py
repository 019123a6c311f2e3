"""A tiny hybrid decoder in pure torch: full, sliding-window, chunked-local and recurrent layers.

Owns `HybridConfig`, its seeded random weights (`random_hybrid_weights`), the layout it
declares (`HybridConfig.layout`: one `LayerGroup` per kind of layer, in the order the
kinds first appear), and `HybridModel`, whose forward pass reads and writes the cache's
paged storage group by group: an attention layer's K/V in its group's blocks
(`prefixcache.attention.KV_LAYOUT`, one tensor per layer), read through the paged
attention kernel with the layer's window or chunk (`window_left`, `chunk_size`); a
recurrent layer's state in its group's blocks (one tensor per layer, ``[num_blocks,
inner, state_dim]``): block i of a request's mamba table holds the state after (i + 1)
* `state_tokens` tokens (the cache's: the block size, or finer), written when a chunk
ends there and read back when a request's hit starts there. A copy-on-write hit
(`copy_blocks`) copies the head of a block in every attention layer. The recurrent layer is a diagonal selective state-space scan
(Mamba's recurrence without its convolution): h = exp(-dt * A) * h + dt * u * B,
y = h . C + D * u, gated by silu(z).

Every operation is row-wise: projections are batched products of one-row matrices
(`_linear`), norms and RoPE act per row, the paged attention kernel gives a query the
same result whatever other queries share its call, and the scan steps one token at a
time. So a token's arithmetic never depends on how the prompt was split into chunks or
which tokens came from the cache: cached and uncached runs are bit-identical, which is
what the engine's exactness tests check (greedy tokens, logits, the recurrent state).

Must never: decide which tokens to compute or which blocks a request uses (the
scheduler and the cache do), or keep a request's running state past `forget`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from prefixcache.attention import PagedAttentionPlan
from prefixcache.engine.batch import SeqChunk
from prefixcache.layout import (
    CHUNKED_LOCAL_ATTENTION,
    FULL_ATTENTION,
    MAMBA,
    NULL_BLOCK,
    SLIDING_WINDOW,
    LayerGroup,
)

__all__ = ["HybridConfig", "HybridWeights", "HybridModel", "TINY_HYBRID_CONFIG", "random_hybrid_weights"]


@dataclass(frozen=True)
class HybridConfig:
    """Sizes in elements, lengths in TOKENS. `layers` lists each layer's kind."""

    vocab_size: int = 320
    hidden_size: int = 64
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64  # the smallest the paged attention kernels take
    state_dim: int = 8  # per channel of the recurrent layer
    layers: tuple[str, ...] = (FULL_ATTENTION, SLIDING_WINDOW, CHUNKED_LOCAL_ATTENTION, MAMBA, FULL_ATTENTION)
    window: int = 48
    chunk: int = 64
    max_position: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def layout(self) -> tuple[LayerGroup, ...]:
        """One group per kind, in order of first appearance (a layer's group is
        `group_of[layer]`)."""
        groups: list[LayerGroup] = []
        for kind in dict.fromkeys(self.layers):
            layers = self.layers.count(kind)
            if kind == MAMBA:
                groups.append(LayerGroup(kind, layers=layers, state_bytes=4 * self.hidden_size * self.state_dim))
                continue
            extent = {"window": self.window} if kind == SLIDING_WINDOW else {}
            if kind == CHUNKED_LOCAL_ATTENTION:
                extent = {"chunk": self.chunk}
            groups.append(LayerGroup(kind, layers=layers, bytes_per_token=4 * 2 * self.num_kv_heads * self.head_dim, **extent))
        return tuple(groups)

    # The geometry `prefixcache.engine.memory` reads (an upper estimate: a recurrent
    # layer's state per block is smaller than an attention layer's KV per block).
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def intermediate_size(self) -> int:
        return 2 * self.hidden_size  # up and down only: counted as three, an upper estimate

    tie_embeddings = False

    @property
    def group_of(self) -> tuple[int, ...]:
        kinds = list(dict.fromkeys(self.layers))
        return tuple(kinds.index(kind) for kind in self.layers)


TINY_HYBRID_CONFIG = HybridConfig()
"""`engine.model: tiny-hybrid`: five layers (full, sliding window 48, chunked local 64,
recurrent, full), random weights seeded by `engine.seed`."""


@dataclass(frozen=True, eq=False)
class HybridWeights:
    """The tensors of a `HybridConfig` model (fp32). `layers[i]` maps names to tensors:
    attention layers q, k, v, o, norm; recurrent layers norm, in_proj, z_proj, dt_proj,
    dt_bias, B_proj, C_proj, A_log, D, out_proj; every layer mlp_norm, up, down."""

    config: HybridConfig
    embed: torch.Tensor
    layers: list[dict[str, torch.Tensor]] = field(default_factory=list)
    norm: torch.Tensor = None  # type: ignore[assignment]
    lm_head: torch.Tensor = None  # type: ignore[assignment]


def random_hybrid_weights(config: HybridConfig = TINY_HYBRID_CONFIG, seed: int = 0) -> HybridWeights:
    """Seeded random weights (the same on every machine), scaled to keep activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    c = config
    h = c.hidden_size

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).contiguous()

    layers = []
    for kind in c.layers:
        layer = {"mlp_norm": torch.ones(h), "up": normal(2 * h, h, std=h**-0.5), "down": normal(h, 2 * h, std=(2 * h) ** -0.5)}
        if kind == MAMBA:
            layer.update(
                norm=torch.ones(h),
                in_proj=normal(h, h, std=h**-0.5),
                z_proj=normal(h, h, std=h**-0.5),
                dt_proj=normal(h, h, std=h**-0.5 * 0.1),
                dt_bias=torch.full((h,), -2.0),
                B_proj=normal(c.state_dim, h, std=h**-0.5),
                C_proj=normal(c.state_dim, h, std=h**-0.5),
                A_log=torch.log(torch.linspace(1.0, 8.0, c.state_dim)).repeat(h, 1).contiguous(),
                D=torch.ones(h),
                out_proj=normal(h, h, std=h**-0.5),
            )
        else:
            layer.update(
                norm=torch.ones(h),
                q=normal(c.num_heads * c.head_dim, h, std=h**-0.5),
                k=normal(c.num_kv_heads * c.head_dim, h, std=h**-0.5),
                v=normal(c.num_kv_heads * c.head_dim, h, std=h**-0.5),
                o=normal(h, c.num_heads * c.head_dim, std=(c.num_heads * c.head_dim) ** -0.5),
            )
        layers.append(layer)
    embed = normal(c.vocab_size, h, std=1.0)
    return HybridWeights(c, embed, layers, torch.ones(h), normal(c.vocab_size, h, std=h**-0.5))


class HybridModel:
    """The decoder over `weights` with paged storage per layer (`allocate_kv`); the same
    `plan`/`forward` calls as `LlamaModel`, plus `forget` (a request left: drop its
    running state) and `states` (a request's running recurrent state, for tests)."""

    def __init__(self, weights: HybridWeights, *, attention_impl: str = "auto", device: torch.device | str = "cpu") -> None:
        self.weights = weights
        self.config = weights.config
        self.device = torch.device(device)
        self.attention_impl = attention_impl
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.outer(torch.arange(c.max_position, dtype=torch.float64), inv_freq)
        emb = torch.cat([angles, angles], dim=-1)
        self.cos_table, self.sin_table = emb.cos().float(), emb.sin().float()
        self.group_of = c.group_of
        self.kinds = c.layers
        # Every projection's weight transposed once (`_linear` multiplies by it).
        self._t = [{k: v.t().contiguous() for k, v in layer.items() if v.dim() == 2 and k != "A_log"} for layer in weights.layers]
        self._lm_head_t = weights.lm_head.t().contiguous()
        self.storage: list[torch.Tensor] = []
        self.num_blocks = self.block_size = 0
        #: TOKENS per entry of a mamba table (the cache's `state_tokens`; set by the engine).
        self.state_tokens = 0
        self._running: dict[Hashable, list[torch.Tensor]] = {}
        #: Tests: keep each request's running states when it leaves, in `final_states`.
        self.keep_final_states = False
        self.final_states: dict[Hashable, list[torch.Tensor]] = {}

    def allocate_kv(self, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32) -> None:
        """Per attention layer a KV tensor, per recurrent layer a state tensor, each of
        `num_blocks` blocks of `block_size` TOKENS (a state block holds one state)."""
        c = self.config
        self.storage = [
            torch.zeros((num_blocks, c.hidden_size, c.state_dim), dtype=dtype)
            if kind == MAMBA
            else torch.zeros((num_blocks, 2, c.num_kv_heads, block_size, c.head_dim), dtype=dtype)
            for kind in self.kinds
        ]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.state_tokens = self.state_tokens or block_size

    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Copy-on-write hits (`Admission.copies`): for each (src, dst, n), the K/V of
        the first n slots of block src into block dst, in every attention layer (a
        block id belongs to one group at a time, so the others' copy is never read)."""
        for src, dst, n in copies:
            if not (0 <= src < self.num_blocks and 0 <= dst < self.num_blocks and 0 < n <= self.block_size):
                raise ValueError(f"copy {(src, dst, n)}: blocks in [0, {self.num_blocks}), 1 <= n <= {self.block_size}")
            for kind, kv in zip(self.kinds, self.storage):
                if kind != MAMBA:
                    kv[dst, :, :, :n] = kv[src, :, :, :n]

    def forget(self, request_id: Hashable) -> None:
        """The request left (finished, preempted, aborted): drop its running state."""
        states = self._running.pop(request_id, None)
        if self.keep_final_states and states is not None:
            self.final_states[request_id] = states

    def states(self, request_id: Hashable) -> list[torch.Tensor]:
        """The request's running recurrent state per recurrent layer (a copy)."""
        return [s.clone() for s in self._running[request_id]]

    def plan(self, chunks: Sequence[SeqChunk]) -> Sequence[SeqChunk]:
        if not self.storage:
            raise RuntimeError("allocate_kv(num_blocks, block_size) before planning a step")
        for i, ch in enumerate(chunks):
            if ch.start + len(ch.token_ids) > self.config.max_position:
                raise ValueError(f"chunk {i}: position {ch.start + len(ch.token_ids) - 1} is past the context length")
        return chunks

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        """Compute every chunk; fp32 logits of the chunks that want them. Running states
        advance only when every chunk succeeded: a pass that raises leaves them as they
        were, so the engine can run its chunks again one by one."""
        out, advanced = [], {}
        for ch in chunks:
            tables = ch.group_tables or (ch.block_table,)
            state = [s.clone() for s in self._start(ch, tables)]
            logits = self._chunk(ch, tables, state)
            self._save(ch.start + len(ch.token_ids), tables, state)
            advanced[ch.request_id] = state
            if ch.want_logits:
                out.append(logits)
        self._running.update(advanced)
        if not out:
            return torch.empty((0, self.config.vocab_size))
        return torch.stack(out)

    # -- internals --------------------------------------------------------------------
    def _table(self, tables: Sequence[Sequence[int]], layer: int) -> Sequence[int]:
        return tables[self.group_of[layer]] if len(tables) > 1 else tables[0]

    def _start(self, ch: SeqChunk, tables: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The request's running states: carried on, or, on its first chunk since
        admission, the cached state its hit ends on (zeros at position 0)."""
        if not ch.fresh and ch.request_id in self._running:
            return self._running[ch.request_id]  # copied by the caller
        c, step = self.config, self.state_tokens
        states = []
        for layer, kind in enumerate(self.kinds):
            if kind != MAMBA:
                continue
            if ch.start == 0:
                states.append(torch.zeros((c.hidden_size, c.state_dim)))
                continue
            table = self._table(tables, layer)
            i = ch.start // step - 1
            if ch.start % step or i >= len(table) or table[i] == NULL_BLOCK:
                raise ValueError(f"request {ch.request_id!r}: no cached state at position {ch.start} to resume from")
            states.append(self.storage[layer][table[i]].clone())
        return states

    def _save(self, end: int, tables: Sequence[Sequence[int]], state: list[torch.Tensor]) -> None:
        """A chunk that ends on a state boundary leaves each state in its block."""
        step = self.state_tokens
        if end % step:
            return
        m = 0
        for layer, kind in enumerate(self.kinds):
            if kind != MAMBA:
                continue
            table = self._table(tables, layer)
            i = end // step - 1
            if i < len(table) and table[i] != NULL_BLOCK:
                self.storage[layer][table[i]].copy_(state[m])
            m += 1

    def _chunk(self, ch: SeqChunk, tables, state: list[torch.Tensor]) -> torch.Tensor | None:
        c, w = self.config, self.weights
        n = len(ch.token_ids)
        x = w.embed.index_select(0, torch.tensor(list(ch.token_ids), dtype=torch.int64))  # [n, hidden]
        m = 0
        for layer, (kind, p) in enumerate(zip(self.kinds, w.layers)):
            t = self._t[layer]
            h = F.rms_norm(x, (c.hidden_size,), p["norm"], c.rms_norm_eps)
            if kind == MAMBA:
                x = x + self._scan(h, p, t, state[m])
                m += 1
            else:
                x = x + self._attend(h, t, ch.start, kind, self._table(tables, layer), self.storage[layer])
            h = F.rms_norm(x, (c.hidden_size,), p["mlp_norm"], c.rms_norm_eps)
            x = x + _linear(F.silu(_linear(h, t["up"])), t["down"])
        last = F.rms_norm(x[n - 1 :], (c.hidden_size,), w.norm, c.rms_norm_eps)
        return _linear(last, self._lm_head_t)[0]

    def _attend(self, h, p, start: int, kind: str, table: Sequence[int], kv: torch.Tensor) -> torch.Tensor:
        c, n = self.config, h.shape[0]
        check_table(table, start, n, self.block_size, f"a {kind} table")
        cos, sin = self.cos_table[start : start + n], self.sin_table[start : start + n]
        q = _rope(_linear(h, p["q"]).view(n, c.num_heads, c.head_dim), cos, sin).contiguous()
        k = _rope(_linear(h, p["k"]).view(n, c.num_kv_heads, c.head_dim), cos, sin)
        v = _linear(h, p["v"]).view(n, c.num_kv_heads, c.head_dim)
        write_kv(kv, table, start, k, v)
        plan = chunk_plan(start, n, table, kv, window_left=c.window - 1 if kind == SLIDING_WINDOW else -1,
                          chunk_size=c.chunk if kind == CHUNKED_LOCAL_ATTENTION else 0)  # fmt: skip
        o = plan.run(q, kv, impl=self.attention_impl)
        return _linear(o.view(n, c.num_heads * c.head_dim), p["o"])

    def _scan(self, h, p, t, state: torch.Tensor) -> torch.Tensor:
        u = _linear(h, t["in_proj"])  # [n, inner]
        z = _linear(h, t["z_proj"])
        dt = F.softplus(_linear(h, t["dt_proj"]) + p["dt_bias"])  # [n, inner]
        b = _linear(h, t["B_proj"])  # [n, state_dim]
        cvec = _linear(h, t["C_proj"])
        a = torch.exp(p["A_log"])
        ys = []
        for j in range(h.shape[0]):  # the recurrence: one token at a time
            state.mul_(torch.exp(-dt[j][:, None] * a)).add_((dt[j] * u[j])[:, None] * b[j][None, :])
            ys.append((state * cvec[j][None, :]).sum(-1) + p["D"] * u[j])
        return _linear(torch.stack(ys) * F.silu(z), t["out_proj"])


def _linear(x: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """x @ wt row by row (`wt` the weight transposed, contiguous: a batched product of
    1-row matrices): a row's result does not depend on how many rows are computed with
    it, as one GEMM's may, so a token computes the same numbers in a long prefill chunk
    and in a chunk of one."""
    return torch.bmm(x[:, None, :], wt.expand(x.shape[0], *wt.shape))[:, 0]



def check_table(table: Sequence[int], start: int, n: int, block_size: int, what: str) -> None:
    """ValueError unless `table` holds a block for every position start..start+n-1
    (TOKENS): the chunk's own KV is written there."""
    end = start + n
    if len(table) * block_size < end or NULL_BLOCK in table[start // block_size : -(-end // block_size)]:
        raise ValueError(f"{what} {list(table)} has no block for positions {start}..{end - 1}")


def write_kv(kv: torch.Tensor, table: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """A chunk's keys and values (``[n, kv_heads, head_dim]``, positions from `start`)
    into their slots of `kv` (``[num_blocks, 2, kv_heads, block_size, head_dim]``)."""
    bs = kv.shape[3]
    pos = torch.arange(start, start + k.shape[0])
    blocks = torch.tensor(table[start // bs : -(-(start + k.shape[0]) // bs)], dtype=torch.int64)[pos // bs - start // bs]
    slots = pos % bs
    kv[blocks, 0, :, slots] = k.to(kv.dtype)  # advanced indices apart: [n, kv_heads, head_dim], as k
    kv[blocks, 1, :, slots] = v.to(kv.dtype)


def chunk_plan(start: int, n: int, table: Sequence[int], kv: torch.Tensor, *, window_left: int = -1,
               chunk_size: int = 0) -> PagedAttentionPlan:
    """One chunk's n queries from position `start` over its request's blocks (`batch_plan`
    of one)."""
    return batch_plan([(start, n, table)], kv, window_left=window_left, chunk_size=chunk_size)


def batch_plan(spans: Sequence[tuple[int, int, Sequence[int]]], kv: torch.Tensor, *, window_left: int = -1,
               chunk_size: int = 0) -> PagedAttentionPlan:
    """Several chunks' queries in one ragged batch, each span (start, n, table): n queries
    from position `start` over that request's blocks, built directly: the indices are the
    cache's own tables (NULL_BLOCK before a window or a chunk), and the kernel checks
    every one it reads again."""
    num_blocks, bs = kv.shape[0], kv.shape[3]
    q_indptr, kv_indptr, kv_indices, kv_lens = [0], [0], [], []
    for start, n, table in spans:
        end = start + n
        used = -(-end // bs)
        q_indptr.append(q_indptr[-1] + n)
        kv_indptr.append(kv_indptr[-1] + used)
        kv_indices.extend(table[:used])
        kv_lens.append(end)
    ints = [torch.tensor(v, dtype=torch.int32) for v in (q_indptr, kv_indptr, kv_indices, kv_lens)]
    dev = [t.to(kv.device) for t in ints]
    return PagedAttentionPlan(
        batch_size=len(spans), total_q=q_indptr[-1], num_blocks=num_blocks, block_size=bs,
        max_q_len=max(n for _, n, _ in spans), max_kv_len=max(kv_lens), device=kv.device,
        q_indptr=dev[0], kv_indptr=dev[1], kv_indices=dev[2], kv_lens=dev[3],
        host_q_indptr=ints[0], host_kv_indptr=ints[1], host_kv_indices=ints[2], host_kv_lens=ints[3],
        window_left=window_left, chunk_size=chunk_size,
    )  # fmt: skip


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


# The model's storage in bytes per block, for capacity planning (A/B and the engine's checks).
def storage_bytes_per_block(config: HybridConfig, block_size: int) -> int:
    """BYTES one block costs across every layer's storage (KV or state)."""
    attn = sum(kind != MAMBA for kind in config.layers) * 2 * config.num_kv_heads * block_size * config.head_dim * 4
    states = sum(kind == MAMBA for kind in config.layers) * config.hidden_size * config.state_dim * 4
    return attn + states


__all__ += ["storage_bytes_per_block"]
