"""The CUDA same-host collective (model/device_exchange.py) between two rank processes on ONE GPU, through CUDA IPC:
all_gather / from_first equal gloo's over the same group bit for bit (a tensor larger than a slot too), a CUDA-graph
replay of the exchange equals its eager call, and what one small exchange costs (printed: what a decode step pays
per collective when two ranks share a GPU)."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.spawned_ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SLOT = 1 << 20
SHAPES = [((2, 1, 4096), torch.float32), ((1, 3, 7), torch.bfloat16), ((3,), torch.int64),
          ((2, 300, 1024), torch.float32)]  # the last: 2.4 MB, three calls of a 1 MiB slot


def _rank(rank: int, world: int, port: int, results: "mp.Queue") -> None:
    try:
        from model.device_exchange import DeviceExchange, cuda_regions
        device = torch.device("cuda", 0)  # every rank on the one GPU
        torch.cuda.set_device(device)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        group = dist.group.WORLD
        exchange = DeviceExchange(cuda_regions(rank, world, group, SLOT, device), rank, SLOT)
        for i, (shape, dtype) in enumerate(SHAPES * 3):
            local = (torch.randn(shape) * (rank + 1) + i).to(dtype)
            want = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(want, local, group=group)
            got = exchange.all_gather(local.to(device)[None], 0).cpu()
            assert torch.equal(got, torch.stack(want)), f"all_gather of {shape} {dtype}"
            first = local.to(device)
            assert torch.equal(exchange.from_first(first).cpu(), want[0]), f"from_first of {shape} {dtype}"

        # A CUDA graph of one exchange, replayed with new inputs: each replay is a new call (device counters).
        static = torch.zeros(2, 1, 4096, device=device)
        exchange.all_gather(static, 0)  # warm the kernel before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = exchange.all_gather(static, 0)
        for i in range(5):
            static.copy_(torch.full_like(static, float(rank * 10 + i)))
            graph.replay()
            eager = exchange.all_gather(static, 0)
            torch.cuda.synchronize()
            assert torch.equal(out, eager), f"replay {i} differs from the eager call"
            peer = 1 - rank
            assert torch.equal(out[2 * peer:2 * peer + 2].cpu(), torch.full((2, 1, 4096), float(peer * 10 + i))), \
                "the peer's rows"

        # The cost of a decode-sized exchange (2 shards x 4096 fp32 = 32 KB), replayed back to back.
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(200):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / 200)
        assert not exchange.failed()
        dist.barrier(group=group)
        results.put(("ok", (rank, statistics.median(times))))
    except BaseException:  # report, never leave the parent waiting
        results.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def test_two_ranks_on_one_gpu_equal_gloo_and_replay():
    got = run_ranks(2, _rank)
    mps = os.path.exists("/tmp/nvidia-mps") or bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))
    for rank, us in sorted(got):
        print(f"device exchange, 2 ranks on one GPU (MPS {'on' if mps else 'off'}): rank {rank} "
              f"{us:.1f} us per 32 KB all_gather (graph replays, median of 5 x 200)")
