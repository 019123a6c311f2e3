"""Mooncake JSONL traces: read them as workloads, write them, and make small ones for tests.

Format (FAST'25 Mooncake release, `FAST25-release/traces/`): one JSON object a line,
`{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [int]}`.
`hash_ids` are prefix-chained ids of 512-token blocks (`len == ceil(input_length / 512)`,
the last block partial unless the length is a multiple of 512).

Expansion into tokens (what makes a trace a workload a real cache can replay): block id h
becomes the 512 ids `[h*512, (h+1)*512)`, the last block cut to the real length, so equal
ids are equal tokens and different ids share no token. Each request's output is
`output_length` fresh ids above every block's range: the trace does not say what was
generated, and it counts reuse of INPUT blocks only (a next turn's prompt holds the
earlier answer as new input blocks), so no later prompt contains an output. A replay
that commits outputs therefore fills cache room with blocks that are never hit, as a real
engine does; `outputs=False` drops them, as the paper's and `kvcache-simulator`'s
replays do.

Reading is bounded and every problem is one `ValueError` naming the file and the
1-based line: a line that is not UTF-8, not JSON, longer than `MAX_LINE_BYTES`, or a
field of the wrong type or value; a timestamp before the previous record's; a trace of
more than `checks.MAX_REQUESTS` records or `checks.MAX_PROMPT_TOKENS` prompt tokens;
and, when the reader is told the largest token id the replay's caches store
(`max_token_id`), a block id whose tokens would pass it.

Must never: be read by tests from `../shared/traces/` (tests write small traces with
`synthetic_records`), or commit those traces.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from prefixcache.config import open_regular_file, short_repr
from prefixcache.workloads.checks import (
    MAX_PROMPT_TOKENS,
    MAX_REQUESTS,
    AtLeast,
    NonNegative,
    Positive,
    Probability,
    check_int,
    checked_params,
    parse_json_object,
)
from prefixcache.workloads.tokens import TokenRuns
from prefixcache.workloads.workload import Request, Workload

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "MooncakeRecord",
    "read_records",
    "write_records",
    "records_to_workload",
    "read_mooncake",
    "workload_to_records",
    "synthetic_records",
    "published_ceiling",
]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per `hash_ids` block in the Mooncake traces."""
MAX_LINE_BYTES = 1 << 24
"""The longest trace line read (16 MiB: two million block ids, a prompt of a billion tokens)."""


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One trace line. `timestamp_ms` in MILLISECONDS; lengths in TOKENS."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def check(self, where: str, block_size: int = MOONCAKE_BLOCK_SIZE) -> None:
        """ValueError naming `where` (file:line) and the field if the record is malformed."""
        t = self.timestamp_ms
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 0 and math.isfinite(t)):
            raise ValueError(f"{where}: field 'timestamp' must be a finite number of milliseconds >= 0, "
                             f"got {short_repr(t)}")
        for field, value, minimum in (("input_length", self.input_length, 1), ("output_length", self.output_length, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{where}: field '{field}' must be an int >= {minimum}, got {short_repr(value)}")
        for i, h in enumerate(self.hash_ids):
            if isinstance(h, bool) or not isinstance(h, int) or h < 0:
                raise ValueError(f"{where}: field 'hash_ids' must hold ints >= 0, got hash_ids[{i}] = {short_repr(h)}")
        expected = -(-self.input_length // block_size)
        if len(self.hash_ids) != expected:
            raise ValueError(
                f"{where}: field 'hash_ids' has {len(self.hash_ids)} ids but input_length={self.input_length} "
                f"needs ceil({self.input_length}/{block_size}) = {expected}"
            )

    def to_json(self) -> str:
        return json.dumps({"timestamp": self.timestamp_ms, "input_length": self.input_length,
                           "output_length": self.output_length, "hash_ids": list(self.hash_ids)})


def read_records(
    path: str | Path,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    limit: int | None = None,
    max_token_id: int | None = None,
) -> list[MooncakeRecord]:
    """The validated records of a Mooncake JSONL file (the first `limit` if given; at
    most MAX_REQUESTS). With `max_token_id`, a block id whose tokens would pass it is an
    error at its line. OSError if the file cannot be read; ValueError naming
    `path:line` for anything wrong in it."""
    check_int("block_size", block_size, 1)
    if limit is not None:
        check_int("limit", limit, 0)
    records: list[MooncakeRecord] = []
    prompt_tokens = 0
    with open_regular_file(path) as f:  # a FIFO would block open() itself
        for lineno in itertools.count(1):
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            if limit is not None and len(records) >= limit:
                break
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                raise ValueError(f"{where}: line longer than {MAX_LINE_BYTES:,} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text (byte {err.start}: {err.reason})") from None
            if not line.strip():
                continue
            if len(records) == MAX_REQUESTS:
                raise ValueError(f"{where}: more than {MAX_REQUESTS:,} records; replay part of the trace (limit)")
            record = _parse_record(where, line, block_size, max_token_id)
            if records and record.timestamp_ms < records[-1].timestamp_ms:
                raise ValueError(f"{where}: field 'timestamp' {short_repr(record.timestamp_ms)} is before the previous "
                                 f"record's {short_repr(records[-1].timestamp_ms)}; records must be in time order")
            prompt_tokens += record.input_length
            if prompt_tokens > MAX_PROMPT_TOKENS:
                raise ValueError(f"{where}: the prompts so far hold more than {MAX_PROMPT_TOKENS:.0e} tokens; "
                                 "replay part of the trace (limit)")
            records.append(record)
    return records


def _parse_record(where: str, line: str, block_size: int, max_token_id: int | None) -> MooncakeRecord:
    obj = parse_json_object(where, line)
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    if "block_size" in obj and obj["block_size"] != block_size:
        raise ValueError(
            f"{where}: field 'block_size' is {short_repr(obj['block_size'])} but the reader expects {block_size}"
        )
    if not isinstance(obj["hash_ids"], list):
        raise ValueError(f"{where}: field 'hash_ids' must be a list of ints, got {short_repr(obj['hash_ids'])}")
    record = MooncakeRecord(obj["timestamp"], obj["input_length"], obj["output_length"], tuple(obj["hash_ids"]))
    record.check(where, block_size)
    if max_token_id is not None and record.hash_ids:
        h = max(record.hash_ids)
        if (h + 1) * block_size - 1 > max_token_id:
            raise ValueError(
                f"{where}: field 'hash_ids': block id {short_repr(h)} expands to token ids up to "
                f"{short_repr((h + 1) * block_size - 1)}, past {max_token_id}, the largest the caches store"
            )
    return record


def write_records(path: str | Path, records: Iterable[MooncakeRecord]) -> None:
    """Write `records` as a Mooncake JSONL file."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(record.to_json() + "\n")


def records_to_workload(
    records: Sequence[MooncakeRecord], *, name: str = "mooncake", block_size: int = MOONCAKE_BLOCK_SIZE,
    outputs: bool = True, params: dict[str, object] | None = None,
) -> Workload:
    """Expand trace records into a workload (module docstring): block id h -> token ids
    `[h*block_size, (h+1)*block_size)`; outputs fresh above all of them, or empty when
    `outputs` is False."""
    check_int("block_size", block_size, 1)
    for i, record in enumerate(records):
        record.check(f"records[{i}]", block_size)
    next_output = (max((max(r.hash_ids) for r in records), default=-1) + 1) * block_size
    requests = []
    for i, r in enumerate(records):
        last = r.input_length - (len(r.hash_ids) - 1) * block_size
        runs = [(h * block_size, h * block_size + block_size) for h in r.hash_ids[:-1]]
        h = r.hash_ids[-1]
        runs.append((h * block_size, h * block_size + last))
        out_len = r.output_length if outputs else 0
        output = TokenRuns(((next_output, next_output + out_len),))
        next_output += out_len
        requests.append(Request(r.timestamp_ms / 1000.0, TokenRuns(runs), output, None, f"line{i + 1}"))
    return Workload(name, tuple(requests), "mooncake", {"block_size": block_size, "outputs": outputs, **(params or {})})


def read_mooncake(
    path: str | Path,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    limit: int | None = None,
    outputs: bool = True,
    max_token_id: int | None = None,
) -> Workload:
    """A Mooncake trace file as a workload (the first `limit` records if given; without
    output tokens when `outputs` is False). With `max_token_id`, a ValueError names the
    first line whose tokens pass it, or says the outputs do."""
    records = read_records(path, block_size=block_size, limit=limit, max_token_id=max_token_id)
    workload = records_to_workload(records, name=Path(path).stem, block_size=block_size, outputs=outputs,
                                   params={"path": str(path), "limit": limit})
    if max_token_id is not None and outputs and records:
        last = (max(max(r.hash_ids) for r in records) + 1) * block_size + sum(r.output_length for r in records) - 1
        if last > max_token_id:
            raise ValueError(
                f"{path}: the outputs take token ids up to {last} (fresh ids above every block's), past "
                f"{max_token_id}, the largest the caches store; replay without outputs (outputs: false) or fewer records"
            )
    return workload


def workload_to_records(workload: Workload, *, block_size: int = MOONCAKE_BLOCK_SIZE) -> list[MooncakeRecord]:
    """`workload` in the Mooncake format: block ids are assigned by (previous block's id,
    block content), so equal prefixes get equal ids, namespace included.

    Lossy where the format is: token content becomes block identity, a prefix shared only
    up to the middle of a block is not shared, and outputs are lengths, so a later prompt
    that contains an earlier answer no longer matches that answer's cached blocks. Full
    prompt blocks round-trip exactly at `block_size`."""
    check_int("block_size", block_size, 1)
    ids: dict[tuple[object, object], int] = {}
    out = []
    for r in workload.requests:
        prev: object = ("namespace", r.namespace)
        chain = []
        full = len(r.prompt) // block_size
        contents: list[object] = list(r.prompt.full_blocks(block_size))
        if len(r.prompt) > full * block_size:
            contents.append(("partial", r.prompt[full * block_size:].runs))
        for content in contents:
            prev = ids.setdefault((prev, content), len(ids))
            chain.append(prev)
        out.append(MooncakeRecord(round(r.arrival_s * 1000.0), len(r.prompt), len(r.output), tuple(chain)))
    return out


@checked_params
def synthetic_records(
    num_records: NonNegative = 200,
    *,
    seed: int = 0,
    max_new_blocks: Positive = 8,
    reuse_probability: Probability = 0.7,
    max_gap_ms: NonNegative = 100,
    max_output: NonNegative = 600,
    aligned_probability: Probability = 0.1,
    block_size: Annotated[int, AtLeast(2)] = MOONCAKE_BLOCK_SIZE,
) -> list[MooncakeRecord]:
    """A small Mooncake-format trace with prefix sharing, for tests.

    Each record reuses, with `reuse_probability`, the first 1..all full blocks of a random
    earlier record, then adds 1..`max_new_blocks` fresh blocks whose last one is full with
    `aligned_probability` (the length is then a multiple of the block size) and else holds
    1..`block_size - 1` tokens."""
    rng = random.Random(seed)
    next_id, t = 0, 0
    full_chains: list[tuple[int, ...]] = []
    records = []
    for _ in range(num_records):
        prefix: tuple[int, ...] = ()
        if full_chains and rng.random() < reuse_probability:
            base = rng.choice(full_chains)
            prefix = base[: rng.randint(1, len(base))]
        new = rng.randint(1, max_new_blocks)
        chain = prefix + tuple(range(next_id, next_id + new))
        next_id += new
        tail = block_size if rng.random() < aligned_probability else rng.randint(1, block_size - 1)
        length = (len(chain) - 1) * block_size + tail
        full = chain if tail == block_size else chain[:-1]
        if full:
            full_chains.append(full)
        t += rng.randint(0, max_gap_ms)
        records.append(MooncakeRecord(t, length, rng.randint(0, max_output), chain))
    return records


def published_ceiling(
    records: Sequence[MooncakeRecord], *, block_size: int = MOONCAKE_BLOCK_SIZE
) -> tuple[float, float]:
    """Infinite-cache token hit ratio (whole trace, last 50% of requests) under the
    convention of the Mooncake paper's figures and `kvcache-simulator`: every block, the
    partial last one included, is cached and hit with its real token count, and a
    request may hit its whole prompt. A real cache does neither (`bounds.infinite_cache`),
    so this is slightly higher; it exists to reproduce the published numbers."""
    chain_ids: dict[tuple[int, int], int] = {}  # (previous block's chain id, hash id) -> chain id
    seen: set[int] = set()
    hits, totals = [], []
    for r in records:
        prev, chain = -1, []
        for h in r.hash_ids:
            prev = chain_ids.setdefault((prev, h), len(chain_ids))
            chain.append(prev)
        hit = 0
        for j, k in enumerate(chain):
            if k not in seen:
                break
            hit += min(block_size, r.input_length - j * block_size)
        seen.update(chain)
        hits.append(hit)
        totals.append(r.input_length)
    half = len(records) // 2
    last = sum(totals[half:])
    return sum(hits) / max(sum(totals), 1), (sum(hits[half:]) / last if last else 0.0)
