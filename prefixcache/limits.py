"""What the native core can represent, read once from it: the limits load-time checks compare against.

Owns the names of the numbers that `prefixcache._C` exports from the C++ that decides
them:

- `MAX_NUM_BLOCKS`: blocks a `BlockPool` holds (ids and sentinels are int32);
- `MAX_BLOCK_SIZE`: TOKENS per block that chain hashing and the radix tree's page
  size take (they cross into C++ as int64);
- `MAX_VERIFIED_BLOCK_SIZE`: TOKENS per block that hit verification (`BlockContents`,
  the `hash` backend under xxhash or `verify_hits: always`) records;
- `PRIORITY_RANGE`: the `admit(priority=)` values a tree node or an evictor keeps (int64);
- `RADIX_TOKEN_RANGE`: the token ids the radix tree stores (int32; the radix backend
  declares it as its `token_id_range`).

A config that names a value past one of these is refused when it is loaded, naming the
key (`prefixcache.config`, `prefixcache.config_checks`, `prefixcache.ab_config`), so
`prefixcache validate` says what building would.

Must never: hold a number of its own for something the native core decides (each is
defined once, in csrc/, and read here), or import anything of prefixcache but `_C`.
"""

from __future__ import annotations

from prefixcache import _C

__all__ = [
    "MAX_NUM_BLOCKS",
    "MAX_BLOCK_SIZE",
    "MAX_VERIFIED_BLOCK_SIZE",
    "PRIORITY_RANGE",
    "RADIX_TOKEN_RANGE",
]

MAX_NUM_BLOCKS: int = _C.MAX_NUM_BLOCKS
MAX_BLOCK_SIZE: int = _C.MAX_BLOCK_SIZE
MAX_VERIFIED_BLOCK_SIZE: int = _C.MAX_VERIFIED_BLOCK_SIZE
PRIORITY_RANGE: tuple[int, int] = (_C.PRIORITY_MIN, _C.PRIORITY_MAX)
RADIX_TOKEN_RANGE: tuple[int, int] = (_C.RADIX_TOKEN_MIN, _C.RADIX_TOKEN_MAX)

