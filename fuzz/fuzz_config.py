"""Fuzz harness: the YAML configuration loader (`prefixcache.config.load_config`).

Each input becomes a YAML file: either raw bytes, or a `cache:` section assembled from
the real keys with values of every YAML type (wrong types, unknown keys, nested maps,
anchors, huge numbers, odd strings). Loading must give a valid `CacheConfig` or raise
`ConfigError` naming the file; anything else (a crash, another exception type, a
config that violates its own constraints) is a bug.

    python fuzz/fuzz_config.py -max_total_time=600
"""

from __future__ import annotations

import os
import tempfile

from harness import main
from reader import Reader

from prefixcache.config import HASH_ALGORITHMS, CacheConfig, ConfigError, load_config

_FILE = os.path.join(tempfile.mkdtemp(prefix="prefixcache-fuzz-"), "config.yaml")

KEYS = ["backend", "block_size", "num_blocks", "hash", "eviction", "enable_events", "options", "bogus"]
SCALARS = [
    "hash",
    "radix",
    "lru",
    "lfu",
    "0",
    "1",
    "16",
    "-3",
    "1e3",
    "4096",
    "99999999999999999999",
    "true",
    "null",
    "~",
    "''",
    '"x"',
    "[1, 2]",
    "{}",
    "{a: 1}",
    "&a 7",
    "*a",
    "!!binary aGk=",
    "1.5",
    ".inf",
    "sha256_cbor",
    "xxhash",
    "md5",
    "'pkg.mod:Cls'",
    "'nope:Nope'",
    '"\\ud800"',
]


def document(r: Reader) -> bytes:
    if r.int(0, 3) == 0:
        return r.raw(300)
    lines = ["cache:"] if r.int(0, 7) else [r.choice(["cache: 3", "cache: [1]", "other: 1", ""])]
    for _ in range(r.int(0, 8)):
        key = r.choice(KEYS)
        if key == "hash" and r.bool():
            lines.append(
                f"  hash: {{algorithm: {r.choice([*HASH_ALGORITHMS, 'md5', '1', '[]'])}, seed: {r.choice(SCALARS)}}}"
            )
        else:
            lines.append(f"  {key}: {r.choice(SCALARS)}")
    return "\n".join(lines).encode()


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    with open(_FILE, "wb") as f:
        f.write(document(r))
    try:
        config = load_config(_FILE)
    except ConfigError as err:
        assert _FILE in str(err), f"the error does not name the file: {err}"
        return
    assert isinstance(config, CacheConfig)
    assert config.block_size >= 1 and config.num_blocks >= 1 and config.hash.algorithm in HASH_ALGORITHMS
    assert config.replace() == config  # validates again, identically


if __name__ == "__main__":
    main(test_one_input)
