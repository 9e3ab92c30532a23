"""A Generate request checked and turned into the scheduler's `Request`, or refused with `InvalidRequest`.

Everything here follows from the request and the model alone: nothing is queued or reserved, so a refused request
leaves no trace. The gateway checks most of it first; the scheduler checks again because a hand-made Generate call
must never reach the ranks (a value they refuse would fail the whole round). The sampling ranges are the shared ones
(kernels/sampling_rules.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Container, Iterator

import torch

from kernels.sampling_rules import (FREQUENCY_PENALTY, LOGIT_BIAS, MAX_LOGIT_BIAS, MIN_P, MIN_TOKENS,
                                    PRESENCE_PENALTY, PROMPT_LOGPROBS, REPETITION_PENALTY, TEMPERATURE, TOP_K,
                                    TOP_LOGPROBS, TOP_P, Range)
from services.common.tensors import from_proto, ids
from services.scheduler.grammar import GrammarBook, GrammarError, RequestGrammar
from services.scheduler.model_info import ModelInfo
from services.scheduler.penalties import PenaltySpec, PenaltyState
from services.scheduler.request import Request, SamplingSpec, derive_seed
from services.scheduler.thinking import ThinkingBudget, ThinkingSpec, spec_error
from twinspark.v1 import generate_pb2

# Bounds on a Generate request's small fields (ids end up in every log line of the request).
MAX_REQUEST_ID = 256
MAX_STOP_IDS = 4096
MAX_IMAGES = 64

_U64 = 0xFFFF_FFFF_FFFF_FFFF


class InvalidRequest(ValueError):
    """A request the scheduler will never run; `str()` is the INVALID_ARGUMENT details, "<code>: <message>"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def validate(msg: generate_pb2.GenerateRequest, info: ModelInfo, *, grammars: GrammarBook | None,
             live: Container[str], order: Iterator[int]) -> Request:
    """The request `msg` describes, for a model described by `info`; raises InvalidRequest. `grammars`: None when
    the scheduler has no tokenizer (structured output is refused); `live`: the ids in flight; `order`: arrival
    numbers (one is taken only when the request is valid)."""
    prompt = _prompt(msg, info)
    sampling = _sampling(msg, prompt)
    if msg.priority not in (generate_pb2.PRIORITY_NORMAL, generate_pb2.PRIORITY_BACKGROUND):
        raise InvalidRequest("invalid_priority", f"unknown priority {msg.priority}")
    rid = msg.request_id or f"sched-{uuid.uuid4().hex}"
    if rid in live:
        raise InvalidRequest("duplicate_request_id", f"request {rid!r} is already in flight")
    if msg.logprobs and not TOP_LOGPROBS.holds(msg.top_logprobs):
        raise InvalidRequest("invalid_logprobs", TOP_LOGPROBS.error(msg.top_logprobs))
    prompt_logprobs = msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None and not PROMPT_LOGPROBS.holds(prompt_logprobs):
        raise InvalidRequest("invalid_logprobs", PROMPT_LOGPROBS.error(prompt_logprobs))
    grammar = _grammar(msg, grammars)
    spec = _penalties(msg, info.vocab_size)
    images = _images(msg, len(prompt))
    thinking = _thinking(msg, info.vocab_size)
    return Request(
        request_id=rid, prompt=prompt, max_tokens=msg.max_tokens, images=images, sampling=sampling,
        stop_ids=frozenset(msg.stop_token_ids), eos_ids=frozenset() if msg.ignore_eos else frozenset(info.eos_ids),
        priority=msg.priority, order=next(order), max_model_len=info.max_model_len,
        no_draft=msg.no_draft, grammar=grammar, logprobs_k=msg.top_logprobs if msg.logprobs else -1,
        penalties=PenaltyState(spec, prompt) if spec is not None else None,
        thinking=ThinkingBudget(thinking) if thinking is not None else None, prompt_logprobs=prompt_logprobs)


def _prompt(msg: generate_pb2.GenerateRequest, info: ModelInfo) -> list[int]:
    """The prompt's ids, once its size, max_tokens and every id fit the model and the ranks' cache."""
    try:
        prompt = ids(msg.prompt_ids)
    except ValueError as exc:
        raise InvalidRequest("invalid_prompt", f"prompt_ids: {exc}") from exc
    if not prompt:
        raise InvalidRequest("invalid_prompt", "the prompt is empty")
    if len(msg.request_id) > MAX_REQUEST_ID:
        raise InvalidRequest("invalid_request_id", f"request_id is longer than {MAX_REQUEST_ID} characters")
    if len(msg.stop_token_ids) > MAX_STOP_IDS:
        raise InvalidRequest("invalid_stop_token_ids", f"more than {MAX_STOP_IDS} stop_token_ids")
    if msg.max_tokens < 0:  # 0: prefill only (scoring the prompt, or warming the prefix cache)
        raise InvalidRequest("invalid_max_tokens", f"max_tokens must be >= 0, got {msg.max_tokens}")
    total = len(prompt) + msg.max_tokens
    if total > info.max_model_len:  # before the per-token check below: a huge prompt is refused at once
        raise InvalidRequest(
            "context_length_exceeded",
            f"this model's maximum context length is {info.max_model_len} tokens; the request needs {total} "
            f"({len(prompt)} in the prompt, {msg.max_tokens} max_tokens)")
    for i, t in enumerate(prompt):
        if not 0 <= t < info.vocab_size:
            raise InvalidRequest("invalid_token_id",
                                 f"prompt token {i} is {t}, outside the vocabulary [0, {info.vocab_size})")
    capacity = info.num_blocks * info.block_size  # a request reserves all it can ever need (pool.py)
    if total > capacity:
        raise InvalidRequest(
            "context_length_exceeded",
            f"the request needs {total} tokens of KV cache but the ranks' cache holds only {capacity}")
    return prompt


