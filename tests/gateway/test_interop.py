"""The ecosystem's extra fields (issue 27): the real gateway in front of a STAND-IN scheduler.

Unknown options are ignored as vLLM ignores them (logged once per name, listed in `x-twinspark-ignored-fields`), or
refused with OpenAI's 400 under --strict-request-fields; the fields vllm-router writes into every request are
known (`no_stop_trim` honoured as SGLang means it); vLLM's `stream_options.continuous_usage_stats` puts the usage so
far in every streamed chunk.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from services.gateway.app import GatewaySettings
from services.gateway.request_fields import HEADER, UnknownFields, printable
from services.gateway.schemas import ChatCompletionRequest
from twinspark.v1 import generate_pb2

from .conftest import KEEPALIVE_S, WINDOW, GatewayServer
from .standin_scheduler import EOS, Finish, Progress, StandinServer, Tokens

MSG = [{"role": "user", "content": "hi"}]
OFF = {"enable_thinking": False}
# What vllm-router 0.1.17 forwards for a plain chat request (captured from the router in front of an echo server):
# SGLang's sampling defaults written into the body.
ROUTER_CHAT = {"messages": MSG, "stream": False, "max_tokens": 4, "logprobs": False, "no_stop_trim": False,
               "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
               "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
               "include_reasoning": True}
ROUTER_COMPLETION = {"prompt": "hi", "max_tokens": 4, "stream": False, "stream_options": {"include_usage": True},
                     "echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}


@pytest.fixture()
def http(gateway: GatewayServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


@pytest.fixture(scope="module")
def strict_gateway(tiny_default: Path, standin: StandinServer) -> Iterator[GatewayServer]:
    server = GatewayServer(GatewaySettings(model_dir=str(tiny_default), scheduler=standin.target,
                                           served_model_name="glm-tiny", keepalive_s=KEEPALIVE_S,
                                           max_model_len=WINDOW, strict_request_fields=True)).start()
    yield server
    server.stop()


def _sse(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


# --------------------------------------------------------------------------------------- unknown fields: ignored

def test_the_routers_fields_are_known(http: httpx.Client) -> None:
    for path, body in (("/v1/chat/completions", {**ROUTER_CHAT, "chat_template_kwargs": OFF}),
                       ("/v1/completions", ROUTER_COMPLETION)):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        assert HEADER not in r.headers  # nothing was ignored: every field the router sends is one we know


def test_unknown_fields_are_ignored_and_listed(http: httpx.Client, standin: StandinServer) -> None:
    r = http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "max_tokens": 2,
                                                "bootstrap_room": 7, "lora_path": None,
                                                "stream_options": {"include_usage": True, "include_obfuscation": False}})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER] == "bootstrap_room, lora_path, stream_options.include_obfuscation"
    assert standin.generator.last().request.max_tokens == 2  # the known fields took effect
    # Streams carry the header too (it leaves with the status line), as do errors about known fields.
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                                      "x_trace": "a"}) as s:
        assert s.status_code == 200 and s.headers[HEADER] == "x_trace"
        assert _sse(s)[-1]["choices"][0]["finish_reason"]
    r = http.post("/v1/completions", json={"prompt": "hi", "temperature": "hot", "x_trace": "a"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature" and r.headers[HEADER] == "x_trace"


def test_each_name_is_logged_once(gateway: GatewayServer, http: httpx.Client,
                                  caplog: pytest.LogCaptureFixture) -> None:
    gateway.app.state.gateway.unknown_fields = UnknownFields()  # a fresh memory of the names seen
    caplog.set_level(logging.WARNING, logger="twinspark.gateway")
    for fields in ({"once_a": 1, "once_b": 2}, {"once_a": 3}, {"once_b": 4, "once_c": 5}):
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **fields}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(lines) == 2 and lines[0].endswith("once_a, once_b") and lines[1].endswith("once_c"), lines


def test_hostile_names_are_escaped_and_bounded(http: httpx.Client) -> None:
    names = {"x" * 10_000: 1, "a\r\nset-cookie: x": 2, "é": 3, "": 4}
    names.update({f"f{i}": i for i in range(40)})
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, **names})
    assert r.status_code == 200, r.text
    listed = r.headers[HEADER]
    assert listed.startswith("x" * 64 + '..., a%0D%0Aset-cookie%3A%20x, %C3%A9, "", f0,'), listed
    assert "set-cookie" not in r.headers
    assert listed.endswith(", +28 more") and len(listed) < 1_000
    assert printable("a.b-c_d~") == "a.b-c_d~"


def test_unknown_keys_inside_content_are_still_refused(http: httpx.Client) -> None:
    for body, param in (({"messages": [{"role": "user", "content": "x", "cache_control": {}}]}, "messages[0].cache_control"),
                        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}, "x": 1}]},
                         "tools[0].x"),
                        ({"messages": MSG, "response_format": {"type": "text", "extra": 1}}, "response_format.extra")):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_bad_values_of_known_fields_are_400(http: httpx.Client) -> None:
    for body, param, code in ((dict(ROUTER_CHAT, no_stop_trim="yes"), "no_stop_trim", None),
                              (dict(ROUTER_CHAT, separate_reasoning=False), "separate_reasoning",
                               "unsupported_parameter"),
                              (dict(ROUTER_CHAT, return_hidden_states=True), "return_hidden_states",
                               "unsupported_parameter"),
                              (dict(ROUTER_CHAT, stream_options={"continuous_usage_stats": "yes"}),
                               "stream_options.continuous_usage_stats", None)):
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and (code is None or err["code"] == code), err


def test_openapi_document_says_options_are_open(http: httpx.Client, strict_gateway: GatewayServer) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert "additionalProperties" not in schemas["ChatCompletionRequest"]
    assert "additionalProperties" not in schemas["StreamOptions"]
    assert schemas["ChatMessage"]["additionalProperties"] is False  # content stays closed
    strict = httpx.get(strict_gateway.url + "/openapi.json").json()["components"]["schemas"]
    assert strict["ChatCompletionRequest"]["additionalProperties"] is False


# ------------------------------------------------------------------------------------------------ strict mode

def test_strict_mode_gives_openais_400(strict_gateway: GatewayServer) -> None:
    r = httpx.post(strict_gateway.url + "/v1/chat/completions", json={"messages": MSG, "wat": 1}, timeout=10)
    assert r.status_code == 400 and HEADER not in r.headers
    assert r.json() == {"error": {"message": "Unrecognized request argument supplied: wat",
                                  "type": "invalid_request_error", "param": "wat", "code": None}}
    client = openai.OpenAI(base_url=strict_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="glm-tiny", prompt="hi", max_tokens=1, extra_body={"no_such_field": 1})
    assert exc.value.body["param"] == "no_such_field"
    # The routers' own fields are known fields, so strict mode still serves a router.
    r = httpx.post(strict_gateway.url + "/v1/completions", json=ROUTER_COMPLETION, timeout=10)
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------- no_stop_trim

def test_no_stop_trim_keeps_the_stop_string_and_token(http: httpx.Client, standin: StandinServer, tokenizer) -> None:
    ids = tokenizer.encode("one END two")
    for trim in (False, True):
        standin.generator.push(Progress(), Tokens(ids), Finish(generate_pb2.FINISH_LENGTH))
        r = http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stop": ["END"],
                                                    "no_stop_trim": trim}).json()
        assert r["choices"][0]["message"]["content"] == ("one END" if trim else "one ")
        standin.generator.push(Progress(), Tokens([71, 75, EOS]), Finish(generate_pb2.FINISH_STOP, stop_token_id=EOS))
        r = http.post("/v1/completions", json={"prompt": "hi", "return_token_ids": True, "no_stop_trim": trim}).json()
        choice = r["choices"][0]
        assert choice["token_ids"] == ([71, 75, EOS] if trim else [71, 75]) and choice["stop_reason"] == EOS
        assert r["usage"]["completion_tokens"] == 3


# --------------------------------------------------------------------------------- continuous usage (vLLM)

@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_stats(http: httpx.Client, standin: StandinServer, path: str) -> None:
    body = {"max_tokens": 5, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": MSG, "chat_template_kwargs": OFF} if "chat" in path else {"prompt": "hi"})
    standin.generator.push(Progress(), Tokens([71]), Tokens([75, 445]), Tokens([71, 75]),
                           Finish(generate_pb2.FINISH_LENGTH))
    with http.stream("POST", path, json=body) as r:
        chunks = _sse(r)
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert prompt > 0 and all(c["usage"] is not None for c in chunks), chunks
    done = [c["usage"]["completion_tokens"] for c in chunks[:-1]]
    assert done == sorted(done) and done[-1] == 5 and (done[0] == 0 or "chat" not in path)
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5  # the final usage chunk
    # Without include_usage it changes nothing (vLLM: continuous usage only with include_usage).
    body["stream_options"] = {"continuous_usage_stats": True}
    with http.stream("POST", path, json=body) as r:
        assert all("usage" not in c for c in _sse(r))


def test_continuous_usage_with_the_openai_client(gateway: GatewayServer, standin: StandinServer) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    standin.generator.push(Progress(), Tokens([71]), Tokens([75]), Finish(generate_pb2.FINISH_LENGTH))
    stream = client.chat.completions.create(
        model="glm-tiny", messages=MSG, max_tokens=2, stream=True, extra_body={"chat_template_kwargs": OFF},
        stream_options={"include_usage": True, "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    usages = [chunk.usage.completion_tokens for chunk in stream if chunk.usage is not None]
    assert usages[0] == 0 and usages[-1] == 2 and len(usages) >= 3


def test_schema_knows_the_router_fields() -> None:
    for name in ("no_stop_trim", "separate_reasoning", "stream_reasoning", "include_reasoning",
                 "return_hidden_states", "session_params", "continue_final_message"):
        assert name in ChatCompletionRequest.model_fields, name


# ------------------------------------------------------------------------------------------- vLLM's render routes

def test_render_gives_the_prompt_ids_generation_uses(http: httpx.Client, standin: StandinServer) -> None:
    for path, body in (("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": OFF}),
                       ("/v1/completions", {"prompt": "Once upon a time"})):
        served = len(standin.generator.records)
        rendered = http.post(path + "/render", json={**body, "max_tokens": 3, "no_stop_trim": False})
        assert rendered.status_code == 200, rendered.text
        assert len(standin.generator.records) == served  # nothing was generated
        ids = rendered.json()["token_ids"]
        reply = http.post(path, json={**body, "max_tokens": 3, "return_token_ids": True}).json()
        assert ids == reply["prompt_token_ids"] and rendered.json()["model"] == "glm-tiny"
        bad = http.post(path + "/render", json={**body, "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
