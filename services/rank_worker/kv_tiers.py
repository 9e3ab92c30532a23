"""This rank's KV tiers: cache blocks and KDA snapshot states kept in host RAM and on disk, behind the paged pool.

The scheduler decides everything (what is saved, spilled, dropped or loaded, and where: StepPlan.tier_moves); this
class only stores this rank's shard of each entry under the scheduler's key, so every rank holds the same keys.

- An entry is the raw bytes of the cache slices it covers (`PagedCache.block_views` / `state_views`, in their
  fixed order) plus an xxh3-64 checksum taken when it was saved. A load verifies the checksum wherever the entry
  was (host RAM or disk); a mismatch on any rank makes every rank drop the entry (`Executor` all-gathers the bad
  keys) and the scheduler recomputes what it held: a bad block is never used.
- Disk entries live in `<kv-disk-dir>/<cache fingerprint>/rank<r>/`, one file each, written to a temporary name
  and renamed, so a crash leaves no half-written entry under a real name. The directory is named by a fingerprint
  of everything that changes a cached row's bits (fingerprint.cache_key), so a restart with the same checkpoint and
  settings finds its entries again and one with another checkpoint never sees them. A state entry keeps its
  position and block chain in its header: `TierList` reports them after a restart.
Why xxhash: a fast non-cryptographic checksum (GB/s) is what catches torn writes and bit rot; nothing here needs
collision resistance against an attacker (the disk directory is the operator's).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from model.cache import PagedCache

log = logging.getLogger("twinspark.rank.tiers")

_MAGIC = b"TSKV1\n"
_HEADER = struct.Struct("<QQ")  # checksum, metadata length


@dataclass
class Entry:
    payload: bytes
    checksum: int
    meta: dict


def checksum(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def pack(views: list[torch.Tensor]) -> bytes:
    """The raw bytes of `views`, one after the other."""
    return b"".join(v.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for v in views)


def unpack(payload: bytes, views: list[torch.Tensor]) -> None:
    """Write `payload` (made by `pack` from views of the same shapes and dtypes) back into `views`."""
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    at = 0
    for v in views:
        n = v.numel() * v.element_size()
        v.copy_(raw[at : at + n].view(v.dtype).view(v.shape))
        at += n


class TierStore:
    def __init__(self, cache: PagedCache, *, host_bytes: int, disk_dir: str | Path | None, disk_bytes: int,
                 rank: int, cache_key: str) -> None:
        self.cache = cache
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes if disk_dir else 0
        self.host: dict[bytes, Entry] = {}
        self.dir = Path(disk_dir) / cache_key[:32] / f"rank{rank}" if disk_dir and disk_bytes > 0 else None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            for tmp in self.dir.glob("*.tmp"):  # a write cut short by a crash
                tmp.unlink(missing_ok=True)

    @property
    def block_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.cache.block_views(0))

    @property
    def state_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.cache.state_views(0))

    # -- files ----------------------------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        assert self.dir is not None
        return self.dir / f"{key.hex()}.kv"

    def _write(self, key: bytes, e: Entry) -> None:
        if self.dir is None:
            raise RuntimeError("a disk tier move without --kv-disk-dir (the scheduler and this rank disagree)")
        meta = json.dumps(e.meta).encode()
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(_MAGIC + _HEADER.pack(e.checksum, len(meta)) + meta)
            f.write(e.payload)
        os.replace(tmp, path)

    def _read(self, key: bytes, with_payload: bool = True) -> Entry | None:
        """The entry on disk, or None when it is missing or its header is unreadable (the checksum is the
        caller's to verify)."""
        if self.dir is None:
            return None
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(len(_MAGIC) + _HEADER.size)
                if len(head) != len(_MAGIC) + _HEADER.size or not head.startswith(_MAGIC):
                    return None
                crc, n_meta = _HEADER.unpack(head[len(_MAGIC):])
                meta = json.loads(f.read(n_meta))
                payload = f.read() if with_payload else b""
        except (OSError, ValueError):
            return None
        return Entry(payload, crc, meta)

    # -- moves ----------------------------------------------------------------------------------------------------
    def save(self, key: bytes, views: list[torch.Tensor], meta: dict, to_disk: bool) -> None:
        payload = pack(views)
        e = Entry(payload, checksum(payload), meta)
        if to_disk:
            self._write(key, e)
        else:
            self.host[key] = e

    def spill(self, key: bytes) -> None:
        e = self.host.pop(key, None)
        if e is not None:  # the checksum taken at save time goes along: a bit flipped in RAM is caught on load too
            self._write(key, e)

    def drop(self, key: bytes) -> None:
        self.host.pop(key, None)
        if self.dir is not None:
            self._path(key).unlink(missing_ok=True)

    def load(self, key: bytes, views: list[torch.Tensor]) -> bool:
        """Verify the entry and write it into `views`; False (nothing written) when missing or corrupt."""
        e = self.host.get(key) or self._read(key)
        expected = sum(v.numel() * v.element_size() for v in views)
        if e is None or len(e.payload) != expected or checksum(e.payload) != e.checksum:
            log.warning("tier entry %s is %s: dropped", key.hex(), "missing" if e is None else "corrupt")
            return False
        unpack(e.payload, views)
        return True

    def listing(self) -> list[dict]:
        """What the disk tier holds (headers only): key, state?, pos, chain, mtime."""
        out = []
        if self.dir is None:
            return out
        for path in sorted(self.dir.glob("*.kv")):
            try:
                key = bytes.fromhex(path.stem)
                mtime = path.stat().st_mtime
            except (ValueError, OSError):
                continue
            e = self._read(key, with_payload=False)
            if e is None:
                continue
            out.append({"key": key, "state": bool(e.meta.get("state")), "pos": int(e.meta.get("pos", 0)),
                        "chain": bytes.fromhex(e.meta.get("chain", "")), "mtime": mtime})
        return out
