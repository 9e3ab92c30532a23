"""Hand-crafted StepPlans against a real rank process: each malformed plan is refused with an error and the rank keeps
serving (the same stream runs a good plan afterwards); calls without the internal token are UNAUTHENTICATED; ranks
started with different tokens refuse to form a group."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path
from queue import Queue
from threading import Thread

import grpc
import pytest
import torch

from services.common.internal_auth import metadata
from services.common.plan_checksum import seal
from services.common.tensors import ids, to_proto
from services.rank_worker.distributed import free_port
from twinspark.v1 import rank_pb2, rank_pb2_grpc
from twinspark.v1.tensor_pb2 import Tensor

from .test_rank_service import BLOCK, BLOCKS, TWINSPARK, _plan

TOKEN = "rank-test-token"


def _start(model: Path, log: Path, *, rank: int = 0, world: int = 1, master: int | None = None, token: str = TOKEN,
           port: int | None = None) -> tuple[subprocess.Popen, int]:
    port = port or free_port()
    proc = subprocess.Popen(
        [TWINSPARK, "serve-rank", "--model", str(model), "--rank", str(rank), "--world", str(world),
         "--master-port", str(master or free_port()), "--port", str(port), "--num-blocks", str(BLOCKS),
         "--block-size", str(BLOCK), "--num-slots", "4"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, "TWINSPARK_INTERNAL_TOKEN": token})
    return proc, port


@pytest.fixture(scope="module")
def rank(tiny_default, tmp_path_factory):
    log = tmp_path_factory.mktemp("hostile_rank") / "rank0.log"
    proc, port = _start(tiny_default, log)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=120)
    yield proc, rank_pb2_grpc.RankWorkerStub(channel), log
    channel.close()
    proc.kill()
    proc.wait()


def _malformed() -> list[tuple[str, rank_pb2.StepPlan]]:
    """(what is wrong, plan): every field a plan has, wrong in the ways a hand-crafted message can be."""
    out = []

    def bad(what: str, **fields) -> None:
        plan = _plan(1, [1, 2, 3], 0)
        for name, value in fields.items():
            getattr(plan, name).CopyFrom(value)
        out.append((what, plan))

    i32, f32 = (lambda v: to_proto(v)), (lambda v: to_proto(v, "float32"))
    bad("lengths do not sum to the rows", lengths=i32([5]))
    bad("negative token id", token_ids=i32([1, -2, 3]))
    bad("token id beyond the vocabulary", token_ids=i32([1, 2, 10**9]))
    bad("float token ids", token_ids=f32([1.0, 2.0, 3.0]))
    bad("bytes that do not fill the shape", token_ids=Tensor(dtype="int32", shape=[3], data=b"\0" * 5))
    bad("a shape that overflows int64", token_ids=Tensor(dtype="int32", shape=[2**32, 2**32], data=b""))
    bad("unknown dtype", token_ids=Tensor(dtype="complex128", shape=[3], data=b"\0" * 48))
    bad("negative start", starts=i32([-4]))
    bad("start at the end of int32", starts=i32([2**31 - 3]))
    bad("start at the end of int64", starts=to_proto([2**63 - 2], "int64"))
    bad("negative slot", slots=i32([-1]))
    bad("slot beyond the cache", slots=i32([4]))
    bad("block id beyond the cache", block_tables=to_proto(torch.tensor([[BLOCKS + 5]], dtype=torch.int32)))
    bad("block table wider than the cache", block_tables=to_proto(torch.zeros(1, BLOCKS + 1, dtype=torch.int32)))
    bad("more rows than the cache holds", token_ids=i32([1] * (BLOCKS * BLOCK + 1)),
        lengths=i32([BLOCKS * BLOCK + 1]), block_tables=to_proto(torch.arange(BLOCKS, dtype=torch.int32)[None]))
    bad("more sample rows than rows", sample_rows=i32([0] * 4), temperature=f32([0.0] * 4), top_p=f32([1.0] * 4),
        top_k=i32([0] * 4), min_p=f32([0.0] * 4), seed=to_proto([0] * 4, "int64"))
    bad("sample row outside the batch", sample_rows=i32([7]))
    bad("NaN temperature", temperature=f32([math.nan]))
    bad("top_p of 0", top_p=f32([0.0]))
    bad("negative top_k", top_k=i32([-3]))
    bad("integer temperature", temperature=i32([1]))
    bad("sampling vectors of the wrong length", seed=to_proto([0, 0], "int64"))
    bad("no sequences", lengths=i32([]), starts=i32([]), slots=i32([]), token_ids=i32([]),
        block_tables=to_proto(torch.zeros(0, 1, dtype=torch.int32)), sample_rows=i32([]))
    bad("verify flag of 2", verify=i32([2]))
    bad("state copies of the wrong shape", state_copies=i32([1, 2, 3]))
    bad("too many state copies", state_copies=to_proto(torch.zeros(9, 2, dtype=torch.int32)))
    bad("state copy from a slot beyond the cache", state_copies=to_proto(torch.tensor([[0, 99]], dtype=torch.int32)))
    def penalties(what: str, **fields) -> None:
        good = dict(rows=i32([0]), presence=f32([0.5]), frequency=f32([0.5]), repetition=f32([1.2]),
                    seen_ids=i32([[4, 9]]), seen_counts=i32([[1, 0]]), bias_ids=i32([[7]]), bias_values=f32([[3.0]]),
                    banned_ids=i32([[2]]))
        plan = _plan(1, [1, 2, 3], 0)
        plan.penalties.CopyFrom(rank_pb2.RowPenalties(**{**good, **fields}))
        out.append((what, plan))

    penalties("a penalised row outside the sample rows", rows=i32([1]))
    penalties("penalised rows listed twice", rows=i32([0, 0]), presence=f32([0.0] * 2), frequency=f32([0.0] * 2),
              repetition=f32([1.0] * 2), seen_ids=i32([[4], [4]]), seen_counts=i32([[1], [1]]),
              bias_ids=i32([[7], [7]]), bias_values=f32([[1.0], [1.0]]), banned_ids=i32([[2], [2]]))
    penalties("presence penalty beyond 2", presence=f32([2.5]))
    penalties("NaN frequency penalty", frequency=f32([math.nan]))
    penalties("repetition penalty of 0", repetition=f32([0.0]))
    penalties("a seen id listed twice", seen_ids=i32([[4, 4]]))
    penalties("a seen id beyond the vocabulary", seen_ids=i32([[4, 10**6]]))
    penalties("negative seen counts", seen_counts=i32([[-1, 0]]))
    penalties("a count at padding", seen_ids=i32([[4, -1]]), seen_counts=i32([[1, 3]]))
    penalties("counts of another shape", seen_counts=i32([[1]]))
    penalties("a bias beyond 100", bias_values=f32([[100.5]]))
    penalties("integer bias values", bias_values=i32([[3]]))
    penalties("a banned id below -1", banned_ids=i32([[-2]]))
    penalties("penalty vectors of the wrong length", presence=f32([0.5, 0.5]))
    plan = _plan(1, [1, 2, 3], 0)
    plan.tier_moves.add(kind=rank_pb2.TIER_SAVE, block_keys=[b"k" * 16], blocks=i32([0]))
    out.append(("a KV tier move on a rank without tiers", plan))
    return out


def test_malformed_plans_are_refused_and_the_rank_keeps_serving(rank):
    proc, stub, _ = rank
    md = metadata(TOKEN)
    cases = _malformed()
    plans: Queue = Queue()
    answers: Queue = Queue()
    thread = Thread(target=lambda: [answers.put(r) for r in stub.Step(iter(plans.get, None), metadata=md)],
                    daemon=True)
    thread.start()
    for round_, (what, plan) in enumerate(cases, 1):
        plan.round = round_
        plans.put(seal(plan))
        res = answers.get(timeout=60)
        assert res.refused and res.error and res.round == round_, (what, res)
    good = _plan(len(cases) + 1, [5, 17, 99], 0)
    plans.put(good)
    res = answers.get(timeout=60)
    assert not res.error and len(ids(res.sampled)) == 1  # the same stream still serves
    plans.put(None)
    thread.join(30)
    assert proc.poll() is None
    assert stub.Describe(rank_pb2.DescribeRequest(), metadata=md).world == 1


def test_calls_without_the_token_are_refused_and_logged(rank):
    proc, stub, log = rank
    for md in (None, metadata("another-token")):
        with pytest.raises(grpc.RpcError) as err:
            stub.Describe(rank_pb2.DescribeRequest(), metadata=md, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Step(iter([_plan(1, [1, 2, 3], 0)]), metadata=md, timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert proc.poll() is None
    text = log.read_text()
    assert "refused /twinspark.v1.RankWorker/Describe" in text and "no internal token" in text
    assert TOKEN not in text and "another-token" not in text


def test_ranks_with_different_tokens_refuse_to_start(tiny_default, tmp_path):
    master = free_port()
    procs = [_start(tiny_default, tmp_path / f"rank{r}.log", rank=r, world=2, master=master, token=f"token-{r}")[0]
             for r in range(2)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [4, 4]
    finally:
        for p in procs:
            p.kill()
    for r in range(2):
        text = (tmp_path / f"rank{r}.log").read_text()
        assert "different internal tokens" in text and "token-0" not in text and "token-1" not in text
