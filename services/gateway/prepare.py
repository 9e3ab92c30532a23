"""A validated request -> what goes to the scheduler: prompt ids, sampling, limits, and how to post-process output.

All the choices where OpenAI, vLLM and twinspark differ are made here, in one place:
- sampling defaults: a field the request omits takes the checkpoint's generation_config.json value (vLLM's
  `--generation-config auto`), else OpenAI's default (temperature 1, top_p 1); `--generation-config vllm` skips
  the checkpoint's values.
- max_tokens (and max_completion_tokens, which wins when both are given): default the rest of the window, for
  completions too (OpenAI's completions default is 16; vLLM's is also the rest of the window).
- `reasoning_effort`: "none" turns thinking off; any other level turns it on and is passed to the template as
  `reasoning_effort` (medium -> high, xhigh -> max, minimal -> low); `chat_template_kwargs` wins over it. It also
  sets the thinking budget, unless `thinking_token_budget` does (thinking.py).
- a thinking budget with structured output or a forced tool call must leave room within max_tokens for the
  shortest constrained part after the forced end of thinking (shortest.py), else a 400 saying what it needs.
- n > 1 (and completions' best_of): one scheduler request per choice, choice i with `seed_offset` i — so choice i
  is exactly the single-choice request with seed `seed + i` (no seed: the prompt-derived key + i).
- logprobs: chat `logprobs` + `top_logprobs`, completions `logprobs` = the top count; best_of > n asks for the
  chosen tokens' logprobs to rank the choices by their sum (vLLM's rule).
- prompt logprobs (vLLM's): `prompt_logprobs: k` on chat and completions, and completions' `echo` with `logprobs`
  (the prompt's entries in the same object); `echo` with `max_tokens: 0` scores the prompt and generates nothing
  (max_tokens 0 without echo is a 400, as in vLLM). `prompt_logprobs` cannot be streamed (vLLM's 400); `echo` can
  (the prompt comes first). Only the first choice's scheduler request scores the prompt (the scores do not depend
  on the seed), unless nothing is generated.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.sampling_rules import MAX_LOGIT_BIAS
from services.common.tensors import to_proto
from twinspark.v1 import generate_pb2

from .checkpoint import CheckpointInfo
from .constraints import THINK_CLOSE, THINK_OPEN, TOOL_TAGS, GrammarBuilder, build_grammar, opens_thinking
from .errors import GatewayError, bad_request, context_length_exceeded
from .grammar_check import CLOSE, OPEN, GrammarChecker
from .images import ImageLimits, ImageProcessor, ProcessedImage, load_image
from .prompt_scores import PromptScore
from .schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, Renames, rename
from .shortest import shortest_reply
from .template import ChatTemplate
from .thinking import ThinkingIds, ThinkingSettings
from .tokenizer import TextTokenizer

_EFFORT = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "max": "max", "xhigh": "max"}


@dataclass
class ModelContext:
    """Everything request preparation reads; built once at startup."""

    checkpoint: CheckpointInfo
    tokenizer: TextTokenizer
    template: ChatTemplate
    use_generation_config: bool = True
    max_model_len: int = 0  # the window in force (checkpoint / flag, narrowed by the scheduler's figure)
    images: ImageProcessor | None = None  # the checkpoint's image processor (None: it reads no images)
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    thinking_settings: ThinkingSettings = field(default_factory=ThinkingSettings)
    grammar: GrammarBuilder = field(init=False)
    grammar_check: GrammarChecker = field(init=False)
    thinking: ThinkingIds = field(init=False)

    def __post_init__(self) -> None:
        if not self.max_model_len:
            self.max_model_len = self.checkpoint.max_model_len
        tag_ids = {t: i for t in (THINK_CLOSE, TOOL_TAGS[0]) if (i := self.tokenizer.token_to_id(t)) is not None}
        self.grammar = GrammarBuilder(self.tokenizer.added_tokens, tag_ids, self.tokenizer.size,
                                      self.checkpoint.eos_token_ids)
        self.thinking = ThinkingIds(self.tokenizer, self.thinking_settings)
        walk_ids = {t: i for t in (*CLOSE, *OPEN, THINK_CLOSE) if (i := self.tokenizer.token_to_id(t)) is not None}
        # The gateway's lifespan starts the check's worker (else the first constrained request does).
        self.grammar_check = GrammarChecker(self.tokenizer.json, self.vocab_size,
                                            sorted(self.checkpoint.eos_token_ids), walk_ids)

    async def constrain(self, prep: "Prepared", req: ChatCompletionRequest | CompletionRequest,
                        reasoning: bool | None, renames: Renames | None = None) -> None:
        """Set the request's grammar, checked (`reasoning`: see `build_grammar`). Last of the refusals: the check
        compiles the grammar, the others cost nothing."""
        built = build_grammar(self.grammar, req, reasoning)
        if built is None:
            return
        if prep.request.HasField("thinking"):
            self.check_room(prep, req, renames)
        await self.grammar_check.check(*built)
        for r in prep.requests:
            r.grammar = built[0]
        prep.grammar_param = built[1]

    def check_room(self, prep: "Prepared", req: ChatCompletionRequest | CompletionRequest,
                   renames: Renames | None) -> None:
        """A 400 when the thinking budget, the forced end of thinking and the shortest constrained part (with the
        newline before it and the end token after it) do not fit max_tokens."""
        shortest = shortest_reply(req)
        if shortest is None:
            return
        texts, what = shortest
        part = min(len(self.tokenizer.encode("\n" + t)) for t in texts) + 1
        thinking = prep.request.thinking
        need = thinking.budget + len(thinking.forced_ids) + part
        limit = prep.request.max_tokens
        if need <= limit:
            return
        param = rename("max_tokens", renames or []) or "max_tokens"
        raise bad_request(
            f"{param} ({limit}) leaves no room for the {what} after thinking: this request needs {param} >= {need} "
            f"({thinking.budget} thinking tokens from {prep.budget_source}, {len(thinking.forced_ids)} forced to end "
            f"thinking, {part} for the shortest {what} with its newline and end token); raise {param} or lower the "
            "thinking budget", param=param, code="thinking_budget_exceeds_max_tokens")

    def limit_thinking(self, prep: "Prepared", explicit: int | None, effort: str | None,
                       renames: Renames | None = None) -> None:
        """Give the request its thinking budget (thinking.py), when its reply starts inside a think block and one
        applies."""
        budget = self.thinking_settings.budget(explicit, effort)
        if not prep.reasoning or budget is None:
            return
        field_name = "thinking_token_budget" if explicit is not None else "reasoning_effort"
        param = rename(field_name, renames or []) or field_name
        prep.budget_source = param if explicit is not None else \
            f"{param} {effort!r}" if effort is not None else "the server's --reasoning-budget"
        proto = self.thinking.proto(budget, prep.tools is not None, param)
        for r in prep.requests:
            r.thinking.CopyFrom(proto)

    @property
    def vocab_size(self) -> int:
        """Ids the model accepts (its embedding rows; may exceed the tokenizer's vocabulary, which is padded)."""
        return self.checkpoint.vocab_size or self.tokenizer.size


@dataclass
class Prepared:
    kind: str                     # "chat" | "completion"
    response_id: str              # what the client sees as `id`
    prompt_ids: list[int]
    request: generate_pb2.GenerateRequest
    prompt_param: str             # "messages" | "prompt": where context-length errors point
    stops: list[str] = field(default_factory=list)
    include_stop_str: bool = False
    keep_stop_token: bool = False  # SGLang's no_stop_trim: the id that stopped generation stays in the output
    skip_special_tokens: bool = True
    final_ids: frozenset[int] = frozenset()
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage)
    return_token_ids: bool = False
    requests: list[generate_pb2.GenerateRequest] = field(default_factory=list)  # one per choice (best_of of them)
    n: int = 1                    # choices returned (the best n of `len(requests)` by summed logprob)
    logprobs: int | None = None   # top logprobs per token the client asked for; None = no logprobs
    reasoning: bool = False       # the prompt opened a think block: the reply starts with reasoning
    tools: dict[str, dict[str, Any] | None] | None = None  # name -> parameters, when tool calls are parsed
    think_end_ids: frozenset[int] = frozenset()  # ids that end the reasoning (reasoning_tokens counts up to one)
    budget_source: str = ""       # what set the thinking budget, in the caller's words (for refusals)
    min_tokens: int = 0           # stop strings count only in the text of later tokens (vLLM)
    image_tokens: int = 0         # prompt tokens that are image placeholders (usage reports them)
    grammar_param: str | None = None  # the field the grammar came from: where a grammar failure points
    echo: bool = False            # completions: the reply's text (and logprobs) start with the prompt's
    prompt_text: str = ""         # what echo puts first: the prompt as sent (token ids: decoded)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: the top k shown per prompt token (None: not shown)
    prompt_scores: list[PromptScore] = field(default_factory=list)  # filled in order by the first choice's stream

    @property
    def scores_prompt(self) -> bool:
        """Whether the first choice's request asks the scheduler for prompt logprobs."""
        return self.request.HasField("prompt_logprobs")

    def __post_init__(self) -> None:
        if not self.requests:
            self.requests = [self.request]

