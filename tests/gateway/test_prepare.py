"""Unit tests: request -> GenerateRequest choices (sampling defaults, reasoning effort, limits)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.tensors import ids as tensor_ids
from services.gateway.checkpoint import CheckpointInfo
from services.gateway.errors import GatewayError
from services.gateway.prepare import ModelContext, prepare_chat, prepare_completion
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, parse
from services.gateway.template import ChatTemplate
from services.gateway.tokenizer import TextTokenizer

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def ctx(tiny_default: Path) -> ModelContext:
    ckpt = CheckpointInfo.load(tiny_default)
    return ModelContext(checkpoint=ckpt, tokenizer=TextTokenizer(tiny_default),
                        template=ChatTemplate.load(tiny_default, ckpt.tokenizer_config), max_model_len=64)


def _chat(ctx: ModelContext, **fields):
    req = parse(ChatCompletionRequest, json.dumps({"messages": MSG, **fields}).encode())
    return asyncio.run(prepare_chat(ctx, req))


def _prompt_text(ctx: ModelContext, prep) -> str:
    return ctx.tokenizer.decode(tensor_ids(prep.request.prompt_ids), skip_special_tokens=False)


def test_reasoning_effort_and_template_kwargs(ctx: ModelContext) -> None:
    assert _prompt_text(ctx, _chat(ctx)).endswith("<|assistant|><think>")
    assert _prompt_text(ctx, _chat(ctx, reasoning_effort="none")).endswith("<|assistant|><think></think>")
    assert _prompt_text(ctx, _chat(ctx, reasoning_effort="high")).endswith("<|assistant|><think>")
    # chat_template_kwargs wins over reasoning_effort
    prep = _chat(ctx, reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert _prompt_text(ctx, prep).endswith("<think></think>")


def test_sampling_defaults(ctx: ModelContext, tiny_default: Path) -> None:
    s = _chat(ctx).request.sampling  # generation_config.json: temperature 1.0, top_p 0.95
    assert (s.temperature, round(s.top_p, 4), s.top_k, s.min_p) == (1.0, 0.95, 0, 0.0)
    plain = ModelContext(checkpoint=ctx.checkpoint, tokenizer=ctx.tokenizer, template=ctx.template,
                         use_generation_config=False)
    assert _chat(plain).request.sampling.top_p == 1.0
    s = _chat(ctx, temperature=0.0, top_p=0.5, top_k=7, seed=3).request.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed) == (0.0, 0.5, 7, 3)


def test_limits(ctx: ModelContext) -> None:
    prep = _chat(ctx, max_tokens=5, max_completion_tokens=9, stop="x", stop_token_ids=[7])
    assert prep.request.max_tokens == 9 and prep.stops == ["x"]
    assert prep.final_ids == frozenset({7, *ctx.checkpoint.eos_token_ids})
    assert _chat(ctx, ignore_eos=True, stop_token_ids=[7]).final_ids == frozenset({7})
    n = len(prep.prompt_ids)
    assert _chat(ctx).request.max_tokens == 64 - n
    with pytest.raises(GatewayError) as exc:
        _chat(ctx, max_tokens=64 - n + 1)
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "messages"
    for prompt, param in (([], "prompt"), ([5, 2000], "prompt[1]")):
        req = parse(CompletionRequest, json.dumps({"prompt": prompt}).encode())
        with pytest.raises(GatewayError) as exc:
            asyncio.run(prepare_completion(ctx, req))
        assert exc.value.param == param


def test_penalties_reach_the_generate_request(ctx: ModelContext) -> None:
    prep = _chat(ctx, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.25,
                 logit_bias={"5": 100, "9": -2.5}, min_tokens=3, max_tokens=8)
    s = prep.request.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -1.0, 1.25)
    assert dict(s.logit_bias) == {5: 100.0, 9: -2.5} and prep.request.min_tokens == 3
    plain = _chat(ctx).request
    assert (plain.sampling.repetition_penalty, len(plain.sampling.logit_bias), plain.min_tokens) == (1.0, 0, 0)


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {" 5": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "out of vocabulary"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias", "twice"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens", "<= max_tokens"),
])
def test_bad_penalty_values_are_400s(ctx: ModelContext, fields: dict, param: str, says: str) -> None:
    with pytest.raises(GatewayError) as exc:
        _chat(ctx, **fields)
    assert exc.value.status == 400 and exc.value.param == param and says in exc.value.message, exc.value.message
