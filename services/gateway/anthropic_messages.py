"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.

A request becomes a chat request (system, user / assistant turns, `tool_use` -> assistant tool calls,
`tool_result` -> tool messages, `thinking` blocks -> the turn's reasoning; `tools[].input_schema` -> function tools;
`tool_choice` auto / any / tool / none -> auto / required / named / none; `thinking.type: enabled` turns the
template's thinking on — off otherwise, as Anthropic's default is — and its `budget_tokens` is the thinking budget
the scheduler enforces (below max_tokens, as Anthropic requires); `output_config.format` (json_schema: what the
SDK's `messages.parse(output_format=...)` sends) -> response_format, the reply's text block constrained to the
schema, thinking on or off; `output_config.effort` -> reasoning_effort's budget; `stop_sequences` -> stop strings)
and runs through the same preparation, scheduler call and reply parser as chat. The reply comes back as content
blocks (`thinking`, `text`, `tool_use`), `stop_reason` end_turn / max_tokens / stop_sequence / tool_use, and, streamed, as Anthropic's
events: message_start, content_block_start / _delta / _stop, message_delta, message_stop (pings while waiting).
Errors have Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernels.sampling_rules import MAX_API_TEMPERATURE, TEMPERATURE, TOP_K, TOP_P

from .choices import Choices
from .errors import bad_request
from .generation import Final, Keepalive
from .prepare import Prepared
from .reply_blocks import Close, Open, Step, Text, reply_steps
from .reply_parser import ParsedReply, ToolCall
from .responses import new_parser, parse_reply
from .schemas import ChatCompletionRequest, Identifier, Renames, StopString, validated
from .streaming import guarded

class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Block(BaseModel):
    # Clients send the blocks of earlier replies back as they got them, with fields newer than ours (citations,
    # caller, ...): a content block's unknown fields are ignored, the request's own are still refused.
    model_config = ConfigDict(extra="ignore")

    cache_control: dict[str, Any] | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]
# What each role's turn may hold (as Anthropic's API has it): the rest is refused, naming the block.
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(min_length=1)]


class Tool(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, bash, ...) are not served
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> "ToolChoice":
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("'name' is given with type 'tool', and only then")
        return self


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    # The thinking budget (chat's thinking_token_budget): enforced by the scheduler. Anthropic's floor of 1,024 is
    # not kept: a small model wants a small budget.
    budget_tokens: int | None = Field(None, ge=0, lt=1 << 31)


class OutputFormat(_Model):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    format: OutputFormat | None = None
    # The thinking budget of chat's reasoning_effort level (when thinking is on and budget_tokens is not given).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(_Model):
    model: Identifier
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[StopString], Field(max_length=64)] | None = None  # chat's bounds on `stop`
    stream: bool = False
    temperature: float | None = Field(None, le=MAX_API_TEMPERATURE, **TEMPERATURE.field())
    top_p: float | None = Field(None, **TOP_P.field())
    top_k: int | None = Field(None, **TOP_K.field())
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