def _new_ids(kind: str, client_id: str | None) -> tuple[str, str]:
    """(response id, scheduler request id). A client-chosen id (vLLM's `request_id`) is echoed back, but the
    scheduler gets a unique id even when clients reuse theirs, since Abort finds requests by it."""
    suffix = uuid.uuid4().hex
    if client_id:
        return client_id, f"{client_id}-{suffix[:8]}"
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{suffix}"
    return rid, rid


def _check_ids(ids: list[int], vocab: int, param: str) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise bad_request(f"token id {t} is out of vocabulary (0..{vocab - 1})", param=f"{param}[{i}]")


def render_chat(ctx: ModelContext, messages: list[ChatMessage], add_generation_prompt: bool,
                chat_template_kwargs: dict[str, Any] | None, reasoning_effort: str | None = None,
                tools: list[Any] | None = None) -> str:
    kwargs: dict[str, Any] = {}
    if reasoning_effort == "none":
        kwargs["enable_thinking"] = False
    elif reasoning_effort is not None:
        kwargs["enable_thinking"] = True
        kwargs["reasoning_effort"] = _EFFORT[reasoning_effort]
    kwargs.update(chat_template_kwargs or {})
    dicts = [m.model_dump(exclude_none=True) for m in messages]
    return ctx.template.render(dicts, add_generation_prompt=add_generation_prompt, kwargs=kwargs,
                               tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None)


