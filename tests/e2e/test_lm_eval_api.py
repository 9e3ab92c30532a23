"""What lm-evaluation-harness 0.4 (`lm_eval --model local-completions` / `local-chat-completions`) sends and reads,
pinned against a real stack (the session's TP 2 stack) without installing lm-eval: its log-likelihood request (the
context + continuation ids as a batch of one, echo, logprobs 1, max_tokens 1) read as it reads it
(`LocalCompletionsAPI.parse_logprobs`: the sum of token_logprobs[ctxlen:-1], greedy when each is the max of its
top_logprobs) gives the offline runtime's log-likelihood bit for bit, and its chat generation request answers.
The full lm-eval run is `python -m bench.lm_eval` (bench/results/lm_eval-*.md)."""

from __future__ import annotations

import httpx
import torch

from services.rank_worker.offline import prompt_log_softmax
from tests.model.reference import our_model


def _payload(model: str, ids: list[int]) -> dict:
    """lm_eval 0.4.13 LocalCompletionsAPI._create_payload(generate=False), with its default seed."""
    return {"model": model, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def _parse(out: dict, ctxlen: int) -> tuple[float, bool]:
    """lm_eval 0.4.13 LocalCompletionsAPI.parse_logprobs for one choice."""
    choice = out["choices"][0]
    logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(logprobs), all(tok == max(top.values()) for tok, top in zip(logprobs, tops))


def test_loglikelihood_as_lm_eval_reads_it(stack_tp2, tiny_default):
    tok = lambda text: httpx.post(stack_tp2.url + "/tokenize", json={"prompt": text},  # noqa: E731
                                  timeout=30).json()["tokens"]
    model = our_model(tiny_default)
    name = stack_tp2.model_name
    for context, continuation in (("Question: What is 9 plus 49?\nAnswer:", " 58"),
                                  ("The quick brown fox jumps over the", " lazy dog, and then")):
        ctx, cont = tok(context), tok(continuation)
        ids = ctx + cont
        reply = httpx.post(stack_tp2.v1 + "/completions", json=_payload(name, ids), timeout=300)
        assert reply.status_code == 200, reply.text
        ll, greedy = _parse(reply.json(), len(ctx))
        ref = prompt_log_softmax(model, ids)[len(ctx) - 1 :]  # rows predicting the continuation
        want = sum(ref.gather(1, torch.tensor(cont)[:, None]).squeeze(1).tolist())
        assert ll == want
        assert greedy == all(int(r.argmax()) == t for r, t in zip(ref, cont))
    # lm-eval batches requests only with batch_size > 1 (its default is 1): two prompts in one request are a 400.
    two = httpx.post(stack_tp2.v1 + "/completions", json={**_payload(name, [5, 6]), "prompt": [[5, 6], [7, 8]]},
                     timeout=60)
    assert two.status_code == 400 and two.json()["error"]["param"] == "prompt"


def test_chat_generation_as_lm_eval_sends_it(stack_tp2):
    """lm_eval 0.4.13 LocalChatCompletion._create_payload(generate=True) with the task's generation_kwargs."""
    body = {"messages": [{"role": "user", "content": "What is 9 plus 49? Reply with the number only."}],
            "model": stack_tp2.model_name, "max_tokens": 8, "temperature": 0, "stop": ["\n"], "seed": 1234,
            "chat_template_kwargs": {"enable_thinking": False}}
    reply = httpx.post(stack_tp2.v1 + "/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert isinstance(reply.json()["choices"][0]["message"]["content"], str)
