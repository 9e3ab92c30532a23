"""Prefix caching on the real stack (gateway, scheduler, a rank worker as processes): a resent prompt resumes from a
KDA snapshot + shared MLA blocks, reports `cached_tokens`, answers sooner and answers the same tokens as a fresh
prefill; a new conversation with the same system prompt reuses the system prompt."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.e2e.stack import Stack, start

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(tiny_default, tmp_path_factory) -> Stack:
    # TP = 2 like the rest of the exactness suite; a 128-token round budget: a 1000-token prompt takes 8 prefill
    # rounds when computed fresh.
    s = start(tiny_default, tmp_path_factory.mktemp("stack_prefix"), tp=2,
              env={"TWINSPARK_MAX_NUM_BATCHED_TOKENS": "128"})
    yield s
    s.down()


def _stream(stack: Stack, prompt: list[int], max_tokens: int, **sampling) -> tuple[list[int], int, float]:
    """(token ids, cached_tokens, time to first token) of a streamed /v1/completions request."""
    ids, cached, first = [], None, None
    t0 = time.monotonic()
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}, **sampling}
    with httpx.stream("POST", stack.v1 + "/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if c.get("token_ids"):
                    first = first or time.monotonic()
                    ids += c["token_ids"]
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None and cached is not None
    return ids, cached, first - t0


def test_identical_resend_is_cached_faster_and_equal(stack):
    prompt = [(i * 37 + 11) % 900 + 5 for i in range(1000)]
    m0 = stack.metrics()
    fresh, cached0, ttft0 = _stream(stack, prompt, 16, temperature=0)
    again, cached1, ttft1 = _stream(stack, prompt, 16, temperature=0)
    print(f"\nidentical resend (greedy): cached {cached0} -> {cached1} of {len(prompt)} prompt tokens; "
          f"TTFT fresh {ttft0 * 1e3:.0f} ms, resent {ttft1 * 1e3:.0f} ms")
    assert again == fresh and cached0 == 0
    assert cached1 >= 0.9 * len(prompt)
    assert ttft1 < ttft0
    # Seeded temperature 0.8, another prompt: the fresh reply and the resumed one agree token for token.
    prompt2 = [(i * 53 + 7) % 900 + 5 for i in range(700)]
    s_fresh, c0, t0 = _stream(stack, prompt2, 16, temperature=0.8, seed=1234)
    s_again, c1, t1 = _stream(stack, prompt2, 16, temperature=0.8, seed=1234)
    print(f"identical resend (T=0.8, seed): cached {c0} -> {c1} of {len(prompt2)}; TTFT {t0 * 1e3:.0f} ms -> "
          f"{t1 * 1e3:.0f} ms")
    assert s_again == s_fresh and c0 == 0 and c1 >= 0.9 * len(prompt2)
    m1 = stack.metrics()
    queries = m1["vllm:prefix_cache_queries_total"] - m0.get("vllm:prefix_cache_queries_total", 0)
    hits = m1["vllm:prefix_cache_hits_total"] - m0.get("vllm:prefix_cache_hits_total", 0)
    print(f"vllm:prefix_cache_queries +{queries:.0f}, vllm:prefix_cache_hits +{hits:.0f}")
    assert queries == 2 * (len(prompt) + len(prompt2)) and hits == cached1 + c1
    assert m1["twinspark:prefix_cache_hits_total"] == m1["vllm:prefix_cache_hits_total"]
    assert m1["vllm:kv_cache_usage_perc"] == 0.0  # idle cached blocks count as free


def test_same_system_prompt_new_question_reuses_it(stack):
    client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    system = " ".join(f"Rule {i}: answer politely and cite section {i * 7 % 13}." for i in range(40))
    questions = ["What is the capital of France?", "How do I boil an egg?", "Name three prime numbers.",
                 "Why is the sky blue?"]

    def tokens(q: str) -> list[int]:
        r = httpx.post(stack.url + "/tokenize", json={"model": model, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]}, timeout=30)
        return r.json()["tokens"]

    toks = [tokens(q) for q in questions]
    common = min(next(i for i, (a, b) in enumerate(zip(toks[0], t)) if a != b) for t in toks[1:])
    reusable = common // 64 * 64
    cached = []
    for q in questions:
        chat = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": q}])
        cached.append(chat.usage.prompt_tokens_details.cached_tokens)
    print(f"\nsystem prompt: {common} shared tokens ({reusable} reusable); prompts {[len(t) for t in toks]}; "
          f"cached per question {cached}")
    assert reusable >= 256
    assert cached[0] == 0 and all(c >= reusable for c in cached[2:])
