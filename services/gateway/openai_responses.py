"""OpenAI's Responses API: `POST /v1/responses`, and `GET /v1/responses/{id}` for stored responses.

A request becomes a chat request: `instructions` -> a system turn; `input` text -> a user turn, or items (messages,
`function_call` -> assistant tool calls, `function_call_output` -> tool results, `reasoning` -> the next assistant
turn's reasoning); function `tools` (flat: name, parameters) and `tool_choice`; `text.format` json_schema /
json_object -> response_format; `reasoning.effort` -> reasoning_effort; `max_output_tokens`. The reply comes back as
output items (`reasoning`, `message` with `output_text`, `function_call`) and, streamed, as the typed events
(response.created, .output_item.added, .output_text.delta, .function_call_arguments.delta, ..., response.completed).

`store` (default true) keeps the conversation (input + output as chat turns) in a bounded in-memory store in this
gateway, least recently stored dropped first; `previous_response_id` continues it. A gateway restart (or another
gateway replica) forgets it: the id then gets a 404.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kernels.sampling_rules import MAX_API_TEMPERATURE, SEED, TEMPERATURE, TOP_P

from .choices import Choices
from .errors import GatewayError, bad_request
from .generation import Final, Keepalive
from .prepare import Prepared
from .reply_blocks import Close, Open, Step, Text, reply_steps
from .reply_parser import ParsedReply, ToolCall
from .responses import new_parser, parse_reply, reasoning_tokens
from .schemas import ChatCompletionRequest, Renames, validated
from .streaming import guarded


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionTool(_Model):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(min_length=1)]  # items: validated one by one below
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, le=MAX_API_TEMPERATURE, **TEMPERATURE.field())
    top_p: float | None = Field(None, **TOP_P.field())
    seed: int | None = Field(None, **SEED.field())  # twinspark / vLLM extension: keyed sampling
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None


class ResponseStore:
    """Stored conversations by response id (bounded; the oldest is dropped first)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self._items[response_id] = (messages, body)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        try:
            return self._items[response_id]
        except KeyError:
            raise GatewayError(404, f"Response with id '{response_id}' not found.", param="previous_response_id",
                               code="not_found") from None


class _Item(BaseModel):
    # Clients send earlier output items back as they got them (ids, statuses, annotations, logprobs, ...): an
    # item's unknown fields are ignored, the request's own are still refused.
    model_config = ConfigDict(extra="ignore")


class ContentPart(_Item):
    type: Literal["input_text", "output_text", "text", "refusal", "input_image"]
    text: str | None = None
    refusal: str | None = None
    image_url: str | None = None  # input_image: a data: (or, when the server allows them, http(s)) URL
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _fields_of_type(self) -> "ContentPart":
        if self.type == "input_image" and self.image_url is None:
            raise ValueError("an 'input_image' part has `image_url` (file ids are not served)")
        if self.type not in ("input_image", "refusal") and self.text is None:
            raise ValueError(f"a {self.type!r} part has `text`")
        return self


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningText(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


_ITEMS: dict[str, type[_Item]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                  "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItem}
# Chat's field paths as this API names them (the chat request is validated again after translation).
RENAMES: Renames = [(r"^messages\b.*", "input"), (r"^tools(\[\d+\])\.function", r"tools\1"),
                    # a path into the schema keeps its way down; the field itself is text.format
                    (r"^response_format\.json_schema\.schema(?=[.\[])", "text.format.schema"),
                    (r"^response_format\b.*", "text.format"), (r"^max_tokens$", "max_output_tokens"),
                    (r"^reasoning_effort$", "reasoning.effort"), (r"^tool_choice\b.*", "tool_choice")]


def _text(content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text or p.refusal or "" for p in content if p.type != "input_image")


def _user_content(content: str | list[ContentPart]) -> str | list[dict[str, Any]]:
    """A user turn's content: its text, or chat's text and image_url parts when it holds images."""
    if isinstance(content, str) or all(p.type != "input_image" for p in content):
        return _text(content)
    return [{"type": "image_url", "image_url": {"url": p.image_url, **({"detail": p.detail} if p.detail else {})}}
            if p.type == "input_image" else {"type": "text", "text": p.text or p.refusal or ""} for p in content]


def _item(i: int, raw: dict[str, Any]) -> _Item:
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise GatewayError(400, f"input[{i}]: item type {kind!r} is not supported", param=f"input[{i}].type")
    return validated(model, raw, at=f"input[{i}]")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own turns as chat messages (instructions excluded: they do not carry over)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    reasoning = ""
    for i, raw in enumerate(req.input):
        item = _item(i, raw)
        if isinstance(item, MessageItem):
            if item.role != "user" and not isinstance(item.content, str) and \
                    any(p.type == "input_image" for p in item.content):
                raise bad_request(f"input[{i}]: images are accepted in user messages only",
                                  param=f"input[{i}].content")
            msg = {"role": item.role, "content": _user_content(item.content) if item.role == "user"
                   else _text(item.content)}
            if item.role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant" and (not out[-1]["content"] or out[-1].get("tool_calls")):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call],
                            **({"reasoning_content": reasoning} if reasoning else {})})
                reasoning = ""
        elif isinstance(item, FunctionCallOutputItem):
            if not isinstance(item.output, str) and any(p.type == "input_image" for p in item.output):
                raise bad_request(f"input[{i}]: images in a function call's output are not served",
                                  param=f"input[{i}].output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        else:
            assert isinstance(item, ReasoningItem)
            reasoning += "".join(p.text for p in (item.content or []) + item.summary)
    return out


def to_chat(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The equivalent chat completions request, validated as one (its errors name this API's fields)."""
    if not history:
        raise bad_request("input: there is no message to answer (only reasoning items)", param="input")
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.parameters}} for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                          "schema": fmt.schema_ or {},
                                                                          "strict": fmt.strict}}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    if req.reasoning and req.reasoning.effort:
        body["reasoning_effort"] = req.reasoning.effort
    body.update({k: v for k, v in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                                   ("top_p", req.top_p), ("seed", req.seed), ("parallel_tool_calls",
                                                                                req.parallel_tool_calls)) if v is not None})
    return validated(ChatCompletionRequest, body, renames=RENAMES)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _call_item(call: ToolCall, item_id: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _message_item(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str, item_id: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def response_body(req: ResponsesRequest, prep: Prepared, model: str, output: list[dict[str, Any]],
                  final: Final | None, created: int) -> dict[str, Any]:
    status = "in_progress" if final is None else "incomplete" if final.finish_reason == "length" else "completed"
    usage = None
    if final is not None:
        usage = {"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens,
                 "total_tokens": final.prompt_tokens + final.completion_tokens,
                 "input_tokens_details": {"cached_tokens": final.cached_tokens},
                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens(prep, final)}}
    return {"id": prep.response_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedFunction)
            else (req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                     if req.text and req.text.format else {"type": "text"}}}


