"""vLLM's render routes: `POST /v1/chat/completions/render` and `POST /v1/completions/render` take the body of a
generation request and answer the prompt as the model would see it (its token ids) without generating.

vllm-router asks a replica for them before routing: `kv_aware` scores each replica by the prompt's blocks it holds
(KV events, services/scheduler/kv_events.py), which needs the prompt's token ids, and the chat template and the
tokenizer live in the gateway. The request is prepared exactly as generation would prepare it (the same checks,
the same 400s), so the ids are those the scheduler would get.
"""

from __future__ import annotations

from typing import Any

from .prepare import Prepared


def render_body(prep: Prepared, model: str) -> dict[str, Any]:
    """vLLM's answer shape (its GenerateRequest: the ids the engine would run), the fields a router reads."""
    return {"request_id": prep.response_id, "model": model, "token_ids": prep.prompt_ids}


__all__ = ["render_body"]
