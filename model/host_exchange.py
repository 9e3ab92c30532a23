"""A one-shot all-gather for ranks on one host, through a shared-memory region that every rank maps.

Why hand-written: torch.distributed has no shared-memory transport for CPU tensors. Gloo, the CPU backend, moves
even same-host tensors through loopback sockets (its transports are TCP, libuv and ibverbs); the MPI backend,
which could use shared memory, needs a PyTorch built from source; and a backend's all_reduce sums in an order of
its own, which the exactness rule forbids (partials are gathered and summed in virtual-shard order, model/parallel.py).
The exchange below is one copy in and one copy out per rank, and its protocol is the one the CUDA transport will
mirror (docs/deploy.md, "The tensor-parallel collective").

The region (one file in /dev/shm, mapped by every rank, unlinked once all have it mapped):

    [header 64 B: nonce, slot bytes, world] [per rank, 64 B: seq, nbytes of buffer 0, nbytes of buffer 1]
    [buffer 0: one slot per rank] [buffer 1: one slot per rank]

Call n (1, 2, ...) of every rank uses buffer n % 2: write my slot, record its size, publish seq = n (release);
wait until every peer's seq >= n (acquire); read the slots in rank order.

Why two buffers: a rank that has finished call n may run ahead into call n + 1 while a slow peer is still reading
call n's slots. With one buffer it would overwrite them. With two it writes the other buffer, and it cannot get
to call n + 2 (which reuses this buffer) before every peer has published n + 1 — which a peer does only after it
has finished reading call n. The sizes are kept per buffer for the same reason: a peer already in call n + 1 must
not change the size a slow rank is still checking for call n.
"""

from __future__ import annotations

import os
import secrets
import socket
import time

import torch

from model import shm_atomics

SHM_DIR = "/dev/shm"
LINE = 64  # one cache line per rank's flags: ranks spinning on different flags never share a line
NONCE_BYTES = 16
SEQ, NBYTES = 0, 8  # offsets of a rank's sequence number and its per-buffer sizes in its line


