"""The disk tier's file: a header that names what wrote it, then one fixed-size record
per slot, each with a checksum that a load verifies.

Owns the layout (`TierFile.record_size`, `file_size`), the header (`FileIdentity`: the
model, the block size, the KV bytes a block holds, the hash algorithm; a file written by
another is refused by name), and positional reads and writes of one record
(`os.pread` / `os.pwrite`: no read-modify-write, no shared file offset). A record holds
the block's key (its chained hash), its parent's key, its token ids, its hit count and
its KV bytes, and an XXH3-64 checksum over all of them: a torn, truncated or corrupted
record reads as `None`, never as wrong KV.

Must never: decide what is stored where (`prefixcache.tiers` does), or know the KV's
shape beyond its byte count (the engine's `kv_tiers` packs and unpacks tensors).

Layout (little-endian):

    [0, 4096)                   header: MAGIC, then the identity as JSON, zero-padded
    [4096 + i * R, + R)         record of slot i, R = record_size (a multiple of 4096)
      u32 magic  u32 flags(1: holds a block)  u64 checksum  i64 hits
      key[32] parent[32] u8 has_parent pad[7]  i64 tokens[block_size]  KV bytes

A full disk (ENOSPC, EDQUOT) or any other OSError on a write is raised as `OSError` to
the caller, which counts the refusal; the file is opened with O_NOFOLLOW, so a path
swapped for a symbolic link after validation is refused rather than followed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from prefixcache.errors import ConfigError

__all__ = ["FileIdentity", "TierFile", "Record", "HEADER_SIZE", "KEY_CAPACITY", "file_size", "record_size", "room_for"]

MAGIC = b"PCTIER01"
RECORD_MAGIC = 0x50435452  # "PCTR"
HEADER_SIZE = 4096
KEY_CAPACITY = 32  # bytes a key or parent key occupies (SHA-256 digests are 32)
_FIXED = struct.Struct("<IIQq32s32sB7x")  # magic, flags, checksum, hits, key, parent, has_parent
_ALIGN = 4096


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def record_size(block_size: int, kv_bytes: int) -> int:
    """BYTES one slot takes: the fixed fields, `block_size` int64 token ids, `kv_bytes`
    of KV, rounded up to 4 KiB."""
    return _align(_FIXED.size + 8 * block_size + kv_bytes)


def room_for(path: str | Path) -> int:
    """BYTES a tier file at `path` may grow to: the free space of its disk plus what the
    file (a regular file, not a link) already takes."""
    path = Path(path)
    existing = path.stat().st_size if path.is_file() and not path.is_symlink() else 0
    return shutil.disk_usage(path.parent if str(path.parent) else ".").free + existing


def file_size(num_slots: int, block_size: int, kv_bytes: int) -> int:
    """BYTES a tier file of `num_slots` slots takes once every slot is written."""
    return HEADER_SIZE + num_slots * record_size(block_size, kv_bytes)


@dataclass(frozen=True)
class FileIdentity:
    """What wrote a tier file; a file whose identity differs is refused by name.

    model:       the model's name (or file) and its KV shape, as the engine describes it
    block_size:  TOKENS per block
    kv_bytes:    BYTES of KV per block
    algorithm:   the chained hash the keys are (`cache.hash.algorithm`)
    num_slots:   slots in the file (a larger or smaller tier reads the common slots)
    """

    model: str
    block_size: int
    kv_bytes: int
    algorithm: str
    num_slots: int

    def to_bytes(self) -> bytes:
        body = MAGIC + json.dumps(asdict(self), sort_keys=True).encode()
        if len(body) > HEADER_SIZE:
            raise ConfigError("path", "the model's description is too long for a tier file header")
        return body.ljust(HEADER_SIZE, b"\0")

    @classmethod
    def from_bytes(cls, raw: bytes) -> FileIdentity | None:
        if not raw.startswith(MAGIC):
            return None
        try:
            data = json.loads(raw[len(MAGIC) :].rstrip(b"\0"))
            return cls(**data)
        except (ValueError, TypeError):
            return None


@dataclass(frozen=True)
class Record:
    """One slot's content, verified."""

    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    hits: int
    kv: bytes


