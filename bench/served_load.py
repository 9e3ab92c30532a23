"""The load the served benches send: streamed completions of random token ids, at most `concurrency` in flight, and
the figures vLLM's `bench serve` reports for them (TTFT, TPOT, ITL, E2E; output, total and request throughput).

Token times are the arrival times of the SSE chunks. Tokens are counted from the chunks' `token_ids` (each body asks
for them: a random-weight model over a small tokenizer emits many ids that decode to no text), else one per chunk
with text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from bench.stats import ms_summary

VOCAB = 1000  # prompt ids stay below this: inside any checkpoint's vocabulary, the tiny one's included


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    e2e_s: float = 0.0
    out_tokens: int = 0
    error: str = ""


def completion_bodies(lengths: Iterable[int], output_len: int, rng: random.Random, vocab: int = VOCAB,
                      **fields: object) -> list[dict]:
    """A streamed greedy completion of `output_len` tokens (ignore_eos) per prompt length, random ids from 5 up
    (below 5: the tiny tokenizer's special tokens); `fields` go into every body."""
    return [{"prompt": [rng.randrange(5, vocab) for _ in range(n)], "max_tokens": output_len, "ignore_eos": True,
             "temperature": 0, "stream": True, **fields} for n in lengths]


async def one(client: httpx.AsyncClient, body: dict) -> Sample:
    """One streamed completion."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", "/completions", json={**body, "return_token_ids": True}) as r:
            if r.status_code != 200:
                return Sample(False, error=f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = (json.loads(line[6:]).get("choices") or [{}])[0]
                n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
                if n:
                    stamps.append(time.perf_counter())
                    tokens += n
    except httpx.HTTPError as exc:
        return Sample(False, error=type(exc).__name__)
    if not stamps:
        return Sample(False, error="no tokens")
    return Sample(True, stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])], stamps[-1] - t0, tokens)


async def level(url: str, bodies: list[dict], concurrency: int) -> tuple[list[Sample], float]:
    """Every body sent to `url` (a /v1 endpoint), at most `concurrency` at a time: the samples and the wall seconds."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        async def gated(b: dict) -> Sample:
            async with sem:
                return await one(client, b)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(gated(b) for b in bodies))
        return list(out), time.perf_counter() - t0


def warm_up(url: str, bodies: list[dict], concurrency: int) -> float:
    """An untimed pass at `concurrency` (vLLM `bench serve`'s warm-ups), with prompts unlike the measured ones (no
    prefix-cache hits): the level's first kernel compiles and lazy CUDA-graph captures (one per batch bucket and
    block-table width) land here, not in its figures. Returns its wall seconds, which the results keep: a long one
    is what a cold server costs its first users."""
    rng = random.Random(-concurrency)
    fresh = [{**b, "prompt": [rng.randrange(5, VOCAB) for _ in b["prompt"]]} for b in bodies[:concurrency]]
    t0 = time.perf_counter()
    asyncio.run(level(url, fresh, concurrency))
    return time.perf_counter() - t0


def summarize(samples: list[Sample], wall_s: float, prompt_len: int) -> dict:
    ok = [s for s in samples if s.ok]
    out_tokens = sum(s.out_tokens for s in ok)
    tpot = [(s.e2e_s - s.ttft_s) / (s.out_tokens - 1) for s in ok if s.out_tokens > 1]
    return {"requests": len(samples), "completed": len(ok), "errors": sorted({s.error for s in samples if not s.ok}),
            "duration_s": wall_s, "request_throughput": len(ok) / wall_s,
            "output_throughput": out_tokens / wall_s, "total_token_throughput": (out_tokens + prompt_len * len(ok))
            / wall_s, "ttft": ms_summary([s.ttft_s for s in ok]), "tpot": ms_summary(tpot),
            "itl": ms_summary([g for s in ok for g in s.itl_s]), "e2e": ms_summary([s.e2e_s for s in ok])}
