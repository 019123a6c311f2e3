"""Fuzz harness: the Mooncake trace reader (`prefixcache.workloads.read_mooncake`).

Each input becomes a JSONL trace of a few lines: raw bytes (not UTF-8, not JSON, NUL,
a bare CR), records assembled from the real fields with values of every JSON type
(missing fields, floats, bools, NaN and Infinity, negatives, huge and too-long ints,
deep nesting, a wrong `block_size`), and good records. Reading it, with and without a
`max_token_id` (the radix tree's int32 limit, or a small one), must give a workload
whose requests match the records, or raise `ValueError` whose message is one line that
starts with `path:line: ` for the 1-based line at fault (or `path: ` for the outputs);
anything else is a bug.

    python fuzz/fuzz_trace.py -max_total_time=600
"""

from __future__ import annotations

import json
import os
import re
import tempfile

from harness import main
from reader import EDGE_INTS, Reader

from prefixcache.workloads import read_mooncake

_FILE = os.path.join(tempfile.mkdtemp(prefix="prefixcache-fuzz-"), "trace.jsonl")
BLOCK = 4  # TOKENS per hash_ids block: small, so lengths stay consistent often

VALUES = [
    "0", "1", "-1", "3.5", "1e3", "true", "null", '"7"', "[]", "{}", "NaN", "Infinity", "-Infinity",
    str(2**31), str(2**63), "9" * 5000, "[" * 3000 + "]" * 3000,
]  # fmt: skip


def field_value(r: Reader, name: str) -> str:
    if r.int(0, 3):
        if name == "hash_ids":
            ids = [r.choice([r.int(0, 5), r.choice(EDGE_INTS)]) for _ in range(r.int(0, 4))]
            return json.dumps(ids) if r.int(0, 5) else "[" + r.choice(VALUES) + "]"
        if name == "input_length":
            return str(r.int(0, 20))
        if name == "timestamp":
            return str(r.int(0, 1000))
        return str(r.int(0, 8))
    return r.choice(VALUES)


def line(r: Reader) -> bytes:
    kind = r.int(0, 9)
    if kind == 0:
        return r.raw(40).replace(b"\n", b" ")
    if kind == 1:
        return r.choice([b"", b"   ", b"\xff\xfe", b"\x00", b"\r", b"{", b"[1]", b'"x"', b"\xed\xa0\x80"])
    fields = ["timestamp", "input_length", "output_length", "hash_ids"]
    if r.int(0, 7) == 0:
        fields.append("block_size")
    parts = []
    for name in fields:
        if r.int(0, 11) == 0:
            continue  # missing
        text = str(r.choice([BLOCK, 512, "x"])) if name == "block_size" else field_value(r, name)
        parts.append(f'"{name}": {text}')
    if kind == 2:  # a good record, consistent lengths
        n = r.int(1, 3)
        ids = [r.int(0, 6) for _ in range(n)]
        return json.dumps({"timestamp": r.int(0, 99), "input_length": (n - 1) * BLOCK + r.int(1, BLOCK),
                           "output_length": r.int(0, 5), "hash_ids": ids}).encode()
    return ("{" + ", ".join(parts) + "}").encode()


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    lines = [line(r) for _ in range(r.int(1, 6))]
    with open(_FILE, "wb") as f:
        f.write(b"\n".join(lines) + (b"\n" if r.bool() else b""))
    max_token_id = r.choice([None, 2**31 - 1, 23])
    limit = r.choice([None, None, 2])
    try:
        workload = read_mooncake(_FILE, block_size=BLOCK, limit=limit, outputs=r.bool(), max_token_id=max_token_id)
    except ValueError as err:
        message = str(err)
        assert "\n" not in message and len(message) < 400, f"not one short line: {message[:300]!r}"
        where = re.match(rf"{re.escape(_FILE)}(:(\d+))?: ", message)
        assert where, f"the error does not name the file: {message[:300]!r}"
        if where.group(2):
            assert 1 <= int(where.group(2)) <= len(lines) + 1, message
        return
    assert len(workload) <= len(lines) and (limit is None or len(workload) <= limit)
    for request in workload.requests:
        assert len(request.prompt) >= 1 and request.arrival_s >= 0
        if max_token_id is not None and request.prompt:
            assert max(stop for _, stop in request.prompt.runs) - 1 <= max_token_id


if __name__ == "__main__":
    main(test_one_input)
