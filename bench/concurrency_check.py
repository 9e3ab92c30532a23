"""Concurrency never changes answers, through HTTP: 12 completions of mixed prompt lengths (greedy and seeded
T=0.8) served one by one (the references), then staggered 50 ms apart, then all at once, their token ids compared
with the references request by request. bench.exactness runs it against a stack; bench.whole_model after every
format's levels; tests/gpu/test_served_cuda.py on a started CUDA stack."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx

N = 12


def requests(n: int = N, seed: int = 99, vocab: int = 1000) -> list[dict]:
    """Mixed prompt lengths (3 .. 300 ids) and output lengths; even ones greedy, odd ones seeded T=0.8."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = {"prompt": [rng.randrange(5, vocab) for _ in range(rng.choice((3, 40, 130, 300)))],
                "max_tokens": rng.randrange(8, 40), "ignore_eos": True, "return_token_ids": True}
        body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 500 + i})
        out.append(body)
    return out


async def concurrent(url: str, bodies: list[dict], stagger_s: float) -> list[list[int]]:
    """Token ids of every body, request i sent i * stagger_s after the first (0: all at once)."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i: int) -> list[int]:
            await asyncio.sleep(i * stagger_s)
            r = await client.post("/completions", json=bodies[i])
            if r.status_code != 200:
                raise RuntimeError(f"request {i}: HTTP {r.status_code} {r.text}")
            return r.json()["choices"][0]["token_ids"]
        return list(await asyncio.gather(*(one(i) for i in range(len(bodies)))))


def serial(url: str, bodies: list[dict]) -> list[list[int]]:
    out = []
    for i, b in enumerate(bodies):
        r = httpx.post(url + "/completions", json=b, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"request {i}: HTTP {r.status_code} {r.text}")
        out.append(r.json()["choices"][0]["token_ids"])
    return out


@dataclass
class Check:
    """Every pass's token ids, request by request (bench.exactness prints a verdict per request)."""

    serial: list[list[int]]
    staggered: list[list[int]]
    burst: list[list[int]]

    @property
    def staggered_same(self) -> int:
        return same_requests(self.staggered, self.serial)

    @property
    def burst_same(self) -> int:
        return same_requests(self.burst, self.serial)

    @property
    def exact(self) -> bool:
        return self.staggered_same == len(self.serial) and self.burst_same == len(self.serial)

    def line(self, label: str) -> str:
        n = len(self.serial)
        return f"{label}: staggered {self.staggered_same}/{n} identical to serial, burst {self.burst_same}/{n}"


def check(url_v1: str, bodies: list[dict] | None = None) -> Check:
    """Serial references, then staggered and burst runs compared with them."""
    bodies = bodies or requests()
    ref = serial(url_v1, bodies)
    return Check(ref, asyncio.run(concurrent(url_v1, bodies, 0.05)), asyncio.run(concurrent(url_v1, bodies, 0.0)))


def same_requests(mine: list[list[int]], theirs: list[list[int]]) -> int:
    """Requests whose token ids are the same in both runs of the mix (none when the runs are of different mixes)."""
    return sum(a == b for a, b in zip(mine, theirs)) if len(mine) == len(theirs) else 0
