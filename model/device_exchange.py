"""The same-host collective for CUDA ranks: a one-shot all-gather through device buffers every rank maps.

Why hand-written: NCCL refuses two ranks on one GPU (so TP = 2 cannot be checked on the one GPU a machine has), and
its all-reduce sums in an order of its own, which the exactness rule forbids (partials are gathered and summed in
virtual-shard order, model/parallel.py). torch's symmetric-memory all-gather needs NVLink multicast or a GPU per rank.

The protocol is model/host_exchange.py's, moved onto the GPU so that it needs no host sync and can be captured in
a CUDA graph. Each rank owns a region of its device memory, which the peers map (CUDA IPC handles, swapped once at
startup over the group; on the CPU stand-in the tests use, files in /dev/shm):

    [flags: G int64, one per program of the exchange kernel] [buffer 0: slot_bytes] [buffer 1: slot_bytes]

and a private counter per program. Call n of program p (n = its counter + 1, kept on the device so that every
graph replay is a new call): copy its share of my tensor into its part of my buffer n % 2; barrier; publish
flags[p] = n (release, system scope); wait until every peer's flags[p] >= n (acquire); barrier; read every rank's
share from its buffer n % 2 in rank order. Program p owns the p-th of G equal parts of each buffer, whatever the
call's size. A call runs only as many programs as its size needs (each moves at least a BLOCK, so a decode step's
few kilobytes take a few programs, not G spinning on G SMs while a peer on the same GPU still computes); the
count is a function of the size alone, the same on every rank, so program p always pairs with program p of every
peer and its counter counts the same calls everywhere. Two buffers, for the reason host_exchange.py gives: program
p of a rank reaches its call n + 2 (which reuses its part of buffer n % 2) only after every peer's program p
published n + 1, which it does only after it finished reading call n. A tensor larger than a slot goes in several
calls of at most a slot each.

A peer that never publishes (it died) would leave the kernel spinning forever: the wait gives up after
`spin_limit` polls, marks the exchange failed (`failed()`) and later calls stop waiting. By then the peer watch
(services/rank_worker/peer_watch.py) has ended this rank (a lost peer becomes 503s at the gateway), so the garbage
a step that gave up computes is never answered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

PROGRAMS = 64  # G: the most programs a call runs; program p always owns the p-th of G parts of each buffer
BLOCK = 1024  # elements a program moves per step, and the least share a program is given
FLAG_BYTES = 1024  # PROGRAMS int64 flags, padded to a 1 KiB boundary so the slots start aligned
# Polls of a peer's flag before the exchange gives up: tens of seconds on a GPU. Longer than the peer watch's silence
# limit (3 s by default), which ends this rank first, so no step that gave up is ever answered; and far longer than
# a peer sharing the GPU without MPS may legitimately take (a time slice, milliseconds).
SPIN_LIMIT = 1 << 25


@triton.jit
def _exchange_kernel(src, out, n, share, out_stride, out_offset, slots, flags, counters, failed, spin_limit,
                     slot_elems, part_elems, RANK: tl.constexpr, WORLD: tl.constexpr, WRITES: tl.constexpr,
                     READS: tl.constexpr, BLOCK: tl.constexpr):
    """One call for program p: elements [p * share, (p + 1) * share) of the `n` of `src` into part p (`part_elems`
    long) of this rank's buffer (WRITES), then the same share of ranks 0 .. READS - 1 ->
    out[r * out_stride + out_offset + share] (READS = 1: a broadcast from the first rank, whose peers do not write)."""
    pid = tl.program_id(0)
    call = tl.load(counters + pid) + 1
    buf = call % 2
    lo = pid * share
    hi = tl.minimum(lo + share, n)
    ety = src.dtype.element_ty
    part = buf * slot_elems + pid * part_elems - lo  # + o: element o's place in this program's part of the buffer
    if WRITES:
        mine = tl.load(slots + RANK).to(tl.pointer_type(ety)) + part
        for i in range(lo, hi, BLOCK):
            o = i + tl.arange(0, BLOCK)
            m = o < hi
            tl.store(mine + o, tl.load(src + o, mask=m), mask=m)
    # Every thread's stores before the flag: the barrier orders them before the one release that publishes them.
    tl.debug_barrier()
    tl.atomic_xchg(tl.load(flags + RANK).to(tl.pointer_type(tl.int64)) + pid, call, sem="release", scope="sys")
    waiting = tl.load(failed) == 0  # once a peer failed to come, no call waits again (the step is lost anyway)
    for r in tl.static_range(WORLD):
        if r != RANK:
            if waiting:
                flag = tl.load(flags + r).to(tl.pointer_type(tl.int64)) + pid
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                spins = 0
                while (seen < call) & (spins < spin_limit):
                    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                    spins += 1
                if seen < call:
                    tl.atomic_xchg(failed, 1)
    tl.debug_barrier()
    for r in tl.static_range(READS):
        theirs = tl.load(slots + r).to(tl.pointer_type(ety)) + part
        dst = out + r * out_stride + out_offset
        for i in range(lo, hi, BLOCK):
            o = i + tl.arange(0, BLOCK)
            m = o < hi
            # .cg: from L2, never a line this SM cached in an earlier call of the same buffer
            tl.store(dst + o, tl.load(theirs + o, mask=m, cache_modifier=".cg"), mask=m)
    tl.store(counters + pid, call)


def _element_view(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as the widest integer elements that divide them (fewer, wider loads; any dtype travels)."""
    data = t.contiguous().reshape(-1).view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if data.numel() % size == 0:
            return data.view(dtype)
    return data


