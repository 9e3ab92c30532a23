"""A STAND-IN scheduler for gateway service tests — not the real scheduler.

A small real grpc.aio `Generator` server that plays scripted event sequences, so the gateway can be driven through
every path the contract allows (queued/prefill progress, token chunks, stops, admission errors, failures after
output, silence) and checked for what it sends back (requests, Abort calls, cancellations). The real-stack
end-to-end tests use the real scheduler; nothing here decides anything a real scheduler would.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
import torch

from services.common.tensors import ids as tensor_ids
from services.common.tensors import to_proto
from twinspark.v1 import generate_pb2, generate_pb2_grpc

EOS = 1000  # the tiny checkpoint's <|endoftext|>


# ------------------------------------------------------------------------------------------------ script steps

@dataclass
class Progress:
    phase: int = generate_pb2.PHASE_QUEUED
    prefilled: int = 0


@dataclass
class Tokens:
    ids: list[int]


@dataclass
class Scores:
    """The prompt's logprobs (GenerateRequest.prompt_logprobs), `chunk` tokens per event (made up: see `_scores`)."""
    chunk: int = 64


@dataclass
class Sleep:
    seconds: float  # ends early (with Finished ABORTED) when the request is aborted


@dataclass
class Finish:
    reason: int = generate_pb2.FINISH_STOP
    stop_token_id: int = -1
    cached_tokens: int = 0
    error: str = ""
    completion_tokens: int | None = None  # default: the ids sent so far


@dataclass
class Fail:
    code: grpc.StatusCode
    details: str = ""
    retry_after: str | None = None


Step = Progress | Tokens | Scores | Sleep | Finish | Fail


@dataclass
class Record:
    request: generate_pb2.GenerateRequest
    metadata: dict[str, str] = field(default_factory=dict)
    cancelled: bool = False
    completed: bool = False


def _chunk(ids: list[int], request: generate_pb2.GenerateRequest) -> generate_pb2.TokenChunk:
    """A TokenChunk of `ids`; with logprobs asked for, it carries them as the contract says (made-up values: each
    chosen id gets -0.5, and the top list is that id then the lowest other ids, each 1.0 lower than the last)."""
    chunk = generate_pb2.TokenChunk(ids=to_proto(ids))
    if request.logprobs:
        k = request.top_logprobs
        top = [([t] + [i for i in range(k + 1) if i != t])[:k] for t in ids]
        chunk.logprobs.CopyFrom(to_proto([-0.5] * len(ids), "float32"))
        chunk.top_ids.CopyFrom(to_proto(torch.tensor(top, dtype=torch.int32).view(len(ids), k)))
        chunk.top_logprobs.CopyFrom(to_proto(
            torch.tensor([[-0.5 - j for j in range(k)] for _ in ids], dtype=torch.float32).view(len(ids), k)))
    return chunk


def _scores(prompt: list[int], start: int, n: int, k: int) -> generate_pb2.PromptLogprobs:
    """Prompt tokens [start, start + n): token i gets logprob -i / 10 and rank 1 + i % 3, and the top list is the
    ids 0.. k - 1 at -0.01, -1.01, ..."""
    idx = range(start, start + n)
    return generate_pb2.PromptLogprobs(
        start=start, logprobs=to_proto([-i / 10 for i in idx], "float32"), ranks=to_proto([1 + i % 3 for i in idx]),
        top_ids=to_proto(torch.tensor([list(range(k))] * n, dtype=torch.int32).view(n, k)),
        top_logprobs=to_proto(torch.tensor([[-0.01 - j for j in range(k)]] * n, dtype=torch.float32).view(n, k)))


