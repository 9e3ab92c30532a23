"""Exactness end to end (docs/design.md §5): concurrency, rank count and restarts never change a reply.

22 requests (11 greedy, 11 seeded at temperature 0.8, mixed prompt and output lengths) are first served one at a
time; those replies are the saved references. Then they are re-run 4 at a time — 11 staggered, 11 in one burst —
and every reply must be byte-identical (text and token ids) to its reference.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.replies import mixed_completions
from tests.e2e.stack import start

N = 22


def _requests() -> list[dict]:
    return mixed_completions(N, 1234, longest_prompt=120, max_tokens=(4, 28), seed_base=1000)


def _reply(r: httpx.Response) -> tuple[str, list[int], str]:
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["choices"][0]["token_ids"], body["token_sha"]


async def _run(url: str, bodies: list[dict], *, concurrency: int, stagger_s: float) -> list[tuple]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, client: httpx.AsyncClient):
        await asyncio.sleep(i * stagger_s)
        async with sem:
            return _reply(await client.post("/completions", json=bodies[i]))

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await asyncio.gather(*(one(i, client) for i in range(len(bodies))))


@pytest.fixture(scope="module")
def references(stack_tp2) -> list[tuple]:
    return [_reply(httpx.post(stack_tp2.v1 + "/completions", json=b, timeout=300)) for b in _requests()]


def test_concurrent_staggered_and_burst_equal_serial(stack_tp2, references):
    bodies = _requests()
    half = N // 2
    staggered = asyncio.run(_run(stack_tp2.v1, bodies[:half], concurrency=4, stagger_s=0.15))
    burst = asyncio.run(_run(stack_tp2.v1, bodies[half:], concurrency=4, stagger_s=0.0))
    same = [a == b for a, b in zip(staggered + burst, references)]
    print(f"staggered {sum(same[:half])}/{half} identical, burst {sum(same[half:])}/{N - half} identical")
    assert all(same)


def test_rounds_of_four_decode_steps_equal_serial_one_step_replies(stack_tp1, references):
    """stack_tp1 runs plain decode rounds four steps at a time (conftest.py): a burst and a staggered run there give
    the replies stack_tp2 gave one request and one step at a time."""
    bodies = _requests()
    half = N // 2
    staggered = asyncio.run(_run(stack_tp1.v1, bodies[:half], concurrency=4, stagger_s=0.15))
    burst = asyncio.run(_run(stack_tp1.v1, bodies[half:], concurrency=4, stagger_s=0.0))
    assert staggered + burst == references
    assert "decode steps per round" in (stack_tp1.state_dir / "logs" / "rank0.log").read_text()


@pytest.mark.tp
def test_tp1_tp2_tp4_same_token_ids(stack_tp1, stack_tp2, references, tiny_default, tmp_path):
    for rank in range(2):
        assert "collective: ipc" in (stack_tp2.state_dir / "logs" / f"rank{rank}.log").read_text()
    bodies = _requests()[:6]
    tp1 = [_reply(httpx.post(stack_tp1.v1 + "/completions", json=b, timeout=300)) for b in bodies]
    assert tp1 == references[:6]
    stack4 = start(tiny_default, tmp_path / "tp4", tp=4)
    try:
        tp4 = [_reply(httpx.post(stack4.v1 + "/completions", json=b, timeout=300)) for b in bodies]
    finally:
        stack4.down()
    assert tp4 == references[:6]


def test_same_seeded_reply_after_restart(tiny_default, tmp_path):
    body = {"prompt": "a seeded request", "max_tokens": 16, "temperature": 0.8, "seed": 7, "ignore_eos": True,
            "return_token_ids": True}
    replies = []
    for attempt in range(2):
        stack = start(tiny_default, tmp_path / f"run{attempt}", tp=2)
        try:
            replies.append(_reply(httpx.post(stack.v1 + "/completions", json=body, timeout=300)))
        finally:
            stack.down()
    assert replies[0] == replies[1]
