"""One Generate call to the scheduler, as a sequence of client-facing events.

`GenerationStream` owns the gRPC call. A reader task pumps scheduler events into a queue, so the consumer can wait
for the next one with a timeout (for SSE keepalives) without cancelling the read. `start()` waits for the first
event so that admission errors (429, 400, 503) can still become HTTP statuses before a stream's 200; `events()`
then yields `Keepalive`, `Delta` and finally `Final`, or raises `GatewayError`. Prompt logprobs (which come before
any token) are not events of their own: the first choice's stream collects them into `Prepared.prompt_scores`, whole
before its first `Delta` or `Final`. `close()` cancels the call (the scheduler frees the request's blocks on
cancellation) and records the request's metrics exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.tensors import from_proto
from services.common.tensors import ids as tensor_ids
from twinspark.v1 import generate_pb2

from .errors import GatewayError, bad_request, internal, unavailable
from .metrics import GatewayMetrics, RequestRecord
from .output import Delta, OutputAssembler, TokenLogprob, token_sha
from .prepare import Prepared
from .prompt_scores import collect, complete
from .scheduler_client import SchedulerClient, map_rpc_error

log = logging.getLogger("twinspark.gateway")

_END = object()  # the scheduler closed the stream cleanly
_FINISH = {generate_pb2.FINISH_STOP: "stop", generate_pb2.FINISH_LENGTH: "length",
           generate_pb2.FINISH_ABORTED: "abort"}
# After a stop string we Abort and wait this long for the scheduler's Finished (it carries cached_tokens and the
# timings for metrics); past it we cancel the call and answer without them.
_DRAIN_S = 1.0


class Keepalive:
    """Nothing was written for a keepalive interval (the request is queued, prefilling, or between tokens)."""


KEEPALIVE = Keepalive()


@dataclass
class Final:
    finish_reason: str                 # "stop" | "length" | "abort"
    stop_reason: str | int | None      # vLLM: the stop string, or the id that stopped generation
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    token_ids: list[int]
    token_sha: str
    drafted_tokens: int = 0   # draft tokens the ranks verified for this request
    accepted_tokens: int = 0  # of which accepted
    index: int = 0            # the choice
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when asked for

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs or [])


Event = Keepalive | Delta | Final


def _logprobs(chunk: generate_pb2.TokenChunk, ids: list[int]) -> list[TokenLogprob]:
    """A TokenChunk's logprobs, one per id."""
    chosen = from_proto(chunk.logprobs).tolist()
    top_ids, top_lp = from_proto(chunk.top_ids).tolist(), from_proto(chunk.top_logprobs).tolist()
    if not len(chosen) == len(top_ids) == len(top_lp) == len(ids):
        raise ValueError(f"{len(chosen)} logprobs for {len(ids)} tokens")
    return [TokenLogprob(t, c, list(zip(i, lp))) for t, c, i, lp in zip(ids, chosen, top_ids, top_lp)]