def output_items(reply: ParsedReply) -> list[dict[str, Any]]:
    items = []
    if reply.reasoning:
        items.append(_reasoning_item(reply.reasoning, _item_id("rs")))
    if reply.content:
        items.append(_message_item(reply.content, _item_id("msg")))
    items += [_call_item(c, _item_id("fc")) for c in reply.tool_calls]
    return items


def reply_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reply's output items as the chat turn a later request continues from."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            turn["content"] = item["content"][0]["text"]
        else:
            turn.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    return [turn]


def full_response(req: ResponsesRequest, prep: Prepared, model: str, stream: Choices, final: Final
                  ) -> dict[str, Any]:
    return response_body(req, prep, model, output_items(parse_reply(prep, stream.assembler.text)), final,
                         int(time.time()))


async def response_events(req: ResponsesRequest, prep: Prepared, model: str, stream: Choices,
                          on_done) -> AsyncIterator[str]:
    """The SSE body of a streamed response; `on_done(body)` gets the completed response (to store it)."""
    created = int(time.time())
    seq = 0

    def ev(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

    yield ev("response.created", response=response_body(req, prep, model, [], None, created))
    yield ev("response.in_progress", response=response_body(req, prep, model, [], None, created))
    parser = new_parser(prep)
    output: list[dict[str, Any]] = []
    texts: dict[int, str] = {}

    def write(steps: list[Step]) -> list[str]:
        out = []
        for s in steps:
            idx = len(output) - 1
            if isinstance(s, Open):
                item = _reasoning_item("", _item_id("rs")) if s.kind == "reasoning" else \
                    _message_item("", _item_id("msg"))
                output.append(item)
                idx, texts[len(output) - 1] = len(output) - 1, ""
                added = dict(item, status="in_progress", content=[])
                out.append(ev("response.output_item.added", output_index=idx, item=added))
                if s.kind == "text":
                    out.append(ev("response.content_part.added", item_id=item["id"], output_index=idx,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            elif isinstance(s, Text):
                texts[idx] += s.text
                kind = "response.reasoning_text.delta" if s.kind == "reasoning" else "response.output_text.delta"
                out.append(ev(kind, item_id=output[idx]["id"], output_index=idx, content_index=0, delta=s.text,
                              logprobs=[]))
            elif isinstance(s, Close):
                item = output[idx]
                item["content"][0]["text"] = texts[idx]
                if s.kind == "reasoning":
                    out.append(ev("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                                  content_index=0, text=texts[idx]))
                else:
                    out += [ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                               text=texts[idx], logprobs=[]),
                            ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0,
                               part=item["content"][0])]
                out.append(ev("response.output_item.done", output_index=idx, item=item))
            else:
                item = _call_item(s, _item_id("fc"))
                output.append(item)
                idx = len(output) - 1
                out += [ev("response.output_item.added", output_index=idx,
                           item=dict(item, arguments="", status="in_progress")),
                        ev("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                           delta=item["arguments"]),
                        ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                           name=item["name"], arguments=item["arguments"]),
                        ev("response.output_item.done", output_index=idx, item=item)]
        return out

    async def steps() -> AsyncIterator[str]:
        async for event in reply_steps(parser, stream.events()):
            if isinstance(event, Keepalive):
                yield ": keepalive\n\n"
            elif isinstance(event, list):
                for piece in write(event):
                    yield piece
            else:
                body = response_body(req, prep, model, output, event, created)
                on_done(body)
                yield ev("response.completed" if body["status"] == "completed" else "response.incomplete",
                         response=body)

    def error(err: GatewayError) -> str:
        return ev("error", code=err.code, message=err.message, param=err.param)

    async for piece in guarded(steps(), stream, error, prep.response_id):
        yield piece
