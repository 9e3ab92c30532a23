"""Responses and Anthropic Messages under hostile input, against the real gateway in front of a STAND-IN scheduler,
driven with the official `openai` and `anthropic` clients: every bad body is a 400 naming the caller's own field,
every error (streamed or not, from a route, a middleware or the scheduler) leaves in its API's shape."""

from __future__ import annotations

import base64
import io
import json

import anthropic
import grpc
import httpx
import openai
import pytest
from PIL import Image

from services.gateway.app import GatewaySettings
from twinspark.v1 import generate_pb2

from .conftest import GatewayServer
from .standin_scheduler import EOS, Fail, Finish, Progress, StandinServer, Tokens

USER = [{"role": "user", "content": "hi"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
GRAMMAR_FAILED = "invalid_grammar: the grammar failed after 1 output tokens: Parser Error: Current row has 2407 items"


@pytest.fixture()
def oai(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)


@pytest.fixture()
def claude(gateway: GatewayServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=10)


def _anthropic_400(claude: anthropic.Anthropic, says: str, **fields) -> None:
    messages = fields.pop("messages", USER)
    with pytest.raises(anthropic.BadRequestError) as err:  # the rest as sent: the client types some fields itself
        claude.messages.create(model="glm-tiny", max_tokens=4, messages=messages, extra_body=fields)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert says in err.value.body["error"]["message"], err.value.body


def _openai_400(call, param: str, code: str | None = None) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    assert err.value.body["param"] == param and (code is None or err.value.body["code"] == code), err.value.body


# ------------------------------------------------------------------------------------ the four requests

def test_the_four_requests_that_were_5xx(oai: openai.OpenAI, claude: anthropic.Anthropic, standin: StandinServer
                                         ) -> None:
    _anthropic_400(claude, "stop_sequences", stop_sequences=["s"] * 10_000)
    _anthropic_400(claude, "messages[0].content[0]",
                   messages=[{"role": "user", "content": [{"type": "thinking", "thinking": "x", "signature": ""}]}])
    _openai_400(lambda: oai.responses.create(model="glm-tiny", input=[
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": 5}]},
        {"role": "user", "content": "hi"}]), "input[0].content[0].text")
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3_000)}}
    _openai_400(lambda: oai.chat.completions.create(
        model="glm-tiny", messages=USER, max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
        "response_format.json_schema.schema", "invalid_grammar")
    assert not standin.generator.records or all(
        not r.request.grammar for r in standin.generator.records.values())  # none reached the scheduler


# --------------------------------------------------------------------------- translations name the caller's field

@pytest.mark.parametrize("fields,says", [
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                   "content": [{"type": "text", "text": 7}]}]}]},
     "messages.0.content.list"),  # pydantic's path through the block union
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": []}]}, "messages"),
    ({"top_k": 2**31}, "top_k"),
    ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name"),
    ({"tools": [{"name": "web", "type": "web_search_20250305", "input_schema": {}}]}, "tools[0].type"),
    ({"tools": [{"name": "f", "input_schema": {"properties": []}}], "tool_choice": {"type": "any"}},
     "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice"),
])
def test_messages_refusals_name_the_field(claude: anthropic.Anthropic, fields: dict, says: str) -> None:
    _anthropic_400(claude, says.replace("messages.0.content.list", "messages[0].content"), **fields)


@pytest.mark.parametrize("fields,param", [
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "bogus"}]}, "input[0].type"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
     "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"input": "x", "seed": -(2**63) - 1}, "seed"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"required": 5}}],
      "tool_choice": "required"}, "tools[0].parameters"),
])
def test_responses_refusals_name_the_field(oai: openai.OpenAI, fields: dict, param: str) -> None:
    extra = {"seed": fields.pop("seed")} if "seed" in fields else None  # twinspark's extension
    _openai_400(lambda: oai.responses.create(model="glm-tiny", max_output_tokens=4, extra_body=extra, **fields),
                param)


