"""Penalties, logit_bias and min_tokens end to end: the official `openai` client against `twinspark up` (TP = 2,
the shared stack), on /v1/completions and /v1/chat/completions.

The tiny checkpoint has random weights, so what a penalty does is checked through what the API reports: logit_bias
decides greedy picks; presence / frequency / repetition penalties replace the first repeat of a greedy continuation
that repeats, or lower its logprob (the sampler's distribution, taken after the penalties); min_tokens holds
back an EOS that logit_bias would otherwise make the first token; a burst of penalised and plain requests gives the
serial replies."""

from __future__ import annotations

import collections
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.e2e.stack import Stack

GREEDY = {"temperature": 0, "top_p": 1}  # top_p 1: logprobs are the whole distribution (the checkpoint says 0.95)


@pytest.fixture(scope="module")
def client(stack_tp2: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack_tp2.v1, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(stack_tp2: Stack) -> str:
    return stack_tp2.model_name


def _complete(client: openai.OpenAI, model: str, prompt: list[int], *, max_tokens: int = 16, ignore_eos: bool = True,
              extra: dict | None = None, **fields):
    """(token ids, the completion choice) of a greedy completion unless `fields` say otherwise."""
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **{**GREEDY, **fields},
                                    extra_body={"return_token_ids": True, "ignore_eos": ignore_eos, **(extra or {})})
    choice = out.choices[0]
    return choice.token_ids, choice


@pytest.fixture(scope="module")
def repeating(client, model) -> tuple[list[int], list[int], int]:
    """A prompt whose greedy continuation repeats a token: (prompt, continuation, index of the first repeat)."""
    rng = random.Random(5)
    for _ in range(24):
        prompt = [rng.randrange(5, 1000) for _ in range(rng.randrange(3, 12))]
        ids, _ = _complete(client, model, prompt)
        first = next((k for k in range(len(ids)) if ids[k] in ids[:k]), None)
        if first is not None:
            return prompt, ids, first
    pytest.fail("no prompt among 24 gave a greedy continuation that repeats a token")


def test_logit_bias_forces_and_bans_a_token(client, model):
    prompt = [5, 17, 99, 3, 250, 8, 41]
    plain, _ = _complete(client, model, prompt, max_tokens=8)
    forced, _ = _complete(client, model, prompt, max_tokens=8, logit_bias={"77": 100})
    assert forced == [77] * 8
    banned, _ = _complete(client, model, prompt, max_tokens=8, logit_bias={str(t): -100 for t in set(plain)})
    assert not set(banned) & set(plain), (plain, banned)
    # chat too
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           logit_bias={"77": 100}, **GREEDY,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert reply.choices[0].token_ids == [77] * 4


def test_presence_and_frequency_penalties_change_a_repeating_continuation(client, model, repeating):
    prompt, plain, k = repeating
    _, base = _complete(client, model, prompt, max_tokens=k + 1, logprobs=1)
    for fields in ({"presence_penalty": 2}, {"frequency_penalty": 2}):
        ids, pen = _complete(client, model, prompt, max_tokens=k + 1, logprobs=1, **fields)
        assert ids[:k] == plain[:k], fields  # nothing repeats before k, so no token is penalised before it
        # the repeated token (generated once before k) lost 2 nats against every token never generated: it is
        # replaced, or kept with a lower probability
        assert ids[k] != plain[k] or pen.logprobs.token_logprobs[k] < base.logprobs.token_logprobs[k] - 1e-3, fields
    strong, _ = _complete(client, model, prompt, presence_penalty=2, frequency_penalty=2)
    assert strong[:k] == plain[:k] and strong[k] != plain[k], (plain, strong)
    assert max(collections.Counter(strong).values()) < max(collections.Counter(plain).values())


def test_repetition_penalty_changes_a_repeating_continuation(client, model, repeating):
    prompt, plain, k = repeating
    ids, _ = _complete(client, model, prompt, extra={"repetition_penalty": 2.0})
    assert ids != plain and max(collections.Counter(ids).values()) < max(collections.Counter(plain).values())
    same, _ = _complete(client, model, prompt, extra={"repetition_penalty": 1.0})
    assert same == plain


def test_min_tokens_holds_back_eos_and_stop_ids(client, model, stack_tp2):
    eos = json.loads((stack_tp2.model / "generation_config.json").read_text())["eos_token_id"]
    eos = eos if isinstance(eos, list) else [eos]

    def run(bias: int, **extra):
        out = client.completions.create(model=model, prompt=[11, 12, 13], max_tokens=16, logit_bias={str(bias): 100},
                                        **GREEDY, extra_body={"return_token_ids": True, **extra})
        return out.choices[0].token_ids, out.choices[0].finish_reason, out.usage.completion_tokens

    # logit_bias makes EOS the first token; min_tokens 5 holds it back for 5 tokens (the stopping EOS is counted in
    # completion_tokens and not shown in token_ids)
    assert run(eos[0]) == ([], "stop", 1)
    ids, reason, n = run(eos[0], min_tokens=5)
    assert (len(ids), reason, n) == (5, "stop", 6) and not set(ids) & set(eos), ids
    # a stop token id is held back the same way (vLLM: min_tokens covers stop_token_ids too)
    assert run(321, stop_token_ids=[321], ignore_eos=True)[1:] == ("stop", 1)
    ids, reason, n = run(321, stop_token_ids=[321], ignore_eos=True, min_tokens=3)
    assert (reason, n) == ("stop", 4) and 321 not in ids[:3], ids


def test_burst_equals_serial_with_penalised_and_plain_requests(stack_tp2):
    rng = random.Random(9)
    variants = [{}, {"frequency_penalty": 1.5}, {"presence_penalty": -1.0}, {"repetition_penalty": 1.4},
                {"logit_bias": {"40": 8.0, "41": -50}}, {"min_tokens": 6, "ignore_eos": False},
                {"temperature": 0.8, "seed": 3, "frequency_penalty": 0.7}, {"temperature": 0.8, "seed": 4}]
    bodies = [{"prompt": [rng.randrange(5, 1000) for _ in range(rng.randrange(3, 60))], "max_tokens": 12,
               "temperature": 0, "ignore_eos": True, "return_token_ids": True, **v} for v in variants * 2]

    def run(body):
        r = httpx.post(stack_tp2.v1 + "/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    serial = [run(b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        burst = list(pool.map(run, bodies))
    assert burst == serial


@pytest.mark.parametrize(("body", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
])
def test_bad_values_are_openai_shaped_400s(client, model, body, param):
    body = dict(body)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=body.pop("max_tokens", 8),
                                  extra_body=body)
    err = exc.value.body
    assert exc.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert set(err) >= {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body=body)
