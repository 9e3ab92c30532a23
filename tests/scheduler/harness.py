"""Run stand-in ranks + the real scheduler in-process on loopback, and talk to it with a real grpc.aio client."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import grpc

from services.common.internal_auth import aio_channel
from services.common.tensors import ids, to_proto
from services.scheduler.engine import EngineConfig
from services.scheduler.server import Scheduler, SchedulerConfig
from tests.scheduler.standin_rank import StandinRank
from twinspark.v1 import generate_pb2, generate_pb2_grpc


@dataclass
class Cluster:
    stub: generate_pb2_grpc.GeneratorStub
    scheduler: Scheduler
    ranks: list[StandinRank]

    async def health(self) -> generate_pb2.HealthReply:
        return await self.stub.Health(generate_pb2.HealthRequest(), timeout=5)

    def standin_errors(self) -> list[str]:
        return [e for r in self.ranks for e in r.errors]


@contextlib.asynccontextmanager
async def cluster(n_ranks: int = 1, *, rank: dict[str, Any] | None = None, per_rank: list[dict[str, Any]] | None = None,
                  progress_interval_s: float = 0.5, token: str | None = None, tokenizer: str | None = None,
                  **engine: Any) -> AsyncIterator[Cluster]:
    """`n_ranks` stand-in ranks (shared kwargs `rank`, per-rank overrides `per_rank`) behind a real scheduler; with
    `token`, every server requires it and every client (the test's included) sends it; with `tokenizer` (a
    checkpoint directory), it serves structured output (the stand-ins sample without the masks). Rounds run one
    decode step unless `num_scheduler_steps` says otherwise (auto would follow the stand-ins' timing)."""
    engine.setdefault("num_scheduler_steps", 1)
    ranks = [StandinRank(rank=i, world=n_ranks, token=token, **(rank or {}), **((per_rank or [{}] * n_ranks)[i]))
             for i in range(n_ranks)]
    addrs = [await r.start() for r in ranks]
    sched = Scheduler(SchedulerConfig(ranks=addrs, host="127.0.0.1", port=0, engine=EngineConfig(**engine),
                                      startup_timeout=5, rank_timeout=10,
                                      progress_interval_s=progress_interval_s, internal_token=token,
                                      tokenizer=tokenizer))
    channel = None
    try:
        port = await sched.start()
        channel = aio_channel(f"127.0.0.1:{port}", token)
        yield Cluster(generate_pb2_grpc.GeneratorStub(channel), sched, ranks)
    finally:
        if channel is not None:
            await channel.close()
        await sched.stop(0)
        for r in ranks:
            await r.stop()


def make_request(prompt: list[int], max_tokens: int, *, rid: str = "", temperature: float = 0.0,
                 seed: int | None = None, **kw: Any) -> generate_pb2.GenerateRequest:
    sampling = generate_pb2.Sampling(temperature=temperature, top_p=1.0)
    if seed is not None:
        sampling.seed = seed
    return generate_pb2.GenerateRequest(request_id=rid, prompt_ids=to_proto(prompt), sampling=sampling,
                                        max_tokens=max_tokens, **kw)


@dataclass
class Reply:
    tokens: list[int] = field(default_factory=list)
    finished: generate_pb2.Finished | None = None
    events: list[generate_pb2.GenerateEvent] = field(default_factory=list)

    @property
    def reason(self) -> str:
        assert self.finished is not None
        return {0: "stop", 1: "length", 2: "aborted", 3: "error"}[self.finished.reason]


async def collect(call: grpc.aio.UnaryStreamCall, reply: Reply | None = None) -> Reply:
    reply = reply if reply is not None else Reply()
    async for ev in call:
        reply.events.append(ev)
        if ev.HasField("tokens"):
            reply.tokens += ids(ev.tokens.ids)
        elif ev.HasField("finished"):
            reply.finished = ev.finished
    return reply


async def generate(c: Cluster, prompt: list[int], max_tokens: int, **kw: Any) -> Reply:
    return await collect(c.stub.Generate(make_request(prompt, max_tokens, **kw), timeout=20))


async def wait_until(cond, timeout_s: float = 5.0, every_s: float = 0.01) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not await cond():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(every_s)