class GenerationStream:
    def __init__(self, client: SchedulerClient, prep: Prepared, assembler: OutputAssembler, metrics: GatewayMetrics,
                 *, keepalive_s: float, metadata: tuple[tuple[str, str], ...] = (), index: int = 0) -> None:
        self._client = client
        self.prep = prep
        self.index = index
        self.request = prep.requests[index]
        self.assembler = assembler
        self._metrics = metrics
        self._keepalive_s = keepalive_s
        self._metadata = metadata
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._get: asyncio.Future[Any] | None = None
        self._pushback: Any = None
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self.arrival = time.monotonic()
        self._last_token_at: float | None = None
        self.finished: generate_pb2.Finished | None = None
        self.final: Final | None = None
        self.error: GatewayError | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------------------ call
    async def start(self, wait_s: float) -> None:
        """Start the call; wait up to `wait_s` for its first token (or end) and raise now if it is an error.

        The scheduler answers admission at once (a status, or a first Progress event), so for a stream this
        turns 429 / 400 / 503 into HTTP statuses before the 200. A scheduler still busy after `wait_s` gets the
        200 and keepalives; an error after that is sent as an SSE error event."""
        self._call = self._client.generate(self.request, self._metadata)
        self._reader = asyncio.create_task(self._pump(self._call))
        deadline = time.monotonic() + wait_s
        while True:
            item = await self._next(max(0.0, deadline - time.monotonic()))
            if item is None:
                return
            # Progress carries nothing for the client: wait on past it, so a failure during queueing or prefill
            # that comes within the wait is still an HTTP status.
            if isinstance(item, BaseException) or item is _END or item.WhichOneof("event") != "progress":
                break
        self._pushback = item
        if isinstance(item, BaseException) or item is _END:
            raise self._fail(self._error_of(item))
        if item.WhichOneof("event") == "finished" and item.finished.reason == generate_pb2.FINISH_ERROR:
            raise self._fail(self._finish_error(item.finished.error))

    async def _pump(self, call: grpc.aio.UnaryStreamCall) -> None:
        try:
            async for event in call:
                self._queue.put_nowait(event)
            self._queue.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # AioRpcError, or anything else the channel throws
            self._queue.put_nowait(exc)

    async def _next(self, timeout: float | None) -> Any:
        """The next queued item, or None after `timeout` seconds (the pending get survives for the next call)."""
        if self._get is None:
            self._get = asyncio.ensure_future(self._queue.get())
        if not self._get.done():
            done, _ = await asyncio.wait({self._get}, timeout=timeout)
            if not done:
                return None
        item = self._get.result()
        self._get = None
        return item

    def _error_of(self, item: Any) -> GatewayError:
        if isinstance(item, grpc.aio.AioRpcError):
            return map_rpc_error(item, self.prep.prompt_param)
        if item is _END:
            return unavailable("the scheduler ended the stream without a Finished event")
        log.error("%s: scheduler stream failed: %r", self.request.request_id, item)
        return internal(f"scheduler stream failed: {item!r}")

    def _finish_error(self, text: str) -> GatewayError:
        """A FINISH_ERROR as the client's error: the request's own grammar failing is a 400 (generate.proto), never
        a 503 — that would tell clients and routers the server is down."""
        code, _, message = text.partition(": ")
        if code == "invalid_grammar":
            return bad_request(message, param=self.prep.grammar_param, code=code)
        return unavailable(f"generation failed: {text or 'unknown error'}")

    def _fail(self, err: GatewayError) -> GatewayError:
        self.error = err
        return err

    # ---------------------------------------------------------------------------------------------- events
    async def events(self) -> AsyncIterator[Event]:
        last_write = time.monotonic()
        while True:
            if self._pushback is not None:
                item, self._pushback = self._pushback, None
            else:
                item = await self._next(max(0.0, last_write + self._keepalive_s - time.monotonic()))
                if item is None:
                    last_write = time.monotonic()
                    yield KEEPALIVE
                    continue
            if isinstance(item, BaseException) or item is _END:
                raise self._fail(self._error_of(item))
            kind = item.WhichOneof("event")
            if kind == "tokens":
                try:
                    new_ids = tensor_ids(item.tokens.ids)
                    logprobs = _logprobs(item.tokens, new_ids) if self.request.logprobs else None
                except ValueError as exc:
                    raise self._fail(internal(f"bad token chunk from the scheduler: {exc}")) from None
                self._time_tokens(len(new_ids))
                delta = self.assembler.add(new_ids, logprobs)
                if delta:
                    last_write = time.monotonic()
                    yield delta
                if self.assembler.stopped_by_string:
                    await self._abort_and_drain()
                    yield self._make_final("stop")
                    return
            elif kind == "prompt_logprobs":
                if self.index == 0:  # later choices score the prompt only when nothing is generated: the same scores
                    try:
                        collect(self.prep.prompt_scores, item.prompt_logprobs, self.prep.prompt_ids)
                    except ValueError as exc:
                        raise self._fail(internal(f"bad prompt logprobs from the scheduler: {exc}")) from None
            elif kind == "finished":
                f = item.finished
                self.finished = f
                if f.reason == generate_pb2.FINISH_ERROR:
                    raise self._fail(self._finish_error(f.error))
                if self.index == 0 and self.prep.scores_prompt and f.reason != generate_pb2.FINISH_ABORTED \
                        and not complete(self.prep.prompt_scores, self.prep.prompt_ids):
                    raise self._fail(internal(f"the scheduler sent {len(self.prep.prompt_scores)} prompt logprobs "
                                              f"for a {len(self.prep.prompt_ids)}-token prompt"))
                stop_id = f.stop_token_id if f.reason == generate_pb2.FINISH_STOP and f.stop_token_id >= 0 else None
                delta = self.assembler.finish(stop_id)
                if delta:
                    yield delta
                yield self._make_final(_FINISH.get(f.reason, "stop"))
                return
            # progress: the request is queued or prefilling; the keepalive clock keeps running

    def _time_tokens(self, count: int) -> None:
        now = time.monotonic()
        if count <= 0:
            return
        if self._last_token_at is None:
            self._metrics.first_token(now - self.arrival)
            if count > 1:
                self._metrics.inter_token(0.0, count - 1)
        else:
            self._metrics.inter_token(now - self._last_token_at, count)
        self._last_token_at = now

    async def _abort_and_drain(self) -> None:
        """A stop string ended the reply: stop the scheduler's work now, and take its Finished if it comes soon."""
        try:
            await self._client.abort(self.request.request_id, timeout_s=_DRAIN_S)
        except grpc.aio.AioRpcError as exc:
            log.debug("%s: Abort failed (%s); cancelling", self.request.request_id, exc.code().name)
            self._cancel_call()
            return
        deadline = time.monotonic() + _DRAIN_S
        while (left := deadline - time.monotonic()) > 0:
            item = await self._next(left)
            if item is None or isinstance(item, BaseException) or item is _END:
                break
            if item.WhichOneof("event") == "finished":
                self.finished = item.finished
                break
        self._cancel_call()

    def _make_final(self, finish_reason: str) -> Final:
        a, f = self.assembler, self.finished
        prompt_tokens = f.prompt_tokens if f is not None and f.prompt_tokens > 0 else len(self.prep.prompt_ids)
        self.final = Final(finish_reason=finish_reason, stop_reason=a.stop_reason, prompt_tokens=prompt_tokens,
                           completion_tokens=a.generated, cached_tokens=f.cached_tokens if f is not None else 0,
                           token_ids=list(a.token_ids), token_sha=token_sha(a.token_ids),
                           drafted_tokens=f.drafted_tokens if f is not None else 0,
                           accepted_tokens=f.accepted_tokens if f is not None else 0, index=self.index,
                           logprobs=list(a.logprobs) if self.request.logprobs else None)
        return self.final

    # ---------------------------------------------------------------------------------------------- closing
    def _cancel_call(self) -> None:
        if self._call is not None and not self._call.done():
            self._call.cancel()

    def close(self) -> str:
        """Release the call (cancelling it if still running) and record metrics; returns the outcome.

        Synchronous on purpose: it runs in `finally` blocks of tasks that may be being cancelled."""
        if self._closed:
            return self._outcome()
        self._closed = True
        self._cancel_call()
        if self._get is not None and not self._get.done():
            self._get.cancel()
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        outcome = self._outcome()
        if self.final is not None:
            prompt_tokens, completion_tokens = self.final.prompt_tokens, self.final.completion_tokens
        else:  # failed or abandoned: its prompt counts as processed only if it got as far as output
            completion_tokens = self.assembler.generated
            prompt_tokens = len(self.prep.prompt_ids) if completion_tokens or self.finished else 0
        self._metrics.request_done(RequestRecord(
            finish_reason=outcome, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
            e2e_s=time.monotonic() - self.arrival, finished=self.finished))
        return outcome

    def _outcome(self) -> str:
        if self.final is not None:
            return self.final.finish_reason
        if self.error is not None:
            return "error"
        return "abort"  # neither finished nor failed: the client went away
