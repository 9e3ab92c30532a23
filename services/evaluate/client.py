"""One served model as `twinspark eval` reads it: its name and window, a text's token ids, and a window's prompt
logprobs (`/v1/completions` with `echo`, `max_tokens: 0` and vLLM's `prompt_logprobs`: scores only, nothing
generated, keyed by token id)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from services.evaluate.divergence import Top


@dataclass
class Scored:
    """Prompt token i (i >= 1): its logprob, and the top k (id, logprob) at its position."""

    logprob: float
    top: Top


class EvalError(RuntimeError):
    """The server refused or failed a request; the message says which and why."""


class ModelClient:
    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        """`url`: the server's base, with or without `/v1` (http://127.0.0.1:8888 or .../v1)."""
        base = url.rstrip("/")
        self.root = base[:-3] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=self.root, headers=headers, timeout=timeout_s)
        self.model = ""
        self.max_model_len = 0

    async def __aenter__(self) -> "ModelClient":
        data = (await self._call("GET", "/v1/models"))["data"][0]
        self.model, self.max_model_len = data["id"], int(data.get("max_model_len") or 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            r = await self.http.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise EvalError(f"{self.root}{path}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise EvalError(f"{self.root}{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    async def tokenize(self, text: str) -> list[int]:
        return (await self._call("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}))["tokens"]

    async def score(self, ids: list[int], k: int) -> list[Scored]:
        """The scores of ids[1:], each with its top k."""
        body = {"model": self.model, "prompt": ids, "echo": True, "max_tokens": 0, "prompt_logprobs": k,
                "temperature": 0}
        plp = (await self._call("POST", "/v1/completions", body))["choices"][0]["prompt_logprobs"]
        if len(plp) != len(ids) or plp[0] is not None:
            raise EvalError(f"{self.root}: {len(plp)} prompt logprobs for {len(ids)} tokens")
        out = []
        for token, entry in zip(ids[1:], plp[1:]):
            # The prompt token first, then the top k; k + 1 entries when the token is not among them.
            top = [(int(i), e["logprob"]) for i, e in entry.items() if len(entry) <= k or int(i) != token]
            top.sort(key=lambda t: (-t[1], t[0]))
            out.append(Scored(entry[str(token)]["logprob"], top))
        return out
