"""How many KV blocks a rank's pool gets when `--num-blocks` is not given: sized from memory, as vLLM sizes its KV
cache, so the served window (`max_model_len`) is as long as the checkpoint allows and the memory holds.

The budget (bytes for the pool's blocks and its KDA state slots together, per rank):
- `--kv-cache-memory-bytes` when given (vLLM's flag);
- on a CUDA GPU with memory of its own: `--gpu-memory-utilization` x the device's memory, less what is in use on it
  once the weights are loaded (by this process and any other), less the peak of a profile run: one prompt chunk at
  the step budget (warmup.activation_peak, as vLLM profiles before it sizes its cache); the rest (1 - utilization)
  is the room left for CUDA graphs, the GPU indexer's buffers and the allocator's slack; ranks that share a GPU
  (TP = 2 on a one-GPU machine) split it evenly, measured once every rank has loaded its weights;
- on an integrated GPU (GB10: the DGX Spark's 128 GB are the system's, CPU and GPU alike): "free GPU memory" is
  the whole system's, so a pool sized from it would take what the OS, the other roles (gateway, scheduler,
  drafter) and the page cache need. There `--gpu-memory-utilization` is vLLM's meaning: the share of the *total*
  memory this rank may fill, weights included: the pool gets it less what this process already holds (its
  allocator's reservation: the weights), less the profile run's peak; never more than the system has available now
  (MemAvailable, which counts the reclaimable page cache as available), else the rank stops and says what to set;
- on the CPU: CPU_KV_CACHE_BYTES, or half the available RAM when that is less (vLLM's CPU backend likewise takes a
  fixed KV space, VLLM_CPU_KVCACHE_SPACE, rather than profiling; a CPU pool is resident from the start).
Every rank sizes its own and the group takes the smallest, so all ranks address the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from model.cache import PagedCache
from model.config import ModelConfig
from model.parallel import Sharding

CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class PoolCost:
    block_bytes: int  # one block in every latent / indexer store and pooled-key table of this rank
    slot_bytes: int  # one KDA state slot (recurrent + conv state of every KDA layer) of this rank


def pool_cost(cfg: ModelConfig, sharding: Sharding, *, block_size: int, dtype: torch.dtype,
              kv_dtype: torch.dtype | None, with_mtp: bool) -> PoolCost:
    """What one block and one slot cost on this rank, read off a cache laid out on the meta device (no memory), so
    the figure is the real cache's layout and cannot drift from it."""
    probe = PagedCache(cfg, sharding, num_blocks=0, block_size=block_size, num_slots=0, dtype=dtype, device="meta",
                       with_mtp=with_mtp, kv_dtype=kv_dtype)
    return PoolCost(sum(t.nbytes for t in probe.block_views(0)), sum(t.nbytes for t in probe.state_views(0)))


