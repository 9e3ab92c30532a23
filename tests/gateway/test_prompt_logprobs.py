"""Prompt logprobs at the gateway (a real gateway in front of the STAND-IN scheduler, whose made-up scores are
`standin_scheduler._scores`): vLLM's `prompt_logprobs` on completions and chat, completions' `echo` (+ `logprobs`,
+ `max_tokens: 0`, streamed, n > 1) with the official `openai` client and raw HTTP, and the 400s around them."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.common.tensors import ids as tensor_ids

from .conftest import GatewayServer
from .standin_scheduler import StandinServer

PROMPT = "hello world, hello"


@pytest.fixture()
def http(gateway: GatewayServer):
    with httpx.Client(base_url=gateway.url, timeout=10) as client:
        yield client


@pytest.fixture()
def oai(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=10)


def _prompt(tokenizer) -> list[int]:
    return tokenizer.encode(PROMPT)


def test_echo_with_logprobs_puts_the_prompt_first(oai: openai.OpenAI, standin: StandinServer, tokenizer) -> None:
    ids = _prompt(tokenizer)
    reply = oai.completions.create(model="glm-tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                   temperature=0)
    sent = standin.generator.last().request
    assert sent.prompt_logprobs == 1 and sent.logprobs and sent.max_tokens == 3
    c = reply.choices[0]
    assert c.text.startswith(PROMPT) and c.text != PROMPT
    lp = c.logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 3 and "".join(lp.tokens[:n]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([-i / 10 for i in range(1, n)])
    # The prompt token first, then the top 1 (id 0), as vLLM writes it; then the reply's own entries.
    assert list(lp.top_logprobs[1]) == [lp.tokens[1], tokenizer.token_bytes(0).decode("utf-8", "replace")]
    assert lp.token_logprobs[n:] == [-0.5] * 3
    assert lp.text_offset[n] == len(PROMPT) and lp.text_offset[:2] == [0, len(lp.tokens[0])]


def test_echo_with_max_tokens_0_only_scores(oai: openai.OpenAI, standin: StandinServer, tokenizer) -> None:
    reply = oai.completions.create(model="glm-tiny", prompt=_prompt(tokenizer), echo=True, logprobs=0, max_tokens=0)
    sent = standin.generator.last().request
    assert sent.max_tokens == 0 and sent.prompt_logprobs == 0
    c = reply.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and reply.usage.completion_tokens == 0
    assert len(c.logprobs.token_logprobs) == len(_prompt(tokenizer)) and c.logprobs.token_logprobs[0] is None
    assert all(len(t) == 1 for t in c.logprobs.top_logprobs[1:])  # logprobs 0: the prompt token alone


def test_echo_without_logprobs_asks_for_no_scores(http: httpx.Client, standin: StandinServer) -> None:
    body = http.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0}).json()
    assert body["choices"][0]["text"] == PROMPT and body["choices"][0]["logprobs"] is None
    assert not standin.generator.last().request.HasField("prompt_logprobs")


def test_prompt_logprobs_as_vllm_returns_them(http: httpx.Client, standin: StandinServer, tokenizer) -> None:
    ids = _prompt(tokenizer)
    body = http.post("/v1/completions", json={"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2}).json()
    assert standin.generator.last().request.prompt_logprobs == 2
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    entry = plp[1]
    assert list(entry) == [str(ids[1]), "0", "1"]  # the prompt token, then the top 2
    assert entry[str(ids[1])] == {"logprob": pytest.approx(-0.1), "rank": 2,
                                  "decoded_token": tokenizer.token_bytes(ids[1]).decode()}
    assert entry["0"]["rank"] == 1 and entry["1"]["rank"] == 2
    assert not body["choices"][0]["text"].startswith(PROMPT)  # no echo
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "prompt_logprobs": 0, "max_tokens": 2}).json()
    sent = tensor_ids(standin.generator.last().request.prompt_ids)
    assert len(chat["prompt_logprobs"]) == len(sent) and list(chat["prompt_logprobs"][2]) == [str(sent[2])]


def test_echo_streams_the_prompt_in_the_first_chunk(http: httpx.Client, tokenizer) -> None:
    for max_tokens in (3, 0):
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 1,
                                                          "max_tokens": max_tokens, "stream": True}) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
        assert texts[0].startswith(PROMPT) and (len(texts[0]) > len(PROMPT)) == (max_tokens > 0)
        first = chunks[0]["choices"][0]["logprobs"]
        assert first["token_logprobs"][0] is None and len(first["tokens"]) >= len(_prompt(tokenizer))
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_echo_with_n_2_scores_once(http: httpx.Client, standin: StandinServer) -> None:
    body = http.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "logprobs": 1, "n": 2, "seed": 1,
                                              "max_tokens": 2}).json()
    assert [c["text"].startswith(PROMPT) for c in body["choices"]] == [True, True]
    assert all(c["logprobs"]["token_logprobs"][1] == pytest.approx(-0.1) for c in body["choices"])
    asked = [r.request.HasField("prompt_logprobs") for r in list(standin.generator.records.values())[-2:]]
    assert asked == [True, False]


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": PROMPT, "echo": "yes"}, "echo"),
])
def test_bad_prompt_logprobs_requests_are_openai_400s(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "echo"
    zero = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_tokens"
