"""Jobs run on every rank of a spawned TP group (module-level so they pickle)."""

from __future__ import annotations

from services.rank_worker.model.model import Glm5Model
from services.rank_worker.offline import GenerateRequest, generate_on_model
from tests.model.reference import fresh_cache, run_chunks


def logits_and_greedy(model: Glm5Model, ids: list[int], prompt_len: int, max_tokens: int) -> dict:
    """Logits of every row (prefilled in chunks, then decoded row by row) and a greedy generation."""
    logits = run_chunks(model, fresh_cache(model, len(ids)), ids, [prompt_len // 2, prompt_len - prompt_len // 2])
    tokens = generate_on_model(model, GenerateRequest(prompt_ids=tuple(ids[:prompt_len]), max_tokens=max_tokens,
                                                      ignore_eos=True))
    return {"logits": logits.clone(), "tokens": tokens}