def _available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def device_sharers(group: dist.ProcessGroup | None, device: torch.device) -> int:
    """How many ranks of the group (this one included) run on this very GPU: TP = 2 on a one-GPU machine puts two
    rank processes on it, and each may take only its share of what is free."""
    if group is None or device.type != "cuda":
        return 1
    from model.host_exchange import host_id

    mine = (host_id(), str(torch.cuda.get_device_properties(device).uuid))
    everyone: list[tuple[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)  # also a barrier: every rank has loaded its weights
    return sum(1 for e in everyone if e == mine)


@dataclass(frozen=True)
class MemoryReport:
    """What a CUDA device says of its memory once this rank's weights are loaded."""

    total: int  # the device's bytes; on an integrated GPU the system's
    free: int  # cudaMemGetInfo's free: on an integrated GPU the system's, whoever holds the rest
    own: int  # what this process's allocator holds (the weights and their staging, before the pool)
    unified: bool  # an integrated GPU (kernels/gpu/arch.py DeviceFacts)
    available: int  # what the system can still hand out (MemAvailable; page cache counts): integrated GPUs only


@dataclass(frozen=True)
class Budget:
    bytes: int  # the pool's blocks and slots together, before the profile run's peak comes off
    rule: str  # how it was reached, for the rank's start-up line


def memory_report(device: torch.device) -> MemoryReport:
    """The CUDA device's memory as the pool sizing reads it (the device facts are read once, kernels/gpu/arch.py)."""
    from kernels.gpu import arch as gpu_arch

    free, total = torch.cuda.mem_get_info(device)
    unified = gpu_arch.facts(device.index if device.index is not None else torch.cuda.current_device()).unified
    return MemoryReport(total=total, free=free, own=torch.cuda.memory_reserved(device), unified=unified,
                        available=_available_ram() if unified else free)


def gpu_budget(report: MemoryReport, utilization: float, sharers: int = 1) -> Budget:
    """A CUDA rank's pool budget from its device's report, by the rules in the module docstring."""
    gib = 2 ** 30
    if not report.unified:
        got = (int(utilization * report.total) - (report.total - report.free)) // sharers
        return Budget(got, f"{utilization:g} x {report.total / gib:.1f} GiB of device memory less the "
                           f"{(report.total - report.free) / gib:.1f} GiB in use" + _shared(sharers))
    got = int(utilization * report.total) // sharers - report.own
    if got > report.available:
        raise ValueError(
            f"unified memory: --gpu-memory-utilization {utilization:g} lets this rank fill "
            f"{utilization * report.total / sharers / gib:.1f} GiB of the system's {report.total / gib:.1f} GiB, "
            f"{report.own / gib:.1f} GiB of it held already, which leaves a {got / gib:.1f} GiB KV pool; the system "
            f"has {report.available / gib:.1f} GiB available now: lower --gpu-memory-utilization or set "
            f"--kv-cache-memory-bytes (what the other processes on this machine need must stay free)")
    return Budget(got, f"unified memory (an integrated GPU: the system's {report.total / gib:.1f} GiB, shared with "
                       f"the CPU): {utilization:g} x total less the {report.own / gib:.1f} GiB this rank holds"
                       + _shared(sharers) + f"; {report.available / gib:.1f} GiB available to the system now")


def _shared(sharers: int) -> str:
    return f", split over the {sharers} ranks on this GPU" if sharers > 1 else ""


def budget_bytes(device: torch.device, *, kv_cache_memory_bytes: int, gpu_memory_utilization: float,
                 sharers: int = 1) -> Budget:
    """Bytes this rank's pool (blocks and slots) may take, by the rules in the module docstring; on a GPU that
    `sharers` ranks share, each takes that part of what the utilisation leaves beside every rank's weights."""
    if kv_cache_memory_bytes > 0:
        return Budget(kv_cache_memory_bytes, "--kv-cache-memory-bytes")
    if device.type == "cuda":
        return gpu_budget(memory_report(device), gpu_memory_utilization, sharers)
    return Budget(min(CPU_KV_CACHE_BYTES, _available_ram() // 2), "CPU: 1 GiB, or half the available RAM if less")


def blocks_for_budget(budget: int, cost: PoolCost, num_slots: int) -> int:
    """Blocks that fit beside `num_slots` slots (each store keeps one scratch block and one scratch slot more)."""
    blocks = (budget - (num_slots + 1) * cost.slot_bytes) // cost.block_bytes - 1
    if blocks < 1:
        raise ValueError(f"the KV pool budget ({budget} bytes) does not hold {num_slots} KDA slots "
                         f"({cost.slot_bytes} bytes each) and a block ({cost.block_bytes} bytes): lower --num-slots "
                         f"or raise --kv-cache-memory-bytes / --gpu-memory-utilization")
    return blocks


def agree(blocks: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The smallest of every rank's block count (each rank sized its own from its own memory)."""
    if group is None:
        return blocks
    # A group joined over gloo (CUDA ranks on one host, whose tensors go through the same-host exchange) reduces
    # host tensors; an NCCL group device tensors.
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([blocks], dtype=torch.int64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def max_model_len(cfg: ModelConfig, num_blocks: int, block_size: int) -> int:
    """The window a pool of this size serves: the checkpoint's, or what one sequence can hold when that is less."""
    return min(cfg.max_position_embeddings, num_blocks * block_size)
