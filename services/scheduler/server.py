"""The scheduler's gRPC face: the `Generator` service (Generate / Abort / Health) on grpc.aio, and `serve()`.

Generate streams one request's events from its queue. While nothing else is sent, a Progress event goes out about
every `progress_interval_s` (queued / prefilling) so the gateway can keep its SSE stream alive. Leaving the handler
before the Finished event (the client cancelled, the deadline passed) aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from services.common.flags import config_values
from services.common.internal_auth import server_interceptors
from services.scheduler.admission import QueueFull
from services.scheduler.engine import Engine, EngineConfig, Unavailable
from services.scheduler.drafts import DrafterClient
from services.scheduler.grammar import GrammarBook
from services.scheduler.ranks import RankSet
from services.scheduler.request import State
from services.scheduler.tracing import generate_parent
from services.scheduler.validation import InvalidRequest
from twinspark.v1 import generate_pb2, generate_pb2_grpc

if TYPE_CHECKING:
    from services.scheduler.cli import SchedulerSettings

log = logging.getLogger("twinspark.scheduler.server")

_SERVER_OPTS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class GeneratorService(generate_pb2_grpc.GeneratorServicer):
    def __init__(self, engine: Engine, ranks: RankSet, *, progress_interval_s: float = 0.5,
                 ping_timeout_s: float = 1.0) -> None:
        self.engine = engine
        self.ranks = ranks
        self.progress_interval_s = progress_interval_s
        self.ping_timeout_s = ping_timeout_s

    async def Generate(self, request: generate_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            req = self.engine.submit(request, generate_parent(request, context.invocation_metadata()))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return
        except QueueFull as exc:
            log.info("refused %s: queue full (%d waiting), retry after %d s", request.request_id or "(no id)",
                     len(self.engine.scheduler.queue), exc.retry_after_s)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                                trailing_metadata=(("retry-after", str(exc.retry_after_s)),))
            return
        except Unavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            return
        try:
            while True:
                try:
                    event = await asyncio.wait_for(req.events.get(), timeout=self.progress_interval_s)
                except asyncio.TimeoutError:
                    event = req.progress_event()  # keepalive; None once tokens are flowing
                    if event is None:
                        continue
                yield event
                if event.HasField("finished"):
                    return
        finally:
            # Cancellation (client gone, deadline) lands here as CancelledError / GeneratorExit.
            if req.state is not State.FINISHED:
                self.engine.abort(req.id, "the client went away")

    async def Abort(self, request: generate_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> generate_pb2.AbortReply:
        found = self.engine.abort(request.request_id, "aborted by request")
        log.info("abort %s: %s", request.request_id, "found" if found else "not found")
        return generate_pb2.AbortReply(found=found)

    async def Health(self, request: generate_pb2.HealthRequest, context: grpc.aio.ServicerContext
                     ) -> generate_pb2.HealthReply:
        e, s = self.engine, self.engine.scheduler
        ranks = await self.ranks.ping(self.ping_timeout_s)  # real liveness, not just "no error seen yet"
        # Waiting for a failed rank group to restart, the scheduler itself is fine (the ranks are named down); ranks
        # that came back with other settings need a scheduler restart, so then the scheduler is down too.
        sched_alive = e.alive and self.ranks.stuck is None
        detail = f"round {s.rounds}" if e.alive else "engine loop stopped"
        if self.ranks.stuck is not None:
            detail += f"; {self.ranks.stuck}"
        elif self.ranks.failure is not None:
            detail += f"; {self.ranks.failure.public}: waiting for the rank group to restart"
        if s.kv.prefix is not None:
            detail += f"; {s.kv.prefix.describe()}"
        if e.loop_error:
            detail += f"; last loop error: {e.loop_error}"
        components = [generate_pb2.ComponentHealth(name="scheduler", alive=sched_alive, detail=detail)]
        components += [generate_pb2.ComponentHealth(name=n, alive=a, detail=d) for n, a, d in ranks]
        healthy = all(c.alive for c in components) and self.ranks.failure is None
        d = e.drafter
        if d is not None:
            # Optional: without the drafter serving goes on (no drafts), so it does not make the reply unhealthy.
            components.append(generate_pb2.ComponentHealth(
                name="drafter", alive=d.alive,
                detail=f"{d.detail}; accepted {s.accepted_total} of {s.drafted_total} drafts in "
                       f"{s.windows_total} windows"))
        return generate_pb2.HealthReply(
            healthy=healthy, components=components, pool=s.pool_stats(),
            running=s.num_running, waiting=len(s.queue), max_model_len=e.info.max_model_len, model=e.info.model,
            prefix_cache_queries=s.kv.prefix_queries, prefix_cache_hits=s.kv.prefix_hits, tiers=s.kv.tier_stats())


@dataclass
class SchedulerConfig:
    """The scheduler's config; a field named as one of serve-scheduler's flags takes its value (`from_settings`)."""

    ranks: list[str]
    host: str = "127.0.0.1"
    port: int = 50051
    engine: EngineConfig = field(default_factory=EngineConfig)
    startup_timeout: float = 120.0  # seconds every rank has to answer Describe
    rank_timeout: float | None = 300.0  # seconds one round may take before its rank is hung; None = never
    progress_interval_s: float = 0.5  # keepalive Progress cadence while queued / prefilling
    drafter: str | None = None  # host:port of the drafter; None = no drafts
    draft_timeout: float = 0.5  # seconds: a Propose slower than this runs the round without drafts
    tokenizer: str | None = None  # checkpoint dir / tokenizer.json for grammar masks; None = no structured output
    internal_token: str | None = None  # required from callers, sent to ranks and drafter (common/internal_auth.py)

    @classmethod
    def from_settings(cls, s: SchedulerSettings) -> SchedulerConfig:
        """serve-scheduler's config: each field takes the flag of its name, the engine's likewise; --ranks is split
        and a rank timeout of 0 is none. ValueError on settings that cannot work."""
        engine = EngineConfig.from_settings(s)
        ranks = [a.strip() for a in s.ranks.split(",") if a.strip()]
        if not ranks:
            raise ValueError("--ranks lists no addresses")
        return cls(**{**config_values(s, cls), "ranks": ranks, "rank_timeout": s.rank_timeout or None,
                      "engine": engine})


class Scheduler:
    """Ranks + engine + gRPC server, started and stopped together (also how tests run it in-process)."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.ranks = RankSet(cfg.ranks, rank_timeout_s=cfg.rank_timeout, token=cfg.internal_token)
        self.engine: Engine | None = None
        self.server: grpc.aio.Server | None = None
        self.drafter: DrafterClient | None = None
        self.port: int = 0

    async def start(self) -> int:
        """Connect to every rank (raises StartupError), start the engine and listen; returns the bound port."""
        try:
            info = await self.ranks.connect(self.cfg.startup_timeout)
        except BaseException:
            await self.ranks.close()
            raise
        self.drafter = DrafterClient(self.cfg.drafter, timeout_s=self.cfg.draft_timeout,
                                     token=self.cfg.internal_token) if self.cfg.drafter else None
        grammars = GrammarBook.load(self.cfg.tokenizer, info.vocab_size, list(info.eos_ids)) \
            if self.cfg.tokenizer else None
        self.engine = Engine(self.ranks, info, self.cfg.engine, self.drafter, grammars)
        self.engine.start()
        self.server = grpc.aio.server(options=_SERVER_OPTS,
                                      interceptors=server_interceptors(self.cfg.internal_token, "scheduler", aio=True))
        generate_pb2_grpc.add_GeneratorServicer_to_server(GeneratorService(
            self.engine, self.ranks, progress_interval_s=self.cfg.progress_interval_s), self.server)
        self.port = self.server.add_insecure_port(f"{self.cfg.host}:{self.cfg.port}")
        if not self.port:
            raise OSError(f"cannot listen on {self.cfg.host}:{self.cfg.port}")
        await self.server.start()
        e = self.cfg.engine
        px = self.engine.scheduler.kv.prefix
        log.info("scheduler listening on %s:%d (max waiting %d, max seqs %d, %d tokens per round, prefix caching %s)",
                 self.cfg.host, self.port, e.max_waiting, self.engine.scheduler.max_running, self.engine.scheduler.budget,
                 f"on, {len(px.slots)} snapshot slots" if px is not None else "off")
        return self.port

    async def stop(self, grace_s: float = 2.0) -> None:
        # The engine first: it fails what is in flight and, with a disk KV tier, saves the prefix cache while the
        # ranks (stopping too) still hold their Step streams open.
        if self.engine is not None:
            await self.engine.stop()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self.drafter is not None:
            await self.drafter.close()
        await self.ranks.close()


async def serve(cfg: SchedulerConfig) -> None:
    """Run until SIGINT / SIGTERM."""
    sched = Scheduler(cfg)
    await sched.start()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    log.info("shutting down")
    await sched.stop()