def _sampling(ctx: ModelContext, req: ChatCompletionRequest | CompletionRequest) -> generate_pb2.Sampling:
    defaults = ctx.checkpoint.default_sampling if ctx.use_generation_config else {}

    def pick(name: str, fallback: float) -> float:
        value = getattr(req, name)
        return float(value if value is not None else defaults.get(name, fallback))

    top_k = int(pick("top_k", 0))
    sampling = generate_pb2.Sampling(temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                                     top_k=max(0, top_k),  # vLLM's -1 and 0 both mean off; the contract says 0
                                     min_p=pick("min_p", 0.0))
    if req.seed is not None:
        sampling.seed = req.seed & 0xFFFF_FFFF_FFFF_FFFF  # OpenAI seeds are signed 64-bit; ours are unsigned
    sampling.presence_penalty = req.presence_penalty or 0.0
    sampling.frequency_penalty = req.frequency_penalty or 0.0
    sampling.repetition_penalty = req.repetition_penalty if req.repetition_penalty is not None else 1.0
    sampling.logit_bias.update(_logit_bias(req.logit_bias or {}, ctx.vocab_size))
    return sampling


def _logit_bias(bias: dict[str, float], vocab: int) -> dict[int, float]:
    """OpenAI's logit_bias (token id as a JSON key -> bias, the range checked by the schema) as ids; keys that name
    the same id ("7", "07") are refused rather than one silently winning."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"Invalid 'logit_bias': at most {MAX_LOGIT_BIAS} entries are allowed, got {len(bias)}",
                          param="logit_bias")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,10}", key):  # not int(): it takes " 7", "+7" and "7_0"
            raise bad_request(f"Invalid key in 'logit_bias': {key[:40]!r} is not a token id", param="logit_bias")
        t = int(key)
        if not 0 <= t < vocab:
            raise bad_request(f"Invalid key in 'logit_bias': token id {t} is out of vocabulary (0..{vocab - 1})",
                              param="logit_bias")
        if t in out:
            raise bad_request(f"Invalid 'logit_bias': token id {t} is given twice", param="logit_bias")
        out[t] = value
    return out


def _build(ctx: ModelContext, kind: str, req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
           max_tokens: int | None, prompt_param: str, *, logprobs: int | None = None, best_of: int = 1,
           score_k: int | None = None) -> Prepared:
    """`score_k`: ask for prompt logprobs with that many top ids (None: none)."""
    window = ctx.max_model_len
    n = len(prompt_ids)
    if n == 0:
        raise bad_request("the prompt is empty", param=prompt_param)
    what = "messages" if prompt_param == "messages" else "prompt"
    if n >= window:
        raise context_length_exceeded(
            f"This model's maximum context length is {window} tokens. However, your {what} resulted in {n} tokens, "
            "leaving no room for a completion. Please reduce the length of the " + what + ".", prompt_param)
    if max_tokens is None:
        max_tokens = window - n
    elif n + max_tokens > window:
        raise context_length_exceeded(
            f"This model's maximum context length is {window} tokens. However, you requested {n + max_tokens} tokens "
            f"({n} in the {what}, {max_tokens} in the completion). Please reduce the length of the {what} or "
            "completion.", prompt_param)
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({max_tokens})", param="min_tokens")
    stop_ids = list(req.stop_token_ids or [])
    _check_ids(stop_ids, ctx.vocab_size, "stop_token_ids")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    final = set(stop_ids) | (set() if req.ignore_eos else set(ctx.checkpoint.eos_token_ids))
    response_id, request_id = _new_ids(kind, req.request_id)
    if best_of < req.n:
        raise bad_request(f"best_of ({best_of}) must be >= n ({req.n})", param="best_of")
    if req.stream and best_of > req.n:
        raise bad_request("best_of > n cannot be streamed (the best choices are known only at the end)",
                          param="best_of")
    want_lp = logprobs is not None or best_of > req.n
    grpc_req = generate_pb2.GenerateRequest(
        request_id=request_id, prompt_ids=to_proto(prompt_ids), sampling=_sampling(ctx, req), max_tokens=max_tokens,
        stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
        priority=generate_pb2.PRIORITY_BACKGROUND if req.background else generate_pb2.PRIORITY_NORMAL,
        no_draft=not req.draft, logprobs=want_lp, top_logprobs=logprobs or 0,
        min_tokens=req.min_tokens or 0)
    if score_k is not None:
        grpc_req.prompt_logprobs = score_k
    requests = [grpc_req]
    for i in range(1, best_of):  # choice i: the same request keyed by seed + i, under its own scheduler id
        choice = generate_pb2.GenerateRequest()
        choice.CopyFrom(grpc_req)
        choice.request_id, choice.seed_offset = f"{request_id}-{i}", i
        if max_tokens > 0:  # the first choice scores the prompt; the others resume from its cached prefix
            choice.ClearField("prompt_logprobs")
        requests.append(choice)
    options = req.stream_options
    return Prepared(kind=kind, response_id=response_id, prompt_ids=prompt_ids, request=grpc_req,
                    prompt_param=prompt_param, stops=stops, keep_stop_token=req.no_stop_trim,
                    include_stop_str=req.include_stop_str_in_output or req.no_stop_trim,
                    skip_special_tokens=req.skip_special_tokens, final_ids=frozenset(final), stream=req.stream,
                    include_usage=bool(options and options.include_usage),
                    continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
                    return_token_ids=req.return_token_ids, requests=requests, n=req.n, logprobs=logprobs,
                    min_tokens=req.min_tokens or 0)


async def chat_images(ctx: ModelContext, messages: list[ChatMessage]) -> list[ProcessedImage]:
    """The images of the messages' `image_url` parts, in order, through the checkpoint's image processor."""
    out = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "image_url":
                continue
            param = f"messages[{i}].content[{j}].image_url.url"
            if ctx.images is None or ctx.checkpoint.image_token_id is None:
                raise bad_request("this model reads no images (its checkpoint has no image processor)", param=param)
            assert part.image_url is not None
            image = await load_image(part.image_url.url, ctx.image_limits, param)
            out.append(await asyncio.to_thread(ctx.images, image))
    return out


def place_images(ids: list[int], image_id: int, images: list[ProcessedImage]) -> tuple[list[int],
                                                                                        list[generate_pb2.Image]]:
    """Expand the template's one placeholder id per image into the image's token count; each image's proto with
    where its tokens start."""
    at = [i for i, t in enumerate(ids) if t == image_id]
    if len(at) != len(images):
        raise bad_request(f"the chat template placed {len(at)} image placeholders for {len(images)} images",
                          param="messages")
    out: list[int] = []
    protos = []
    prev = 0
    for pos, img in zip(at, images):
        out += ids[prev:pos]
        protos.append(generate_pb2.Image(pixel_values=to_proto(torch.from_numpy(img.pixel_values), "float32"),
                                         grid_thw=to_proto(list(img.grid)), digest=img.digest, offset=len(out),
                                         tokens=img.tokens))
        out += [image_id] * img.tokens
        prev = pos + 1
    return out + ids[prev:], protos


async def prepare_chat(ctx: ModelContext, req: ChatCompletionRequest, renames: Renames | None = None) -> Prepared:
    """`renames`: the caller's names of chat's fields, when another API translated the request (its errors name
    them)."""
    images = await chat_images(ctx, req.messages)
    text = render_chat(ctx, req.messages, req.add_generation_prompt, req.chat_template_kwargs, req.reasoning_effort,
                       req.tools)
    ids = await ctx.tokenizer.encode_async(text, add_special_tokens=req.add_special_tokens)
    protos: list[generate_pb2.Image] = []
    if images:
        assert ctx.checkpoint.image_token_id is not None
        ids, protos = place_images(ids, ctx.checkpoint.image_token_id, images)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    _check_prompt_logprobs(req)
    prep = _build(ctx, "chat", req, ids, max_tokens, "messages",
                  logprobs=(req.top_logprobs or 0) if req.logprobs else None, best_of=req.n,
                  score_k=req.prompt_logprobs)
    prep.prompt_logprobs = req.prompt_logprobs
    prep.reasoning = opens_thinking(text)
    if req.tools and req.tool_choice != "none":
        prep.tools = {t.function.name: t.function.parameters for t in req.tools}
    prep.think_end_ids = frozenset(ctx.thinking.end_ids(prep.tools is not None))
    ctx.limit_thinking(prep, req.thinking_token_budget, req.reasoning_effort, renames)
    await ctx.constrain(prep, req, prep.reasoning, renames)
    prep.image_tokens = sum(p.tokens for p in protos)
    for r in prep.requests:
        r.images.extend(protos)
    return prep


async def prepare_translated(ctx: ModelContext, req: ChatCompletionRequest, renames: Renames) -> Prepared:
    """`prepare_chat` for a request another API translated (Anthropic Messages, Responses): its errors, and the
    field a later grammar failure points at, name that API's fields."""
    try:
        prep = await prepare_chat(ctx, req, renames)
    except GatewayError as err:
        err.param = rename(err.param, renames)
        raise
    prep.grammar_param = rename(prep.grammar_param, renames)
    return prep


