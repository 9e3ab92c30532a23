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
from concurrent import futures
from typing import Iterator

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.internal_auth import server_interceptors
from services.common.plan_checksum import plan_checksum
from services.common.tensors import to_proto
from services.rank_worker.executor import Executor, PlanError
from services.rank_worker.round_profiler import RoundProfiler
from twinspark.v1 import rank_pb2, rank_pb2_grpc

log = logging.getLogger("twinspark.rank")
EXIT_BAD_PLAN = 3
_tracer = trace.get_tracer("twinspark.rank")


class RankService(rank_pb2_grpc.RankWorkerServicer):
    def __init__(self, executor: Executor, describe: rank_pb2.DescribeReply) -> None:
        self.executor = executor
        self.describe = describe
        self.rank = describe.rank
        self._stream_lock = threading.Lock()
        self.profiler = RoundProfiler.from_env(self.rank)  # TWINSPARK_TORCH_PROFILER_DIR: off by default

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
            expected = 1
            log.info("rank %d: step stream opened by %s", self.rank, context.peer())
            for plan in plans:
                error = ""
                if plan.round != expected:
                    error = f"round {plan.round} arrived, expected {expected}"
                elif plan.checksum != plan_checksum(plan):
                    error = f"round {plan.round}: checksum mismatch"
                if error:
                    yield rank_pb2.StepResult(round=plan.round, rank=self.rank, error=error)
                    self._stop(error)
                    return
                expected += 1
                try:
                    # A child of the scheduler's round span; no span when the plan carries no trace context.
                    with telemetry.server_span(_tracer, "step", plan.trace_context,
                                               {"twinspark.rank": self.rank, "twinspark.round": plan.round}) as span:
                        if self.profiler is not None:
                            self.profiler.before(plan.round)
                        out = self.executor.execute(plan)
                        if span is not None:
                            span.set_attributes({"twinspark.seqs": len(plan.request_ids),
                                                 "twinspark.rows": plan.token_ids.shape[0],
                                                 "twinspark.forward_ms": out.forward_ms,
                                                 "twinspark.sample_ms": out.sample_ms})
                except PlanError as exc:
                    log.warning("rank %d: refused round %d: %s", self.rank, plan.round, exc)
                    yield rank_pb2.StepResult(round=plan.round, rank=self.rank, refused=True,
                                              error=f"round {plan.round}: bad plan: {exc}")
                    continue
                except Exception as exc:  # noqa: BLE001 — the forward failed half-way: the group must restart
                    log.exception("rank %d: round %d failed", self.rank, plan.round)
                    error = f"round {plan.round}: the forward failed: {type(exc).__name__}: {exc}"
                    yield rank_pb2.StepResult(round=plan.round, rank=self.rank, error=error)
                    self._stop(error)
                    return
                res = rank_pb2.StepResult(round=plan.round, rank=self.rank, sampled=to_proto(out.sampled),
                                          forward_ms=out.forward_ms, sample_ms=out.sample_ms)
                if out.accepted is not None:
                    res.accepted.CopyFrom(to_proto(out.accepted))
                if out.hidden is not None:
                    res.hidden.CopyFrom(to_proto(out.hidden, "float32"))
                if out.tier_bad:
                    res.tier_bad.extend(out.tier_bad)
                if out.logprobs is not None:
                    res.logprobs.CopyFrom(to_proto(out.logprobs.chosen, "float32"))
                    res.top_ids.CopyFrom(to_proto(out.logprobs.top_ids, "int32"))
                    res.top_logprobs.CopyFrom(to_proto(out.logprobs.top_logprobs, "float32"))
                if self.profiler is not None:
                    self.profiler.after(plan.round)
                yield res
            log.info("rank %d: step stream closed after %d rounds", self.rank, expected - 1)
        finally:
            self._stream_lock.release()


def serve(service: RankService, host: str, port: int, token: str | None = None) -> grpc.Server:
    """Listen on host:port; with `token`, every call must carry it (services/common/internal_auth.py)."""
    opts = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=opts,
                         interceptors=server_interceptors(token, f"rank{service.rank}"))
    rank_pb2_grpc.add_RankWorkerServicer_to_server(service, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise RuntimeError(f"cannot listen on {host}:{port}")
    server.start()
    return server
