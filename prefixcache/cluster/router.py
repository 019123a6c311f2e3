"""The router interface: choose among candidate replicas for a request.

Owns `Router` (the one interface every router implements), what a router is shown
(`RoutingRequest`, `ReplicaLoad`), what it is built with (`RouterContext`), and
`pick_replica`, the rule that turns a router's ranked answer into one replica.

The shape is Ray Serve's `RequestRouter` (`ray.serve.request_router`):
`choose_replicas(candidates, request)` returns RANKED GROUPS of candidates (as their
positions in `candidates`), best group first; the caller takes the first group with a
candidate in it and, within the group, the least-loaded one (Ray probes queue lengths
for that; here loads come with the candidates: `pick_replica`). `on_request_routed`
tells the router where a request went, and `on_replica_added` / `on_replica_removed`
follow the replica set (Ray's `update_replicas` / `on_replica_actor_died`). A Ray Serve
adapter is then a thin shell: it turns Ray's candidate list and pending request into
`Candidates` and a `RoutingRequest`, and the ranked positions back into Ray's replicas.

`Candidates` holds the loads as columns (one `array('q')` per field, aligned with
`replicas`), so a router that weighs every candidate reads whole columns (natively, for
`kv_events`) instead of building an object per replica per request; `candidates[i]`
is the same row as a `ReplicaLoad`, for routers that read a few.

Load. A replica's load is the TOKENS of the requests routed to it and not finished,
queued plus running (`ReplicaLoad.tokens`, each request counting prompt + output
tokens); `ReplicaLoad` also carries the request counts (all, and those still waiting for
a slot: vLLM's `num_requests_waiting`, which llm-d's queue scorer reads), the KV blocks
its running requests hold (vLLM's KV-cache usage times its blocks, which llm-d's
utilization scorer reads) and the two sums NVIDIA Dynamo's router keeps per worker
(`ActiveSequences`) and its cost reads: prompt tokens still to prefill and the distinct
prompt blocks of active requests. Each router says which it reads.

Lifecycle hooks. Besides `on_request_routed`, the cluster that routes tells a router when
a request's first token is out (`on_first_token`: its prefill is done, as Dynamo's
`mark_prefill_completed`) and when it completes (`on_request_completed`, also for a
request that failed or was rejected), in the simulation and in the Ray Serve adapter
alike. `RouterContext.service` is the replicas' service model where the cluster knows it
(the simulation's; a deployment's, given to the adapter), for routers that estimate time.

Must never: touch a cache or an event stream (the KV index arrives built, through
`RouterContext.index`), or sleep: a decision is a pure function of the router's own
state, the candidates and the request.
"""

from __future__ import annotations

import dataclasses
import random
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from prefixcache.cluster.kv_index import KVIndex, ReplicaId
from prefixcache.cluster.prompt_hashes import PromptHasher, PromptHashes
from prefixcache.service_model import ServiceModel
from prefixcache.config import ConfigError, from_mapping
from prefixcache.isolation import Namespace

__all__ = [
    "ReplicaId",
    "ReplicaLoad",
    "Candidates",
    "RoutingRequest",
    "RouterContext",
    "Router",
    "Ranked",
    "LoadUnit",
    "pick_replica",
]

