"""The drafter's gRPC face: `Drafter.Propose` over one draft method, and `serve()`."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
import torch
from opentelemetry import trace

from services.common import telemetry
from services.common.internal_auth import server_interceptors
from services.common.tensors import from_proto, ids, to_proto
from twinspark.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("twinspark.drafter")
_tracer = trace.get_tracer("twinspark.drafter")
# Bounds no honest scheduler reaches (it asks for --num-draft-tokens drafts for at most its running requests).
MAX_DRAFT = 64
MAX_SEQUENCES = 4096
MAX_TOKENS = 1 << 21  # twice the real model's window


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, method) -> None:
        self.method = method
        self.calls = 0
        self.proposed = 0

    def Propose(self, request: drafter_pb2.ProposeRequest, context: grpc.ServicerContext) -> drafter_pb2.ProposeReply:
        with telemetry.server_span(_tracer, "Propose", telemetry.metadata_carrier(context.invocation_metadata()),
                                   {"twinspark.method": self.method.name,
                                    "twinspark.sequences": len(request.sequences)}) as span:
            reply = self._propose(request, context)
            if span is not None:
                span.set_attribute("twinspark.drafted_tokens", sum(d.shape[0] for d in reply.drafts if d.shape))
        return reply

    def _propose(self, request: drafter_pb2.ProposeRequest, context: grpc.ServicerContext
                 ) -> drafter_pb2.ProposeReply:
        try:
            drafts = [to_proto(d) for d in self._drafts(request)]
        except ValueError as exc:  # a malformed request: refused whole, the drafter keeps serving
            log.warning("refused a Propose: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.calls += 1
        return drafter_pb2.ProposeReply(drafts=drafts)

    def _drafts(self, request: drafter_pb2.ProposeRequest) -> list[list[int]]:
        """Every sequence checked before any is drafted; raises ValueError naming the first bad one."""
        if len(request.sequences) > MAX_SEQUENCES:
            raise ValueError(f"{len(request.sequences)} sequences in one call (at most {MAX_SEQUENCES})")
        todo = []
        for i, seq in enumerate(request.sequences):
            where = f"sequence {i} ({seq.request_id[:64]!r})"
            if not 0 <= seq.max_draft <= MAX_DRAFT:
                raise ValueError(f"{where}: max_draft {seq.max_draft} is outside [0, {MAX_DRAFT}]")
            try:
                tokens = ids(seq.tokens)
                hidden = from_proto(seq.hidden) if seq.HasField("hidden") and seq.hidden.shape else None
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            if len(tokens) > MAX_TOKENS:
                raise ValueError(f"{where}: {len(tokens)} tokens (at most {MAX_TOKENS})")
            if any(t < 0 for t in tokens):
                raise ValueError(f"{where}: negative token id")
            if hidden is not None and hidden.dtype != torch.float32:
                raise ValueError(f"{where}: hidden must be float32, got {seq.hidden.dtype}")
            if not 0 <= seq.hidden_start < MAX_TOKENS:
                raise ValueError(f"{where}: hidden_start {seq.hidden_start} is outside [0, {MAX_TOKENS})")
            self.method.check(tokens, hidden)  # what the method needs (vocabulary, hidden size)
            todo.append((seq, tokens, hidden))
        drafts = []
        for seq, tokens, hidden in todo:
            d = (self.method.propose(seq.request_id, tokens, seq.max_draft, hidden, seq.hidden_start)
                 if seq.max_draft else [])
            self.proposed += len(d)
            drafts.append(d)
        return drafts


def serve(method, host: str, port: int, token: str | None = None) -> tuple[grpc.Server, int]:
    # One worker: the MTP method owns one scratch cache, and the scheduler sends one Propose per round anyway.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1),
                         options=[("grpc.max_receive_message_length", 256 << 20)],
                         interceptors=server_interceptors(token, "drafter"))
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterService(method), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


def serve_forever(method, host: str, port: int, token: str | None = None) -> None:
    server, bound = serve(method, host, port, token)
    log.info("drafter (%s) listening on %s:%d", method.name, host, bound)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(1.0).wait()
