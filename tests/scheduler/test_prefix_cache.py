"""The prefix index through the real scheduler and the stand-in rank (tests/scheduler/standin_rank.py).

The stand-in keeps a per-slot running hash of every token fed to the slot and copies it on `state_copies`; at every
sampled row it checks that hash against the tokens read back through the block table. So a resumed request whose
snapshot is wrong, stale or taken at the wrong position, or whose shared blocks hold other tokens, makes the round
fail; and every reply is compared with what the request produces alone (`standin_generate`).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from services.scheduler.request import derive_seed
from tests.scheduler.harness import cluster, generate
from tests.scheduler.standin_rank import standin_generate
from twinspark.v1 import generate_pb2

pytestmark = pytest.mark.timeout(60)
VOCAB = 1000


def run(coro) -> None:
    asyncio.run(coro)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _expect(prompt: list[int], n: int, temperature: float = 0.0, seed: int | None = None) -> list[int]:
    return standin_generate(prompt, n, vocab=VOCAB, temperature=temperature,
                            seed=derive_seed(prompt) if seed is None else seed)[0]


def _empty(h: generate_pb2.HealthReply) -> bool:
    return h.pool.free_blocks == h.pool.total_blocks and h.running == 0 and h.waiting == 0


async def _settled(c) -> generate_pb2.HealthReply:
    """Health once the reply replays held for --reply-reuse-delay (0.5 s of idle) have run: up to 5 s."""
    for _ in range(50):
        h = await c.health()
        if _empty(h):
            break
        await asyncio.sleep(0.1)
    return h


def _first_start(c, rid: str) -> int:
    return next(start for rl in c.ranks[0].rounds for r, start, _, _ in rl.seqs if r == rid)


def test_identical_resend_is_cached_and_equal():
    async def body():
        async with cluster(1, rank=dict(num_blocks=160, block_size=4, num_slots=8, max_model_len=512),
                           max_num_seqs=4, max_num_batched_tokens=128, max_snapshots=4) as c:
            prompt = _ids(200, 1)
            fresh = await generate(c, prompt, 12, rid="fresh")
            again = await generate(c, prompt, 12, rid="again")
            assert fresh.tokens == again.tokens == _expect(prompt, 12)
            assert fresh.finished.cached_tokens == 0
            assert again.finished.cached_tokens == 192 >= 0.9 * len(prompt)  # the largest multiple of 64 below 200
            assert _first_start(c, "again") == 192
            # The fresh prefill's last chunk was cut at the snapshot point 192 (the state there is copied out).
            starts = [s for rl in c.ranks[0].rounds for r, s, n, _ in rl.seqs if r == "fresh" and s < 200]
            assert starts == [0, 128, 192]
            # Seeded sampling resumes the same way.
            a = await generate(c, prompt, 10, temperature=0.8, seed=5, rid="s1")
            b = await generate(c, prompt, 10, temperature=0.8, seed=5, rid="s2")
            assert a.tokens == b.tokens == _expect(prompt, 10, 0.8, 5)
            assert a.finished.cached_tokens == b.finished.cached_tokens == 192
            h = await c.health()
            assert (h.prefix_cache_queries, h.prefix_cache_hits) == (800, 3 * 192)
            assert "prefix cache" in h.components[0].detail
            assert _empty(h) and h.pool.total_slots == 4 and not c.standin_errors()
            assert any(c.ranks[0].copies)
    run(body())


def test_same_system_prompt_new_conversation_reuses_it():
    async def body():
        async with cluster(1, rank=dict(num_blocks=200, block_size=4, num_slots=8, max_model_len=512),
                           max_num_seqs=4, max_num_batched_tokens=68, max_snapshots=4) as c:
            system = _ids(150, 2)
            prompts = [system + _ids(100, 10 + i) for i in range(4)]
            replies = [await generate(c, prompts[0], 8, rid="q0")]
            # q1 diverges from q0 inside the system prompt: nothing to resume yet (q0's snapshot is at 192), but
            # it snapshots the fork point (128: the system prompt's reusable part) on the way.
            replies.append(await generate(c, prompts[1], 8, rid="q1"))
            # Now every new question resumes at the fork point, concurrently too.
            replies += await asyncio.gather(*(generate(c, p, 8, rid=f"q{i}") for i, p in enumerate(prompts[2:], 2)))
            for p, r in zip(prompts, replies):
                assert r.tokens == _expect(p, 8)
            assert [r.finished.cached_tokens for r in replies] == [0, 0, 128, 128]
            assert _empty(await _settled(c)) and not c.standin_errors()
    run(body())


def test_two_conversations_alternating_stay_cached():
    """Each turn's prompt is the previous prompt + the reply + a new user message. Only 2 snapshot slots and a
    pool that the two conversations nearly fill: a conversation's superseded state goes first, so both stay
    cached (plain LRU would evict the other conversation's latest state: resuming touches one's own old state)."""
    async def body():
        async with cluster(1, rank=dict(num_blocks=136, block_size=4, num_slots=6, max_model_len=512),
                           max_num_seqs=4, max_num_batched_tokens=68, max_snapshots=2) as c:
            convs = {"x": _ids(130, 3), "y": _ids(130, 4)}
            cached: dict[str, list[int]] = {"x": [], "y": []}
            for turn in range(3):
                for name in ("x", "y"):
                    prompt = convs[name]
                    r = await generate(c, prompt, 8, rid=f"{name}{turn}")
                    assert r.tokens == _expect(prompt, 8), (name, turn)
                    cached[name].append(r.finished.cached_tokens)
                    convs[name] = prompt + r.tokens + _ids(62, 100 + turn * 2 + (name == "y"))
            assert cached == {"x": [0, 128, 192], "y": [0, 128, 192]}
            h = await c.health()
            assert _empty(h) and not c.standin_errors()
    run(body())


def test_filling_the_pool_evicts_lru_and_replies_stay_correct():
    async def body():
        # 100 blocks of 4 = 400 positions: three 130-token prompts' cached prefixes (32 blocks each) fill it.
        async with cluster(1, rank=dict(num_blocks=100, block_size=4, num_slots=8, max_model_len=512,
                                        step_delay_s=0.001),
                           max_num_seqs=3, max_num_batched_tokens=67, max_snapshots=5) as c:
            prompts = [_ids(130, 20 + i) for i in range(8)]
            for i, p in enumerate(prompts[:4]):
                r = await generate(c, p, 8, rid=f"a{i}")
                assert r.tokens == _expect(p, 8) and r.finished.cached_tokens == 0
            # a0 was evicted (least recently used) to make room for a3; a3 and a2 are still cached.
            r = await generate(c, prompts[3], 8, rid="a3-again")
            assert r.tokens == _expect(prompts[3], 8) and r.finished.cached_tokens == 128
            r = await generate(c, prompts[0], 8, rid="a0-again")
            assert r.tokens == _expect(prompts[0], 8) and r.finished.cached_tokens == 0
            # A burst of old and new prompts at once, under pressure: all correct, the pool drains.
            burst = prompts[3:] + prompts[:3]  # a3 is still cached and comes first
            out = await asyncio.gather(*(generate(c, p, 8, rid=f"b{i}") for i, p in enumerate(burst)))
            for p, r in zip(burst, out):
                assert r.tokens == _expect(p, 8)
            assert out[0].finished.cached_tokens == 128
            h = await c.health()
            assert _empty(h) and not c.standin_errors()
            assert "evicted" in h.components[0].detail and c.scheduler.engine.scheduler.kv.prefix.evictions > 0
    run(body())


def test_prefix_caching_off():
    async def body():
        async with cluster(1, rank=dict(num_blocks=160, block_size=4, num_slots=8, max_model_len=512),
                           max_num_seqs=4, max_num_batched_tokens=68, enable_prefix_caching=False) as c:
            prompt = _ids(200, 1)
            a = await generate(c, prompt, 6)
            b = await generate(c, prompt, 6)
            assert a.tokens == b.tokens == _expect(prompt, 6)
            assert a.finished.cached_tokens == b.finished.cached_tokens == 0
            h = await c.health()
            assert (h.prefix_cache_queries, h.prefix_cache_hits) == (0, 0) and h.pool.total_slots == 8
            assert not any(c.ranks[0].copies)
    run(body())
