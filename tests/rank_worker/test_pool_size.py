"""The pool sized from memory (services/rank_worker/pool_size.py): what a block and a slot cost, the count a budget
buys, and two rank processes that size their pools from different budgets agreeing on the smaller one."""

from __future__ import annotations

import dataclasses
import subprocess

import grpc
import pytest
import torch

from services.rank_worker import pool_size
from services.rank_worker.distributed import free_port
from model.cache import PagedCache
from model.config import ModelConfig
from model.parallel import Sharding
from model.row_store import RowStore
from tests.rank_worker.test_rank_service import TWINSPARK, _stub
from twinspark.v1 import rank_pb2

SLOTS = 4


def _allocated(cache: PagedCache) -> int:
    """Bytes of every tensor the cache holds, found by walking its attributes (a store added later counts too)."""
    total = 0
    for value in vars(cache).values():
        for item in value.values() if isinstance(value, dict) else [value]:
            if isinstance(item, RowStore):
                total += item.data.nbytes + (item.scale.nbytes if item.scale is not None else 0)
            elif isinstance(item, torch.Tensor):
                total += item.nbytes
    return total


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("world", [1, 2])
def test_cost_is_what_a_cache_allocates(tiny_default, kv_dtype, world) -> None:
    cfg = ModelConfig.from_pretrained(tiny_default)
    sharding = Sharding(rank=0, world=world, virtual=4)
    cost = pool_size.pool_cost(cfg, sharding, block_size=16, dtype=torch.float32, kv_dtype=kv_dtype, with_mtp=True)
    cache = PagedCache(cfg, sharding, num_blocks=5, block_size=16, num_slots=3, dtype=torch.float32, device="cpu",
                       kv_dtype=kv_dtype)
    assert _allocated(cache) == 6 * cost.block_bytes + 4 * cost.slot_bytes  # one scratch block and slot each


def test_blocks_for_a_budget() -> None:
    cost = pool_size.PoolCost(block_bytes=1000, slot_bytes=300)
    budget = (SLOTS + 1) * 300 + 51 * 1000
    assert pool_size.blocks_for_budget(budget, cost, SLOTS) == 50
    assert pool_size.blocks_for_budget(budget + 999, cost, SLOTS) == 50
    with pytest.raises(ValueError, match="does not hold 4 KDA slots"):
        pool_size.blocks_for_budget((SLOTS + 1) * 300 + 1999, cost, SLOTS)


def test_budget_rules() -> None:
    cpu = torch.device("cpu")
    assert pool_size.budget_bytes(cpu, kv_cache_memory_bytes=12345, gpu_memory_utilization=0.9).bytes == 12345
    assert 0 < pool_size.budget_bytes(cpu, kv_cache_memory_bytes=0, gpu_memory_utilization=0.9).bytes \
        <= pool_size.CPU_KV_CACHE_BYTES


GIB = 2 ** 30
# A DGX Spark once a rank's ~85 GiB of weights are loaded, as its device reports it (faked: no GPU here): 128 GiB
# that the CPU and the GPU share, cudaMemGetInfo's free the system's (the OS, the other roles and this rank's
# weights taken), 30 GiB available to the system with the reclaimable page cache.
SPARK = pool_size.MemoryReport(total=128 * GIB, free=20 * GIB, own=85 * GIB, unified=True, available=30 * GIB)


def test_unified_memory_budget_is_a_share_of_the_total_with_a_faked_device_report() -> None:
    """vLLM's meaning on an integrated GPU: 0.9 x the total less what this rank holds, whatever the others use;
    the free-memory rule of a discrete GPU would have taken 0.9 x 128 - 108 GiB of it."""
    got = pool_size.gpu_budget(SPARK, 0.75)
    assert got.bytes == int(0.75 * 128 * GIB) - 85 * GIB  # 11 GiB
    assert "unified memory" in got.rule and "85.0 GiB this rank holds" in got.rule
    discrete = dataclasses.replace(SPARK, unified=False)
    assert pool_size.gpu_budget(discrete, 0.75).bytes == int(0.75 * 128 * GIB) - 108 * GIB


def test_unified_memory_budget_refuses_what_the_system_cannot_give_with_a_faked_device_report() -> None:
    """0.95 of the total would leave a 36.6 GiB pool with 30 GiB available: the rank stops and says what to set,
    rather than take the memory the OS and the other processes run in."""
    with pytest.raises(ValueError, match="lower --gpu-memory-utilization or set --kv-cache-memory-bytes"):
        pool_size.gpu_budget(SPARK, 0.95)


def test_unified_memory_ranks_sharing_the_gpu_split_the_total_with_a_faked_device_report() -> None:
    two = dataclasses.replace(SPARK, own=40 * GIB)
    got = pool_size.gpu_budget(two, 0.9, sharers=2)
    assert got.bytes == int(0.9 * 128 * GIB) // 2 - 40 * GIB and "split over the 2 ranks" in got.rule


def test_ranks_agree_on_the_smaller_pool(tiny_default, tmp_path) -> None:
    """TP = 2 over gloo, each rank with its own budget (as two GPUs with different free memory): both serve the
    smaller rank's count, and the window is what that pool holds."""
    cfg = ModelConfig.from_pretrained(tiny_default)
    budgets = [6 << 20, 4 << 20]
    master, ports, procs = free_port(), [free_port(), free_port()], []
    try:
        for r in range(2):
            log = open(tmp_path / f"rank{r}.log", "w")
            procs.append(subprocess.Popen(
                [TWINSPARK, "serve-rank", "--model", str(tiny_default), "--rank", str(r), "--world", "2",
                 "--master-port", str(master), "--host", "127.0.0.1", "--port", str(ports[r]), "--num-blocks", "0",
                 "--kv-cache-memory-bytes", str(budgets[r]), "--num-slots", str(SLOTS)],
                stdout=log, stderr=subprocess.STDOUT))
        replies = [_stub(p).Describe(rank_pb2.DescribeRequest(), timeout=30) for p in ports]
    except grpc.RpcError:
        raise AssertionError((tmp_path / "rank0.log").read_text() + (tmp_path / "rank1.log").read_text()) from None
    finally:
        for p in procs:
            p.kill()
            p.wait()
    cost = pool_size.pool_cost(cfg, Sharding(rank=0, world=2, virtual=4), block_size=16, dtype=torch.float32,
                               kv_dtype=None, with_mtp=True)
    want = pool_size.blocks_for_budget(min(budgets), cost, SLOTS)
    assert [r.num_blocks for r in replies] == [want, want]
    assert [r.max_model_len for r in replies] == [want * 16] * 2 and want * 16 < cfg.max_position_embeddings
    assert replies[0].settings["cache blocks"] == "auto" and replies[0].fingerprint == replies[1].fingerprint
