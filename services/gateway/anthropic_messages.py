"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.

A request becomes a chat request (system, user / assistant turns, `tool_use` -> assistant tool calls,
`tool_result` -> tool messages, `thinking` blocks -> the turn's reasoning; `tools[].input_schema` -> function tools;
`tool_choice` auto / any / tool / none -> auto / required / named / none; `thinking.type: enabled` turns the
template's thinking on — off otherwise, as Anthropic's default is; `stop_sequences` -> stop strings) and runs through
the same preparation, scheduler call and reply parser as chat. The reply comes back as content blocks (`thinking`,
`text`, `tool_use`), `stop_reason` end_turn / max_tokens / stop_sequence / tool_use, and, streamed, as Anthropic's
events: message_start, content_block_start / _delta / _stop, message_delta, message_stop (pings while waiting).
Errors have Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from kernels.sampling_rules import MAX_API_TEMPERATURE, TEMPERATURE, TOP_K, TOP_P

from .choices import Choices
from .errors import GatewayError
from .generation import Final, Keepalive
from .prepare import Prepared
from .reply_blocks import Close, Open, Step, Text, reply_steps
from .reply_parser import ParsedReply, ToolCall
from .responses import new_parser, parse_reply
from .schemas import ChatCompletionRequest

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(err: GatewayError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def error_response(err: GatewayError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Block(_Model):
    # Clients send the blocks of earlier replies back as they got them, with fields newer than ours (citations,
    # caller, ...): a content block's unknown fields are ignored, the request's own are still refused.
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: dict[str, Any] | None = None


class Message(_Model):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Model):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Model):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(_Model):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, le=MAX_API_TEMPERATURE, **TEMPERATURE.field())
    top_p: float | None = Field(None, **TOP_P.field())
    top_k: int | None = Field(None, **TOP_K.field())
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


def _text(content: str | list[Any] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.get("text", "") if isinstance(b, dict) else (b.text or "") for b in content)


def to_chat(req: CountTokensRequest, *, max_tokens: int = 1, stream: bool = False) -> dict[str, Any]:
    """The equivalent chat completions request (as JSON, validated by the chat schema afterwards)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _text(req.system)})
    for m in req.messages:
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        if m.role == "user":
            texts = []
            for b in m.content:
                if b.type == "tool_result":
                    messages.append({"role": "tool", "tool_call_id": b.tool_use_id or "", "content": _text(b.content)})
                elif b.type == "text":
                    texts.append(b.text or "")
            if texts:
                messages.append({"role": "user", "content": "".join(texts)})
            continue
        turn: dict[str, Any] = {"role": "assistant",
                                "content": "".join(b.text or "" for b in m.content if b.type == "text")}
        reasoning = "".join(b.thinking or "" for b in m.content if b.type == "thinking")
        if reasoning:
            turn["reasoning_content"] = reasoning
        calls = [{"id": b.id or "", "type": "function", "function": {"name": b.name or "",
                                                                      "arguments": json.dumps(b.input or {})}}
                 for b in m.content if b.type == "tool_use"]
        if calls:
            turn["tool_calls"] = calls
        messages.append(turn)
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "stream": stream,
                            "chat_template_kwargs": {"enable_thinking": bool(req.thinking and
                                                                             req.thinking.type != "disabled")}}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
        choice = req.tool_choice
        if choice is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                {"type": "function", "function": {"name": choice.name or ""}}
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        body.update({k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                       ("top_k", req.top_k), ("stop", req.stop_sequences)) if v is not None})
    return body


def parse_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(body, strict=False)


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


async def message_events(prep: Prepared, model: str, stream: Choices) -> AsyncIterator[str]:
    """The SSE body of a streamed message."""
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

    try:
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
    except GatewayError as err:
        stream.error = err
        yield f"event: error\ndata: {json.dumps(error_body(err))}\n\n"


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"