def _in_range(code: str, values: tuple[tuple[Range, float], ...]) -> None:
    for rule, value in values:
        if not rule.holds(value):
            raise InvalidRequest(code, rule.error(value))


def _sampling(msg: generate_pb2.GenerateRequest, prompt: list[int]) -> SamplingSpec:
    sp = msg.sampling
    # proto3 cannot tell "unset" from 0: top_p 0 means off (1), like top_k 0 and min_p 0.
    top_p = 1.0 if sp.top_p == 0 else sp.top_p
    _in_range("invalid_sampling", ((TEMPERATURE, sp.temperature), (TOP_P, top_p), (TOP_K, sp.top_k),
                                   (MIN_P, sp.min_p)))
    seed = sp.seed if sp.HasField("seed") else derive_seed(prompt)
    seed = (seed + msg.seed_offset) & _U64  # choice i of an n > 1 request: seed + i
    return SamplingSpec(temperature=sp.temperature, top_p=top_p, top_k=sp.top_k, min_p=sp.min_p, seed=seed)


def _grammar(msg: generate_pb2.GenerateRequest, grammars: GrammarBook | None) -> RequestGrammar | None:
    if not msg.grammar:
        return None
    if grammars is None:
        raise InvalidRequest("invalid_grammar", "structured output needs the scheduler's --tokenizer")
    try:
        return grammars.compile(msg.grammar)
    except GrammarError as exc:
        raise InvalidRequest("invalid_grammar", str(exc)) from None


def _penalties(msg: generate_pb2.GenerateRequest, vocab: int) -> PenaltySpec | None:
    """The request's penalties, logit bias and min_tokens; None when it uses none (its rows then carry nothing)."""
    sp = msg.sampling
    repetition = 1.0 if sp.repetition_penalty == 0 else sp.repetition_penalty  # proto3: 0 = unset
    _in_range("invalid_penalties", ((PRESENCE_PENALTY, sp.presence_penalty), (FREQUENCY_PENALTY, sp.frequency_penalty),
                                    (REPETITION_PENALTY, repetition)))
    if len(sp.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("invalid_penalties", f"logit_bias has {len(sp.logit_bias)} entries; at most "
                                                  f"{MAX_LOGIT_BIAS} are allowed")
    for t, b in sp.logit_bias.items():
        if not 0 <= t < vocab:
            raise InvalidRequest("invalid_penalties",
                                 f"logit_bias: token id {t} is outside the vocabulary [0, {vocab})")
        if not LOGIT_BIAS.holds(b):
            raise InvalidRequest("invalid_penalties", f"logit_bias: the bias of token {t} must be {LOGIT_BIAS}, "
                                                      f"got {b}")
    if not (MIN_TOKENS.holds(msg.min_tokens) and msg.min_tokens <= msg.max_tokens):
        raise InvalidRequest("invalid_penalties", f"min_tokens must be {MIN_TOKENS} and at most max_tokens "
                                                  f"({msg.max_tokens}), got {msg.min_tokens}")
    spec = PenaltySpec(presence=sp.presence_penalty, frequency=sp.frequency_penalty, repetition=repetition,
                       logit_bias=tuple(sorted(sp.logit_bias.items())), min_tokens=msg.min_tokens)
    return spec if spec != PenaltySpec() else None


def _thinking(msg: generate_pb2.GenerateRequest, vocab: int) -> ThinkingSpec | None:
    """The request's thinking budget (None: unbounded)."""
    if not msg.HasField("thinking"):
        return None
    error = spec_error(msg.thinking, vocab)
    if error is not None:
        raise InvalidRequest("invalid_thinking", error)
    t = msg.thinking
    return ThinkingSpec(budget=t.budget, forced=tuple(t.forced_ids), ends=frozenset(t.end_ids))


def _images(msg: generate_pb2.GenerateRequest, prompt_len: int) -> list[generate_pb2.Image]:
    """The request's images, checked: in prompt order, placeholders inside the prompt, pixel tensors of a sane
    shape (the ranks check them against the vision tower's geometry)."""
    images = list(msg.images)
    if len(images) > MAX_IMAGES:
        raise InvalidRequest("invalid_image", f"more than {MAX_IMAGES} images")
    end = 0
    for i, im in enumerate(images):
        if im.offset < end or im.tokens < 1 or im.offset + im.tokens > prompt_len:
            raise InvalidRequest("invalid_image", f"image {i}: its placeholder tokens [{im.offset}, "
                                 f"{im.offset + im.tokens}) overlap another image or leave the prompt")
        end = im.offset + im.tokens
        try:
            pixels, grid = from_proto(im.pixel_values), ids(im.grid_thw)
        except ValueError as exc:
            raise InvalidRequest("invalid_image", f"image {i}: {exc}") from exc
        if pixels.dtype != torch.float32 or pixels.dim() != 2 or len(grid) != 3 or min(grid) < 1 \
                or grid[0] * grid[1] * grid[2] != pixels.shape[0] or len(im.digest) != 32:
            raise InvalidRequest("invalid_image", f"image {i}: pixel_values must be float32 [t*h*w, patch] for "
                                 "grid_thw (t, h, w), with a sha256 digest")
    return images
