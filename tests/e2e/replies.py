"""One request's replies as token ids, for the burst = one-by-one checks of the e2e tests: what a mixed burst is
compared on."""

from __future__ import annotations

import json

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
