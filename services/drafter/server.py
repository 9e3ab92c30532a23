"""The drafter's gRPC face: `Drafter.Propose` over one draft method, and `serve()`."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.tensors import from_proto, ids, to_proto
from twinspark.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("twinspark.drafter")
_tracer = trace.get_tracer("twinspark.drafter")


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
        drafts = []
        for seq in request.sequences:
            try:
                tokens = ids(seq.tokens)
                hidden = from_proto(seq.hidden) if seq.HasField("hidden") and seq.hidden.shape else None
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sequence {seq.request_id}: {exc}")
            d = self.method.propose(seq.request_id, tokens, seq.max_draft, hidden) if seq.max_draft > 0 else []
            self.proposed += len(d)
            drafts.append(to_proto(d))
        self.calls += 1
        return drafter_pb2.ProposeReply(drafts=drafts)


def serve(method, host: str, port: int) -> tuple[grpc.Server, int]:
    # One worker: the MTP method owns one scratch cache, and the scheduler sends one Propose per round anyway.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1),
                         options=[("grpc.max_receive_message_length", 256 << 20)])
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterService(method), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {host}:{port}")
    server.start()
    return server, bound


def serve_forever(method, host: str, port: int) -> None:
    server, bound = serve(method, host, port)
    log.info("drafter (%s) listening on %s:%d", method.name, host, bound)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(1.0).wait()
