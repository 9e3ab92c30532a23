"""Server-sent events: the stream body of a reply, and an ASGI response that stops it when the client leaves.

Our own response class instead of Starlette's StreamingResponse, because what happens on disconnect is the point:
a task watches `receive()` for `http.disconnect` and cancels the body at once, which closes the generation
(cancelling the gRPC call, so the scheduler frees the request's blocks) even while nothing is being written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.types import Receive, Scope, Send

from .choices import Choices
from .errors import GatewayError, internal
from .generation import Final, Keepalive
from .output import Delta
from .responses import ChunkWriter

log = logging.getLogger("twinspark.gateway")

KEEPALIVE_COMMENT = ": keepalive\n\n"
DONE = "data: [DONE]\n\n"


def sse_data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def guarded(events: AsyncIterator[str], stream: Choices, error_event: Callable[[GatewayError], str],
                  response_id: str) -> AsyncIterator[str]:
    """`events`, a stream body after its 200, with a failure ending it as `error_event` writes it (each API has its
    own error event): a GatewayError as it is, anything else — a bug of ours — logged and sent as a 500, rather
    than the stream cut silently."""
    try:
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for piece in events:
                yield piece
    except GatewayError as err:
        stream.error = err
        yield error_event(err)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.exception("%s: stream failed", response_id)
        stream.error = internal(f"internal error: {type(exc).__name__}")
        yield error_event(stream.error)


def sse_events(stream: Choices, writer: ChunkWriter) -> AsyncIterator[str]:
    """The whole SSE body of one streamed reply (OpenAI chat / completions chunks). Errors after the 200 become an
    error event, then [DONE]."""
    return guarded(_chunks(stream, writer), stream, lambda err: sse_data(err.body()) + DONE, writer.prep.response_id)


async def _chunks(stream: Choices, writer: ChunkWriter) -> AsyncIterator[str]:
    for chunk in writer.first():
        yield sse_data(chunk)
    async for index, event in stream.events():
        if isinstance(event, Keepalive):
            yield KEEPALIVE_COMMENT
        elif isinstance(event, Delta):
            for chunk in writer.delta(index, event):
                yield sse_data(chunk)
        elif isinstance(event, Final):
            for chunk in writer.finish(index, event):
                yield sse_data(chunk)
    if writer.prep.include_usage:
        yield sse_data(writer.usage(stream.finals))
    yield DONE


class SSEResponse:
    """A text/event-stream ASGI response; `on_close` runs exactly once however the stream ends."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], *, headers: dict[str, str] | None = None,
                 on_close: Callable[[bool], None] | None = None) -> None:
        self._body = body
        self._headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        self._on_close = on_close
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self._headers.items()]
        disconnected = False
        try:
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            writer = asyncio.create_task(self._write(send))
            watcher = asyncio.create_task(self._wait_disconnect(receive))
            try:
                await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (writer, watcher):
                    if not task.done():
                        task.cancel()
                await asyncio.gather(writer, watcher, return_exceptions=True)
            # Finished cleanly only if the writer ran to the end; cancelled (the watcher saw the client leave
            # first) or failed sending (OSError) both mean the client is gone.
            disconnected = writer.cancelled() or writer.exception() is not None
        except OSError:
            disconnected = True
        finally:
            if self._on_close is not None:
                self._on_close(disconnected)

    async def _write(self, send: Send) -> None:
        try:
            async for piece in self._body:
                await send({"type": "http.response.body", "body": piece.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]

    @staticmethod
    async def _wait_disconnect(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
