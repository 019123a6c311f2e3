"""The engine's lower-tier KV: a host tensor pool per CPU tier, a file of blocks per DISK
tier, and the transfers between them and the device pool, run in the order the cache
recorded them.

Owns `KVTiers`: built from `cache.tiers` and the model's KV geometry; `run(transfers)`
copies each block (every layer, K and V) as `PrefixCache.drain_transfers` lists it: a
store into a host slot or a disk record, a move from host to disk, a load into the
device pool. A disk tier's file (`prefixcache.tier_file`) carries a checksum per
record: the cache's admission asks `verify` before it counts a disk block as a hit, so a
torn, truncated or corrupted record is a miss and a counted error, never wrong KV; the
bytes verified are kept for the load that follows. A write that fails (a full disk:
ENOSPC, EDQUOT, any OSError) drops the slot from its tier and counts a refusal; the
request that caused it goes on. At start, a disk tier's file is read back: every
record that verifies is restored into the tier, so an engine restarted on the same file
serves hits from it at once; a file written for another model, block size, KV size or
hash algorithm is refused by name.

Must never: decide what moves (the cache does), run a transfer out of order, or load a
record it has not verified.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from prefixcache.config import CacheConfig, ConfigError
from prefixcache.tier_file import FileIdentity, TierFile, file_size, room_for
from prefixcache.tiers import DEVICE, Tiers

__all__ = ["KVTiers"]


class KVTiers:
    """The data of a cache's lower tiers (module docstring). `device_kv` is the model's
    per-layer KV pool, `[num_blocks, 2, kv_heads, block_size, head_dim]` each."""

    def __init__(self, config: CacheConfig, tiers: Tiers, device_kv: Sequence[torch.Tensor], model_name: str) -> None:
        self.config = config
        self.tiers = tiers
        self.device_kv = list(device_kv)
        first = self.device_kv[0]
        self.block_shape = tuple(first.shape[1:])
        self.dtype = first.dtype
        self.num_layers = len(self.device_kv)
        self.kv_bytes = self.num_layers * first[0].numel() * first.element_size()
        self.pools: dict[int, list[torch.Tensor]] = {}
        self.files: dict[int, TierFile] = {}
        self._staged: dict[tuple[int, int], bytes] = {}  # verified records a load is about to read
        self.restored = self.restore_errors = 0
        tiers.set_block_bytes(self.kv_bytes)
        _, kv_heads, _, head_dim = self.block_shape
        identity_model = (
            f"{model_name} layers={self.num_layers} kv_heads={kv_heads} head_dim={head_dim} "
            f"dtype={str(self.dtype).split('.')[-1]}"
        )
        try:
            for t, spec in enumerate(config.tiers):
                if spec.medium == "CPU":
                    pin = torch.cuda.is_available() and first.is_cuda
                    self.pools[t] = [
                        torch.zeros((spec.num_blocks, *self.block_shape), dtype=self.dtype, pin_memory=pin)
                        for _ in range(self.num_layers)
                    ]
                else:
                    self.files[t] = self._open(t, identity_model)
        except BaseException:
            self.close()
            raise
        tiers.verifier = self.verify

    # -- disk files ---------------------------------------------------------------------
    def _open(self, t: int, model: str) -> TierFile:
        spec = self.config.tiers[t]
        where = f"cache.tiers[{t}].path"
        path = Path(spec.path)
        need = file_size(spec.num_blocks, self.config.block_size, self.kv_bytes)
        free = room_for(path)
        if need > free:
            raise ConfigError(
                f"cache.tiers[{t}].num_blocks",
                f"{spec.num_blocks} blocks of {self.kv_bytes:,} bytes need {need / 1e9:.3g} GB at {spec.path!r}; the disk "
                f"has {free / 1e9:.3g} GB free",
            )
        identity = FileIdentity(model, self.config.block_size, self.kv_bytes, self.config.hash.algorithm,
                                spec.num_blocks)  # fmt: skip
        f = TierFile.open(path, identity, self.tiers.native.key_size, where=where)
        self._restore(t, f)
        return f

    def _restore(self, t: int, f: TierFile) -> None:
        """Put back every record of the file that verifies (a restart); erase the rest."""
        slots = min(f.slots_in_file(), self.config.tiers[t].num_blocks)
        seen: set[bytes] = set()
        for slot in range(slots):
            record = f.read(slot)
            if record is None:
                continue
            if record.key in seen:  # a key written twice (a crash between two writes): keep the first
                f.erase(slot)
                continue
            try:
                self.tiers.native.restore(t, slot, record.key, record.parent, record.tokens, record.hits)
            except ValueError:  # token ids the strategy cannot hold (radix: beyond int32): not restored
                f.erase(slot)
                self.restore_errors += 1
                continue
            seen.add(record.key)
            self.restored += 1
        self.tiers.flush_events()

    def close(self) -> None:
        """Close the disk files (their records stay, for a restart)."""
        for f in self.files.values():
            f.close()
        self.files.clear()

    # -- the cache's verifier -------------------------------------------------------------
    def verify(self, tier: int, slot: int, key: bytes) -> bool:
        """Whether disk slot `slot` of `tier` holds block `key` whole: its record's checksum
        and key match. The bytes are kept for the load that follows."""
        f = self.files.get(tier)
        if f is None:
            return True
        record = f.read(slot)
        if record is None or record.key != key:
            return False
        self._staged[(tier, slot)] = record.kv
        return True

    # -- transfers ------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, transfers: Sequence[tuple[int, int, int, int]]) -> None:
        """Run the transfers in order (`PrefixCache.drain_transfers`)."""
        for src_tier, src, dst_tier, dst in transfers:
            if dst_tier == DEVICE:
                self._load(src_tier, src, dst)
            elif dst_tier in self.pools:
                self._to_host(src_tier, src, dst_tier, dst)
            else:
                self._to_disk(src_tier, src, dst_tier, dst)
        self._staged.clear()

    def _block(self, tier: int, slot: int) -> list[torch.Tensor]:
        """The per-layer views of a device block (tier -1) or a host slot."""
        pool = self.device_kv if tier == DEVICE else self.pools[tier]
        return [layer[slot] for layer in pool]

    def _to_host(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None:
        if src_tier in self.files:
            raise ValueError(f"a transfer from disk tier {src_tier} to host tier {dst_tier}: tiers move only down")
        for out, layer in zip(self._block(dst_tier, dst), self._block(src_tier, src), strict=True):
            out.copy_(layer)

    def _to_disk(self, src_tier: int, src: int, dst_tier: int, dst: int) -> None:
        native = self.tiers.native
        kv = torch.stack(self._block(src_tier, src)).contiguous().view(torch.uint8).numpy().tobytes()
        key = native.slot_key(dst_tier, dst)
        try:
            self.files[dst_tier].write(dst, key, native.slot_parent(dst_tier, dst), native.slot_tokens(dst_tier, dst),
                                       native.slot_hits(dst_tier, dst), kv)  # fmt: skip
        except OSError:
            # A full disk (ENOSPC, EDQUOT) or any other write error: the tier never holds
            # that block, and the refusal is counted; never a crash.
            self.tiers.native.drop(dst_tier, dst, True)
            self.tiers.flush_events()
            try:
                self.files[dst_tier].erase(dst)
            except OSError:
                pass

    def _load(self, src_tier: int, src: int, dst: int) -> None:
        if src_tier in self.pools:
            for out, layer in zip(self._block(DEVICE, dst), self._block(src_tier, src), strict=True):
                out.copy_(layer)
            return
        raw = self._staged.pop((src_tier, src), None)
        if raw is None:  # the cache verifies every disk block it loads: this one must verify too
            record = self.files[src_tier].read(src)
            if record is None:
                raise RuntimeError(f"disk tier {src_tier} slot {src} failed its checksum after it was verified")
            raw = record.kv
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(self.dtype).view(self.num_layers, *self.block_shape)
        for out, layer in zip(self._block(DEVICE, dst), flat, strict=True):
            out.copy_(layer)

    @property
    def disk_bytes(self) -> int:
        """BYTES the disk files take on disk now."""
        return sum(os.fstat(f.fd).st_size for f in self.files.values() if f.fd >= 0)
