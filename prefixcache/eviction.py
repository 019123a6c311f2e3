"""Eviction policies: which unpinned cached entry goes first.

Owns the `EvictionPolicy` strategy (one method: map a candidate to a sortable
priority; the LOWEST priority is evicted first), the built-in policies, each a few
lines, named in `BUILTIN_POLICIES` for `eviction:` in YAML.

A candidate is anything with the attributes of `Candidate`:
- `radix`: an unlocked tree LEAF (a run of pages). Evicting it frees all its blocks;
  its parent becomes a candidate when its last child goes.
- `hash`: a FREE block that still holds its hash (released, not reused yet). Any such
  block may go, whatever its position in a prefix; `lru` is the pool's free queue
  itself and never builds candidates at all.

Must never: walk a tree, touch the pool or keep state of its own: `priority()` is a
function of the candidate alone, so a backend keeps the key it returned. A backend
calls it ONCE per candidate, when it becomes a candidate (a radix leaf when it is
created, unlocked or its last child goes, and again only after a walk changed what
the policy reads, before the next eviction; a hash block when its last reference is
dropped), never per comparison, per operation or per eviction. So a Python policy
costs one call per candidate and change, and its keys sit in the same persistent order
as a native one's (O(log n) per eviction); a policy whose `native` names a C++ ordering
is never called back at all (its `priority()` is the executable definition the native
code mirrors).
Recency and creation are logical clocks (counters), so replays are reproducible.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

__all__ = [
    "Candidate",
    "EvictionPolicy",
    "LRU",
    "LFU",
    "FIFO",
    "MRU",
    "FILO",
    "Priority",
    "GSLRU",
    "Chain",
    "SLRU",
    "TLRU",
    "BUILTIN_POLICIES",
]


class Candidate(Protocol):
    """What a policy may read about an eviction candidate (`_C.EvictionCandidate`).

    | attribute | radix leaf | hash block |
    |---|---|---|
    | `node` / `block` | node id | block id |
    | `num_tokens` | tokens in the leaf's run | the block size |
    | `last_access_time` | clock of the last match / insert through it | clock of its last hit, or of the free that made it a candidate (one tick per freed block, in free order, so ordering by it IS the free-queue LRU) |
    | `creation_time` | clock when the node was created | clock when the block was cached |
    | `hit_count` | inserts that walked or created it past their own earlier inserts (SGLang 0.5.23) | admissions that hit it |
    | `priority` | highest request priority that touched it | same |
    | `use_count` | requests that used it: hits, the insert that created it, inserts that walked it past their own prefix | hits, plus 1 for the request that computed it |
    | `last_use` | traffic clock (TOKENS admitted) at the last insert through it | traffic clock when it was freed |
    | `request_tokens` | length of that insert (whole pages, TOKENS) | whole-block prompt TOKENS of the request that freed it |
    | `cached_prefix_len` | TOKENS from the root to the end of the leaf | 0 |
    | `history_len` | deepest `cached_prefix_len` its branch ever reached | 0 |

    With history (a policy with `history > 0`), content evicted and computed again
    continues its `use_count` from a bounded ghost table of evicted content
    (csrc/ghost_table.h).
    """

    # `_C.CANDIDATE_FIELDS` in its order (csrc/eviction_order.h defines them; a test holds the two equal).
    num_tokens: int
    last_access_time: int
    creation_time: int
    hit_count: int
    priority: int
    use_count: int
    last_use: int
    request_tokens: int
    cached_prefix_len: int
    history_len: int


class EvictionPolicy(ABC):
    """Orders eviction candidates: `priority(c)` smallest is evicted first."""

    name: ClassVar[str] = ""
    #: Name of the native (C++) ordering with the same result, if there is one; the
    #: native code then never calls `priority()`.
    native: ClassVar[str | None] = None
    #: Size of the ghost table of evicted content, in multiples of the pool's blocks
    #: (0: `use_count` forgets content once it is evicted).
    history: ClassVar[int] = 0
    #: In a lower tier (`cache.tiers`), only chain tails leave: a block another block of
    #: the tier extends stays until that one has gone (a radix tree evicts only leaves
    #: anyway; the hash strategy's device pool ignores it).
    leaves_only: ClassVar[bool] = False

    @abstractmethod
    def priority(self, candidate: Candidate) -> Any:
        """A sortable key; lower means evicted sooner."""

    def native_params(self) -> dict[str, int]:
        """Parameters of the native ordering (names of `_C.RadixTree` keywords)."""
        return {}


class LRU(EvictionPolicy):
    name = "lru"
    native = "lru"

    def priority(self, candidate: Candidate) -> Any:
        return candidate.last_access_time


class LFU(EvictionPolicy):
    """Least hits first, then least recent (`hit_count` as SGLang 0.5.23 counts it: at
    insert, once per request per node)."""

    name = "lfu"
    native = "lfu"

    def priority(self, candidate: Candidate) -> Any:
        return (candidate.hit_count, candidate.last_access_time)


class FIFO(EvictionPolicy):
    name = "fifo"
    native = "fifo"

    def priority(self, candidate: Candidate) -> Any:
        return candidate.creation_time


class MRU(EvictionPolicy):
    name = "mru"
    native = "mru"

    def priority(self, candidate: Candidate) -> Any:
        return -candidate.last_access_time


class FILO(EvictionPolicy):
    name = "filo"
    native = "filo"

    def priority(self, candidate: Candidate) -> Any:
        return -candidate.creation_time


class Priority(EvictionPolicy):
    """Lowest request priority first, then least recent."""

    name = "priority"
    native = "priority"

    def priority(self, candidate: Candidate) -> Any:
        return (candidate.priority, candidate.last_access_time)


class SLRU(EvictionPolicy):
    """SGLang 0.5.23's segmented LRU: candidates hit `protected_threshold` times or more are
    PROTECTED and go after every probationary one; LRU within a segment."""

    name = "slru"
    native = "slru"
    protected_threshold: ClassVar[int] = 2

    def priority(self, candidate: Candidate) -> Any:
        return (1 if candidate.hit_count >= self.protected_threshold else 0, candidate.last_access_time)

    def native_params(self) -> dict[str, int]:
        return {"protected_threshold": self.protected_threshold}


class TLRU(EvictionPolicy):
    """SGLang 0.5.23's tail-optimized LRU (Zhang et al., arXiv:2510.15152): a branch whose
    history is `history_len` TOKENS only needs `history_len + next_prompt_estimate -
    threshold` of them cached to keep its next prefill in budget; a leaf entirely past that
    budget is "TEL-safe" and goes first; then plain LRU. Both parameters in TOKENS (SGLang's
    defaults: 0 and 0). Only `radix` has branches: on `hash` blocks it is LRU."""

    name = "tlru"
    native = "tlru"
    threshold: ClassVar[int] = 0
    next_prompt_estimate: ClassVar[int] = 0

    def priority(self, candidate: Candidate) -> Any:
        budget = max(candidate.history_len + self.next_prompt_estimate - self.threshold, 0)
        tel_safe = candidate.cached_prefix_len - candidate.num_tokens >= budget
        return (-1 if tel_safe else 0, candidate.last_access_time)

    def native_params(self) -> dict[str, int]:
        return {"tlru_threshold": self.threshold, "next_prompt_estimate": self.next_prompt_estimate}


class GSLRU(EvictionPolicy):
    """Ghost-backed, size-aware segmented LRU, on the traffic clock (TOKENS admitted).

    Content used by two requests or more (counting uses before an eviction, from a
    ghost table of `history` x pool blocks) is PROTECTED: it ranks as if last used
    `protect_tokens` of traffic later. Content used once is PROBATIONARY: it ranks as if
    last used `size_weight` tokens of traffic earlier per token of the request that
    used it, so a large one-off prompt goes before a small one (small conversations
    come back more often, and cost less to keep). Within a segment, LRU.

    The defaults were chosen on the Mooncake traces (docs/extending.md: what was
    tried, and the sensitivity); subclass to change them.
    """

    name = "gslru"
    native = "gslru"
    history = 4
    protect_tokens: ClassVar[int] = 10_000_000
    size_weight: ClassVar[int] = 150

    def priority(self, candidate: Candidate) -> Any:
        if candidate.use_count >= 2:
            return candidate.last_use + self.protect_tokens
        return candidate.last_use - self.size_weight * candidate.request_tokens

    def native_params(self) -> dict[str, int]:
        return {"protect_tokens": self.protect_tokens, "size_weight": self.size_weight}


class Chain(GSLRU):
    """Our tier policy: gslru's order on a chain's own statistics, and only chain tails leave.

    Prefix-aware: in a lower tier only a block no other block of the tier extends may
    leave (`leaves_only`), so a tier never keeps a chain's tail while dropping the
    prefix it needs. Frequency-aware per chain, not per block: a block counts as
    reused (protected by `protect_tokens` of traffic, as gslru's reused content) when
    it was hit again, or when the request that computed it continued a chain (its hit
    ended at a block only that block's own computer had used: a conversation's next
    turn), because a continued chain is the one that comes back (on the Mooncake
    conversation trace a first turn is continued 30% of the time, a fourth 59%).
    One-off content ranks earlier by `size_weight` tokens of traffic per prompt token
    of its request, as in gslru. On a device pool (no tier) it orders as gslru without
    its ghost table.
    """

    name = "chain"
    native = "chain"
    history = 0
    leaves_only = True


BUILTIN_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRU, LFU, FIFO, MRU, FILO, Priority, SLRU, TLRU, GSLRU, Chain)
}
"""The built-in policies by name: what `prefixcache.registry` resolves an `eviction:` name to
when no policy is registered under it."""

