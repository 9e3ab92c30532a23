"""services.common.telemetry: off without an endpoint, context round trips, SERVER spans under a caller's context,
and a traced process's spans reaching an OTLP receiver when it exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from services.common import telemetry
from tests.e2e import otlp_receiver
from twinspark.v1 import rank_pb2

_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


@pytest.fixture
def tracer() -> trace.Tracer:
    # A provider of the test's own: the global one can be set once per process and stays off here.
    return TracerProvider().get_tracer("test")


def test_off_without_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _ENDPOINTS:
        monkeypatch.delenv(var, raising=False)
    assert telemetry.setup_tracing("twinspark-test") is False
    assert not telemetry.enabled()
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)  # nothing installed
    assert telemetry.metadata() == ()  # nothing to carry


def test_inject_extract_round_trip(tracer: trace.Tracer) -> None:
    with tracer.start_as_current_span("caller") as span:
        sent = span.get_span_context()
        md = telemetry.metadata()
        plan = rank_pb2.StepPlan()
        telemetry.inject(plan.trace_context)  # a protobuf map is a carrier
    assert dict(md)["traceparent"] == dict(plan.trace_context)["traceparent"]
    # gRPC hands binary entries over as bytes; they are dropped, not mistaken for context
    for carrier in (telemetry.metadata_carrier([*md, ("x-bin", b"\x00")]),
                    dict(rank_pb2.StepPlan.FromString(plan.SerializeToString()).trace_context)):
        got = trace.get_current_span(telemetry.extract(carrier)).get_span_context()
        assert (got.trace_id, got.span_id, got.is_remote) == (sent.trace_id, sent.span_id, True)
    assert not telemetry.is_traced(telemetry.extract({}))


def test_server_span_parent_and_off_cases(tracer: trace.Tracer, monkeypatch: pytest.MonkeyPatch) -> None:
    with tracer.start_as_current_span("caller") as caller:
        carrier = dict(telemetry.metadata())
    with telemetry.server_span(tracer, "work", carrier) as span:
        assert span is None  # tracing is off in this process
    monkeypatch.setattr(telemetry, "_enabled", True)
    with telemetry.server_span(tracer, "work", {}) as span:
        assert span is None  # the caller sent no context: no root trace per round
    with telemetry.server_span(tracer, "work", carrier, {"k": 1}) as span:
        assert trace.get_current_span() is span
    assert span.parent.span_id == caller.get_span_context().span_id
    assert span.get_span_context().trace_id == caller.get_span_context().trace_id
    assert span.kind is trace.SpanKind.SERVER and span.attributes["k"] == 1


def test_spans_reach_the_receiver_at_exit() -> None:
    """A long batch delay: the span can only arrive through the flush at interpreter exit."""
    receiver, server, port = otlp_receiver.start()
    script = textwrap.dedent("""
        import logging
        from opentelemetry import trace
        from services.common import telemetry
        logging.basicConfig(level=logging.INFO)
        assert telemetry.setup_tracing("twinspark-test")
        with trace.get_tracer("t").start_as_current_span("one"):
            pass
    """)
    env = {k: v for k, v in os.environ.items() if k not in _ENDPOINTS}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}", OTEL_BSP_SCHEDULE_DELAY="600000",
               OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test,service.name=overridden")
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "tracing on: spans of service twinspark-test go to http://127.0.0.1" in proc.stderr
        spans = receiver.spans
    finally:
        server.stop(None)
    assert [(s.name, s.service) for s in spans] == [("one", "twinspark-test")]
    assert spans[0].resource["deployment.environment"] == "test"
