"""The rank worker as processes (TP = 2 over gloo), driven through its real gRPC Step stream."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from queue import Queue
from threading import Thread

import grpc
import pytest
import torch

from services.common.plan_checksum import seal
from services.common.tensors import ids, to_proto
from services.rank_worker.distributed import free_port
from services.rank_worker.offline import GenerateRequest, generate
from twinspark.v1 import rank_pb2, rank_pb2_grpc

TWINSPARK = str(Path(sys.executable).parent / "twinspark")
BLOCKS, BLOCK = 64, 16


def _start_ranks(model: Path, world: int, tmp: Path, *, blocks: list[int] | None = None) -> tuple[list, list[int]]:
    master, ports, procs = free_port(), [free_port() for _ in range(world)], []
    for r in range(world):
        log = open(tmp / f"rank{r}.log", "w")
        procs.append(subprocess.Popen(
            [TWINSPARK, "serve-rank", "--model", str(model), "--rank", str(r), "--world", str(world),
             "--master-port", str(master), "--host", "127.0.0.1", "--port", str(ports[r]),
             "--num-blocks", str((blocks or [BLOCKS] * world)[r]), "--block-size", str(BLOCK), "--num-slots", "4"],
            stdout=log, stderr=subprocess.STDOUT))
    return procs, ports


def _stub(port: int) -> rank_pb2_grpc.RankWorkerStub:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=120)
    return rank_pb2_grpc.RankWorkerStub(channel)


def _plan(round_: int, tokens: list[int], start: int) -> rank_pb2.StepPlan:
    return seal(rank_pb2.StepPlan(
        round=round_, token_ids=to_proto(tokens), starts=to_proto([start]), lengths=to_proto([len(tokens)]),
        slots=to_proto([0]), block_tables=to_proto(torch.arange(8, dtype=torch.int32).view(1, 8)),
        sample_rows=to_proto([len(tokens) - 1]), temperature=to_proto([0.0], "float32"),
        top_p=to_proto([1.0], "float32"), top_k=to_proto([0]), min_p=to_proto([0.0], "float32"),
        seed=to_proto([0], "int64"), request_ids=["r1"]))


@pytest.fixture(scope="module")
def ranks(tiny_default, tmp_path_factory):
    procs, ports = _start_ranks(tiny_default, 2, tmp_path_factory.mktemp("ranks"))
    yield procs, [_stub(p) for p in ports]
    for p in procs:
        p.kill()
        p.wait()


def _drive(stubs, prompt: list[int], rounds: int, decorate=lambda plan, generated: None) -> list[int]:
    """Generate round by round on every rank (a plan can only be built once the previous token is known);
    `decorate(plan, generated)` adds to each plan (sealed again after). Every rank must sample the same ids."""
    queues = [Queue() for _ in stubs]
    results = [Queue() for _ in stubs]

    def pump(i):
        for res in stubs[i].Step(iter(queues[i].get, None)):
            results[i].put(res)

    threads = [Thread(target=pump, args=(i,), daemon=True) for i in range(len(stubs))]
    for t in threads:
        t.start()
    got, pos, chunk = [], 0, prompt
    for round_ in range(1, rounds + 1):
        plan = _plan(round_, chunk, pos)
        decorate(plan, got)
        plan = seal(plan)
        for q in queues:
            q.put(plan)
        answers = [r.get(timeout=120) for r in results]
        assert all(not a.error for a in answers), [a.error for a in answers]
        assert all(ids(a.sampled) == ids(answers[0].sampled) for a in answers)
        token = ids(answers[0].sampled)[0]
        got.append(token)
        pos += len(chunk)
        chunk = [token]
    for q in queues:
        q.put(None)
    return got


@pytest.mark.tp
def test_tp2_service_matches_offline_generate(tiny_default, ranks):
    procs, stubs = ranks
    describe = [s.Describe(rank_pb2.DescribeRequest()) for s in stubs]
    assert describe[0].fingerprint == describe[1].fingerprint and describe[1].rank == 1
    prompt = [5, 17, 99, 3, 250, 8, 41]
    expected = generate(tiny_default, GenerateRequest(prompt_ids=tuple(prompt), max_tokens=6, ignore_eos=True))
    assert _drive(stubs, prompt, 6) == expected


@pytest.mark.tp
def test_tp2_ranks_apply_penalties_alike(tiny_default, ranks):
    """Penalties, logit bias and banned ids (StepPlan.penalties) on two ranks over gloo: the same ids on both, the
    bias and bans honoured, and the greedy continuation changed."""
    _, stubs = ranks
    prompt = [5, 17, 99, 3, 250, 8, 41]
    plain = generate(tiny_default, GenerateRequest(prompt_ids=tuple(prompt), max_tokens=6, ignore_eos=True))

    def penalise(plan, generated):
        counts = {t: generated.count(t) for t in dict.fromkeys(prompt + generated)}
        plan.penalties.CopyFrom(rank_pb2.RowPenalties(
            rows=to_proto([0]), presence=to_proto([1.5], "float32"), frequency=to_proto([2.0], "float32"),
            repetition=to_proto([1.7], "float32"), seen_ids=to_proto([list(counts)]),
            seen_counts=to_proto([list(counts.values())]), bias_ids=to_proto([[plain[0], 77]]),
            bias_values=to_proto([[-100.0, 0.5]], "float32"),
            banned_ids=to_proto([[plain[1]]] if len(generated) < 3 else torch.zeros(1, 0, dtype=torch.int32))))

    got = _drive(stubs, prompt, 6, penalise)
    assert got != plain and got[0] != plain[0] and plain[1] not in got[:3]


def test_round_gap_stops_the_rank(tiny_default, tmp_path):
    procs, ports = _start_ranks(tiny_default, 1, tmp_path)
    try:
        stub = _stub(ports[0])
        out = list(stub.Step(iter([_plan(1, [1, 2, 3], 0), _plan(3, [4], 3)])))
        assert not out[0].error and "expected 2" in out[1].error
        assert procs[0].wait(timeout=30) == 3
    finally:
        procs[0].kill()


def test_bad_checksum_stops_the_rank(tiny_default, tmp_path):
    """A checksum mismatch may mean this rank got another plan than its peers: it stops (malformed plans that every
    rank refuses alike are tests/rank_worker/test_hostile_plans.py)."""
    procs, ports = _start_ranks(tiny_default, 1, tmp_path)
    try:
        plan = _plan(1, [1, 2, 3], 0)
        plan.checksum = "0" * 64
        out = list(_stub(ports[0]).Step(iter([plan])))
        assert "checksum" in out[0].error and not out[0].refused
        assert procs[0].wait(timeout=30) == 3
    finally:
        procs[0].kill()


def test_settings_mismatch_refuses_to_start(tiny_default, tmp_path):
    procs, _ = _start_ranks(tiny_default, 2, tmp_path, blocks=[64, 32])
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [4, 4]
    log = (tmp_path / "rank0.log").read_text()
    assert "cache blocks" in log and "rank 0=64" in log and "rank 1=32" in log
