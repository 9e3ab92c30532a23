"""Prompt logprobs (vLLM's `prompt_logprobs`, and what `echo` + `logprobs` show for the prompt): the scheduler's
PromptLogprobs events collected in prompt order, and their two client shapes.

The scores are the model's raw distribution (log-softmax of the fp32 logits, no temperature or filter: vLLM's
default for prompt logprobs), computed by the prefill the request runs anyway (generate.proto). Prompt token 0 has
no score (nothing predicts it): both shapes start with null.

- `prompt_logprobs` (vLLM): per position a dict `{token id: {"logprob", "rank", "decoded_token"}}` of the prompt
  token and the top k, the prompt token first (once, when it is among the top k).
- `echo` + `logprobs` (OpenAI completions): the prompt's entries of the `logprobs` object; each `top_logprobs`
  dict holds the prompt token and the top k by text, as vLLM writes it (so `k + 1` entries when the token is not
  among the top k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.common.tensors import from_proto
from twinspark.v1 import generate_pb2

from .tokenizer import TextTokenizer

_NEG = -9999.0  # JSON has no -inf (vLLM writes the same)


@dataclass
class PromptScore:
    """The score of one prompt token: its logprob and rank, and the top (id, logprob) pairs at its position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


def collect(scores: list[PromptScore], event: generate_pb2.PromptLogprobs, prompt_ids: list[int]) -> None:
    """Append one event's scores; raises ValueError unless it continues exactly where `scores` ends."""
    if event.start != len(scores) + 1:
        raise ValueError(f"prompt logprobs from token {event.start}, expected {len(scores) + 1}")
    lp, ranks = from_proto(event.logprobs).tolist(), from_proto(event.ranks).tolist()
    top_ids, top_lp = from_proto(event.top_ids).tolist(), from_proto(event.top_logprobs).tolist()
    if not len(lp) == len(ranks) == len(top_ids) == len(top_lp) or event.start + len(lp) > len(prompt_ids):
        raise ValueError(f"{len(lp)} prompt logprobs from token {event.start} of a {len(prompt_ids)}-token prompt")
    for i, (v, r, ids, vals) in enumerate(zip(lp, ranks, top_ids, top_lp)):
        scores.append(PromptScore(prompt_ids[event.start + i], v, r, list(zip(ids, vals))))


def complete(scores: list[PromptScore], prompt_ids: list[int]) -> bool:
    return len(scores) == len(prompt_ids) - 1


def _finite(v: float) -> float:
    return v if math.isfinite(v) else _NEG


def _text(tok: TextTokenizer, token_id: int) -> str:
    return tok.token_bytes(token_id).decode("utf-8", errors="replace")


def vllm_prompt_logprobs(tok: TextTokenizer, scores: list[PromptScore]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: [null, {id: {logprob, rank, decoded_token}}, ...]."""
    out: list[dict[str, Any] | None] = [None]
    for s in scores:
        entry = {str(s.token_id): {"logprob": _finite(s.logprob), "rank": s.rank,
                                   "decoded_token": _text(tok, s.token_id)}}
        for rank, (i, v) in enumerate(s.top, start=1):
            entry.setdefault(str(i), {"logprob": _finite(v), "rank": rank, "decoded_token": _text(tok, i)})
        out.append(entry)
    return out


def echo_logprobs(tok: TextTokenizer, prompt_ids: list[int], scores: list[PromptScore]) -> dict[str, Any]:
    """The prompt's part of a completions `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset),
    the text offsets counted over the prompt tokens' texts from 0."""
    tokens = [_text(tok, t) for t in prompt_ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    token_logprobs: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for s in scores:
        token_logprobs.append(_finite(s.logprob))
        top = {_text(tok, s.token_id): _finite(s.logprob)}  # the prompt token first, as vLLM writes it
        for i, v in s.top:
            top.setdefault(_text(tok, i), _finite(v))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
