"""Joining the tensor-parallel group: gloo on CPU, NCCL on CUDA (whose IB transport is RoCE between Sparks)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from model.parallel import Sharding


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world: int, *, master_addr: str, master_port: int, device: str,
               virtual: int = 4, timeout_s: float = 60.0) -> tuple[Sharding, dist.ProcessGroup | None]:
    """Initialise torch.distributed for this rank (no-op for one rank) and return its sharding."""
    sharding = Sharding(rank=rank, world=world, virtual=virtual)
    if world == 1:
        return sharding, None
    if device.startswith("cuda"):
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return sharding, dist.group.WORLD


def rank_device(device: str, rank: int) -> torch.device:
    """cuda -> cuda:<rank mod local GPUs>; cpu stays cpu."""
    if device.startswith("cuda") and device == "cuda":
        return torch.device("cuda", rank % max(torch.cuda.device_count(), 1))
    return torch.device(device)
