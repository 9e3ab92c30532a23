"""What the e2e exactness checks send and compare: mixed completion bodies, and one request's replies as token ids."""

from __future__ import annotations

import json
import random

import httpx


async def token_ids(url: str, kind: str, body: dict, *, timeout: float = 300) -> tuple[list, dict]:
    """POST `body` to chat ("chat") or completions with `return_token_ids`. Returns the choices in index order — a
    streamed chat's as token-id lists, otherwise (token_ids, logprobs) pairs — and the reply's `usage` ({} when
    streamed)."""
    body = {**body, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=timeout) as http:
        if body.get("stream"):
            ids: dict[int, list[int]] = {}
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for c in json.loads(line[6:])["choices"]:
                            ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
            return [ids[i] for i in sorted(ids)], {}
        r = await http.post(f"{url}/v1/{'chat/completions' if kind == 'chat' else 'completions'}", json=body)
        assert r.status_code == 200, r.text
        return [(c["token_ids"], c.get("logprobs")) for c in r.json()["choices"]], r.json()["usage"]


def mixed_completions(n: int, seed: int, *, longest_prompt: int, max_tokens: tuple[int, int],
                      seed_base: int) -> list[dict]:
    """`n` completions of random token-id prompts (3 to `longest_prompt` - 1 ids), `ignore_eos`, greedy and seeded in
    turn (the seeded ones at temperature 0.8 with seed `seed_base` + i): a mix whose every reply is one fixed list of
    ids, whatever runs beside it."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        body = {"prompt": [rng.randrange(5, 1000) for _ in range(rng.randrange(3, longest_prompt))],
                "max_tokens": rng.randrange(*max_tokens), "ignore_eos": True, "return_token_ids": True}
        body.update({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": seed_base + i})
        out.append(body)
    return out