@dataclass
class Region:
    """One rank's region as this process sees it: the tensor that keeps the memory (or mapping) alive and its
    address here."""
    memory: torch.Tensor

    @property
    def address(self) -> int:
        return self.memory.data_ptr()


class DeviceExchange:
    """One rank's end of the device collective. `regions`: every rank's region mapped in this process (this
    rank's own at `rank`), each FLAG_BYTES + 2 x slot_bytes bytes, flags zeroed before any rank's first call."""

    def __init__(self, regions: list[Region], rank: int, slot_bytes: int, *, spin_limit: int = SPIN_LIMIT) -> None:
        self.world = len(regions)
        self.rank = rank
        self.slot_bytes = slot_bytes
        self.spin_limit = spin_limit
        self.regions = regions  # kept: the peers' mappings live as long as these tensors
        device = regions[rank].memory.device
        self.slots = torch.tensor([r.address + FLAG_BYTES for r in regions], dtype=torch.int64, device=device)
        self.flags = torch.tensor([r.address for r in regions], dtype=torch.int64, device=device)
        self.counters = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        self.failed_word = torch.zeros(1, dtype=torch.int32, device=device)

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `t` (the same shape and dtype on all), concatenated along `dim` in rank order."""
        src = _element_view(t)
        out = torch.empty(self.world, src.numel(), dtype=src.dtype, device=src.device)
        self._calls(src, out, first_only=False)
        gathered = out.view(torch.uint8).view(t.dtype).view(self.world, *t.shape)
        return torch.cat(gathered.unbind(0), dim=dim)

    def from_first(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t`, copied into `t` on the other ranks (only rank 0 writes its slot)."""
        src = _element_view(t)
        out = torch.empty_like(src)
        self._calls(src, out.view(1, -1), first_only=True)
        if self.rank != 0:
            t.copy_(out.view(torch.uint8).view(t.dtype).view(t.shape))
        return t

    def failed(self) -> bool:
        """Whether a call gave up waiting for a peer since startup (a host sync: call it where one is paid)."""
        return bool(self.failed_word.item())

    def _calls(self, src: torch.Tensor, out: torch.Tensor, *, first_only: bool) -> None:
        """As many calls as slots of `src` need, each writing its piece at its offset in every row of `out`."""
        slot_elems = self.slot_bytes // src.element_size()
        part = slot_elems // PROGRAMS
        per_call = part * PROGRAMS
        n = src.numel()
        writes, reads = not first_only or self.rank == 0, 1 if first_only else self.world
        for start in range(0, max(n, 1), per_call):
            size = min(per_call, n - start)
            share, programs = call_shape(size, part)
            _exchange_kernel[(programs,)](src[start:], out, size, share, out.stride(0), start, self.slots,
                                          self.flags, self.counters, self.failed_word, self.spin_limit, slot_elems,
                                          part, RANK=self.rank, WORLD=self.world, WRITES=writes, READS=reads,
                                          BLOCK=BLOCK, num_warps=4)


def call_shape(size: int, part: int) -> tuple[int, int]:
    """(elements per program, programs) of a call moving `size` elements, each program's share fitting its `part`
    of a buffer (size <= PROGRAMS x part): at least a BLOCK each, so few programs for a small tensor. A function of
    the size alone, so that every rank runs the same programs."""
    share = min(part, max(BLOCK, -(-size // PROGRAMS)))
    return share, max(1, -(-size // share))


def region_bytes(slot_bytes: int) -> int:
    return FLAG_BYTES + 2 * slot_bytes


def check_slot_bytes(slot_bytes: int) -> None:
    if slot_bytes <= 0 or slot_bytes % 4096:
        raise ValueError(f"the device collective's slot must be a positive multiple of 4,096 bytes, got "
                         f"{slot_bytes}")


def cuda_regions(rank: int, world: int, group: dist.ProcessGroup, slot_bytes: int,
                 device: torch.device) -> list[Region]:
    """Every rank's region mapped in this process: this rank's own, allocated zeroed on `device`, and the peers'
    through the CUDA IPC handles swapped over `group` (ranks of one host only: see `host_id`). Raises on every
    rank, naming the ranks, where some handle cannot be opened (a driver or container without IPC)."""
    check_slot_bytes(slot_bytes)
    mine = torch.zeros(region_bytes(slot_bytes), dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)  # zeroed before any peer can see it
    handles: list[tuple | None] = [None] * world
    dist.all_gather_object(handles, mine.untyped_storage()._share_cuda_(), group=group)
    regions, why = [], ""
    try:
        for r, handle in enumerate(handles):
            if r == rank:
                regions.append(Region(mine))
                continue
            storage = torch.UntypedStorage._new_shared_cuda(*handle)
            regions.append(Region(torch.empty(0, dtype=torch.uint8, device=device).set_(storage)))
    except RuntimeError as exc:  # after the loop's collectives, so a rank that fails never leaves a peer waiting
        why = f"rank {rank} cannot map rank {len(regions)}'s region: {exc}"
    reasons: list[str | None] = [None] * world
    dist.all_gather_object(reasons, why, group=group)  # also: every rank has mapped every region before any call
    failed = "; ".join(r for r in reasons if r)
    if failed:
        raise RuntimeError(failed)
    return regions
