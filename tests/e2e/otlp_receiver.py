"""An in-process OTLP/gRPC trace receiver for tests: collects every exported span with its service.name."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def _value(v: AnyValue) -> object:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class Span:
    service: str
    resource: dict[str, object]
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    links: tuple[str, ...]  # linked span ids (hex)
    attributes: dict[str, object]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
               ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(service=str(resource.get("service.name", "")), resource=resource, name=s.name,
                                    kind=s.kind, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                                    parent_id=s.parent_span_id.hex(), links=tuple(l.span_id.hex() for l in s.links),
                                    attributes={a.key: _value(a.value) for a in s.attributes}))
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float) -> list[Span]:
        """The spans once `done(spans)` holds, or whatever arrived by the timeout."""
        deadline = time.monotonic() + timeout_s
        while not done(spans := self.spans) and time.monotonic() < deadline:
            time.sleep(0.1)
        return spans


def start() -> tuple[Receiver, grpc.Server, int]:
    """A receiver listening on a free loopback port: (receiver, server, port); stop the server when done."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return receiver, server, port
