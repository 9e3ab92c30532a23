"""The same-host collective (model/host_exchange.py): spawned ranks joined with --collective ipc get, through the
shared region, exactly what torch.distributed's gloo all_gather / broadcast give over the same group; a missing peer
times out naming it; an exchange larger than the slot is refused; the flag's refusals."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import traceback

import pytest
import torch
import torch.distributed as dist

from model.host_exchange import HostExchange, create_region, stale_regions
from model.parallel import Collective
from services.rank_worker.distributed import backend_for, join_group
from tests.spawned_ranks import run_ranks

# (shape, dtype) of successive exchanges: partial stacks, logits columns, odd sizes, a scalar, integer ids.
SHAPES = [((2, 5, 8), torch.float32), ((1, 3, 7), torch.bfloat16), ((3,), torch.int64), ((), torch.float32),
          ((2, 64, 33), torch.float32), ((1, 1, 1), torch.float16)]


def _check_rank(rank: int, world: int, port: int, results: "mp.Queue") -> None:
    try:
        torch.set_num_threads(1)
        sharding, group, exchange = join_group(rank, world, master_addr="127.0.0.1", master_port=port, device="cpu",
                                               collective="ipc", slot_bytes=1 << 16, timeout_s=20)
        assert exchange is not None
        coll = Collective(sharding, group, exchange)
        jitter = random.Random(rank)
        for i, (shape, dtype) in enumerate(SHAPES * 3):  # 18 calls: both buffers, reused several times each
            local = (torch.randn(shape) * (rank + 1) + i).to(dtype)
            if jitter.random() < 0.5:  # ranks arrive out of step: a fast one runs ahead into the other buffer
                torch.randn(20000).sort()
            want = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(want, local, group=group)
            assert torch.equal(exchange.all_gather(local[None], 0), torch.stack(want))  # rank order
            if shape:
                assert torch.equal(coll.gather_partials(local.float()), torch.cat(want).float())
            if len(shape) > 1:  # [local shards, rows, columns]
                columns = torch.cat([torch.cat(list(w), dim=-1) for w in want], dim=-1)  # local shards, then ranks
                assert torch.equal(coll.gather_columns(local), columns)
            first = local.clone()
            assert torch.equal(coll.from_first(first), want[0])
        results.put(("ok", exchange.path))
    except BaseException:  # report, never leave the parent waiting
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


@pytest.mark.parametrize("world", [2, 4])
def test_ipc_equals_gloo(world):
    paths = set(run_ranks(world, _check_rank, timeout_s=120))
    assert len(paths) == 1 and not os.path.exists(paths.pop()), "region left behind"


def test_a_dead_creators_region_is_removed_by_the_next_one():
    """A rank 0 killed between making the region and unlinking it leaves the file; the next region made on the host
    removes it (its name carries the dead creator's pid), and leaves a live creator's alone."""
    dead = mp.get_context("spawn").Process(target=os.getpid)
    dead.start()
    dead.join()
    leftover = os.path.join("/dev/shm", f"twinspark-collective-{dead.pid}-00000000deadbeef")
    open(leftover, "wb").close()
    assert leftover in stale_regions()
    path, _ = create_region(world=2, slot_bytes=1024)
    try:
        assert not os.path.exists(leftover) and os.path.exists(path) and path not in stale_regions()
    finally:
        os.unlink(path)


def test_missing_peer_times_out_naming_it():
    path, nonce = create_region(world=2, slot_bytes=1024)
    try:
        ex = HostExchange(path, 0, nonce, timeout_s=0.3)
        with pytest.raises(TimeoutError, match=r"rank 0 waited 0.3 s at exchange 1 for rank 1 at 0"):
            ex.all_gather(torch.ones(4))
        with pytest.raises(ValueError, match="larger than the slot of 1024 bytes"):
            ex.all_gather(torch.ones(257))
    finally:
        os.unlink(path)


def test_foreign_region_is_refused():
    path, _ = create_region(world=2, slot_bytes=64)
    try:
        with pytest.raises(RuntimeError, match="not this group's region"):
            HostExchange(path, 1, b"x" * 16)
    finally:
        os.unlink(path)


def test_collective_flag_refusals_and_backends():
    with pytest.raises(ValueError, match="needs --device cuda"):
        backend_for("nccl", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        backend_for("mpi", "cpu")
    # auto and ipc join over gloo everywhere (auto on CUDA moves to NCCL only when the ranks cannot share memory)
    assert [backend_for(c, d) for d in ("cpu", "cuda") for c in ("auto", "ipc", "gloo")] == ["gloo"] * 6
    assert backend_for("nccl", "cuda") == "nccl"
