"""Prompt logprobs end to end (issue 28): `twinspark up` stacks (the session's TP 2 stack, whose 80-token round
budget cuts prompts into 64-grid chunks, and the TP 1 one) serve `/v1/completions` with `echo` + `logprobs` and
vLLM's `prompt_logprobs`. Every prompt token's logprob, rank and top ids equal, bit for bit, the offline runtime's
torch.log_softmax of the same prefill on the CPU (`offline.prompt_log_softmax`), alone and in a burst of 12, at TP 1
and TP 2, and after the prompt was cached by another request; `echo` + `max_tokens: 0` returns the scores only."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
import torch

from services.rank_worker.offline import prompt_log_softmax
from tests.model.reference import our_model

K = 2


def _prompts() -> list[list[int]]:
    rng = random.Random(28)
    return [[rng.randrange(5, 1000) for _ in range(rng.randrange(2, 200))] for _ in range(12)]


def _body(ids: list[int], i: int) -> dict:
    return {"prompt": ids, "echo": True, "logprobs": K, "prompt_logprobs": K, "temperature": 0,
            "max_tokens": 0 if i % 3 == 0 else 3, "ignore_eos": True}


def _scores(body: dict) -> list:
    """What a reply says of its prompt: (logprob, rank, {id: logprob}) per prompt token after the first."""
    choice = body["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and choice["logprobs"]["token_logprobs"][0] is None
    out = []
    for i, entry in enumerate(plp[1:], start=1):
        token = entry[next(iter(entry))]  # the prompt token comes first
        assert choice["logprobs"]["token_logprobs"][i] == token["logprob"]
        out.append((token["logprob"], token["rank"], {int(t): e["logprob"] for t, e in entry.items()}))
    return out


def _expected(ref: torch.Tensor, ids: list[int]) -> list:
    out = []
    for i in range(1, len(ids)):
        row, lp = ref[i - 1], ref[i - 1, ids[i]]
        top = torch.topk(row, K).indices.tolist()
        out.append((float(lp), int((row >= lp).sum()), {t: float(row[t]) for t in [ids[i], *top]}))
    return out


@pytest.fixture(scope="module")
def offline(tiny_default) -> list[list]:
    model = our_model(tiny_default)
    return [_expected(prompt_log_softmax(model, ids), ids) for ids in _prompts()]


async def _burst(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        replies = await asyncio.gather(*(client.post("/completions", json=b) for b in bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    return [r.json() for r in replies]


def test_prompt_logprobs_equal_the_offline_log_softmax_alone_in_a_burst_and_at_tp1(stack_tp2, stack_tp1, offline):
    bodies = [_body(ids, i) for i, ids in enumerate(_prompts())]
    alone = [httpx.post(stack_tp2.v1 + "/completions", json=b, timeout=300).json() for b in bodies]
    for body, want in zip(alone, offline):
        assert _scores(body) == want
    burst = asyncio.run(_burst(stack_tp2.v1, bodies))
    assert [_scores(b) for b in burst] == offline
    assert [b["choices"][0]["text"] for b in burst] == [b["choices"][0]["text"] for b in alone]
    tp1 = asyncio.run(_burst(stack_tp1.v1, bodies))
    assert [_scores(b) for b in tp1] == offline


def test_echo_with_max_tokens_0_returns_the_scores_only(stack_tp2, offline):
    client = openai.OpenAI(base_url=stack_tp2.v1, api_key="unused", max_retries=0, timeout=300)
    ids = _prompts()[1]
    text = httpx.post(stack_tp2.url + "/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    reply = client.completions.create(model=stack_tp2.model_name, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    c = reply.choices[0]
    assert c.text == text and c.finish_reason == "length" and reply.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs == [None] + [lp for lp, _, _ in offline[1]]


def test_a_cached_prompt_is_scored_by_its_own_prefill(stack_tp2, offline):
    ids = _prompts()[2]
    assert len(ids) > 128  # the prefix cache keeps it at the 64 grid: a later request could resume at 128
    plain = {"prompt": ids, "max_tokens": 2, "temperature": 0}
    for _ in range(2):
        warm = httpx.post(stack_tp2.v1 + "/completions", json=plain, timeout=300).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128
    body = httpx.post(stack_tp2.v1 + "/completions", json=_body(ids, 1), timeout=300).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _scores(body) == offline[2]
