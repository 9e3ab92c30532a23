"""Unit tests: request validation (400 naming the field in `param`) and the OpenAI error shape."""

from __future__ import annotations

import json

import pytest

from services.gateway.errors import GatewayError, unsupported
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, TokenizeRequest, parse

MSG = [{"role": "user", "content": "hi"}]


def _chat(**fields) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, json.dumps({"messages": MSG, **fields}).encode())


def _param_of_error(model, body: bytes | dict) -> GatewayError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(GatewayError) as exc:
        parse(model, raw)
    assert exc.value.status == 400
    return exc.value


def test_accepts_supported_and_neutral_fields() -> None:
    req = _chat(model="m", temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=-5, max_completion_tokens=3,
                stop="x", stop_token_ids=[5], ignore_eos=True, return_token_ids=True, stream=True,
                stream_options={"include_usage": True}, background=True, draft=False, user="u",
                chat_template_kwargs={"enable_thinking": False}, reasoning_effort="none",
                n=1, logprobs=False, top_logprobs=0, tools=[], tool_choice="none", presence_penalty=0,
                frequency_penalty=0.0, repetition_penalty=1, response_format={"type": "text"},
                parallel_tool_calls=True, logit_bias={}, echo=False)
    assert req.temperature == 0.0 and req.stream_options.include_usage and not req.draft
    comp = parse(CompletionRequest, b'{"prompt": [[1, 2, 3]], "max_tokens": 4}')
    assert comp.prompt == [[1, 2, 3]]


@pytest.mark.parametrize(("fields", "param"), [
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"priority": 1}, "priority"),
    ({"separate_reasoning": False}, "separate_reasoning"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"audio": {"voice": "x"}}, "audio"),
])
def test_unsupported_fields_are_named(fields: dict, param: str) -> None:
    err = _param_of_error(ChatCompletionRequest, {"messages": MSG, **fields})
    assert err.param == param and err.code == "unsupported_parameter"


def test_penalties_are_accepted_in_range() -> None:
    req = _chat(presence_penalty=-2, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={"5": -100, "7": 100},
                min_tokens=4)
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (-2.0, 2.0, 1.3)
    assert req.logit_bias == {"5": -100.0, "7": 100.0} and req.min_tokens == 4


@pytest.mark.parametrize(("fields", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.5}, "repetition_penalty"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ({"logit_bias": {"5": "up"}}, "logit_bias.5"),
    ({"logit_bias": [5, 10]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2.5}, "min_tokens"),
])
def test_bad_penalties_are_named(fields: dict, param: str) -> None:
    err = _param_of_error(ChatCompletionRequest, {"messages": MSG, **fields})
    assert err.param == param and err.type == "invalid_request_error", (err.param, err.message)


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 0}, "n"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
])
def test_agent_fields_are_validated(fields: dict, param: str) -> None:
    err = _param_of_error(ChatCompletionRequest, {"messages": MSG, **fields})
    assert err.param is not None and err.param.startswith(param), err.param


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "max_tokens": "5"}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "seed": 1.5}, "seed"),
    ({"messages": MSG, "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ({"messages": MSG, "wat": 1}, "wat"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages[0].extra"),
    ({"messages": MSG, "reasoning_effort": "huge"}, "reasoning_effort"),
])
def test_wrong_types_name_the_field(body: dict, param: str) -> None:
    err = _param_of_error(ChatCompletionRequest, body)
    assert err.param == param and err.type == "invalid_request_error", err.message
    if param == "wat":
        assert err.message == "Unrecognized request argument supplied: wat"


def test_completion_prompt_shapes() -> None:
    assert _param_of_error(CompletionRequest, {"prompt": [1, "a"]}).param == "prompt[1]"
    assert _param_of_error(CompletionRequest, {"prompt": "x", "suffix": "y"}).param == "suffix"
    assert _param_of_error(CompletionRequest, {"prompt": "x", "echo": 1}).param == "echo"  # strict: a bool
    assert _param_of_error(TokenizeRequest, {"prompt": "x", "messages": MSG}).status == 400


def test_malformed_json() -> None:
    err = _param_of_error(ChatCompletionRequest, b'{"messages": [')
    assert err.code == "invalid_json" and "malformed JSON" in err.message
    assert _param_of_error(ChatCompletionRequest, b"[1, 2]").code == "invalid_json"


def test_error_shape() -> None:
    err = unsupported("n", "must be 1")
    assert err.body() == {"error": {"message": "'n' must be 1", "type": "invalid_request_error", "param": "n",
                                    "code": "unsupported_parameter"}}
    assert GatewayError(429, "busy", headers={"Retry-After": "3"}).response().headers["retry-after"] == "3"
    assert GatewayError(503, "down").body()["error"]["type"] == "server_error"
