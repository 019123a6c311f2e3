"""A workload seen at block granularity: the block-level replay model the bounds run on.

Owns `BlockPlan`: for each request, the chain key of every full block of its prompt and
output, how many leading blocks it may hit, and how many blocks it holds while it runs.
Must never: decide what stays cached (the bounds do) or call a real cache.

The replay model, which is what the A/B runner does with a real `PrefixCache` (the
protocol's rules 1 and 5, prefixcache/protocol.py), one request at a time in arrival order:
  admit    the hit is the longest run of leading cached blocks, at most
           `hittable = floor((P - 1) / B)` blocks (whole blocks, and the last prompt token
           is always computed); the request then holds `footprint = ceil((P + O) / B)`
           blocks (its prompt and output, the partial tail included), the hit ones among
           them, all pinned while it runs;
  commit   every prompt and output token is computed;
  release  every FULL block of prompt + output, `floor((P + O) / B)` of them, is cached;
           a partial tail block is not.
P and O are the prompt and output lengths in TOKENS, B the block size.

Keys. Block j of a request is named by (key of block j-1, content of block j), with a
root per namespace, and equal names get one small int from an intern table. So two blocks
have the same key exactly when their whole prefixes (namespace included) hold the same
tokens, which is the identity a block hash chain or a radix path gives, without hashing
and without collisions. Keys are numbered in order of first appearance; `parent[k]` is the
key of the block before k (-1 for a first block).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.workloads.checks import check_int
from prefixcache.workloads.workload import Workload

__all__ = ["BlockPlan"]


@dataclass(frozen=True, eq=False)
class BlockPlan:
    """Block-level view of a workload at `block_size` TOKENS (see the module docstring).

    Per request i: `keys[i]` (chain keys of the full blocks of prompt + output),
    `hittable[i]` and `footprint[i]` (BLOCKS), `prompt_tokens[i]` (TOKENS).
    Per key k: `parent[k]`.
    """

    block_size: int
    keys: tuple[list[int], ...]
    hittable: tuple[int, ...]
    footprint: tuple[int, ...]
    prompt_tokens: tuple[int, ...]
    parent: list[int]

    @classmethod
    def of(cls, workload: Workload, block_size: int) -> BlockPlan:
        """The plan of `workload` at `block_size` TOKENS. O(blocks + token runs); at
        block size 1 that is one dict look-up per token."""
        check_int("block_size", block_size, 1)
        intern: dict[tuple[int, object], int] = {}
        roots: dict[str | None, int] = {}
        parent: list[int] = []
        keys, hittable, footprint, prompt_tokens = [], [], [], []
        for r in workload.requests:
            p, total = len(r.prompt), len(r.prompt) + len(r.output)
            # A namespace root is a negative pseudo-key, so first blocks of different
            # namespaces never share a key.
            prev = roots.setdefault(r.namespace, -1 - len(roots))
            chain = []
            for content in (r.prompt + r.output).full_blocks(block_size):
                name = (prev, content)
                k = intern.get(name)
                if k is None:
                    k = intern[name] = len(parent)
                    parent.append(prev if prev >= 0 else -1)
                chain.append(k)
                prev = k
            keys.append(chain)
            hittable.append((p - 1) // block_size)
            footprint.append(-(-total // block_size))
            prompt_tokens.append(p)
        return cls(block_size, tuple(keys), tuple(hittable), tuple(footprint), tuple(prompt_tokens), parent)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def num_keys(self) -> int:
        """Distinct full blocks in the workload (BLOCKS an infinite cache ends up holding)."""
        return len(self.parent)

    @property
    def max_footprint(self) -> int:
        """The most BLOCKS one request holds at once (a smaller pool rejects it)."""
        return max(self.footprint, default=0)