class StandinGenerator(generate_pb2_grpc.GeneratorServicer):
    def __init__(self) -> None:
        self.scripts: deque[list[Step]] = deque()
        self.records: dict[str, Record] = {}
        self.aborts: list[str] = []
        self._abort_flags: dict[str, asyncio.Event] = {}
        self.health = generate_pb2.HealthReply(
            healthy=True, running=1, waiting=2, max_model_len=0, model="tiny",
            components=[generate_pb2.ComponentHealth(name="scheduler", alive=True),
                        generate_pb2.ComponentHealth(name="rank0", alive=True)],
            pool=generate_pb2.PoolStats(block_size=16, total_blocks=100, free_blocks=75, total_slots=8, free_slots=6),
            prefix_cache_queries=120, prefix_cache_hits=30)
        self.default_reply: list[int] = [71, 75, 445]  # "hllo"

    # -------------------------------------------------------------------------------------------- test API
    def push(self, *steps: Step) -> None:
        """The next Generate call plays these steps (FIFO); with no script, it replies `default_reply` + EOS."""
        self.scripts.append(list(steps))

    def last(self) -> Record:
        return list(self.records.values())[-1]

    # ------------------------------------------------------------------------------------------------- RPCs
    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        rec = Record(request=request, metadata={k: v for k, v in context.invocation_metadata() or ()})
        self.records[rid] = rec
        aborted = self._abort_flags[rid] = asyncio.Event()
        prompt = tensor_ids(request.prompt_ids)
        steps = self.scripts.popleft() if self.scripts else self._default(request)
        sent = 0

        def finished(reason: int, **kw: object) -> generate_pb2.GenerateEvent:
            kw.setdefault("completion_tokens", sent)
            return generate_pb2.GenerateEvent(finished=generate_pb2.Finished(
                reason=reason, prompt_tokens=len(prompt), queue_s=0.01, prefill_s=0.02, decode_s=0.03,
                drafted_tokens=4, accepted_tokens=3, **kw))

        try:
            for step in steps:
                if aborted.is_set():
                    yield finished(generate_pb2.FINISH_ABORTED, stop_token_id=-1)
                    rec.completed = True
                    return
                if isinstance(step, Progress):
                    yield generate_pb2.GenerateEvent(progress=generate_pb2.Progress(phase=step.phase,
                                                                                    prefilled=step.prefilled))
                elif isinstance(step, Tokens):
                    sent += len(step.ids)
                    yield generate_pb2.GenerateEvent(tokens=_chunk(step.ids, request))
                elif isinstance(step, Scores):
                    for a in range(1, len(prompt), step.chunk):
                        yield generate_pb2.GenerateEvent(prompt_logprobs=_scores(
                            prompt, a, min(step.chunk, len(prompt) - a), request.prompt_logprobs))
                elif isinstance(step, Sleep):
                    try:
                        await asyncio.wait_for(aborted.wait(), step.seconds)
                    except asyncio.TimeoutError:
                        pass
                elif isinstance(step, Finish):
                    kw = {"stop_token_id": step.stop_token_id, "cached_tokens": step.cached_tokens,
                          "error": step.error}
                    if step.completion_tokens is not None:
                        kw["completion_tokens"] = step.completion_tokens
                    yield finished(step.reason, **kw)
                    rec.completed = True
                    return
                elif isinstance(step, Fail):
                    if step.retry_after is not None:
                        context.set_trailing_metadata((("retry-after", step.retry_after),))
                    await context.abort(step.code, step.details)
            if aborted.is_set():
                yield finished(generate_pb2.FINISH_ABORTED, stop_token_id=-1)
            rec.completed = True
        except asyncio.CancelledError:
            rec.cancelled = True  # the gateway cancelled the call (client gone, or after a stop string)
            raise
        finally:
            self._abort_flags.pop(rid, None)

    def _default(self, request: generate_pb2.GenerateRequest) -> list[Step]:
        scores: list[Step] = [Scores(4)] if request.HasField("prompt_logprobs") else []
        if request.max_tokens == 0:
            return [Progress(), *scores, Finish(generate_pb2.FINISH_LENGTH)]
        ids = self.default_reply[: request.max_tokens]
        if len(ids) < request.max_tokens:
            return [Progress(), *scores, Tokens(ids + [EOS]), Finish(generate_pb2.FINISH_STOP, stop_token_id=EOS)]
        return [Progress(), *scores, Tokens(ids), Finish(generate_pb2.FINISH_LENGTH)]

    async def Abort(self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext):
        self.aborts.append(request.request_id)
        flag = self._abort_flags.get(request.request_id)
        if flag is not None:
            flag.set()
        return generate_pb2.AbortReply(found=flag is not None)

    async def Health(self, request: generate_pb2.HealthRequest, context: grpc.aio.ServicerContext):
        return self.health


class StandinServer:
    """Runs a StandinGenerator on 127.0.0.1:<free port> in its own thread and event loop."""

    def __init__(self) -> None:
        self.generator = StandinGenerator()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standin-scheduler", daemon=True)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "StandinServer":
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("stand-in scheduler did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = grpc.aio.server()
        generate_pb2_grpc.add_GeneratorServicer_to_server(self.generator, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._ready.set()
        await self._stop.wait()
        await server.stop(grace=None)


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    """Poll `predicate` (the stand-in runs in another thread) until it holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
