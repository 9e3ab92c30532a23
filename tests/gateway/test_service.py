"""Service tests: the real gateway (uvicorn on loopback) in front of a STAND-IN scheduler (scripted events).

Driven with raw HTTP (httpx) and the official `openai` client. The real-stack e2e tests (real scheduler and ranks)
live elsewhere; these pin the gateway's side of the contract.
"""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest

from services.common.tensors import ids as tensor_ids
from twinspark.v1 import generate_pb2

from .conftest import WINDOW, GatewayServer
from .standin_scheduler import EOS, Fail, Finish, Progress, Sleep, StandinServer, Tokens, wait_until

MSG = [{"role": "user", "content": "hi"}]
OFF = {"enable_thinking": False}  # replies are content (thinking on: reasoning until </think>)


@pytest.fixture()
def http(gateway: GatewayServer):
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


@pytest.fixture()
def oai(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def _sse(response: httpx.Response) -> tuple[list[dict], list[str]]:
    """(data objects, raw lines) of an SSE body."""
    lines = list(response.iter_lines())
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    return data, lines


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


# ------------------------------------------------------------------------------------------------ happy paths

def test_chat_with_openai_client(oai: openai.OpenAI, standin: StandinServer, tokenizer) -> None:
    ids = _ids(tokenizer, "Hello 世界")
    standin.generator.push(Progress(), Tokens(ids[:2]), Tokens(ids[2:] + [EOS]),
                           Finish(stop_token_id=EOS, cached_tokens=4))
    reply = oai.chat.completions.create(model="glm-tiny", messages=MSG,
                                       extra_body={"return_token_ids": True, "chat_template_kwargs": OFF})
    assert reply.choices[0].message.content == "Hello 世界"
    assert reply.choices[0].finish_reason == "stop"
    extra = reply.model_extra
    assert reply.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert reply.usage.completion_tokens == len(ids) + 1  # the hidden EOS was generated too
    assert reply.usage.prompt_tokens_details.cached_tokens == 4
    choice = reply.choices[0].model_extra
    assert choice["token_ids"] == ids and choice["stop_reason"] == EOS
    from services.gateway.output import token_sha
    assert extra["token_sha"] == token_sha(ids)
    # what the scheduler got: the rendered prompt's ids, defaults from generation_config.json (top_p 0.95)
    req = standin.generator.last().request
    assert tensor_ids(req.prompt_ids) == extra["prompt_token_ids"]
    assert req.max_tokens == WINDOW - len(extra["prompt_token_ids"])
    assert req.sampling.temperature == 1.0 and req.sampling.top_p == pytest.approx(0.95)
    assert not req.sampling.HasField("seed") and req.priority == generate_pb2.PRIORITY_NORMAL and not req.no_draft


def test_chat_logprobs_from_the_scheduler(oai: openai.OpenAI, standin: StandinServer, tokenizer) -> None:
    """The chunks' logprobs reach the reply: one entry per visible token, the top list as the scheduler sent it.
    (The fuzzer found the stand-in sending chunks without them: the gateway then rightly answers 500.)"""
    ids = _ids(tokenizer, "Hello")
    standin.generator.push(Progress(), Tokens(ids + [EOS]), Finish(stop_token_id=EOS))
    reply = oai.chat.completions.create(model="glm-tiny", messages=MSG, logprobs=True, top_logprobs=2,
                                       extra_body={"chat_template_kwargs": OFF})
    req = standin.generator.last().request
    assert req.logprobs and req.top_logprobs == 2
    content = reply.choices[0].logprobs.content
    assert "".join(c.token for c in content) == "Hello"
    assert [c.logprob for c in content] == [-0.5] * len(content)
    assert all([t.logprob for t in c.top_logprobs] == [-0.5, -1.5] for c in content)


def test_completion_token_prompt_and_sampling_fields(http: httpx.Client, standin: StandinServer) -> None:
    r = http.post("/v1/completions", json={
        "model": "glm-tiny", "prompt": [[5, 6, 7]], "max_tokens": 2, "temperature": 0, "top_p": 0.5, "top_k": -1,
        "min_p": 0.05, "seed": -1, "stop_token_ids": [9], "ignore_eos": True, "background": True, "draft": False,
        "return_token_ids": True}, headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hl"
    assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["stop_reason"] is None
    assert body["choices"][0]["prompt_token_ids"] == [5, 6, 7] == body["prompt_token_ids"]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "completion_tokens_details": {"reasoning_tokens": 0},
                             "prompt_tokens_details": {"cached_tokens": 0}, "twinspark": {"drafted": 4, "accepted": 3}}
    rec = standin.generator.last()
    req = rec.request
    assert tensor_ids(req.prompt_ids) == [5, 6, 7] and req.max_tokens == 2
    assert req.sampling.temperature == 0 and req.sampling.top_p == 0.5 and req.sampling.top_k == 0
    assert req.sampling.min_p == pytest.approx(0.05) and req.sampling.seed == 2**64 - 1
    assert list(req.stop_token_ids) == [9] and req.ignore_eos
    assert req.priority == generate_pb2.PRIORITY_BACKGROUND and req.no_draft
    # Tracing is off in this process: a client's trace header is not passed on (the gateway sends its own span's
    # context when tracing is on, tests/e2e/test_tracing.py).
    assert "traceparent" not in rec.metadata
    assert r.headers["x-request-id"] == body["id"]


def test_chat_stream_with_openai_client(oai: openai.OpenAI, standin: StandinServer, tokenizer) -> None:
    ids = _ids(tokenizer, "ab 世")
    standin.generator.push(Progress(), Tokens(ids[:1]), Tokens(ids[1:]), Tokens([EOS]),
                           Finish(stop_token_id=EOS))
    chunks = list(oai.chat.completions.create(model="glm-tiny", messages=MSG, stream=True,
                                              extra_body={"chat_template_kwargs": OFF},
                                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "ab 世"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids) + 1


def test_stream_raw_shape_and_token_ids(http: httpx.Client, standin: StandinServer, tokenizer) -> None:
    ids = _ids(tokenizer, "xyz")
    standin.generator.push(Tokens(ids), Finish(generate_pb2.FINISH_LENGTH))
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True, "return_token_ids": True,
                                                      "max_tokens": len(ids)}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data, lines = _sse(r)
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert "".join(d["choices"][0]["text"] for d in data) == "xyz"
    assert [t for d in data for t in d["choices"][0]["token_ids"]] == ids
    assert data[0]["prompt_token_ids"] == tokens_of(http, "hi")
    assert data[-1]["choices"][0]["finish_reason"] == "length"
    from services.gateway.output import token_sha
    assert data[-1]["token_sha"] == token_sha(ids)


def tokens_of(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_keepalive_while_scheduler_is_silent(http: httpx.Client, standin: StandinServer) -> None:
    # Silent from the start: the 200 goes out after one keepalive interval, then keepalives until tokens come.
    standin.generator.push(Sleep(1.0), Progress(generate_pb2.PHASE_PREFILLING, 3), Sleep(0.5), Tokens([71]),
                           Finish(generate_pb2.FINISH_LENGTH))
    t0 = time.monotonic()
    with http.stream("POST", "/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stream": True, "max_tokens": 1}) as r:
        assert r.status_code == 200
        assert time.monotonic() - t0 < 1.4  # headers went out before the first token (due at 1.5 s)
        data, lines = _sse(r)
    keepalives = [line for line in lines if line == ": keepalive"]
    assert 2 <= len(keepalives) <= 6, lines  # ~1.2 s of silence after the 200, at one per 0.3 s
    assert data[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in data if d["choices"]) == "h"


def test_stop_string_aborts_scheduler(http: httpx.Client, standin: StandinServer, tokenizer) -> None:
    ids = _ids(tokenizer, "one END two")
    standin.generator.push(Progress(), *[Tokens([t]) for t in ids], Sleep(5), Finish(generate_pb2.FINISH_LENGTH))
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stop": ["END"], "return_token_ids": True})
    assert time.monotonic() - t0 < 2
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "one " and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "END"
    assert tokenizer.decode(choice["token_ids"]).rstrip().endswith("END")
    rid = standin.generator.last().request.request_id
    assert wait_until(lambda: rid in standin.generator.aborts)


# ------------------------------------------------------------------------------------------------ errors

def test_429_before_stream_200(http: httpx.Client, oai: openai.OpenAI, standin: StandinServer) -> None:
    standin.generator.push(Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_after="7"))
    with http.stream("POST", "/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stream": True}) as r:
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        body = json.loads(r.read())
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_error"
    standin.generator.push(Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"))
    with pytest.raises(openai.RateLimitError) as exc:
        oai.completions.create(model="glm-tiny", prompt="hi", stream=True)
    assert exc.value.response.headers["retry-after"] == "1"


@pytest.mark.parametrize("stream", [False, True])
def test_503_when_engine_down(http: httpx.Client, standin: StandinServer, stream: bool) -> None:
    standin.generator.push(Fail(grpc.StatusCode.UNAVAILABLE, "rank1 is down"))
    r = http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stream": stream})
    assert r.status_code == 503 and "rank1 is down" in r.json()["error"]["message"]
    standin.generator.push(Progress(), Finish(generate_pb2.FINISH_ERROR, error="rank0 crashed"))
    r = http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stream": stream})
    assert r.status_code == 503 and "rank0 crashed" in r.json()["error"]["message"]


def test_error_after_output(http: httpx.Client, oai: openai.OpenAI, standin: StandinServer) -> None:
    standin.generator.push(Tokens([71]), Sleep(0.1), Finish(generate_pb2.FINISH_ERROR, error="rank0 crashed"))
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        assert r.status_code == 200
        data, lines = _sse(r)
    assert data[0]["choices"][0]["text"] == "h"
    assert data[-1]["error"]["code"] == "service_unavailable" and "rank0 crashed" in data[-1]["error"]["message"]
    assert [line for line in lines if line][-1] == "data: [DONE]"
    standin.generator.push(Tokens([71]), Sleep(0.1), Fail(grpc.StatusCode.UNAVAILABLE, "gone"))
    with pytest.raises(openai.APIError):
        list(oai.chat.completions.create(model="glm-tiny", messages=MSG, stream=True))
    standin.generator.push(Tokens([71]), Fail(grpc.StatusCode.UNAVAILABLE, "gone"))
    assert http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF}).status_code == 503