async def prepare_completion(ctx: ModelContext, req: CompletionRequest) -> Prepared:
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported (a list must hold exactly one prompt)",
                              param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = await ctx.tokenizer.encode_async(prompt, add_special_tokens=req.add_special_tokens)
    else:
        ids = list(prompt)
        _check_ids(ids, ctx.vocab_size, "prompt")
    _check_prompt_logprobs(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be at least 1, got 0 (0 is accepted with echo: the prompt is scored and "
                          "nothing is generated)", param="max_tokens")
    echo_scores = req.echo and req.logprobs is not None
    score_k = None if req.prompt_logprobs is None and not echo_scores else \
        max(req.prompt_logprobs or 0, req.logprobs or 0 if echo_scores else 0)
    prep = _build(ctx, "completion", req, ids, req.max_tokens, "prompt", logprobs=req.logprobs,
                  best_of=req.best_of or req.n, score_k=score_k)
    prep.prompt_logprobs = req.prompt_logprobs
    if req.echo:
        prep.echo = True
        prep.prompt_text = prompt if isinstance(prompt, str) else ctx.tokenizer.decode(ids, skip_special_tokens=False)
    # A raw prompt may open a think block too (its last <think> after its last </think>): then the budget applies
    # and a grammar starts after the reasoning, as in chat.
    prep.reasoning = _opens_thinking_ids(ctx, ids)
    prep.think_end_ids = frozenset(ctx.thinking.end_ids(False))
    ctx.limit_thinking(prep, req.thinking_token_budget, None)
    await ctx.constrain(prep, req, True if prep.reasoning else None)
    return prep


def _check_prompt_logprobs(req: ChatCompletionRequest | CompletionRequest) -> None:
    if req.stream and req.prompt_logprobs is not None:  # vLLM's rule: they come whole, with the full reply
        raise bad_request("'prompt_logprobs' are not available when 'stream' is true", param="prompt_logprobs")


def _opens_thinking_ids(ctx: ModelContext, ids: list[int]) -> bool:
    open_id, close_id = ctx.tokenizer.token_to_id(THINK_OPEN), ctx.thinking.close
    if open_id is None or open_id not in ids:
        return False
    last_open = len(ids) - 1 - ids[::-1].index(open_id)
    return close_id is None or close_id not in ids[last_open:]
