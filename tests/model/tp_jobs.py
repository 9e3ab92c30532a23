"""Jobs run on every rank of a spawned TP group (module-level so they pickle)."""

from __future__ import annotations

from collections import Counter

import torch

from model.model import Glm5Model
from services.rank_worker.offline import GenerateRequest, generate_on_model
from tests.model.reference import CAP, fresh_cache, run_chunks, step


def logits_and_greedy(model: Glm5Model, ids: list[int], prompt_len: int, max_tokens: int,
                      kv_dtype: torch.dtype | None = None) -> dict:
    """Logits of every row (prefilled in chunks, then decoded row by row) and a greedy generation."""
    cache = fresh_cache(model, len(ids), kv_dtype=kv_dtype)
    logits = run_chunks(model, cache, ids, [prompt_len // 2, prompt_len - prompt_len // 2])
    tokens = generate_on_model(model, GenerateRequest(prompt_ids=tuple(ids[:prompt_len]), max_tokens=max_tokens,
                                                      ignore_eos=True), kv_dtype=kv_dtype)
    return {"logits": logits.clone(), "tokens": tokens}


def gpu_path_rounds(model: Glm5Model, rounds: list[list[tuple]], slots: int) -> dict:
    """Packed rounds (reference.step's sequences: prompt chunks, decode rows, verify windows) through the GPU path
    (the fused ops, in Triton's CPU interpreter) from an empty cache -> every round's logits, and the Triton
    kernel launches the rounds made on this rank, by kernel name."""
    from triton.runtime.interpreter import InterpretedFunction  # every interpreted launch goes through its run

    from tests import interpreter
    interpreter.install()  # a spawned rank does not read tests/conftest.py: the parent's interpreter
    cache = fresh_cache(model, CAP, slots=slots)
    launches: Counter[str] = Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[self.__name__] += 1
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        logits = [torch.cat(step(model, cache, seqs, gpu=True)) for seqs in rounds]
    finally:
        InterpretedFunction.run = run
    return {"logits": logits, "launches": launches}
