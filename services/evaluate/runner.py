"""The two evaluations over a text's windows, run concurrently against the server(s) with a progress bar."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from services.evaluate.client import EvalError, ModelClient, Scored
from services.evaluate.divergence import Divergence, Perplexity
from services.evaluate.windows import Window, cut

T = TypeVar("T")


@dataclass
class Settings:
    file: Path
    window: int
    stride: int | None = None
    max_windows: int | None = None
    top_k: int = 20
    concurrency: int = 4
    progress: bool = True
    api_key: str | None = None


async def text_windows(client: ModelClient, s: Settings, check: ModelClient | None = None
                       ) -> tuple[list[Window], dict[str, Any]]:
    """The text's windows as `client` tokenizes it (`check`: a second server that must tokenize it alike), and
    what the report says of them."""
    text = s.file.read_text(encoding="utf-8")
    ids = await client.tokenize(text)
    if check is not None and await check.tokenize(text) != ids:
        raise EvalError("the two servers tokenize the text differently: KL needs the same tokenizer")
    if client.max_model_len and s.window > client.max_model_len:
        raise EvalError(f"--window {s.window} is longer than the server's window ({client.max_model_len} tokens)")
    windows = cut(ids, s.window, s.stride, s.max_windows)
    if not windows:
        raise EvalError(f"{s.file} holds {len(ids)} tokens: not enough for one window")
    source = {"file": s.file.name, "sha256": hashlib.sha256(text.encode()).hexdigest(), "text_tokens": len(ids),
              "window": s.window, "stride": s.stride or s.window, "windows": len(windows)}
    return windows, source


async def _each(windows: list[Window], s: Settings, what: str, job: Callable[[Window], Awaitable[T]]) -> list[T]:
    """`job` for every window, `s.concurrency` at a time (the server batches them), in window order."""
    gate = asyncio.Semaphore(s.concurrency)
    bar = tqdm(total=len(windows), desc=what, unit="window", disable=not s.progress)

    async def one(w: Window) -> T:
        async with gate:
            out = await job(w)
        bar.update(1)
        return out

    try:
        return list(await asyncio.gather(*(one(w) for w in windows)))
    finally:
        bar.close()


async def score_windows(client: ModelClient, windows: list[Window], s: Settings, k: int, what: str = "scoring"
                        ) -> list[list[Scored]]:
    """Every window's prompt logprobs with the top k."""
    return await _each(windows, s, what, lambda w: client.score(w.ids, k))


def _counted(w: Window, scored: list[Scored]) -> list[Scored]:
    return scored[w.counted_from - 1 :]  # scored[i] is position i + 1 of the window


def compare(windows: list[Window], ref: list[list[Scored]], model: list[list[Scored]]) -> dict[str, Any]:
    """KL_k(reference || model) and top-1 agreement over the counted positions, and both perplexities."""
    div, ppl_ref, ppl_model = Divergence(), Perplexity(), Perplexity()
    for w, a, b in zip(windows, ref, model):
        a, b = _counted(w, a), _counted(w, b)
        ppl_ref.add([x.logprob for x in a])
        ppl_model.add([x.logprob for x in b])
        for x, y in zip(a, b):
            div.add(x.top, y.top)
    return {**div.summary(), "perplexity": ppl_model.value, "ref_perplexity": ppl_ref.value}


async def perplexity(url: str, s: Settings) -> dict[str, Any]:
    async with ModelClient(url, api_key=s.api_key) as client:
        windows, source = await text_windows(client, s)
        t0 = time.monotonic()
        scored = await score_windows(client, windows, s, 0)
        seconds = time.monotonic() - t0
    ppl = Perplexity()
    for w, sc in zip(windows, scored):
        ppl.add([x.logprob for x in _counted(w, sc)])
    return {"kind": "ppl", "url": url, "model": client.model, **source, **ppl.summary(), "seconds": seconds,
            "scored_tokens_per_s": sum(len(w.ids) for w in windows) / seconds if seconds else float("nan")}


async def divergence(url: str, ref_url: str, s: Settings) -> dict[str, Any]:
    """KL_k(reference || model) and top-1 agreement on the same windows, and each one's perplexity."""
    if not 1 <= s.top_k <= 20:
        raise EvalError(f"--top-k must be in [1, 20] (the API's limit), got {s.top_k}")
    async with ModelClient(url, api_key=s.api_key) as model, ModelClient(ref_url, api_key=s.api_key) as ref:
        windows, source = await text_windows(ref, s, check=model)

        async def both(w: Window) -> tuple[list[Scored], list[Scored]]:
            a, b = await asyncio.gather(ref.score(w.ids, s.top_k), model.score(w.ids, s.top_k))
            return a, b

        t0 = time.monotonic()
        pairs = await _each(windows, s, "scoring on both", both)
        seconds = time.monotonic() - t0
    result = compare(windows, [a for a, _ in pairs], [b for _, b in pairs])
    return {"kind": "kl", "url": url, "model": model.model, "ref_url": ref_url, "ref_model": ref.model, **source,
            "top_k": s.top_k, **result, "seconds": seconds}