def host_id() -> str:
    """Ranks with the same id share a host (and so may map each other's memory): the kernel's boot id, which
    differs between machines, plus the hostname, which differs between containers (mapping another container's
    memory would need a shared IPC namespace: such ranks count as on other hosts)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class RegionError(RuntimeError):
    """The region cannot be created or mapped (another host, another /dev/shm, a stale name)."""


def _layout(world: int, slot_bytes: int) -> tuple[int, int, int]:
    """(offset of the first slot, bytes between slots, total bytes)."""
    stride = -(-slot_bytes // LINE) * LINE
    data = LINE * (1 + world)
    return data, stride, data + 2 * world * stride


REGION_PREFIX = "twinspark-collective-"


def stale_regions() -> list[str]:
    """Paths of regions whose creating process is gone: left behind when a rank died between making the region and
    unlinking it (the name carries the creator's pid)."""
    stale = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        pid = name[len(REGION_PREFIX):].split("-")[0] if name.startswith(REGION_PREFIX) else ""
        if pid.isdigit() and not _alive(int(pid)):
            stale.append(os.path.join(SHM_DIR, name))
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def create_region(world: int, slot_bytes: int) -> tuple[str, bytes]:
    """Rank 0: a fresh region file (flags zeroed), readable by this user only, after removing the regions of dead
    creators. Returns (path, nonce); the nonce lets a peer tell this region from anything else at the path."""
    for path in stale_regions():
        try:
            os.unlink(path)
        except OSError:  # another user's, or gone meanwhile
            pass
    nonce = secrets.token_bytes(NONCE_BYTES)
    path = os.path.join(SHM_DIR, f"{REGION_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        raise RegionError(f"cannot create {path}: {exc}") from exc
    try:
        os.ftruncate(fd, _layout(world, slot_bytes)[2])  # tmpfs: pages are taken when first written, not here
        os.write(fd, nonce + slot_bytes.to_bytes(8, "little") + world.to_bytes(8, "little"))
    finally:
        os.close(fd)
    return path, nonce


class HostExchange:
    """One rank's end of the region at `path` (made by `create_region`)."""

    def __init__(self, path: str, rank: int, nonce: bytes, *, timeout_s: float = 60.0) -> None:
        try:
            size = os.path.getsize(path)
            storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
        except (OSError, RuntimeError) as exc:
            raise RegionError(f"cannot map {path}: {exc}") from exc
        self.region = torch.empty(0, dtype=torch.uint8).set_(storage)
        head = bytes(self.region[:LINE // 2].tolist())
        if head[:NONCE_BYTES] != nonce:
            raise RegionError(f"{path} is not this group's region (its nonce differs)")
        self.slot_bytes = int.from_bytes(head[NONCE_BYTES:NONCE_BYTES + 8], "little")
        self.world = int.from_bytes(head[NONCE_BYTES + 8:NONCE_BYTES + 16], "little")
        self.data, self.stride, total = _layout(self.world, self.slot_bytes)
        if size != total or not 0 <= rank < self.world:
            raise RegionError(f"{path}: {size} bytes for {self.world} ranks, rank {rank}: not a region this rank fits")
        self.rank = rank
        self.path = path  # the region's name while it was being mapped (unlinked once every rank has it)
        self.timeout_s = timeout_s
        self.calls = 0
        self.base = self.region.data_ptr()
        try:
            shm_atomics.check_lock_free(self._flag(rank, SEQ))
        except (OSError, RuntimeError) as exc:  # no libatomic, or locked atomics: `auto` falls back to gloo
            raise RegionError(str(exc)) from exc

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `t` (the same shape and dtype on all), concatenated along `dim` in rank order."""
        views = self._exchange(t, write=True)
        return torch.cat([v.view(t.dtype).view(t.shape) for v in views], dim=dim)

    def from_first(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t`, copied into `t` on the other ranks (only rank 0 writes a slot)."""
        views = self._exchange(t, write=self.rank == 0)
        if self.rank != 0:
            t.copy_(views[0].view(t.dtype).view(t.shape))
        return t

    def _exchange(self, t: torch.Tensor, *, write: bool) -> list[torch.Tensor]:
        """One call of the protocol; the byte views of every rank's slot, valid until the call after next."""
        data = t.contiguous().reshape(-1).view(torch.uint8)
        n = data.numel()
        if n > self.slot_bytes:
            raise ValueError(f"same-host collective: an exchange of {n} bytes is larger than the slot of "
                             f"{self.slot_bytes} bytes it was sized for at startup (--collective-slot-bytes)")
        self.calls += 1
        buf = self.calls % 2
        if write:
            self._slot(buf, self.rank)[:n].copy_(data)
        self._word(self.rank, NBYTES + 8 * buf).fill_(n)
        shm_atomics.store_release(self._flag(self.rank, SEQ), self.calls)  # after the data and size: release
        self._wait(self.calls)
        for r in range(self.world):
            got = int(self._word(r, NBYTES + 8 * buf).item())
            if got != n:
                raise RuntimeError(f"same-host collective: exchange {self.calls} is {n} bytes on rank {self.rank} "
                                   f"but {got} on rank {r} (the ranks called collectives out of step)")
        return [self._slot(buf, r)[:n] for r in range(self.world)]

    def _wait(self, call: int) -> None:
        """Until every peer has published `call` (acquire loads), or raise naming the ones that have not."""
        deadline = time.monotonic() + self.timeout_s
        pending = [r for r in range(self.world) if r != self.rank]
        pause = 0.0
        while True:
            pending = [r for r in pending if shm_atomics.load_acquire(self._flag(r, SEQ)) < call]
            if not pending:
                return
            if time.monotonic() > deadline:
                seen = ", ".join(f"rank {r} at {shm_atomics.load_acquire(self._flag(r, SEQ))}" for r in pending)
                raise TimeoutError(f"same-host collective: rank {self.rank} waited {self.timeout_s:g} s at exchange "
                                   f"{call} for {seen}")
            # Yield at first (a peer is usually microseconds away), then back off to 1 ms: ranks share the cores,
            # and a spinning waiter would slow the very peer it waits for.
            time.sleep(pause)
            pause = min(max(pause * 2, 1e-6), 1e-3)

    def _flag(self, rank: int, offset: int) -> int:
        return self.base + LINE * (1 + rank) + offset

    def _word(self, rank: int, offset: int) -> torch.Tensor:
        """A rank's flag word as a one-element int64 tensor (plain loads and stores; ordered by the seq's)."""
        start = LINE * (1 + rank) + offset
        return self.region[start:start + 8].view(torch.int64)

    def _slot(self, buf: int, rank: int) -> torch.Tensor:
        start = self.data + (buf * self.world + rank) * self.stride
        return self.region[start:start + self.slot_bytes]
