"""DFlash drafts end to end: `twinspark up --drafter dflash` on the tiny checkpoint with its random DFlash2 drafter
(`make-tiny --drafter dflash`, ckpt/dflash2, the default --drafter-model), at TP = 1 and TP = 2 on the CPU.

12 mixed requests (greedy and seeded, prompts across the 64-token prefill grid) served one at a time with drafts
give the same token ids as with `draft: false`, and as in one burst; TP = 1 and TP = 2 agree; the drafts are really
proposed and verified (usage's drafted > 0). The random drafter rarely guesses the random target, so this checks
that drafts never change a reply, not that they pay.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.replies import mixed_completions
from tests.e2e.stack import Stack, start

N = 12


def _requests() -> list[dict]:
    return mixed_completions(N, 23, longest_prompt=100, max_tokens=(8, 24), seed_base=500)


def _reply(r: httpx.Response) -> tuple[list[int], dict]:
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["twinspark"]


def _serial(stack: Stack, bodies: list[dict]) -> list[tuple[list[int], dict]]:
    return [_reply(httpx.post(stack.v1 + "/completions", json=b, timeout=300)) for b in bodies]


async def _burst(url: str, bodies: list[dict]) -> list[tuple[list[int], dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return [_reply(r) for r in await asyncio.gather(*(client.post("/completions", json=b) for b in bodies))]


def _stack(tiny_dflash, tmp_path_factory, tp: int) -> Stack:
    return start(tiny_dflash, tmp_path_factory.mktemp(f"drafts_dflash_tp{tp}"), tp=tp,
                 env={"TWINSPARK_DRAFTER": "dflash", "TWINSPARK_MAX_RESTARTS": "0"})


@pytest.fixture(scope="module")
def tp1_ids(tiny_dflash, tmp_path_factory) -> list[list[int]]:
    stack = _stack(tiny_dflash, tmp_path_factory, 1)
    try:
        return _check_stack(stack)
    finally:
        stack.down()


def _check_stack(stack: Stack) -> list[list[int]]:
    """The stack's replies with drafts, after checking them against `draft: false` and a burst."""
    log = (stack.state_dir / "logs" / "drafter.log").read_text()
    assert "drafter (dflash2) listening" in log, log[-2000:]
    bodies = _requests()
    drafted = _serial(stack, bodies)
    plain = _serial(stack, [{**b, "draft": False} for b in bodies])
    burst = asyncio.run(_burst(stack.v1, bodies))
    assert [ids for ids, _ in drafted] == [ids for ids, _ in plain]
    assert [ids for ids, _ in burst] == [ids for ids, _ in plain]
    assert all(u == {"drafted": 0, "accepted": 0} for _, u in plain)
    n_drafted = sum(u["drafted"] for _, u in drafted + burst)
    n_accepted = sum(u["accepted"] for _, u in drafted + burst)
    print(f"TP {stack.tp}: {n_accepted} of {n_drafted} dflash drafts accepted over {2 * N} replies")
    assert n_drafted > 0
    return [ids for ids, _ in plain]


def test_dflash_drafts_tp1_equal_no_draft(tp1_ids):
    assert len(tp1_ids) == N and all(tp1_ids)


def test_dflash_drafts_tp2_equal_no_draft_and_tp1(tiny_dflash, tmp_path_factory, tp1_ids):
    stack = _stack(tiny_dflash, tmp_path_factory, 2)
    try:
        assert _check_stack(stack) == tp1_ids
    finally:
        stack.down()
