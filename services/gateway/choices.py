"""The n generations of one request (n > 1, best_of) as one event stream.

Choice i is its own scheduler request (seed_offset i, see prepare.py). The first starts at once; the others start
when the first has its first token, i.e. once its prompt is in the cache: they then resume from the prefix cache's
snapshot of the prompt instead of each prefilling it again (choices share the prompt's cached blocks). With one
choice this is a thin wrapper around its `GenerationStream`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from .errors import GatewayError, internal
from .generation import KEEPALIVE, Final, GenerationStream, Keepalive
from .metrics import GatewayMetrics
from .output import Delta, OutputAssembler
from .prepare import ModelContext, Prepared
from .scheduler_client import SchedulerClient

ChoiceEvent = tuple[int, Keepalive | Delta | Final]
_DONE = object()


class Choices:
    def __init__(self, client: SchedulerClient, ctx: ModelContext, prep: Prepared, metrics: GatewayMetrics, *,
                 keepalive_s: float, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.prep = prep
        self._keepalive_s = keepalive_s
        self.streams = [
            GenerationStream(client, prep, OutputAssembler(
                ctx.tokenizer, stops=prep.stops, include_stop_str=prep.include_stop_str,
                keep_stop_token=prep.keep_stop_token,
                skip_special_tokens=prep.skip_special_tokens, final_ids=prep.final_ids, min_tokens=prep.min_tokens),
                metrics,
                keepalive_s=keepalive_s, metadata=metadata, index=i)
            for i in range(len(prep.requests))]
        self._tasks: list[asyncio.Task[None]] = []

    # The first choice stands for the request in logs and in the status before a stream's 200.
    @property
    def first(self) -> GenerationStream:
        return self.streams[0]

    @property
    def final(self) -> Final | None:
        return self.first.final

    @property
    def assembler(self) -> OutputAssembler:
        return self.first.assembler

    @property
    def error(self) -> GatewayError | None:
        return next((s.error for s in self.streams if s.error is not None), None)

    @error.setter
    def error(self, err: GatewayError) -> None:
        self.first.error = err

    @property
    def finals(self) -> list[Final]:
        return [s.final for s in self.streams if s.final is not None]

    async def start(self, wait_s: float) -> None:
        await self.first.start(wait_s)

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        if len(self.streams) == 1:
            async for event in self.first.events():
                yield 0, event
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()
        first_token = asyncio.Event()

        async def pump(i: int, stream: GenerationStream) -> None:
            try:
                if i > 0:
                    await first_token.wait()
                    await stream.start(0.0)
                async for event in stream.events():
                    if i == 0 and not isinstance(event, Keepalive):
                        first_token.set()
                    queue.put_nowait((i, event))
            except Exception as exc:  # noqa: BLE001 — handed to the consumer, which raises it
                queue.put_nowait(exc)
            finally:
                first_token.set()  # the first choice failed or ended: the others go on alone
                queue.put_nowait(_DONE)

        self._tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        running, last_keepalive = len(self._tasks), time.monotonic()
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, GatewayError):
                raise item
            elif isinstance(item, BaseException):
                raise internal(f"choice stream failed: {item!r}")
            elif isinstance(item[1], Keepalive):  # one keepalive per interval, whichever choice is waiting
                if time.monotonic() - last_keepalive >= self._keepalive_s:
                    last_keepalive = time.monotonic()
                    yield item[0], KEEPALIVE
            else:
                last_keepalive = time.monotonic()
                yield item

    def close(self) -> str:
        for task in self._tasks:
            if not task.done():
                task.cancel()
        outcomes = [s.close() for s in self.streams]
        return "error" if "error" in outcomes else outcomes[0]

    def best(self) -> list[Final]:
        """The choices returned: all of them, or for best_of > n the n with the highest summed logprob."""
        finals = sorted(self.finals, key=lambda f: f.index)
        if len(finals) > self.prep.n:
            finals = sorted(finals, key=lambda f: (-f.cumulative_logprob, f.index))[: self.prep.n]
        return finals