def test_bad_requests(http: httpx.Client, oai: openai.OpenAI) -> None:
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    for body, param in [({"messages": MSG, "temperature": "x"}, "temperature"), ({"messages": MSG, "n": 0}, "n"),
                        ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f g"}}]},
                         "tools[0].function.name"),
                        ({"messages": MSG, "logprobs": "yes"}, "logprobs"),
                        ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
                        ({"messages": MSG, "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
                        ({"messages": MSG, "stop_token_ids": [10**6]}, "stop_token_ids[0]")]:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/completions", json={"prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="glm-tiny", messages=MSG, n=0)
    assert exc.value.body["param"] == "n"


def test_unknown_model_and_route(http: httpx.Client, oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        oai.chat.completions.create(model="gpt-4", messages=MSG)
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_context_length(http: httpx.Client, standin: StandinServer) -> None:
    r = http.post("/v1/completions", json={"prompt": list(range(WINDOW))})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    r = http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "max_tokens": WINDOW})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    # the scheduler's own check (its window may be smaller than the gateway knows) maps the same way
    standin.generator.push(Fail(grpc.StatusCode.INVALID_ARGUMENT, "context_length_exceeded: 300 > 200"))
    r = http.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stream": True})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"


# ------------------------------------------------------------------------------------------------ cancellation