def test_responses_input_image_reaches_the_scheduler(oai: openai.OpenAI, standin: StandinServer) -> None:
    """An input_image part was dropped without a word; it is the chat image_url part now."""
    raw = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(raw, "PNG")
    url = "data:image/png;base64," + base64.b64encode(raw.getvalue()).decode()
    oai.responses.create(model="glm-tiny", max_output_tokens=4, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url}, {"type": "input_text", "text": "what?"}]}])
    assert len(standin.generator.last().request.images) == 1


@pytest.mark.parametrize("params", [{"properties": []}, {"required": 5}, {"required": [{"a": 1}]},
                                    {"properties": {"x": 5}},
                                    {"properties": {"x": {"type": "string", "minLength": "3"}}},
                                    {"properties": {"x": {"type": "string", "maxLength": -1}}},
                                    {"properties": {"x": {"type": "string", "pattern": 5}}}])
def test_tool_parameters_the_grammar_reads_are_type_checked(oai: openai.OpenAI, params: dict) -> None:
    """A forced call's grammar read these keywords as given: a TypeError (a 500) on a malformed one."""
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    _openai_400(lambda: oai.chat.completions.create(model="glm-tiny", messages=USER, tools=[tool],
                                                    tool_choice="required", max_tokens=4),
                "tools[0].function.parameters")


# ------------------------------------------------------------------------------- each API's own error shape

def test_anthropic_routes_answer_every_error_in_anthropic_shape(gateway: GatewayServer, claude: anthropic.Anthropic,
                                                                standin: StandinServer) -> None:
    def shape(r: httpx.Response, status: int, kind: str) -> None:
        assert r.status_code == status and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == kind and set(r.json()["error"]) == {"type", "message"}

    url = gateway.url + "/v1/messages"
    body = {"model": "glm-tiny", "max_tokens": 4, "messages": USER}
    shape(httpx.post(url, content=b"{" * 100), 400, "invalid_request_error")  # the limits middleware
    shape(httpx.post(url, content=b"[" * 100 + b"]" * 100), 400, "invalid_request_error")
    shape(httpx.post(url, json=body, headers={f"x-h{i}": "v" for i in range(120)}), 431, "invalid_request_error")
    shape(httpx.post(url, content=b" " * ((32 << 20) + 1)), 413, "request_too_large")
    shape(httpx.get(url), 405, "invalid_request_error")  # Starlette's
    shape(httpx.post(url + "/nope", json=body), 404, "not_found_error")
    shape(httpx.post(url + "/count_tokens", json={"model": "nope", "messages": USER}), 404, "not_found_error")
    standin.generator.push(Fail(grpc.StatusCode.INTERNAL, "boom"))
    with pytest.raises(anthropic.InternalServerError) as err:
        claude.messages.create(**body)
    assert err.value.body["error"]["type"] == "api_error"
    standin.generator.push(Fail(grpc.StatusCode.UNAVAILABLE, "rank down"))
    with pytest.raises(anthropic.APIStatusError) as err:
        claude.messages.create(**body)
    assert err.value.status_code == 503 and err.value.body["error"]["type"] == "overloaded_error"


def test_anthropic_api_key_refusal_in_anthropic_shape(tiny_default, standin: StandinServer) -> None:
    server = GatewayServer(GatewaySettings(model_dir=str(tiny_default), scheduler=standin.target,
                                           served_model_name="glm-tiny", api_key="k1")).start()
    try:
        with pytest.raises(anthropic.AuthenticationError) as err:
            anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
                model="glm-tiny", max_tokens=4, messages=USER)
        assert err.value.body["error"]["type"] == "authentication_error"
    finally:
        server.stop()


def _grammar_failure(standin: StandinServer, tokenizer) -> None:
    standin.generator.push(Progress(), Tokens(tokenizer.encode("\n")), Finish(reason=generate_pb2.FINISH_ERROR,
                                                                           error=GRAMMAR_FAILED))


