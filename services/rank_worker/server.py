"""The rank worker's gRPC service: Describe, and the Step stream that executes one StepPlan per round.

Two kinds of bad plans:
- malformed content (wrong lengths or dtypes, ids out of range, counts beyond the cache: `PlanError`, found before
  anything runs): the rank answers the error with `refused = true` and goes on serving the stream. Every rank checks
  the same plan the same way, so they all refuse it together and stay in lock-step; nothing changed.
- a round that is not the next one, a checksum mismatch, or a failure inside the forward: this rank may no longer
  agree with its peers (it missed a plan, got another plan, or left a collective half-way). It answers the error and
  stops the process (exit code 3), and a supervisor restarts the group.
Only one Step stream runs at a time (one scheduler drives a rank).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Iterator

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.internal_auth import server_interceptors
from services.common.plan_checksum import plan_checksum
from services.rank_worker.compile_watch import CompileWatch
from services.rank_worker.executor import Executor
from services.rank_worker.plan_checks import PlanError
from services.rank_worker.plan_queue import END, NOT_YET, PlanQueue
from services.rank_worker.round_profiler import RoundProfiler
from services.rank_worker.round_stats import DEFAULT_INTERVAL_S, RoundStats
from services.rank_worker.rounds import Launched
from twinspark.v1 import rank_pb2, rank_pb2_grpc

log = logging.getLogger("twinspark.rank")
EXIT_BAD_PLAN = 3
_tracer = trace.get_tracer("twinspark.rank")


class RankService(rank_pb2_grpc.RankWorkerServicer):
    def __init__(self, executor: Executor, describe: rank_pb2.DescribeReply,
                 stats_interval_s: float = DEFAULT_INTERVAL_S, watch_compiles: bool = False) -> None:
        """`watch_compiles`: log and count Triton compiles from now on (a GPU rank after its warm-up)."""
        self.executor = executor
        self.describe = describe
        self.rank = describe.rank
        self._stream_lock = threading.Lock()
        self.profiler = RoundProfiler.from_env(self.rank)  # TWINSPARK_TORCH_PROFILER_DIR: off by default
        # Kernel compiles from here on are on the request path (the warm-up is over): logged, and counted per window.
        self.compiles = CompileWatch(self.rank) if watch_compiles else None
        if self.compiles is not None:
            self.compiles.install()
        self.stats = RoundStats(self.rank, stats_interval_s,
                                compiles=self.compiles.take if self.compiles is not None else None)

    def Describe(self, request: rank_pb2.DescribeRequest, context: grpc.ServicerContext) -> rank_pb2.DescribeReply:
        return self.describe

    def TierList(self, request: rank_pb2.TierListRequest, context: grpc.ServicerContext) -> rank_pb2.TierListReply:
        tiers = self.executor.tiers
        return rank_pb2.TierListReply(entries=[rank_pb2.TierEntry(**e) for e in (tiers.listing() if tiers else [])])

    def _stop(self, reason: str) -> None:
        """Leave the group: the reply with the error goes out first, then the process ends."""
        log.error("rank %d stopping: %s", self.rank, reason)
        threading.Timer(0.5, os._exit, args=(EXIT_BAD_PLAN,)).start()

    def Step(self, plans: Iterator[rank_pb2.StepPlan], context: grpc.ServicerContext) -> Iterator[rank_pb2.StepResult]:
        if not self._stream_lock.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another Step stream is already driving this rank")
        try:
            yield from self._rounds(PlanQueue(plans), context)
        finally:
            self._stream_lock.release()

    def _rounds(self, incoming: PlanQueue, context: grpc.ServicerContext) -> Iterator[rank_pb2.StepResult]:
        """Launch each plan, read it back, answer it — in round order. On a GPU, when plan n+1 is already here while
        round n still runs, round n+1 is launched before round n is read back (Launched.overlappable), so the GPU is
        never idle while the host checks a plan and queues its kernels."""
        expected = 1
        log.info("rank %d: step stream opened by %s", self.rank, context.peer())
        running: _Round | None = None  # launched, not yet read back
        while True:
            t_wait = time.perf_counter()
            plan = incoming.next(running.launched.ready if running is not None else None)
            if running is None:
                self.stats.waited_for_plan(time.perf_counter() - t_wait)
            self.stats.maybe_log()
            if plan is NOT_YET or plan is END:
                if running is not None:
                    res, ok = self._finish(running)
                    yield res
                    running = None
                    if not ok:
                        return
                if plan is END:
                    break
                continue
            error = ""
            if plan.round != expected:
                error = f"round {plan.round} arrived, expected {expected}"
            elif plan.checksum != plan_checksum(plan):
                error = f"round {plan.round}: checksum mismatch"
            expected += 1
            new = refusal = None
            if not error:
                try:
                    new = self._launch(plan, behind=running is not None)
                except PlanError as exc:
                    log.warning("rank %d: refused round %d: %s", self.rank, plan.round, exc)
                    refusal = rank_pb2.StepResult(round=plan.round, rank=self.rank, refused=True,
                                                  error=f"round {plan.round}: bad plan: {exc}")
                except Exception as exc:  # noqa: BLE001 — the forward failed half-way: the group must restart
                    log.exception("rank %d: round %d failed", self.rank, plan.round)
                    error = f"round {plan.round}: the forward failed: {type(exc).__name__}: {exc}"
            if running is not None:  # round n is answered before round n+1, whatever became of n+1
                res, ok = self._finish(running)
                yield res
                running = None
                if not ok:
                    return
            if error:
                yield rank_pb2.StepResult(round=plan.round, rank=self.rank, error=error)
                self._stop(error)
                return
            if refusal is not None:
                yield refusal
                continue
            assert new is not None
            if new.launched.overlappable:
                running = new
            else:
                res, ok = self._finish(new)
                yield res
                if not ok:
                    return
        log.info("rank %d: step stream closed after %d rounds", self.rank, expected - 1)

    def _launch(self, plan: rank_pb2.StepPlan, behind: bool) -> "_Round":
        """Queue a plan's work. Its trace span (a child of the scheduler's round span; none when the plan carries no
        trace context) stays open until the round is read back."""
        span = telemetry.start_server_span(_tracer, "step", plan.trace_context,
                                           {"twinspark.rank": self.rank, "twinspark.round": plan.round})
        try:
            if self.profiler is not None:
                self.profiler.before(plan.round)
            t0 = time.perf_counter()
            launched = self.executor.launch(plan)
            self.stats.launched(plan.round, (time.perf_counter() - t0) * 1e3, behind, launched.has_prompt,
                                launched.steps)
            if self.profiler is not None:
                self.profiler.launched(plan.round)
        except BaseException as exc:
            if span is not None:
                span.record_exception(exc)
                span.end()
            raise
        rows = plan.token_ids.shape[0] if plan.token_ids.shape else 0  # a plan of tier moves has none
        return _Round(plan.round, len(plan.request_ids), rows, launched, span)

    def _finish(self, r: "_Round") -> tuple[rank_pb2.StepResult, bool]:
        """Read a launched round back: its result, and False when this rank must stop (the read-back failed)."""
        try:
            t0 = time.perf_counter()
            out = self.executor.finish(r.launched)
            self.stats.finished(r.launched.begin, r.launched.done, (time.perf_counter() - t0) * 1e3,
                                r.launched.has_prompt)
        except Exception as exc:  # noqa: BLE001 — the round failed on the device: the group must restart
            log.exception("rank %d: round %d failed", self.rank, r.round)
            error = f"round {r.round}: the forward failed: {type(exc).__name__}: {exc}"
            if r.span is not None:
                r.span.record_exception(exc)
                r.span.end()
            self._stop(error)
            return rank_pb2.StepResult(round=r.round, rank=self.rank, error=error), False
        if r.span is not None:
            r.span.set_attributes({"twinspark.seqs": r.seqs, "twinspark.rows": r.rows,
                                   "twinspark.forward_ms": out.forward_ms, "twinspark.sample_ms": out.sample_ms})
            r.span.end()
        res = out.to_proto(r.round, self.rank)
        if self.profiler is not None:
            self.profiler.after(r.round)
        return res, True


@dataclass
class _Round:
    """A launched round and what its answer and trace span need."""
    round: int
    seqs: int
    rows: int
    launched: Launched
    span: trace.Span | None  # ended when the round is read back


def serve(service: RankService, host: str, port: int, token: str | None = None) -> grpc.Server:
    """Listen on host:port; with `token`, every call must carry it (services/common/internal_auth.py)."""
    # Results may carry a round's DFlash layer rows: at the release's size 8,192 rows x 5 layers x 4,096 fp32 values
    # are 640 MiB.
    opts = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 1 << 30)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=opts,
                         interceptors=server_interceptors(token, f"rank{service.rank}"))
    rank_pb2_grpc.add_RankWorkerServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"cannot listen on {host}:{port}")
    server.start()
    return server
