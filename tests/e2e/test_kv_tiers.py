"""KV tiers through `twinspark up` (TP = 2, a pool of 100 blocks): a prompt evicted from the pool comes back from
host RAM; a pool filled past capacity keeps serving; the disk tier survives `twinspark down` / `up` (same checkpoint)
and a corrupted disk block is detected, dropped on every rank and recomputed; turn 2 of a chat resumes from turn 1's
reply."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from services.scheduler.prefix import block_hashes
from tests.e2e.stack import Stack, start

pytestmark = pytest.mark.timeout(900)

BLOCKS = 100  # 1,600 positions: two 1,000-token prompts do not fit together


def _env(disk) -> dict[str, str]:
    return {"TWINSPARK_NUM_BLOCKS": str(BLOCKS), "TWINSPARK_MAX_NUM_BATCHED_TOKENS": "256",
            "TWINSPARK_KV_HOST_BYTES": str(64 << 20), "TWINSPARK_KV_DISK_DIR": str(disk),
            "TWINSPARK_KV_DISK_BYTES": str(256 << 20)}


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return tmp_path_factory.mktemp("kv_disk")


@pytest.fixture(scope="module")
def stack(tiny_default, tmp_path_factory, disk) -> Stack:
    s = start(tiny_default, tmp_path_factory.mktemp("stack_tiers"), tp=2, env=_env(disk))
    yield s
    s.down()


def prompt(seed: int, n: int = 1000) -> list[int]:
    return [(i * (31 + seed) + 7 * seed) % 900 + 5 for i in range(n)]


def complete(stack: Stack, ids: list[int]) -> tuple[list[int], int]:
    r = httpx.post(stack.v1 + "/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                    "ignore_eos": True, "return_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_evicted_prompt_comes_back_from_host_ram(stack):
    a, b = prompt(1), prompt(2)
    ref, cached0 = complete(stack, a)
    complete(stack, b)  # needs the blocks A's cached prefix holds: A moves to host RAM
    again, cached1 = complete(stack, a)
    m = stack.metrics()
    print(f"\nA fresh: cached {cached0}; after B evicted it: cached {cached1} of {len(a)}; host tier hits "
          f"{m.get('twinspark:kv_tier_hits_total')}, bytes {m.get('twinspark:kv_tier_bytes')}")
    assert cached0 == 0 and again == ref
    assert cached1 >= 0.9 * len(a)
    assert m["twinspark:kv_tier_hits_total"] > 0


def test_pool_filled_past_capacity_keeps_serving(stack):
    prompts = [prompt(10 + i, 600) for i in range(6)]  # 6 x 600 tokens through a 1,600-position pool, twice
    first = [complete(stack, p)[0] for p in prompts]
    second = [complete(stack, p) for p in prompts]
    print(f"\nresent after the pool turned over: cached {[c for _, c in second]}")
    assert [ids for ids, _ in second] == first
    assert all(c >= 512 for _, c in second)


def test_two_chats_alternating_under_a_full_pool_resume_from_their_replies(stack):
    """Turn 2 of each chat (its messages + the reply + a new user message, rendered by the chat template) resumes
    from turn 1's prompt + reply. The reply is forced to text whose tokens re-encode to the same ids (a random-weight
    model's free text would not: the cache matches ids, not text)."""
    client = openai.OpenAI(base_url=stack.v1, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "structured_outputs": {"regex": "x{48}"}}
    chats = [[{"role": "system", "content": " ".join(f"Rule {i} of chat {c}: be brief." for i in range(40))},
              {"role": "user", "content": f"Hello from chat {c}."}] for c in "AB"]
    turn1 = []
    for msgs in chats:
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=64, temperature=0,
                                           extra_body=extra)
        assert r.choices[0].message.content.strip() == "x" * 48
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "And now?"}]
        turn1.append(r.usage.prompt_tokens + r.usage.completion_tokens)
        time.sleep(1.0)  # the user reads the reply: the replay starts once the stack was idle --reply-reuse-delay
    cached = []
    for msgs in chats:  # A, B, then A, B: each turn 2 comes after the other chat went through the full pool
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    print(f"\nturn 1 prompt + reply {turn1} tokens; turn 2 cached {cached}")
    assert all(c >= 0.9 * t for c, t in zip(cached, turn1))


def test_disk_tier_survives_down_up_and_a_corrupt_block_is_recomputed(stack, tiny_default, tmp_path, disk):
    ids = prompt(50)
    ref, _ = complete(stack, ids)
    assert stack.down().returncode == 0  # the scheduler saves its prefix cache to the disk tier on the way out

    again = start(tiny_default, tmp_path / "after_restart", tp=2, env=_env(disk))
    try:
        resent, cached = complete(again, ids)
    finally:
        assert again.down().returncode == 0
    print(f"\nafter down + up: cached {cached} of {len(ids)} from the disk tier; same reply: {resent == ref}")
    assert resent == ref and cached >= 0.9 * len(ids)

    # Flip one byte of the prompt's first block in rank 1's disk tier: every rank drops it, the prompt is recomputed.
    first = block_hashes(ids, 16, len(ids) - 1)[0].hex()
    files = list(disk.glob(f"*/rank1/{first}.kv"))
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    raw[-5] ^= 0x40
    files[0].write_bytes(bytes(raw))
    third = start(tiny_default, tmp_path / "after_corruption", tp=2, env=_env(disk))
    try:
        resent, cached = complete(third, ids)
        m = third.metrics()
        rank_logs = [(third.state_dir / "logs" / f"rank{r}.log").read_text() for r in (0, 1)]
    finally:
        assert third.down().returncode == 0
    print(f"after corrupting block 0 on rank 1: cached {cached}, corrupt entries {m.get('twinspark:kv_tier_corrupt_total')}"
          f", same reply: {resent == ref}")
    assert resent == ref and cached == 0
    assert m["twinspark:kv_tier_corrupt_total"] >= 1
    assert f"tier entry {first} is corrupt" in rank_logs[1]
    # Dropped, recomputed, and saved again at the last shutdown: the file now holds the good bytes.
    assert files[0].read_bytes() != bytes(raw)