def test_a_grammar_failing_mid_generation_is_a_400_in_each_api(oai: openai.OpenAI, claude: anthropic.Anthropic,
                                                                 standin: StandinServer, tokenizer) -> None:
    """It was a 503 ("the server is down") for the client's own grammar; now each API's invalid-request error,
    streamed or not, naming the field the grammar came from."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer"}}}
    _grammar_failure(standin, tokenizer)
    _openai_400(lambda: oai.chat.completions.create(model="glm-tiny", messages=USER, response_format=fmt,
                                                    extra_body=OFF), "response_format.json_schema.schema",
                "invalid_grammar")
    _grammar_failure(standin, tokenizer)
    with pytest.raises(openai.APIError) as err:
        list(oai.chat.completions.create(model="glm-tiny", messages=USER, response_format=fmt, stream=True,
                                         extra_body=OFF))
    assert err.value.body["code"] == "invalid_grammar" and err.value.body["type"] == "invalid_request_error"
    _grammar_failure(standin, tokenizer)
    _openai_400(lambda: oai.responses.create(model="glm-tiny", input="x", reasoning={"effort": "none"},
                                             text={"format": {"type": "json_schema", "name": "s",
                                                              "schema": {"type": "integer"}}}),
                "text.format", "invalid_grammar")
    _grammar_failure(standin, tokenizer)  # (a tool's description would not fit the test gateway's window)
    with pytest.raises(anthropic.APIStatusError) as err2:
        with claude.messages.stream(model="glm-tiny", max_tokens=8, messages=USER) as s:
            s.get_final_message()
    assert err2.value.body["error"]["type"] == "invalid_request_error"
    assert "Current row has 2407 items" in err2.value.body["error"]["message"]


def test_other_failures_after_the_200_end_each_stream_in_its_error_event(gateway: GatewayServer,
                                                                         standin: StandinServer, tokenizer) -> None:
    def events(path: str, body: dict) -> list[str]:
        standin.generator.push(Progress(), Tokens(tokenizer.encode("hi")), Finish(
            reason=generate_pb2.FINISH_ERROR, error="scheduler error: RuntimeError: boom"))
        with httpx.stream("POST", gateway.url + path, json={**body, "stream": True}, timeout=10) as r:
            assert r.status_code == 200
            return [line for line in r.iter_lines() if line]

    chat = events("/v1/chat/completions", {"messages": USER, **OFF})
    assert json.loads(chat[-2][6:])["error"]["type"] == "server_error" and chat[-1] == "data: [DONE]"
    resp = events("/v1/responses", {"model": "glm-tiny", "input": "x", "reasoning": {"effort": "none"}})
    assert resp[-2] == "event: error" and json.loads(resp[-1][6:])["code"] == "service_unavailable"
    msg = events("/v1/messages", {"model": "glm-tiny", "max_tokens": 8, "messages": USER})
    assert msg[-2] == "event: error" and json.loads(msg[-1][6:])["error"]["type"] == "overloaded_error"
    standin.generator.push(Progress(), Tokens([5, EOS]), Finish(stop_token_id=EOS))  # the gateway serves on
    assert httpx.post(gateway.url + "/v1/messages", json={"model": "glm-tiny", "max_tokens": 8, "messages": USER},
                      timeout=10).status_code == 200


def test_a_bug_after_the_200_ends_the_stream_in_its_error_event(gateway: GatewayServer, standin: StandinServer,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug of ours while a Responses or Messages stream is written (forced here by breaking a helper) ended
    the stream without a word; now it is the API's error event, as chat's always was."""
    from services.gateway import anthropic_messages, openai_responses

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(anthropic_messages, "_stop_reason", broken)  # used once the reply is complete
    monkeypatch.setattr(openai_responses, "reply_messages", broken)  # used to store the completed response
    for path, body in (("/v1/messages", {"model": "glm-tiny", "max_tokens": 8, "messages": USER}),
                       ("/v1/responses", {"model": "glm-tiny", "input": "x", "reasoning": {"effort": "none"}})):
        standin.generator.push(Progress(), Tokens([5, EOS]), Finish(stop_token_id=EOS))
        with httpx.stream("POST", gateway.url + path, json={**body, "stream": True}, timeout=10) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-2] == "event: error", (path, lines[-3:])
        error = json.loads(lines[-1][6:])
        assert error.get("code") == "internal_error" or error["error"]["type"] == "api_error", error
