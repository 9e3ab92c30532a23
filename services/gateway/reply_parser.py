"""A reply's text -> reasoning, content and tool calls, streamed or whole (the same code both ways, so a streamed
reply always adds up to the non-streamed one).

- Reasoning: when the prompt opened a think block (it ends with `<think>`), or the reply itself starts with
  `<think>`, everything up to `</think>` is reasoning (`reasoning_content`, and vLLM's newer `reasoning`). When tool
  calls are parsed, a call's opening ends the reasoning too (the scheduler's thinking budget counts it as the end
  of thinking, and a forced tool call may open straight from the reasoning).
- Tool calls (only when the request has tools and tool_choice is not "none"): GLM's
  `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` blocks become tool calls whose
  arguments are a JSON object, each value typed by the tool's JSON schema, read through its `$ref`s as the grammar
  reads it (a string parameter keeps the raw text; other values are read as JSON, and kept as text when they are
  not). Text outside the blocks is content.
  A call is emitted once its `</tool_call>` arrives, name and arguments together (vLLM streams GLM calls whole
  too); an unfinished block at the end of the reply is given back as content.
Tags may arrive split across deltas: a tail that could still begin a tag is held back until it cannot.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .constraints import THINK_CLOSE, THINK_OPEN, raw_text
from .json_schema import resolve

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str  # a JSON object


ReplyEvent = ReasoningDelta | ContentDelta | ToolCall


@dataclass
class ParsedReply:
    """A whole reply, accumulated from the events."""

    reasoning: str | None = None
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, events: list[ReplyEvent]) -> None:
        for e in events:
            if isinstance(e, ReasoningDelta):
                self.reasoning = (self.reasoning or "") + e.text
            elif isinstance(e, ContentDelta):
                self.content += e.text
            else:
                self.tool_calls.append(e)


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def typed_arguments(pairs: list[tuple[str, str]], schema: dict[str, Any] | None) -> dict[str, Any]:
    """Argument values as the tool's JSON schema types them."""
    props = (schema or {}).get("properties") or {}
    out: dict[str, Any] = {}
    for key, raw in pairs:
        prop = resolve(props.get(key), schema) if isinstance(props, dict) else None
        kind = prop.get("type") if prop is not None else None
        if raw_text(prop) or (isinstance(kind, list) and "string" in kind and not _is_json(raw)):
            out[key] = raw
            continue
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ReplyParser:
    def __init__(self, *, reasoning: bool, tools: dict[str, dict[str, Any] | None] | None,
                 id_prefix: str = "call") -> None:
        """`reasoning`: the prompt opened a think block. `tools`: name -> parameters schema of the request's tools
        when calls are to be parsed, else None. Call ids are `{id_prefix}_{random}`."""
        self._state = "reasoning" if reasoning else "start"
        self._tools = tools
        self._buf = ""
        self._calls = 0
        self._id_prefix = id_prefix
        # The newline after </think> belongs to the format (the template writes "</think>\n" before a turn's
        # content, also when the prompt closed the think block itself), not to the content.
        self._after_think = True

    def feed(self, text: str) -> list[ReplyEvent]:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[ReplyEvent]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ReplyEvent]:
        out: list[ReplyEvent] = []
        step = {"start": self._start, "reasoning": self._reasoning, "content": self._content, "call": self._call}
        while True:
            before = (self._state, self._buf)
            step[self._state](out, final)
            if (self._state, self._buf) == before:
                return [e for e in out if not isinstance(e, (ReasoningDelta, ContentDelta)) or e.text]

    def _start(self, out: list[ReplyEvent], final: bool) -> None:
        """Before any output: a reply that opens with <think> starts with reasoning."""
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_OPEN):
            self._buf = stripped[len(THINK_OPEN):]
            self._state = "reasoning"
        elif final or not THINK_OPEN.startswith(stripped):
            self._state = "content"

    def _reasoning(self, out: list[ReplyEvent], final: bool) -> None:
        ends = (THINK_CLOSE, TOOL_OPEN) if self._tools is not None else (THINK_CLOSE,)
        found = [(at, tag) for tag in ends if (at := self._buf.find(tag)) >= 0]
        if found:
            at, tag = min(found)
            out.append(ReasoningDelta(self._buf[:at]))
            # </think> is the format's and goes; a call's opening stays, for the call to parse.
            self._buf = self._buf[at + len(THINK_CLOSE):] if tag == THINK_CLOSE else self._buf[at:]
            self._state = "content"
            self._after_think = tag == THINK_CLOSE
            return
        keep = 0 if final else max(_partial_tail(self._buf, tag) for tag in ends)
        out.append(ReasoningDelta(self._buf[: len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep:]

    def _content(self, out: list[ReplyEvent], final: bool) -> None:
        if self._after_think:
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return
            self._after_think = False
        if self._tools is None:
            out.append(ContentDelta(self._buf))
            self._buf = ""
            return
        at = self._buf.find(TOOL_OPEN)
        if at >= 0:
            out.append(ContentDelta(self._buf[:at]))
            self._buf = self._buf[at:]
            self._state = "call"
            return
        keep = 0 if final else _partial_tail(self._buf, TOOL_OPEN)
        out.append(ContentDelta(self._buf[: len(self._buf) - keep]))
        self._buf = self._buf[len(self._buf) - keep:]

    def _call(self, out: list[ReplyEvent], final: bool) -> None:
        end = self._buf.find(TOOL_CLOSE)
        if end < 0:
            if final:  # cut off mid-call: give the text back as content
                out.append(ContentDelta(self._buf))
                self._buf = ""
                self._state = "content"
            return
        body = self._buf[len(TOOL_OPEN):end]
        self._buf = self._buf[end + len(TOOL_CLOSE):]
        self._state = "content"
        cut = body.find("<arg_key>")
        name = (body if cut < 0 else body[:cut]).strip()
        pairs = [(k.strip(), v) for k, v in _ARG.findall(body[cut:] if cut >= 0 else "")]
        assert self._tools is not None
        args = typed_arguments(pairs, self._tools.get(name))
        out.append(ToolCall(index=self._calls, id=f"{self._id_prefix}_{uuid.uuid4().hex[:24]}", name=name,
                            arguments=json.dumps(args, ensure_ascii=False)))
        self._calls += 1
