"""Property-based fuzzing of the real gateway (in front of a STAND-IN scheduler), bounded in time:
- schemathesis generates requests from the gateway's own /openapi.json (valid and invalid bodies for every route);
- hypothesis throws arbitrary JSON values, and arbitrary bytes, at every body-taking route.
Whatever comes, the answer is below 500 and every error is in its API's shape (Anthropic's on /v1/messages*)."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from bench.malformed import Case, problem

from .conftest import GatewayServer

ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
          "/tokenize", "/detokenize"]
# Derandomized: the same examples every run (a failure reproduces); ~20 s in all.
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


def test_openapi_fuzz(gateway: GatewayServer) -> None:
    """Cases of every operation in /openapi.json, valid and invalid alike. (Driven through hypothesis directly:
    schemathesis' pytest fixture loader does not run under pytest 9.)"""
    api = schemathesis.openapi.from_url(gateway.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= set(ROUTES)
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    cases = st.one_of([op.as_strategy(generation_mode=mode) for op in operations for mode in modes])

    @given(case=cases)
    @settings(FUZZ, max_examples=400)
    def check(case) -> None:
        response = case.call(base_url=gateway.url, timeout=30)
        assert _problem(case.path, response) is None, (case.as_curl_command(), response.text[:300])

    check()


def _problem(route: str, r) -> str | None:
    ctype = r.headers.get("content-type") or ""
    if isinstance(ctype, list):  # schemathesis' responses hold each header's values as a list
        ctype = ctype[0]
    return problem(Case("fuzz", "POST", route, b""), r.status_code, ctype, r.content)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=20), inner, max_size=5),
    max_leaves=30)
# Bodies shaped like the real ones, with arbitrary values in the known fields.
FIELDS = ["messages", "prompt", "tokens", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "stop_token_ids", "stream", "stream_options", "model", "n", "logprobs", "tools", "chat_template_kwargs",
          "reasoning_effort", "thinking_token_budget", "request_id", "return_token_ids", "add_special_tokens",
          "ignore_eos",
          # Responses and Messages
          "input", "instructions", "max_output_tokens", "text", "reasoning", "system", "stop_sequences", "thinking",
          "tool_choice", "response_format", "structured_outputs", "logit_bias", "top_logprobs"]
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6) | json_values


@given(route=st.sampled_from(ROUTES), body=bodies)
@FUZZ
def test_arbitrary_json_bodies(gateway: GatewayServer, route: str, body) -> None:
    r = httpx.post(gateway.url + route, json=body, timeout=30)
    assert _problem(route, r) is None, (route, body, r.text[:300])


@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=300))
@FUZZ
def test_arbitrary_bytes(gateway: GatewayServer, route: str, raw: bytes) -> None:
    r = httpx.post(gateway.url + route, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code >= 400 and _problem(route, r) is None, (route, raw, r.text[:300])
