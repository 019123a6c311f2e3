"""Fuzz harness: the YAML configuration loaders (`load_config`, and the A/B loader).

Each input becomes a YAML file: raw bytes; a `cache:` section assembled from the real
keys with values of every YAML type (wrong types, unknown keys, nested maps, huge
numbers, odd strings); or an A/B file (a generator or a trace, capacities, arms). Any
of them may carry anchors, aliases (chained, as in an alias bomb, or to their own
enclosing node), merge keys and deep nesting. Loading must give a valid config or raise
`ConfigError` whose message is one line that names the file, bounded in length, and
within the input's time budget; anything else (a crash, another exception type, a
multi-line or huge message, a config that violates its own constraints) is a bug.

    python fuzz/fuzz_config.py -max_total_time=600
"""

from __future__ import annotations

import os
import tempfile

from harness import main
from reader import Reader

import inspect

from prefixcache import _C, registry
from prefixcache.ab_config import ABConfig, parse_ab_config
from prefixcache.config import HASH_ALGORITHMS, CacheConfig, ConfigError, load_yaml
from prefixcache.config_checks import load_config

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
    "1073741825",  # one past the pool's block limit
    "16777217",  # one past hit verification's block size
    "9223372036854775808",  # past int64
    "0x" + "f" * 1200,  # an int too big to print
    "9" * 5000,  # an int too long to parse
    "2001-02-30",  # a date that does not exist
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
    "*b",
    "!!binary aGk=",
    "!!python/name:os.system",
    "1.5",
    ".inf",
    "sha256_cbor",
    "xxhash",
    "md5",
    "'pkg.mod:Cls'",
    "'nope:Nope'",
    "'.evil:X'",
    "'prefixcache.protocol:PrefixCache'",
    "'json:JSONDecodeError'",
    '"\\ud800"',
    "{verify_hits: never}",
    "{verify_hits: always}",
]
ANCHORS = [
    # a chain of anchors, each nine aliases of the last: an alias bomb when long
    lambda depth: "".join(
        f"l{i}: &l{i} [{', '.join([f'*l{i - 1}' if i else 'lol'] * 9)}]\n" for i in range(depth)
    ),
    lambda depth: "b: &b {backend: radix, block_size: 4}\n",
    lambda depth: "r: &r [" * depth + "*r" + "]" * depth + "\n",  # an alias inside its own node
]


def nested(r: Reader) -> str:
    depth = r.choice([2, 30, 33, 200])  # deeper costs PyYAML 1024 characters of look-ahead each time
    return "[" * depth + r.choice(["1", "", "*a"]) + "]" * depth


def value(r: Reader) -> str:
    kind = r.int(0, 9)
    if kind == 0:
        return nested(r)
    if kind == 1:
        return f"*l{r.int(0, 8)}"
    return r.choice(SCALARS)


def cache_section(r: Reader, indent: str = "  ") -> list[str]:
    lines = []
    if r.int(0, 5) == 0:
        lines.append(f"{indent}<<: *b")
    for _ in range(r.int(0, 8)):
        key = r.choice(KEYS)
        if key == "hash" and r.bool():
            lines.append(f"{indent}hash: {{algorithm: {r.choice([*HASH_ALGORITHMS, 'md5', '1', '[]'])}, seed: {value(r)}}}")
        else:
            lines.append(f"{indent}{key}: {value(r)}")
    return lines


def ab_document(r: Reader) -> list[str]:
    workload = r.choice([
        "{generator: no_sharing, params: {num_requests: 3, prompt_len: 8}}",
        "{generator: tree_of_thought, params: {branching: 1000, depth: 100000}}",
        "{generator: no_sharing, params: {num_requests: 100000000}}",
        "{generator: nope}",
        "{mooncake: {path: null}}",
        "{mooncake: {path: /nonexistent.jsonl}}",
        f"{{generator: rag, params: {{seed: {value(r)}}}}}",
        value(r),
    ])
    lines = [f"workload: {workload}", f"capacity_tokens: {r.choice(['4096', '100000000000000', '0', value(r)])}"]
    if r.bool():
        lines.append(f"sweep_capacities: [{r.choice(['256', '1', '100000000000000', value(r)])}]")
    lines.append("arms:" if r.int(0, 7) else f"arms: {value(r)}")
    for name in r.choice([["hash/16"], ["hash/16", "radix/1"], ["bad name!"]]):
        lines.append(f"  {name}:")
        lines += cache_section(r, "    ")
    return lines


def document(r: Reader) -> bytes:
    if r.int(0, 3) == 0:  # as the harness always began: saved inputs keep their meaning
        return r.raw(300)
    head = "".join(anchor(r.choice([1, 3, 8])) for anchor in ANCHORS if r.bool())
    if r.int(0, 3) == 0:
        return (head + "\n".join(ab_document(r))).encode()
    lines = ["cache:"] if r.int(0, 7) else [r.choice(["cache: 3", "cache: [1]", "other: 1", "", "cache: *l3"])]
    return (head + "\n".join(lines + cache_section(r))).encode()


def test_one_input(data: bytes) -> None:
    r = Reader(data)
    with open(_FILE, "wb") as f:
        f.write(document(r))
    try:
        loaded = load_yaml(_FILE)
        config = parse_ab_config(loaded, _FILE, check_trace=False) if "arms" in loaded else load_config(_FILE)
    except ConfigError as err:
        message = str(err)
        assert message.startswith(f"{_FILE}: "), f"the error does not name the file: {message[:300]}"
        assert "\n" not in message and len(message) < 1300, f"not one short line: {message[:300]!r}"
        return
    for cache in config.arms.values() if isinstance(config, ABConfig) else [config]:
        assert isinstance(cache, CacheConfig)
        assert cache.block_size >= 1 and cache.num_blocks >= 1 and cache.hash.algorithm in HASH_ALGORITHMS
        assert cache.replace() == cache  # validates again, identically
        buildable(cache)


def buildable(cache: CacheConfig) -> None:
    """What the native core would refuse when the cache is built, checked against the
    native core itself (cheaply: no pool of num_blocks is made)."""
    assert cache.num_blocks <= _C.MAX_NUM_BLOCKS, f"loaded num_blocks={cache.num_blocks} that no pool holds"
    assert cache.block_size <= _C.MAX_BLOCK_SIZE, f"loaded block_size={cache.block_size} past int64"
    cls = registry.backend_class(cache.backend)
    assert not inspect.isabstract(cls), f"loaded an abstract backend {cache.backend!r}"
    verify = cache.options.get("verify_hits", "auto")
    if "verify_hits" in cls.option_defaults and (verify == "always" or verify == "auto" and "xx" in cache.hash.algorithm):
        _C.BlockContents(_C.BlockPool(1), cache.block_size)  # raises past what verification records


if __name__ == "__main__":
    main(test_one_input)
