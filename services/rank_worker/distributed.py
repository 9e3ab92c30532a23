"""Joining the tensor-parallel group and choosing its collective (docs/deploy.md: the tensor-parallel collective).

- nccl: torch.distributed over NCCL (CUDA; its IB transport is RoCE between Sparks).
- gloo: torch.distributed over gloo (CPU tensors; loopback sockets even on one host).
- ipc: the same-host exchange, for ranks that share a host: on the CPU a shared-memory region every rank maps
  (model/host_exchange.py); on CUDA device buffers the ranks map through CUDA IPC handles (model/device_exchange.py),
  which also lets two ranks share one GPU (NCCL refuses that). The group is joined over gloo, for the once-only
  handshake and `Collective.union`.
- auto: ipc when every rank shares this host and can map the others' memory; else NCCL on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from model.host_exchange import HostExchange, RegionError, create_region, host_id
from model.parallel import Sharding
from services.common import shared_flags as shared
from services.common.ports import free_ports

if TYPE_CHECKING:
    from model.device_exchange import DeviceExchange
    from model.parallel import Exchange

log = logging.getLogger(__name__)

COLLECTIVES = shared.COLLECTIVE.choices or ()
DEFAULT_SLOT_BYTES = 64 << 20  # serve-rank's --collective-slot-bytes default (tmpfs: only the pages written cost)


def free_port() -> int:
    """A loopback port for a one-host group's rendezvous (outside the ephemeral range: services/common/ports.py)."""
    return free_ports(1)[0]


def backend_for(collective: str, device: str) -> str:
    """The torch.distributed backend a collective choice joins over; refuses what cannot run on `device`."""
    cuda = device.startswith("cuda")
    if collective not in COLLECTIVES:
        raise ValueError(f"--collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    if collective == "nccl" and not cuda:
        raise ValueError("--collective nccl needs --device cuda (NCCL moves CUDA tensors only); on the CPU use "
                         "ipc, gloo or auto")
    # auto starts over gloo too: whether the ranks share a host is known only once they have joined (a CUDA group
    # that cannot use the same-host exchange then moves its tensors to an NCCL group).
    return "gloo" if collective in ("ipc", "auto") else collective


def join_group(rank: int, world: int, *, master_addr: str, master_port: int, device: str, virtual: int = 4,
               timeout_s: float = 60.0, collective: str = "auto", slot_bytes: int = DEFAULT_SLOT_BYTES,
               ) -> tuple[Sharding, dist.ProcessGroup | None, Exchange | None]:
    """Initialise torch.distributed for this rank (no-op for one rank): (its sharding, the group, the same-host
    exchange when the collective runs through one)."""
    sharding = Sharding(rank=rank, world=world, virtual=virtual)
    backend = backend_for(collective, device)
    if world == 1:
        return sharding, None, None
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    chosen: list[str | None] = [None] * world
    dist.all_gather_object(chosen, collective, group=group)
    if len(set(chosen)) > 1:
        raise RuntimeError(f"the ranks chose different collectives: {', '.join(map(str, chosen))} (rank order); "
                           "give every rank the same --collective")
    exchange = None
    cuda = device.startswith("cuda")
    if collective in ("ipc", "auto"):
        required = collective == "ipc"
        exchange = (_same_host_cuda(rank, world, group, required=required, slot_bytes=slot_bytes) if cuda else
                    _same_host(rank, world, group, required=required, slot_bytes=slot_bytes, timeout_s=timeout_s))
    if cuda and exchange is None and collective == "auto":
        group, backend = dist.new_group(backend="nccl"), "nccl"
    if exchange is not None:
        log.info("collective: ipc (%s)", "CUDA IPC device buffers" if cuda else "same-host shared memory")
    else:
        log.info("collective: %s", backend)
    return sharding, group, exchange


def _same_host_cuda(rank: int, world: int, group: dist.ProcessGroup, *, required: bool,
                    slot_bytes: int) -> DeviceExchange | None:
    """The CUDA handshake: when every rank reports this host's id, each maps the others' device regions
    (`required`: else raise, saying why)."""
    from model.device_exchange import DeviceExchange, cuda_regions  # needs Triton: CUDA ranks only
    hosts: list[str | None] = [None] * world
    dist.all_gather_object(hosts, host_id(), group=group)
    why = ""
    if len(set(hosts)) > 1:
        why = "the ranks are on different hosts (" + ", ".join(f"rank {r}: {h}" for r, h in enumerate(hosts)) + ")"
    else:
        try:
            device = torch.device("cuda", torch.cuda.current_device())
            return DeviceExchange(cuda_regions(rank, world, group, slot_bytes, device), rank, slot_bytes)
        except (RuntimeError, ValueError) as exc:  # the same on every rank: cuda_regions gathers the reasons
            why = str(exc)
    if required:
        raise RuntimeError(f"--collective ipc on CUDA needs every rank on this host, mapping the others' memory: "
                           f"{why}")
    log.info("same-host CUDA collective not usable (%s): nccl instead", why)
    return None


def _same_host(rank: int, world: int, group: dist.ProcessGroup, *, required: bool, slot_bytes: int,
               timeout_s: float) -> HostExchange | None:
    """The once-only handshake: rank 0 makes the region and sends its name; every rank maps it; the exchange is
    used when all could (`required`: else raise, naming the ranks that could not)."""
    made: list[tuple[str, bytes] | str | None] = [None]
    if rank == 0:
        try:
            made[0] = create_region(world, slot_bytes)
        except RegionError as exc:
            made[0] = str(exc)
    try:
        dist.broadcast_object_list(made, src=0, group=group)
        exchange, why = None, made[0] if isinstance(made[0], str) else ""
        if not why:
            path, nonce = made[0]
            try:
                exchange = HostExchange(path, rank, nonce, timeout_s=timeout_s)
            except RegionError as exc:
                why = str(exc)
        reasons: list[str | None] = [None] * world
        dist.all_gather_object(reasons, why, group=group)  # also the barrier after which no rank opens the file
    finally:
        # Mapped everywhere it can be (or a peer failed): the name goes, and nothing is left if a rank dies later.
        # A rank 0 killed before this leaves it to the next create_region, which removes regions of dead creators.
        if rank == 0 and isinstance(made[0], tuple):
            os.unlink(made[0][0])
    failed = "; ".join(f"rank {r}: {w}" for r, w in enumerate(reasons) if w)
    if not failed:
        return exchange
    if required:
        raise RuntimeError(f"--collective ipc needs every rank on this host, mapping rank 0's region: {failed}")
    log.info("same-host collective not usable (%s): gloo instead", failed)
    return None


def rank_device(device: str, rank: int) -> torch.device:
    """cuda -> cuda:<rank mod local GPUs>; cpu stays cpu."""
    if device.startswith("cuda") and device == "cuda":
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device(device)
