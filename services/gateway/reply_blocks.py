"""A reply as a sequence of blocks (reasoning, text, tool call): what the Responses API calls output items and
Anthropic calls content blocks. Both APIs open a block, stream deltas into it and close it; this turns the reply
parser's events into those steps, so each API only says how a step is written."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from .generation import Final, Keepalive
from .output import Delta
from .reply_parser import ContentDelta, ReasoningDelta, ReplyEvent, ReplyParser, ToolCall


@dataclass
class Open:
    kind: str  # "reasoning" | "text"


@dataclass
class Text:
    kind: str
    text: str


@dataclass
class Close:
    kind: str


Step = Open | Text | Close | ToolCall  # a tool call is a whole block


class BlockTracker:
    def __init__(self) -> None:
        self.current: str | None = None

    def feed(self, events: list[ReplyEvent]) -> list[Step]:
        out: list[Step] = []
        for e in events:
            kind = "reasoning" if isinstance(e, ReasoningDelta) else "text" if isinstance(e, ContentDelta) else None
            if kind != self.current and self.current is not None:
                out.append(Close(self.current))
                self.current = None
            if kind is None:
                out.append(e)  # type: ignore[arg-type]
                continue
            if self.current is None:
                out.append(Open(kind))
                self.current = kind
            out.append(Text(kind, e.text))  # type: ignore[union-attr]
        return out

    def close(self) -> list[Step]:
        if self.current is None:
            return []
        kind, self.current = self.current, None
        return [Close(kind)]


async def reply_steps(parser: ReplyParser, events: AsyncIterator[tuple[int, Keepalive | Delta | Final]]
                      ) -> AsyncIterator[Keepalive | list[Step] | Final]:
    """A one-choice generation as keepalives, block steps, and at the end the last steps then the Final."""
    blocks = BlockTracker()
    async for _, event in events:
        if isinstance(event, Keepalive):
            yield event
        elif isinstance(event, Delta):
            yield blocks.feed(parser.feed(event.text))
        elif isinstance(event, Final):
            yield blocks.feed(parser.finish()) + blocks.close()
            yield event
