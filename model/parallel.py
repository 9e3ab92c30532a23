"""Tensor parallelism: which slices a rank owns, and the two collectives the model needs.

Every sharded dimension is cut into a fixed number of *virtual shards* (default 4) whatever the rank count; a rank
owns a contiguous run of them and computes each one's product separately (on the GPU in one launch for all of them,
each shard with the schedule of its own product). Row-parallel partial sums are all-gathered
(fp32) and added in virtual-shard order on every rank, so TP = 1, 2 and 4 perform the very same floating-point
operations and give the same bits (docs/design.md §5.3) — and every rank ends a reduction holding identical values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # the CUDA exchange needs Triton, which a CPU install on ARM lacks: imported where it is made
    from model.device_exchange import DeviceExchange
    from model.host_exchange import HostExchange

    # The same-host exchanges (ranks of one host): shared memory for CPU ranks, CUDA IPC device buffers for GPU ones.
    Exchange = HostExchange | DeviceExchange


@dataclass(frozen=True)
class Sharding:
    rank: int = 0
    world: int = 1
    virtual: int = 4

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"bad rank {self.rank} of {self.world}")
        if self.virtual % self.world:
            raise ValueError(f"virtual shards ({self.virtual}) must be a multiple of the rank count ({self.world})")

    @property
    def local(self) -> range:
        """The virtual shards this rank computes."""
        per = self.virtual // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    def split(self, size: int, what: str) -> list[slice]:
        """The slices of a dimension of `size` for each local virtual shard."""
        if size % self.virtual:
            raise ValueError(f"{what}: size {size} is not divisible into {self.virtual} virtual shards")
        step = size // self.virtual
        return [slice(v * step, (v + 1) * step) for v in self.local]


class Collective:
    """All-gather based reductions over the tensor-parallel group (gloo on CPU, NCCL on CUDA), or, with an
    `exchange`, through the same-host memory every rank maps (model/host_exchange.py on the CPU,
    model/device_exchange.py on CUDA; `union` stays on the group).

    With one rank no process group is needed and nothing is sent.
    """

    def __init__(self, sharding: Sharding, group: dist.ProcessGroup | None = None,
                 exchange: Exchange | None = None) -> None:
        self.sharding = sharding
        self.group = group
        self.exchange = exchange

    def gather_partials(self, partials: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Every virtual shard's partial result, stacked in virtual-shard order ([S, ...] fp32), on every rank.
        partials: this rank's local shards' partials, as a list or already stacked ([local shards, ...])."""
        local = partials.float() if isinstance(partials, torch.Tensor) else torch.stack([p.float() for p in partials])
        return self._all_gather(local, 0) if self.sharding.world > 1 else local

    def sum_partials(self, partials: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Sum of every virtual shard's partial result, in virtual-shard order, identical on every rank."""
        local = self.gather_partials(partials)
        acc = local[0].clone()
        for part in local[1:]:
            acc += part
        return acc

    def gather_columns(self, parts: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Concatenate column slices (e.g. vocab shards of the logits) from every rank in order. parts: this rank's
        local shards' slices, as a list or stacked ([local shards, rows, columns])."""
        local = torch.cat(list(parts), dim=-1).contiguous()
        return self._all_gather(local, -1) if self.sharding.world > 1 else local

    def union(self, keys: set[bytes]) -> set[bytes]:
        """The union of every rank's `keys` (KV tier entries that failed on some rank: all must drop them alike)."""
        if self.sharding.world == 1:
            return keys
        gathered: list[set[bytes] | None] = [None] * self.sharding.world
        dist.all_gather_object(gathered, keys, group=self.group)
        return set().union(*(g or set() for g in gathered))

    def from_first(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` on every rank (the other ranks pass a tensor of the same shape and dtype to receive it)."""
        if self.sharding.world > 1 and self.exchange is not None:
            return self.exchange.from_first(t)
        if self.sharding.world > 1:
            t = t.contiguous()
            dist.broadcast(t, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0,
                           group=self.group)
        return t

    def _all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's `local`, concatenated along `dim` in rank order."""
        if self.exchange is not None:
            return self.exchange.all_gather(local, dim)
        gathered = [torch.empty_like(local) for _ in range(self.sharding.world)]
        dist.all_gather(gathered, local.contiguous(), group=self.group)
        return torch.cat(gathered, dim=dim)
