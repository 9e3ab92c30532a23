"""Bad input and overload against the running stack: clear OpenAI-shaped errors, and no service ever falls over."""

from __future__ import annotations

import asyncio

import httpx

from tests.e2e.stack import wait_until


def _post(stack, path: str, **kw) -> httpx.Response:
    return httpx.post(stack.v1 + path, timeout=120, **kw)


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


def test_bad_requests(stack_tp2):
    _error(_post(stack_tp2, "/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    err = _error(_post(stack_tp2, "/chat/completions", json={"messages": "hi", "max_tokens": 2}), 400)
    assert err["param"] == "messages"
    err = _error(_post(stack_tp2, "/completions", json={"prompt": "hi", "max_tokens": "many"}), 400)
    assert err["param"] == "max_tokens"
    _error(_post(stack_tp2, "/completions", json={"model": "no-such-model", "prompt": "hi"}), 404)
    window = httpx.get(stack_tp2.v1 + "/models", timeout=10).json()["data"][0]["max_model_len"]
    err = _error(_post(stack_tp2, "/completions", json={"prompt": "hi", "max_tokens": window}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"]
    err = _error(_post(stack_tp2, "/completions", json={"prompt": "hi", "n": 0}), 400)
    assert err["param"] == "n"
    err = _error(_post(stack_tp2, "/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "tools": [{"type": "function"}]}), 400)
    assert err["param"].startswith("tools")
    _error(_post(stack_tp2, "/completions", json={"prompt": [10**7]}), 400)  # token id outside the vocabulary
    assert httpx.get(stack_tp2.url + "/health", timeout=10).status_code == 200  # nothing crashed


def test_queue_full_gives_429_with_retry_after(stack_tp2):
    """16 running + 8 waiting fit; the rest are refused with 429 + Retry-After, streamed ones before the SSE 200."""
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 120, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=stack_tp2.v1, timeout=300) as client:
            long = [asyncio.create_task(client.post("/completions", json=body)) for _ in range(24)]
            await asyncio.sleep(2.0)  # let them be admitted / queued
            plain = await client.post("/completions", json=body)
            async with client.stream("POST", "/completions", json={**body, "stream": True}) as streamed:
                streamed_status, streamed_headers = streamed.status_code, streamed.headers
                await streamed.aread()
            done = await asyncio.gather(*long)
            return plain, streamed_status, streamed_headers, done

    plain, s_status, s_headers, done = asyncio.run(main())
    assert plain.status_code == 429 and int(plain.headers["retry-after"]) >= 1
    assert plain.json()["error"]["type"]
    assert s_status == 429 and int(s_headers["retry-after"]) >= 1
    assert all(r.status_code == 200 for r in done)


def test_client_gone_mid_stream_frees_its_blocks(stack_tp2):
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", stack_tp2.v1 + "/completions",
                           json={"prompt": [9, 9, 9], "max_tokens": 2000, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                if got >= 3:
                    break
            assert stack_tp2.metrics()["vllm:kv_cache_usage_perc"] > 0
    # The connection is closed: the gateway cancels, the scheduler frees the request's blocks.
    assert wait_until(lambda: stack_tp2.metrics()["vllm:kv_cache_usage_perc"] == 0.0, timeout=10)
    assert stack_tp2.metrics()["vllm:num_requests_running"] == 0


def test_metrics_names(stack_tp2):
    names = set(stack_tp2.metrics())
    for base in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert f"vllm:{base}" in names and f"twinspark:{base}" in names, base