class TierFile:
    """A tier file opened for reading and writing (`open` creates or checks it)."""

    def __init__(self, fd: int, path: Path, identity: FileIdentity, key_size: int) -> None:
        self.fd, self.path, self.identity, self.key_size = fd, path, identity, key_size
        import xxhash  # here, not at import: the layout's sizes are read without it

        self.record_size = record_size(identity.block_size, identity.kv_bytes)
        self._tokens = struct.Struct(f"<{identity.block_size}q")
        self._xxh3 = xxhash.xxh3_64

    @classmethod
    def open(cls, path: str | Path, identity: FileIdentity, key_size: int, *, where: str = "path") -> TierFile:
        """Open (or create) the file at `path` for `identity`. ConfigError naming `where`
        if it is a link, not a regular file, or was written by another model, block size,
        KV size or hash algorithm (by name). A file with another slot count is reused:
        slots past the smaller count are ignored."""
        if key_size > KEY_CAPACITY:
            raise ConfigError(where, f"keys of {key_size} bytes do not fit a tier file ({KEY_CAPACITY})")
        path = Path(path)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as err:
            raise ConfigError(where, f"cannot open tier file {str(path)!r}: {err.strerror}") from None
        try:
            import stat

            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigError(where, f"{str(path)!r} is not a regular file")
            raw = os.pread(fd, HEADER_SIZE, 0)
            if not raw.strip(b"\0"):  # new (or never written): claim it
                os.pwrite(fd, identity.to_bytes(), 0)
            else:
                found = FileIdentity.from_bytes(raw)
                if found is None:
                    raise ConfigError(where, f"{str(path)!r} is not a prefixcache tier file: refused")
                for name in ("model", "block_size", "kv_bytes", "algorithm"):
                    if getattr(found, name) != getattr(identity, name):
                        raise ConfigError(
                            where,
                            f"{str(path)!r} was written with {name} {getattr(found, name)!r}; this cache has "
                            f"{getattr(identity, name)!r}: refused (use another path, or delete the file)",
                        )
                if found.num_slots != identity.num_slots:
                    os.pwrite(fd, identity.to_bytes(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path, identity, key_size)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _offset(self, slot: int) -> int:
        return HEADER_SIZE + slot * self.record_size

    def _checksum(self, fixed_tail: bytes, tokens: bytes, kv: bytes | memoryview) -> int:
        h = self._xxh3()
        h.update(fixed_tail)
        h.update(tokens)
        h.update(kv)
        return h.intdigest()

    def write(self, slot: int, key: bytes, parent: bytes | None, tokens: tuple[int, ...] | list[int], hits: int,
              kv: bytes | memoryview) -> None:
        """Write slot `slot` whole; `kv` is `identity.kv_bytes` bytes. OSError (ENOSPC
        among them) passes to the caller, which counts the refusal."""
        if len(kv) != self.identity.kv_bytes:
            raise ValueError(f"a block's KV is {self.identity.kv_bytes} bytes, got {len(kv)}")
        toks = self._tokens.pack(*tokens)
        keyed = struct.pack("<q32s32sB7x", hits, key, parent or b"", parent is not None)
        checksum = self._checksum(keyed, toks, kv)
        fixed = _FIXED.pack(RECORD_MAGIC, 1, checksum, hits, key, parent or b"", parent is not None)
        data = b"".join((fixed, toks, bytes(kv)))
        written = os.pwrite(self.fd, data, self._offset(slot))
        if written != len(data):
            raise OSError(28, "short write (the disk is full)")

    def erase(self, slot: int) -> None:
        """Mark slot `slot` empty (its record no longer restores)."""
        os.pwrite(self.fd, _FIXED.pack(0, 0, 0, 0, b"", b"", 0), self._offset(slot))

    def read(self, slot: int) -> Record | None:
        """Slot `slot`'s record if it is whole and its checksum matches; None if it is
        empty, torn, truncated or corrupted."""
        size = _FIXED.size + self._tokens.size + self.identity.kv_bytes
        try:
            raw = os.pread(self.fd, size, self._offset(slot))
        except OSError:
            return None
        if len(raw) != size:
            return None
        magic, flags, checksum, hits, key, parent, has_parent = _FIXED.unpack_from(raw)
        if magic != RECORD_MAGIC or flags != 1:
            return None
        toks = raw[_FIXED.size : _FIXED.size + self._tokens.size]
        kv = memoryview(raw)[_FIXED.size + self._tokens.size :]
        keyed = struct.pack("<q32s32sB7x", hits, key, parent, has_parent)
        if self._checksum(keyed, toks, kv) != checksum:
            return None
        ks = self.key_size
        return Record(key[:ks], parent[:ks] if has_parent else None, self._tokens.unpack(toks), hits, bytes(kv))

    def slots_in_file(self) -> int:
        """Slots whose records the file's length reaches (the last record's padding is
        never written, so a whole record may end before its slot does)."""
        length = os.fstat(self.fd).st_size
        return max(0, -(-(length - HEADER_SIZE) // self.record_size))
