"""The CUDA same-host collective's protocol (model/device_exchange.py), run on a CPU stand-in: spawned ranks map
each other's regions as files in /dev/shm instead of CUDA IPC handles, and the very kernel runs in Triton's CPU
interpreter. What it must give: exactly what gloo's all_gather / broadcast give over the same group, in rank order,
for every dtype, a tensor larger than a slot (several calls), ranks arriving out of step; a peer that never comes
marks the exchange failed instead of hanging. The CUDA mapping itself is checked on a GPU
(tests/gpu/test_device_exchange_cuda.py)."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import secrets
import traceback

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("triton", reason="Triton is not installed")

from model.device_exchange import BLOCK, PROGRAMS, DeviceExchange, Region, call_shape, region_bytes  # noqa: E402
from tests.spawned_ranks import run_ranks  # noqa: E402

SLOT = 4096  # small, so the larger tensors below go in several calls, each program's share capped by its part
WIDE_SLOT = 1 << 20  # one call each, small tensors on few programs of a BLOCK or more
SHAPES = [((2, 5, 8), torch.float32), ((1, 3, 7), torch.bfloat16), ((3,), torch.int64), ((), torch.float32),
          ((2, 64, 33), torch.float32), ((1, 1, 1), torch.float16), ((5,), torch.uint8)]


def _map(path: str, size: int) -> Region:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    return Region(torch.empty(0, dtype=torch.uint8).set_(storage))


def standin_exchange(rank: int, world: int, group, *, spin_limit: int | None = None,
                     slot: int = SLOT) -> DeviceExchange:
    """Regions as zeroed /dev/shm files that every rank maps (what CUDA IPC handles give on a GPU)."""
    size = region_bytes(slot)
    path = f"/dev/shm/twinspark-test-device-exchange-{secrets.token_hex(8)}"
    with open(path, "wb") as f:
        f.truncate(size)
    paths: list[str | None] = [None] * world
    dist.all_gather_object(paths, path, group=group)
    regions = [_map(p, size) for p in paths]
    dist.barrier(group=group)
    os.unlink(path)
    kw = {} if spin_limit is None else {"spin_limit": spin_limit}
    return DeviceExchange(regions, rank, slot, **kw)


def _check_rank(rank: int, world: int, port: int, results: "mp.Queue", slot: int = SLOT) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        exchange = standin_exchange(rank, world, dist.group.WORLD, slot=slot)
        jitter = random.Random(rank)
        for i, (shape, dtype) in enumerate(SHAPES * 2):  # both buffers, each reused several times
            local = (torch.randn(shape) * (rank + 1) + i).to(dtype)
            if jitter.random() < 0.5:  # ranks arrive out of step: a fast one runs ahead into the other buffer
                torch.randn(20000).sort()
            want = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(want, local)
            got = exchange.all_gather(local[None], 0)
            assert torch.equal(got, torch.stack(want)), f"all_gather of {shape} {dtype}"
            if len(shape) > 1:
                assert torch.equal(exchange.all_gather(local, -1), torch.cat(want, dim=-1)), "along the last dim"
            first = local.clone()
            assert torch.equal(exchange.from_first(first), want[0]), f"from_first of {shape} {dtype}"
        assert not exchange.failed()
        results.put(("ok", rank))
    except BaseException:  # report, never leave the parent waiting
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


@pytest.mark.parametrize(("world", "slot"), [(2, SLOT), (3, SLOT), (2, WIDE_SLOT)])
def test_cpu_standin_device_exchange_equals_gloo(world: int, slot: int) -> None:
    run_ranks(world, functools.partial(_check_rank, slot=slot))


@pytest.mark.parametrize("part", [16, 1024, 4096, 1 << 14])
def test_call_shape_covers_the_call_once_within_each_program_part(part: int) -> None:
    for size in [0, 1, 15, 16, 17, BLOCK - 1, BLOCK, BLOCK + 1, 6144, 64 * BLOCK + 1, PROGRAMS * part - 1,
                 PROGRAMS * part]:
        if size > PROGRAMS * part:
            continue
        share, programs = call_shape(size, part)
        assert share <= part and 1 <= programs <= PROGRAMS, (size, share, programs)
        assert share * (programs - 1) < max(size, 1) <= share * programs, (size, share, programs)
        if size <= BLOCK and part >= BLOCK:
            assert programs == 1, "a small tensor takes one program, not G"


def _lonely_rank(rank: int, world: int, port: int, results: "mp.Queue") -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        exchange = standin_exchange(rank, world, dist.group.WORLD, spin_limit=200)
        if rank == 0:  # rank 1 never calls: rank 0 must give up and say so, not spin forever
            exchange.all_gather(torch.ones(8), 0)
            assert exchange.failed()
        dist.barrier()
        results.put(("ok", rank))
    except BaseException:
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def test_cpu_standin_missing_peer_marks_the_exchange_failed() -> None:
    run_ranks(2, _lonely_rank)