# Chat's field paths as this API names them (the chat request is validated again after translation).
RENAMES: Renames = [(r"^stop\b.*", "stop_sequences"),
                    (r"^tools(\[\d+\])\.function\.parameters", r"tools\1.input_schema"),
                    (r"^tools(\[\d+\])\.function", r"tools\1"), (r"^messages\b.*", "messages"),
                    (r"^tool_choice\b.*", "tool_choice"), (r"^thinking_token_budget$", "thinking.budget_tokens"),
                    # a path into the schema keeps its way down; the field itself is output_config.format
                    (r"^response_format\.json_schema\.schema(?=[.\[])", "output_config.format.schema"),
                    (r"^response_format\b.*", "output_config.format"), (r"^reasoning_effort$", "output_config.effort")]


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def _turns(i: int, m: Message) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's tool results become tool messages of their own."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    for j, b in enumerate(m.content):
        if b.type not in _ROLE_BLOCKS[m.role]:
            raise bad_request(f"messages[{i}].content[{j}]: a {b.type!r} block is not accepted in a {m.role} turn "
                              f"(it holds {', '.join(_ROLE_BLOCKS[m.role])} blocks)",
                              param=f"messages[{i}].content[{j}].type")
    if m.role == "user":
        out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content)}
               for b in m.content if isinstance(b, ToolResultBlock)]
        texts = [b.text for b in m.content if isinstance(b, TextBlock)]
        return out + ([{"role": "user", "content": "".join(texts)}] if texts else [])
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in m.content
                                                                    if isinstance(b, TextBlock))}
    reasoning = "".join(b.thinking for b in m.content if isinstance(b, ThinkingBlock))
    if reasoning:
        turn["reasoning_content"] = reasoning
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def to_chat(req: CountTokensRequest) -> ChatCompletionRequest:
    """The equivalent chat completions request, validated as one (its errors name this API's fields)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": _text(req.system)}] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _turns(i, m)
    body: dict[str, Any] = {"messages": messages,
                            "chat_template_kwargs": {"enable_thinking": bool(req.thinking and
                                                                             req.thinking.type != "disabled")}}
    if req.thinking is not None and req.thinking.type == "enabled" and req.thinking.budget_tokens is not None:
        budget = req.thinking.budget_tokens
        # Anthropic's rule: the budget is part of max_tokens and must leave some of it to the answer.
        if isinstance(req, MessagesRequest) and budget >= req.max_tokens:
            raise bad_request(f"max_tokens ({req.max_tokens}) must be greater than thinking.budget_tokens ({budget})",
                              param="thinking.budget_tokens")
        body["thinking_token_budget"] = budget
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
        choice = req.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    output = req.output_config
    if output is not None and output.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": output.format.schema_}}
    if output is not None and output.effort is not None:
        body["reasoning_effort"] = output.effort
    if isinstance(req, MessagesRequest):
        body.update({k: v for k, v in (("max_tokens", req.max_tokens), ("stream", req.stream),
                                       ("temperature", req.temperature), ("top_p", req.top_p),
                                       ("top_k", req.top_k), ("stop", req.stop_sequences)) if v is not None})
    return validated(ChatCompletionRequest, body, renames=RENAMES)


def _stop_reason(final: Final, reply_calls: int) -> tuple[str, str | None]:
    if final.finish_reason == "length":
        return "max_tokens", None
    if isinstance(final.stop_reason, str):
        return "stop_sequence", final.stop_reason
    return ("tool_use" if reply_calls else "end_turn"), None


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)}


def _usage(final: Final | None, prompt_tokens: int) -> dict[str, Any]:
    return {"input_tokens": final.prompt_tokens if final else prompt_tokens,
            "output_tokens": final.completion_tokens if final else 0,
            "cache_read_input_tokens": final.cached_tokens if final else 0, "cache_creation_input_tokens": 0}


def message_body(prep: Prepared, model: str, reply: ParsedReply, final: Final) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content += [_tool_block(c) for c in reply.tool_calls]
    stop, seq = _stop_reason(final, len(reply.tool_calls))
    return {"id": prep.response_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": seq, "usage": _usage(final, len(prep.prompt_ids))}


def full_message(prep: Prepared, model: str, stream: Choices, final: Final) -> dict[str, Any]:
    return message_body(prep, model, parse_reply(prep, stream.assembler.text), final)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def message_events(prep: Prepared, model: str, stream: Choices) -> AsyncIterator[str]:
    """The SSE body of a streamed message; an error after the 200 is Anthropic's `error` event."""
    return guarded(_events(prep, model, stream), stream,
                   lambda err: f"event: error\ndata: {json.dumps(err.anthropic_body())}\n\n", prep.response_id)


async def _events(prep: Prepared, model: str, stream: Choices) -> AsyncIterator[str]:
    start = {"id": prep.response_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": _usage(None, len(prep.prompt_ids))}
    yield _event("message_start", {"message": start})
    parser, index, calls = new_parser(prep), -1, 0
    kinds = {"reasoning": ("thinking", "thinking_delta", "thinking"), "text": ("text", "text_delta", "text")}

    def write(steps: list[Step]) -> list[str]:
        nonlocal index, calls
        out = []
        for s in steps:
            if isinstance(s, Open):
                index += 1
                block, _, field = kinds[s.kind]
                start_block = {"type": block, field: ""} | ({"signature": ""} if block == "thinking" else {})
                out.append(_event("content_block_start", {"index": index, "content_block": start_block}))
            elif isinstance(s, Text):
                _, delta, field = kinds[s.kind]
                out.append(_event("content_block_delta", {"index": index, "delta": {"type": delta, field: s.text}}))
            elif isinstance(s, Close):
                if s.kind == "reasoning":
                    out.append(_event("content_block_delta", {"index": index, "delta": {"type": "signature_delta",
                                                                                         "signature": ""}}))
                out.append(_event("content_block_stop", {"index": index}))
            else:
                index += 1
                calls += 1
                block = {"type": "tool_use", "id": s.id, "name": s.name, "input": {}}
                out += [_event("content_block_start", {"index": index, "content_block": block}),
                        _event("content_block_delta", {"index": index, "delta": {"type": "input_json_delta",
                                                                                  "partial_json": s.arguments}}),
                        _event("content_block_stop", {"index": index})]
        return out

    async for event in reply_steps(parser, stream.events()):
        if isinstance(event, Keepalive):
            yield _event("ping", {})
        elif isinstance(event, list):
            for piece in write(event):
                yield piece
        else:
            stop, seq = _stop_reason(event, calls)
            yield _event("message_delta", {"delta": {"stop_reason": stop, "stop_sequence": seq},
                                           "usage": {"output_tokens": event.completion_tokens}})
            yield _event("message_stop", {})




def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"

