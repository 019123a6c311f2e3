"""An eviction candidate as plain data: what the Python twins (`PyRadixTree`,
`PyBlockEvictor`) hand a policy, as the native code hands `_C.EvictionCandidate`.

Owns `CandidateRecord`, whose fields are read from `_C.CANDIDATE_FIELDS` (the one
definition, csrc/eviction_order.h), so a field added there reaches the twins' records
without being spelled again. Must never: rank or evict anything.
"""

from __future__ import annotations

from dataclasses import make_dataclass

from prefixcache._C import CANDIDATE_FIELDS

__all__ = ["CandidateRecord"]

CandidateRecord = make_dataclass(
    "CandidateRecord",
    [("id", int, 0), *((name, int, 0) for name in CANDIDATE_FIELDS)],
    frozen=True,
    namespace={
        "node": property(lambda self: self.id, doc="Node id (radix)."),
        "block": property(lambda self: self.id, doc="Block id (hash)."),
    },
)
CandidateRecord.__module__ = __name__
CandidateRecord.__doc__ = "A `prefixcache.eviction.Candidate` as a frozen dataclass: `id`, then `_C.CANDIDATE_FIELDS`."
