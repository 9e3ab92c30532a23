"""One request, one trace across every service: the real TP=2 stack with the copy drafter exporting to an in-process
OTLP/gRPC receiver, checked span by span through parent ids."""

from __future__ import annotations

import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai

from tests.e2e import otlp_receiver
from tests.e2e.stack import Stack, start
from tests.e2e.otlp_receiver import Span

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
SERVICES = {"twinspark-gateway", "twinspark-scheduler", "twinspark-rank0", "twinspark-rank1", "twinspark-drafter"}


def _one(spans: list[Span], service: str, name: str) -> Span:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{service} {name}: {len(found)} spans ({[s.name for s in spans if s.service == service]})"
    return found[0]


def _chat(client: openai.OpenAI, model: str, trace_id: str, parent_span: str, prompt: str) -> int:
    """One greedy chat request of 12 tokens inside the client's trace; its prompt tokens."""
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers={"traceparent": f"00-{trace_id}-{parent_span}-01"})
    assert chat.usage.completion_tokens == 12
    return chat.usage.prompt_tokens


def test_one_trace_across_every_service(tiny_default, tmp_path) -> None:
    receiver, server, port = otlp_receiver.start()
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    pair = [secrets.token_hex(16) for _ in range(2)]  # two requests sent together: they share rounds
    # A batch delay far beyond the test: every span reaches the receiver only through the flush each process does
    # at exit, so this also proves `twinspark down` loses none.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "600000"}
    stack: Stack | None = None
    try:
        stack = start(tiny_default, tmp_path, tp=2, env=env)
        client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, timeout=120)
        model = stack.model_name
        prompt_tokens = _chat(client, model, trace_id, client_span, "Tell me a story about the sea.")
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda t: _chat(client, model, t, secrets.token_hex(8), f"Count to ten {t}."), pair))
        down = stack.down()
        stack = None
        assert down.returncode == 0, down.stderr
        received = receiver.wait_for(lambda got: SERVICES <= {s.service for s in got}, timeout_s=30)
        spans = [s for s in received if s.trace_id == trace_id]
    finally:
        if stack is not None:
            stack.down()
        server.stop(None)
    assert SERVICES <= {s.service for s in spans}, Counter(s.service for s in spans)

    # gateway: the HTTP SERVER span continues the client's traceparent
    http = [s for s in spans if s.service == "twinspark-gateway" and s.kind == SERVER]
    assert len(http) == 1 and http[0].parent_id == client_span, http
    http = http[0]
    assert http.attributes["twinspark.finish_reason"] == "length"
    assert http.attributes["gen_ai.usage.output_tokens"] == 12

    # scheduler: Generate under the HTTP span, its phases under Generate, chunks under prefill
    sched = [s for s in spans if s.service == "twinspark-scheduler"]
    gen = _one(sched, "twinspark-scheduler", "Generate")
    assert gen.kind == SERVER and gen.parent_id == http.span_id
    assert gen.attributes["twinspark.request_id"] == http.attributes["twinspark.request_id"]
    assert gen.attributes["twinspark.completion_tokens"] == 12
    assert gen.attributes["twinspark.prompt_tokens"] == prompt_tokens
    phases = {name: _one(sched, "twinspark-scheduler", name) for name in ("queue", "prefill", "decode")}
    assert all(p.parent_id == gen.span_id for p in phases.values())
    chunks = [s for s in sched if s.name == "prefill chunk"]
    assert chunks and all(c.parent_id == phases["prefill"].span_id for c in chunks)
    assert sum(c.attributes["twinspark.length"] for c in chunks) == prompt_tokens

    # rounds: under one of the request's phase spans; every rank ran a step for every round, under that round
    rounds = {s.span_id: s for s in sched if s.name == "round"}
    assert len(rounds) >= 2
    assert {r.parent_id for r in rounds.values()} == {phases["prefill"].span_id, phases["decode"].span_id}
    for rank in ("twinspark-rank0", "twinspark-rank1"):
        steps = [s for s in spans if s.service == rank]
        assert steps and all(s.name == "step" and s.kind == SERVER for s in steps)
        assert sorted(s.parent_id for s in steps) == sorted(rounds), rank
        for s in steps:
            assert s.attributes["twinspark.round"] == rounds[s.parent_id].attributes["twinspark.round"]

    # drafts: the scheduler's Propose CLIENT span under decode, the drafter's Propose SERVER span under it
    proposes = {s.span_id: s for s in sched if s.name == "Propose"}
    assert proposes and all(p.kind == CLIENT and p.parent_id == phases["decode"].span_id for p in proposes.values())
    served = [s for s in spans if s.service == "twinspark-drafter"]
    assert all(s.name == "Propose" and s.kind == SERVER for s in served)
    assert sorted(s.parent_id for s in served) == sorted(proposes)

    # a round of both concurrent requests: a child of one's phase span, linked to the other's
    phase_of = {t: {s.span_id for s in received if s.trace_id == t and s.name in ("prefill", "decode")} for t in pair}
    ids = [_one([s for s in received if s.trace_id == t], "twinspark-scheduler", "Generate")
           .attributes["twinspark.request_id"] for t in pair]
    shared = [s for s in received if s.name == "round" and set(ids) <= set(s.attributes["twinspark.request_ids"])]
    assert shared, "the two concurrent requests never shared a round"
    for r in shared:
        first = 0 if r.parent_id in phase_of[pair[0]] else 1
        assert r.parent_id in phase_of[pair[first]] and r.trace_id == pair[first]
        assert set(r.links) & phase_of[pair[1 - first]], r
