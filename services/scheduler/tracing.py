"""The scheduler's spans: each request's Generate span and its phases, and the spans the ranks and drafter hang on.

Per request (`RequestSpans`): a `Generate` SERVER span under the caller's context, from acceptance until the request
finishes, with `queue` (accepted → admitted), `prefill` (admitted → first token, with a `prefill chunk` child per
chunk) and `decode` (first token → finished) under it in turn; `phase` is the one open now.
Per round: a `round` span, child of the first request's phase span and linked to every other request's, whose
context travels in `StepPlan.trace_context` so every rank's `step` span is its child. Per Propose: a CLIENT span,
child of the first asking request's decode span and linked to the others', whose context goes in the call's
metadata. Nothing here runs when tracing is off: requests then carry no spans and the round / propose helpers
return at their first check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context

from services.common import telemetry
from twinspark.v1 import generate_pb2, rank_pb2

if TYPE_CHECKING:  # the batcher imports Request, which holds RequestSpans: no import cycle at run time
    from services.scheduler.batcher import PlannedSeq
    from services.scheduler.request import Request

_tracer = trace.get_tracer("twinspark.scheduler")


def generate_parent(msg: generate_pb2.GenerateRequest, metadata: Iterable[tuple[str, str | bytes]] | None
                    ) -> Context | None:
    """The caller's context for a Generate call: from its metadata, else from `GenerateRequest.trace_context`
    (for clients that cannot set metadata); None when tracing is off here (the request then gets no spans)."""
    if not telemetry.enabled():
        return None
    ctx = telemetry.extract(telemetry.metadata_carrier(metadata))
    return ctx if telemetry.is_traced(ctx) or not msg.trace_context else telemetry.extract(msg.trace_context)


class RequestSpans:
    def __init__(self, parent: Context, request_id: str, prompt_tokens: int) -> None:
        self.generate = _tracer.start_span(
            "Generate", context=parent, kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": "twinspark.v1.Generator", "rpc.method": "Generate",
                        "twinspark.request_id": request_id, "twinspark.prompt_tokens": prompt_tokens})
        self._context = trace.set_span_in_context(self.generate)
        self.phase: trace.Span = _tracer.start_span("queue", context=self._context)

    def _next(self, name: str) -> None:
        self.phase.end()
        self.phase = _tracer.start_span(name, context=self._context)

    def admitted(self) -> None:
        self._next("prefill")

    def first_token(self) -> None:
        self._next("decode")

    def finished(self, f: generate_pb2.Finished) -> None:
        self.phase.end()
        g = self.generate
        g.set_attributes({"twinspark.finish_reason": generate_pb2.FinishReason.Name(f.reason),
                          "twinspark.prompt_tokens": f.prompt_tokens, "twinspark.cached_tokens": f.cached_tokens,
                          "twinspark.completion_tokens": f.completion_tokens,
                          "twinspark.drafted_tokens": f.drafted_tokens,
                          "twinspark.accepted_tokens": f.accepted_tokens})
        if f.reason == generate_pb2.FINISH_ERROR:
            g.set_status(trace.Status(trace.StatusCode.ERROR, f.error))
        g.end()


def _parent_and_links(spans: Sequence[trace.Span]) -> tuple[Context, list[trace.Link]]:
    """Parent under the first span, links to the rest: work shared by several requests shows in each one's trace."""
    return (trace.set_span_in_context(spans[0]),
            [trace.Link(s.get_span_context()) for s in spans[1:]])


@contextlib.contextmanager
def round_span(number: int, seqs: Sequence[PlannedSeq], plan: rank_pb2.StepPlan) -> Iterator[None]:
    """Trace one round (its block: from sending the plan to the ranks to committing the results). Writes the round
    span's context into `plan.trace_context`, so call it before the plan is sealed; a plan stays byte-identical
    when nothing is traced."""
    traced = [s for s in seqs if s.req.spans is not None] if telemetry.enabled() else []
    if not traced:
        yield
        return
    parent, links = _parent_and_links([s.req.spans.phase for s in traced])
    attrs = {"twinspark.round": number, "twinspark.seqs": len(seqs),
             "twinspark.rows": sum(len(s.token_ids) for s in seqs),
             "twinspark.request_ids": [s.req.id for s in seqs]}
    # Not made the current span: rounds overlap (the next is sent before this one's result is committed), so their
    # contexts are passed explicitly rather than attached and detached out of order.
    span = _tracer.start_span("round", context=parent, links=links, attributes=attrs)
    telemetry.inject(plan.trace_context, trace.set_span_in_context(span))
    chunks = [_tracer.start_span("prefill chunk", context=trace.set_span_in_context(s.req.spans.phase),
                                 attributes={"twinspark.round": number, "twinspark.start": s.start,
                                             "twinspark.length": len(s.token_ids)})
              for s in traced if s.req.prefilling]
    try:
        yield
    finally:
        for c in chunks:
            c.end()
        span.end()


@contextlib.contextmanager
def propose_span(requests: Sequence[Request]) -> Iterator[tuple[tuple[str, str], ...]]:
    """Trace one Propose call; yields the gRPC metadata that carries the span to the drafter (empty when off)."""
    spans = [r.spans.phase for r in requests if r.spans is not None] if telemetry.enabled() else []
    if not spans:
        yield ()
        return
    parent, links = _parent_and_links(spans)
    with _tracer.start_as_current_span("Propose", context=parent, links=links, kind=trace.SpanKind.CLIENT,
                                       attributes={"rpc.system": "grpc", "rpc.service": "twinspark.v1.Drafter",
                                                   "rpc.method": "Propose",
                                                   "twinspark.sequences": len(requests)}):
        yield telemetry.metadata()
