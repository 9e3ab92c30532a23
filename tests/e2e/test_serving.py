"""The serving stack end to end: real processes (gateway, scheduler, 2 rank workers over gloo), real HTTP and gRPC,
the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import httpx
import openai
import pytest

from services.rank_worker.offline import GenerateRequest, generate
from tests.e2e.stack import Stack

PROMPT_IDS = [17, 250, 3, 99, 41, 8, 600, 12, 77]


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, timeout=120)


def test_curl_and_openai_client(stack_tp2):
    # The seed recipe's request shape, with curl.
    body = json.dumps({"model": stack_tp2.model_name, "messages": [{"role": "user", "content": "Reply with OK."}], "max_tokens": 8,
                       "temperature": 0})
    out = subprocess.run(["curl", "-s", "-H", "Content-Type: application/json", "-d", body,
                          f"{stack_tp2.v1}/chat/completions"], capture_output=True, text=True, timeout=60)
    reply = json.loads(out.stdout)
    assert reply["choices"][0]["message"]["role"] == "assistant" and reply["usage"]["completion_tokens"] >= 1

    client = _client(stack_tp2)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.total_tokens > 0
    text = client.completions.create(model=model, prompt="hello", max_tokens=6, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length")
    pieces = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    streamed = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert streamed == chat.choices[0].message.content
    comp_stream = list(client.completions.create(model=model, prompt="hello", max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in comp_stream if p.choices) == text.choices[0].text
    assert comp_stream[-1].usage.completion_tokens == text.usage.completion_tokens


def _http_ids(stack: Stack, prompt: list[int], max_tokens: int) -> list[int]:
    r = httpx.post(stack.v1 + "/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("which", ["stack_tp1", "stack_tp2"])
def test_greedy_http_equals_offline_generate(request, tiny_default, which):
    stack = request.getfixturevalue(which)
    expected = generate(tiny_default, GenerateRequest(prompt_ids=tuple(PROMPT_IDS), max_tokens=24, ignore_eos=True))
    assert _http_ids(stack, PROMPT_IDS, 24) == expected


def test_sixteen_concurrent_streams_equal_alone_and_pool_drains(stack_tp2):
    prompts = [[(7 * i + 3 * j) % 900 + 5 for j in range(3 + 11 * i)] for i in range(16)]  # 3..168 tokens
    max_tokens = [4 + (5 * i) % 17 for i in range(16)]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[list[int], dict]:
        ids, usage = [], None
        stream = await client.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True, "ignore_eos": True})
        async for chunk in stream:
            for c in chunk.choices:
                ids += getattr(c, "token_ids", None) or []
            if chunk.usage:
                usage = chunk.usage
        return ids, usage

    async def run_all():
        async with openai.AsyncOpenAI(base_url=stack_tp2.v1, api_key="unused", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    model = stack_tp2.model_name
    results = asyncio.run(run_all())
    for i, (ids, usage) in enumerate(results):
        assert len(ids) == max_tokens[i]
        assert usage.prompt_tokens == len(prompts[i]) and usage.completion_tokens == max_tokens[i]
        assert ids == _http_ids(stack_tp2, prompts[i], max_tokens[i]), f"request {i} changed under concurrency"
    m = stack_tp2.metrics()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0


def test_long_prompt_is_chunked_while_others_stream(stack_tp2):
    """The stack runs with a 64-token round budget: a 900-token prompt needs 15+ rounds of prefill, and a stream that
    is already decoding keeps receiving tokens during them."""
    arrivals: list[float] = []
    long_sent: list[float] = []
    long_first: list[float] = []

    async def background(client):
        stream = await client.completions.create(model=model, prompt=[5, 6, 7], max_tokens=120, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text is not None:
                arrivals.append(time.monotonic())

    async def long_one(client):
        while len(arrivals) < 5:  # the other stream is decoding
            await asyncio.sleep(0.01)
        long_sent.append(time.monotonic())
        stream = await client.completions.create(model=model, prompt=[(i * 13) % 900 + 5 for i in range(900)],
                                                 max_tokens=2, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text and not long_first:
                long_first.append(time.monotonic())

    async def main():
        async with openai.AsyncOpenAI(base_url=stack_tp2.v1, api_key="unused", max_retries=0, timeout=300) as client:
            await asyncio.gather(background(client), long_one(client))

    model = stack_tp2.model_name
    asyncio.run(main())
    during = [t for t in arrivals if long_sent[0] < t < long_first[0]]
    print(f"long prompt prefill took {long_first[0] - long_sent[0]:.2f} s; the other stream got {len(during)} tokens "
          f"meanwhile")
    assert len(during) >= 5


def test_models_says_the_window_the_pool_holds(stack_tp2, tiny_default):
    """The ranks size their pools from memory (no --num-blocks): on the CPU 1 GiB each, ~1.3M positions of the tiny
    model, so the window is the checkpoint's whole max_position_embeddings, and /v1/models says so as vLLM does."""
    window = json.loads((tiny_default / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert window == 1_048_576
    served = httpx.get(stack_tp2.v1 + "/models", timeout=10).json()["data"][0]
    assert served["max_model_len"] == window
    tokenized = httpx.post(stack_tp2.url + "/tokenize", json={"prompt": "hi"}, timeout=10).json()
    assert tokenized["max_model_len"] == window
