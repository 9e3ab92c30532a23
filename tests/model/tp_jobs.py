"""Jobs run on every rank of a spawned TP group (module-level so they pickle)."""

from __future__ import annotations

import torch

from services.rank_worker.model.model import Glm5Model
from services.rank_worker.offline import GenerateRequest, generate_on_model
from tests.model.reference import fresh_cache, run_chunks


def logits_and_greedy(model: Glm5Model, ids: list[int], prompt_len: int, max_tokens: int,
                      kv_dtype: torch.dtype | None = None) -> dict:
    """Logits of every row (prefilled in chunks, then decoded row by row) and a greedy generation."""
    cache = fresh_cache(model, len(ids), kv_dtype=kv_dtype)
    logits = run_chunks(model, cache, ids, [prompt_len // 2, prompt_len - prompt_len // 2])
    tokens = generate_on_model(model, GenerateRequest(prompt_ids=tuple(ids[:prompt_len]), max_tokens=max_tokens,
                                                      ignore_eos=True), kv_dtype=kv_dtype)
    return {"logits": logits.clone(), "tokens": tokens}
