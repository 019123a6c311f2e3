"""partial_block: reuse the matching head of the first block that missed (copy-on-write).

With whole-block matching, a prompt that shares 500 of the 512 tokens of its next block
with a cached block recomputes all 512. TensorRT-LLM copies the 500 into a fresh block
instead. This plugin does that for the `hash` strategy: it indexes every cached block
under its parent's hash, and when a prompt's hit stops, it offers the child of the last
hit block whose tokens share the longest head with the prompt's next block. The backend
pins that source and returns `Admission.copies = ((src, dst, n),)`; the engine copies
the n slots before computing, and the hit is n tokens longer (protocol: partial hits).

    cache:
      backend: "partial_block:PartialBlockHash"
      block_size: 16
      num_blocks: 4096

Cost: one dict look-up per admission, plus a scan of the last hit block's children.
Children are found by hash: under a non-cryptographic hash (`xxhash`) the backend
proves the offered source from its exact contents (`verify_head`: its head tokens,
after exactly the request's proved hit blocks, in its namespace) and drops one that
fails (counted in `verify_failures`), so a collision costs a partial hit, never
wrong KV.
"""

from __future__ import annotations

from prefixcache.backends.hash import HashCache, HashRequest


class PartialBlockHash(HashCache):
    """`hash` with TensorRT-LLM's partial reuse of the first non-matching block."""

    partial_hits = True

    def __init__(self, pool, config) -> None:
        super().__init__(pool, config)
        # parent key -> {block: (its hash, its tokens)}; a first block's parent is its namespace.
        self._children: dict[object, dict[int, tuple[bytes, tuple[int, ...]]]] = {}
        self._parent_of: dict[int, object] = {}  # block -> parent key, so a recached block moves

    def blocks_cached(self, request: HashRequest, start: int, stop: int) -> None:
        bs = self.block_size
        for i in range(start, stop):
            block = request.block_table[i]
            parent = self.block_hash(request, i - 1) if i else ("root", request.namespace)
            old = self._parent_of.pop(block, None)
            if old is not None:
                self._children[old].pop(block, None)
            held = tuple(request.tokens[i * bs : (i + 1) * bs])
            self._children.setdefault(parent, {})[block] = (self.block_hash(request, i), held)
            self._parent_of[block] = parent

    def partial_hit(self, tokens, namespace, digests, num_hit_blocks, limit):
        bs, ds, k = self.block_size, self.digest_size, num_hit_blocks
        parent = digests[(k - 1) * ds : k * ds] if k else ("root", namespace)
        want = tokens[k * bs : k * bs + min(limit, bs - 1)]
        best = None
        for block, (block_hash, held) in self._children.get(parent, {}).items():
            if self.pool.key(block) != block_hash:
                continue  # evicted (and perhaps reused) since it was indexed
            n = 0
            while n < len(want) and held[n] == want[n]:
                n += 1
            if n and (best is None or n > best[1]):
                best = (block, n)
        return best

    def reset(self) -> bool:
        if not super().reset():
            return False
        self._children.clear()
        self._parent_of.clear()
        return True
