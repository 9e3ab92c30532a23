"""OpenTelemetry tracing for every role, and W3C trace context across gRPC metadata and plan fields.

Off unless OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set: no provider is installed,
the API hands out its no-op tracer and `enabled()` is False, so hot loops skip building spans, links and carriers
altogether. On: one TracerProvider per process, `service.name` naming the role (twinspark-gateway,
twinspark-scheduler, twinspark-rank0, ..., twinspark-drafter), spans batched to the OTLP/gRPC exporter.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context

log = logging.getLogger("twinspark.telemetry")

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_enabled = False


def enabled() -> bool:
    """True once `setup_tracing` installed an exporting provider in this process."""
    return _enabled


def setup_tracing(service_name: str) -> bool:
    """Install the tracer provider when an OTLP endpoint is configured; True when tracing is on.

    The exporter reads its endpoint, headers and `insecure` from the OTEL_EXPORTER_OTLP_* variables (an http://
    endpoint is insecure). Spans are flushed at interpreter exit (the provider's `shutdown_on_exit` registers an
    atexit hook), which the scheduler, ranks and drafter reach on SIGTERM; the gateway calls `flush`
    itself (see why there) — so `twinspark down` loses none."""
    global _enabled
    endpoint = next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), None)
    if endpoint is None:
        return False
    # Imported here so a process without tracing never loads the SDK and the exporter's gRPC machinery.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES (and OTEL_SERVICE_NAME) under ours: the role's name wins, as
    # one deployment-wide OTEL_SERVICE_NAME would otherwise merge every role into one service.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}), shutdown_on_exit=True)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing on: spans of service %s go to %s (OTLP/gRPC)", service_name, endpoint)
    return True


def flush(timeout_ms: int = 5000) -> None:
    """Export every ended span now. For a process whose exit skips atexit hooks: uvicorn re-raises the SIGTERM
    it caught once the server has stopped, and the default action ends the gateway without them."""
    if _enabled:
        trace.get_tracer_provider().force_flush(timeout_ms)


def inject(carrier: MutableMapping[str, str], context: Context | None = None) -> MutableMapping[str, str]:
    """Write the W3C trace context of `context` (default: the current one) into `carrier`; returns it.
    A protobuf map field (StepPlan.trace_context) is a valid carrier."""
    propagate.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str]) -> Context:
    """The context a caller put into `carrier` (an empty one when it holds none)."""
    return propagate.extract(carrier)


def metadata(context: Context | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying `context` (default: the current one); empty when nothing is traced."""
    return tuple(inject({}, context).items())


def metadata_carrier(md: Iterable[tuple[str, str | bytes]] | None) -> dict[str, str]:
    """gRPC invocation metadata as a carrier (binary `-bin` entries are never trace context)."""
    return {k: v for k, v in md or () if isinstance(v, str)}


def is_traced(context: Context) -> bool:
    """Whether `context` holds a valid span (a caller's, after `extract`)."""
    return trace.get_current_span(context).get_span_context().is_valid


def start_server_span(tracer: trace.Tracer, name: str, caller: Mapping[str, str],
                      attributes: Mapping[str, object] | None = None) -> trace.Span | None:
    """A SERVER span under the context a caller put in `caller`, started but not made current (the caller ends
    it; for work that outlives one block, like a rank's round from launch to read-back). None when tracing is off
    here or the caller sent no trace context: per-round work is traced only as part of a traced request, never as
    a root trace of its own."""
    parent = extract(caller) if _enabled and caller else None
    if parent is None or not is_traced(parent):
        return None
    return tracer.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)


@contextlib.contextmanager
def server_span(tracer: trace.Tracer, name: str, caller: Mapping[str, str],
                attributes: Mapping[str, object] | None = None) -> Iterator[trace.Span | None]:
    """`start_server_span`, current inside the block and ended after it; yields None when nothing is traced."""
    span = start_server_span(tracer, name, caller, attributes)
    if span is None:
        yield None
        return
    with trace.use_span(span, end_on_exit=True):
        yield span