LoadUnit = Literal["requests", "tokens"]
"""How a router that compares loads against thresholds counts them."""
Ranked = list[list[int]]
"""Groups of positions in `candidates`, best group first (Ray Serve's `choose_replicas`
result, which lists the candidates themselves)."""


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What a router knows of one candidate replica's load. Counts in TOKENS unless a name
    says blocks or requests.

    queued_tokens:  prompt + output tokens of requests waiting for a slot
    running_tokens: prompt + output tokens of requests running (prefill or decode)
    num_requests:   requests queued + running
    prefill_tokens: prompt tokens of queued and running requests whose first token is
                    not out yet, each counted as what the replica's cache did not hold
                    when it was routed (Dynamo's active prefill tokens)
    active_blocks:  distinct full prompt blocks of queued and running requests: a block
                    several of them share counts once, output blocks not at all
                    (Dynamo's active blocks, its `router_track_output_blocks` off)
    queued_requests: requests waiting for a slot (vLLM's `num_requests_waiting`)
    kv_blocks:      BLOCKS of KV its running requests hold (vLLM's KV-cache usage x its
                    blocks; where the cluster cannot see the replica's pool, an estimate
                    from what it routed there)
    """

    replica: ReplicaId
    queued_tokens: int = 0
    running_tokens: int = 0
    num_requests: int = 0
    prefill_tokens: int = 0
    active_blocks: int = 0
    queued_requests: int = 0
    kv_blocks: int = 0

    @property
    def tokens(self) -> int:
        """The load: queued + running TOKENS."""
        return self.queued_tokens + self.running_tokens

    def amount(self, unit: LoadUnit) -> int:
        """The load counted in `unit`: "tokens" (queued + running) or "requests"."""
        return self.num_requests if unit == "requests" else self.queued_tokens + self.running_tokens


V = TypeVar("V")

LOAD_FIELDS = ("queued_tokens", "running_tokens", "num_requests", "prefill_tokens", "active_blocks", "queued_requests",
               "kv_blocks")
"""The columns of `Candidates`, the fields of `ReplicaLoad` after `replica`."""


class Candidates:
    """The replicas a request may go to and their loads, as columns aligned with
    `replicas` (see `ReplicaLoad` for each field's meaning). The cluster that routes owns
    it and keeps it current (it may update columns in place between requests); a router
    reads it and never changes it. O(1) per row by position or by replica id."""

    __slots__ = ("replicas", "_row", *LOAD_FIELDS)

    def __init__(self, replicas: Iterable[ReplicaId]) -> None:
        self.replicas: list[ReplicaId] = list(replicas)
        if not self.replicas:
            raise ValueError("a request needs at least one candidate replica")
        self._row = {r: i for i, r in enumerate(self.replicas)}
        if len(self._row) != len(self.replicas):
            raise ValueError(f"candidate replicas repeat: {self.replicas!r}")
        zeros = array("q", bytes(8 * len(self.replicas)))
        self.queued_tokens = array("q", zeros)
        self.running_tokens = array("q", zeros)
        self.num_requests = array("q", zeros)
        self.prefill_tokens = array("q", zeros)
        self.active_blocks = array("q", zeros)
        self.queued_requests = array("q", zeros)
        self.kv_blocks = array("q", zeros)

    @classmethod
    def of(cls, loads: Iterable[ReplicaLoad]) -> Candidates:
        """Candidates from one `ReplicaLoad` per replica."""
        loads = list(loads)
        out = cls(load.replica for load in loads)
        for i, load in enumerate(loads):
            for name in LOAD_FIELDS:
                getattr(out, name)[i] = getattr(load, name)
        return out

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, i: int) -> ReplicaLoad:
        """Row i as a ReplicaLoad."""
        return ReplicaLoad(self.replicas[i], *(getattr(self, name)[i] for name in LOAD_FIELDS))

    def __iter__(self) -> Iterator[ReplicaLoad]:
        return (self[i] for i in range(len(self.replicas)))

    def row(self, replica: ReplicaId) -> int:
        """The position of `replica`; KeyError if it is not a candidate."""
        return self._row[replica]

    def get_row(self, replica: ReplicaId) -> int | None:
        """The position of `replica`, or None."""
        return self._row.get(replica)

    def by_position(self, by_replica: Mapping[ReplicaId, V]) -> dict[int, V]:
        """`by_replica` keyed by candidate position instead (replicas that are not
        candidates left out): how a router reads the KV index's {replica: blocks}."""
        rows = self._row
        return {rows[r]: v for r, v in by_replica.items() if r in rows}

    def tokens(self, i: int) -> int:
        """Row i's load: queued + running TOKENS."""
        return self.queued_tokens[i] + self.running_tokens[i]

    def amounts(self, unit: LoadUnit) -> list[int]:
        """Every row's load counted in `unit`."""
        if unit == "requests":
            return self.num_requests.tolist()
        return [q + r for q, r in zip(self.queued_tokens, self.running_tokens, strict=True)]


class RoutingRequest:
    """A request being routed: its tokens (a sequence of int ids: a list, or an int32
    buffer where the cluster holds one), namespace and expected
    output length (TOKENS; a client's max_tokens). `hashes` are its prompt's chained
    block hashes under the replicas' hash config, computed on first use and kept, so a
    router that never reads them never pays for them."""

    __slots__ = ("request_id", "tokens", "namespace", "num_output_tokens", "_hasher", "_hashes")

    def __init__(
        self,
        request_id: Hashable,
        tokens: Sequence[int],
        *,
        namespace: Namespace = None,
        num_output_tokens: int = 0,
        hasher: PromptHasher | None = None,
    ) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.namespace = namespace
        self.num_output_tokens = num_output_tokens
        self._hasher = hasher
        self._hashes: PromptHashes | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens)

    @property
    def hashes(self) -> PromptHashes:
        """The prompt's chained block hashes (full blocks only)."""
        if self._hashes is None:
            if self._hasher is None:
                raise ValueError(f"request {self.request_id!r} has no hasher: build it with hasher=PromptHasher(...)")
            self._hashes = self._hasher(self.tokens, self.namespace)
        return self._hashes


@dataclass(frozen=True)
class RouterContext:
    """What a router is built with, besides its options.

    block_size:      TOKENS per block of the replicas' caches (their hash config's)
    capacity_tokens: TOKENS one replica's cache holds (a default for predicted-cache sizes)
    index:           the cluster KV index, fed by the replicas' events (None where there is none)
    rng:             the router's random source (seeded: a replay is reproducible)
    clock:           the current time in SECONDS (simulated time in a simulation)
    service:         the replicas' service model (`ServiceModel`: step costs, prefill
                     estimates, capacity), None where the cluster does not know it
    active:          the active sequences, kept by the cluster that routes (None where it
                     keeps none): a `KVIndex` holding, per replica, the full prompt blocks
                     of each request routed there and not finished, one copy per request
                     (NVIDIA Dynamo's `ActiveSequences`, which its router keeps because it
                     sees every request start and finish); `active.blocks(replica)` is the
                     `active_blocks` column. Read-only to a router.
    """

    block_size: int
    capacity_tokens: int
    index: KVIndex | None = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    clock: Callable[[], float] = lambda: 0.0
    active: KVIndex | None = None
    service: ServiceModel | None = None


class Router(ABC):
    """Chooses among candidate replicas for a request (see the module docstring).

    A router is one class: `choose_replicas` and, where it keeps state, the `on_*` hooks.
    Its options are the frozen dataclass `Options` (None: it takes none), validated at
    config load; registered by name with `@register_router`, or named by
    "package.module:ClassName" or a `prefixcache.routers` entry point.
    """

    name: ClassVar[str] = ""
    Options: ClassVar[type | None] = None
    needs_index: ClassVar[bool] = False
    """Whether the router reads `context.index` (the cluster is then built to feed one)."""

    def __init__(self, context: RouterContext, options: Any = None) -> None:
        if options is None and self.Options is not None:
            options = self.Options()
        if self.needs_index and context.index is None:
            raise ValueError(f"router {type(self).__name__} reads the KV index, but its context has none")
        self.context = context
        self.options = options

    @classmethod
    def parse_options(cls, data: Mapping[str, Any] | None, path: str = "options") -> Any:
        """`data` as this router's `Options`; ConfigError naming `path`.key and what is allowed."""
        if cls.Options is None:
            if data:
                raise ConfigError(path, f"router {cls.__name__} takes no options, got {', '.join(map(str, data))}")
            return None
        return from_mapping(cls.Options, dict(data or {}), path)

    @classmethod
    def option_values(cls, options: Any) -> dict[str, Any]:
        """Options as a plain dict (for reports)."""
        return {} if options is None else dataclasses.asdict(options)

    @abstractmethod
    def choose_replicas(self, candidates: Candidates, request: RoutingRequest) -> Ranked:
        """Ranked groups of candidate positions for `request`, best first (`candidates` is
        never empty; a group may be, and is skipped)."""

    def on_request_routed(self, request: RoutingRequest, replica: ReplicaId) -> None:
        """`request` was sent to `replica`."""

    def on_first_token(self, request: RoutingRequest, replica: ReplicaId) -> None:
        """`request`'s first token is out of `replica`: its prefill is done."""

    def on_request_completed(self, request: RoutingRequest, replica: ReplicaId) -> None:
        """`request` left `replica`: finished, failed, or rejected there."""

    def on_replica_added(self, replica: ReplicaId) -> None:
        """`replica` joined the candidate set."""

    def on_replica_removed(self, replica: ReplicaId) -> None:
        """`replica` left the candidate set (removed, or died)."""


def pick_replica(ranked: Ranked, candidates: Candidates) -> int:
    """The candidate position a ranked answer stands for: in the first non-empty group,
    the least loaded (TOKENS), the earlier in the group on a tie. ValueError for a
    position that is not a candidate's, or when every group is empty (a router bug,
    reported with its answer)."""
    n = len(candidates)
    for group in ranked:
        best, best_tokens = -1, 0
        for i in group:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
                raise ValueError(f"the router's answer {ranked!r} has {i!r}, not a position among {n} candidates")
            tokens = candidates.tokens(i)
            if best < 0 or tokens < best_tokens:
                best, best_tokens = i, tokens
        if best >= 0:
            return best
    raise ValueError(f"the router's answer {ranked!r} names none of the {n} candidates")
