"""The rank's Step loop when rounds overlap, with a mocked asynchronous device (no GPU here): a launched round that
is not done yet lets the next plan be launched first, and whatever happens to that next plan, answers keep round
order — every accepted round is answered, a refused plan after an overlapped round is answered after it, and a
failure stops the stream only after the round before it has been answered. The real executor's overlap runs on
CUDA only (tests/gpu/test_served_cuda.py drives it through the stack)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from services.common.plan_checksum import seal
from services.rank_worker import server as rank_server
from services.rank_worker.plan_checks import PlanError
from services.rank_worker.rounds import RoundResult
from services.rank_worker.plan_queue import PlanQueue
from twinspark.v1 import rank_pb2


@dataclass
class _Launched:
    round: int
    gate: threading.Event = field(default_factory=threading.Event)  # "the device is done with this round"

    def ready(self) -> bool:
        return self.gate.is_set()

    overlappable = True
    has_prompt = False
    steps = 1
    begin = done = None  # no timing events on the mock GPU (the round stats then sum host figures only)


class _MockGpuExecutor:
    """Rounds stay 'running' until the next plan has been launched (or the stream ends), as on a busy GPU."""

    def __init__(self, refuse: set[int] = frozenset(), fail: set[int] = frozenset()) -> None:
        self.calls: list[str] = []
        self.refuse, self.fail = refuse, fail
        self.running: _Launched | None = None

    def launch(self, plan: rank_pb2.StepPlan) -> _Launched:
        self.calls.append(f"launch {plan.round}")
        if self.running is not None:
            self.running.gate.set()  # the device finishes the older round while the host queues this one
        if plan.round in self.refuse:
            raise PlanError("refused by the test")
        if plan.round in self.fail:
            raise RuntimeError("failed by the test")
        self.running = _Launched(plan.round)
        return self.running

    def finish(self, launched: _Launched) -> RoundResult:
        self.calls.append(f"finish {launched.round}")
        return RoundResult([launched.round], 0.0, 0.0)


class _Context:
    def peer(self) -> str:
        return "test"


def _run(executor: _MockGpuExecutor, rounds: int, monkeypatch) -> list[rank_pb2.StepResult]:
    stopped: list[str] = []
    service = rank_server.RankService(executor, rank_pb2.DescribeReply(rank=0))
    monkeypatch.setattr(service, "_stop", stopped.append)
    plans = [seal(rank_pb2.StepPlan(round=r)) for r in range(1, rounds + 1)]
    # Plans come in while the loop waits: the queue is filled by its reader thread from this list.
    results = list(service._rounds(PlanQueue(iter(plans)), _Context()))
    executor.stopped = stopped
    return results


def test_overlapped_rounds_answer_in_order(monkeypatch):
    ex = _MockGpuExecutor()
    results = _run(ex, 4, monkeypatch)
    assert [r.round for r in results] == [1, 2, 3, 4]
    assert all(not r.error for r in results)
    # Round n+1 is launched before round n is read back whenever it was already waiting.
    assert ex.calls.index("launch 2") < ex.calls.index("finish 1")
    assert ex.calls.index("launch 4") < ex.calls.index("finish 3")


def test_refused_plan_after_an_overlapped_round(monkeypatch):
    ex = _MockGpuExecutor(refuse={2})
    results = _run(ex, 3, monkeypatch)
    assert [(r.round, r.refused) for r in results] == [(1, False), (2, True), (3, False)]
    assert "bad plan" in results[1].error


def test_failure_answers_the_round_before_then_stops(monkeypatch):
    ex = _MockGpuExecutor(fail={3})
    results = _run(ex, 4, monkeypatch)
    assert [r.round for r in results] == [1, 2, 3]
    assert not results[1].error and "failed by the test" in results[2].error
    assert ex.stopped and "launch 4" not in ex.calls