def test_client_disconnect_mid_stream_cancels(gateway: GatewayServer, standin: StandinServer) -> None:
    standin.generator.push(Progress(), Tokens([71]), Sleep(10), Finish(generate_pb2.FINISH_LENGTH))
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        with client.stream("POST", "/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stream": True}) as r:
            lines = r.iter_lines()
            while '"content":"h"' not in next(lines):  # read until the first token arrived, then hang up
                pass
    rec = standin.generator.last()
    assert wait_until(lambda: rec.cancelled, timeout=3)


def test_client_disconnect_mid_request_cancels(gateway: GatewayServer, standin: StandinServer) -> None:
    standin.generator.push(Progress(), Sleep(10), Finish(generate_pb2.FINISH_LENGTH))
    with httpx.Client(base_url=gateway.url, timeout=0.5) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/completions", json={"prompt": "hi"})
    rec = standin.generator.last()
    assert wait_until(lambda: rec.cancelled, timeout=3)


# ------------------------------------------------------------------------------------------------ other routes

def test_tokenize_detokenize_models(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"prompt": "hi 世"}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == WINDOW
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "hi 世"}
    chat = http.post("/tokenize", json={"messages": MSG, "chat_template_kwargs": OFF, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == \
        "[gMASK]<sop><|user|>\nhi<|assistant|><think></think>"
    r = http.post("/detokenize", json={"tokens": [1, -1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens[1]"
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == "glm-tiny" and models["data"][0]["max_model_len"] == WINDOW


def test_metrics_names_and_mirrors(http: httpx.Client) -> None:
    http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "request_success_total", "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                 "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
        for prefix in ("vllm", "twinspark"):
            assert f"\n{prefix}:{name}{{" in text, f"{prefix}:{name}"
    assert 'vllm:kv_cache_usage_perc{model_name="glm-tiny"} 0.25' in text
    assert 'vllm:request_success_total{finished_reason="length",model_name="glm-tiny"}' in text


def test_health(http: httpx.Client, standin: StandinServer) -> None:
    r = http.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["pool"]["free_blocks"] == 75
    health = standin.generator.health
    health.healthy = False
    health.components[1].alive = False
    try:
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["down"] == ["rank0"] and r.json()["pool"]["total_blocks"] == 100
    finally:
        health.healthy = True
        health.components[1].alive = True


def test_scheduler_abort_and_client_request_id(http: httpx.Client, standin: StandinServer) -> None:
    standin.generator.push(Tokens([71]), Finish(generate_pb2.FINISH_ABORTED))
    r = http.post("/v1/completions", json={"prompt": "hi", "request_id": "my-req-1"})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "abort" and body["choices"][0]["text"] == "h"
    assert body["id"] == "my-req-1"
    assert standin.generator.last().request.request_id.startswith("my-req-1-")  # unique for the scheduler


def test_concurrent_requests(gateway: GatewayServer) -> None:
    import asyncio

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=10) as client:
            return await asyncio.gather(*[
                client.post("/v1/chat/completions", json={"messages": MSG, "chat_template_kwargs": OFF, "stream": i % 2 == 1})
                for i in range(8)])

    replies = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies)
    assert all(r.json()["choices"][0]["message"]["content"] == "hllo" for r in replies[::2])
    assert all('"content":"hllo"' in r.text and r.text.endswith("data: [DONE]\n\n") for r in replies[1::2])
