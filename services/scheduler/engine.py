"""The scheduler's loop: admit → plan a round → send it to every rank → commit the sampled tokens → stop rules → events.

What to run is decided by the synchronous `RoundScheduler` (round_scheduler.py); this loop only carries its plans to
the ranks and the results back, asks the drafter for drafts, and turns failures into the rules below. Everything runs
on one asyncio loop, so no structure needs a lock: Generate / Abort handlers call `submit` / `abort` between the
loop's awaits, and the loop acts on them at the next round boundary. At most `PIPELINE_DEPTH` rounds are in flight;
an abort or a cancelled call therefore frees its blocks and slot within that many rounds.

Failure rules: a rank failure fails every request (running and waiting) with FINISH_ERROR and makes the engine
unavailable (new Generate calls get UNAVAILABLE) until the whole rank group has restarted (see ranks.py: new
instances, same fingerprint); then the pool and prefix index are rebuilt empty and serving resumes. Any other
exception inside the loop fails only the requests that were running — the ranks are still in lock-step, and a new
request starts at position 0 with a fresh slot state — and the loop goes on: exceptions never kill the server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from opentelemetry.context import Context

from services.common.flags import config_values
from services.scheduler.decode_steps import DecodeSteps
from services.scheduler.drafts import PROPOSE_ROW_BYTES, DrafterClient
from services.scheduler.grammar import GrammarBook
from services.scheduler.model_info import ModelInfo
from services.scheduler.ranks import RankError, RankSet, Round
from services.scheduler.request import Request
from services.scheduler.round_scheduler import RoundScheduler, ScheduledRound
from services.scheduler.tracing import propose_span, round_span
from twinspark.v1 import generate_pb2, rank_pb2

if TYPE_CHECKING:
    from services.scheduler.cli import SchedulerSettings

log = logging.getLogger("twinspark.scheduler")


# Rounds in flight at most (`_overlap`): while the ranks compute round n, rounds n+1 and n+2 are planned and sent, so
# a rank on a GPU queues n+1 behind n and finds n+2 waiting when it has read n back — the GPU never waits for this
# loop's round trip (result in, commit, plan, send). A request that stops at a sample still in flight gets at most
# two rows too many, dropped at commit.
PIPELINE_DEPTH = 3


@dataclass
class _InFlight:
    step: ScheduledRound
    round: Round
    span: contextlib.ExitStack  # the round's trace span, closed when its result is committed
    t0: float


class Unavailable(RuntimeError):
    """The engine cannot serve (a rank is down, or it is shutting down)."""


@dataclass(frozen=True)
class EngineConfig:
    max_waiting: int = 64
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None  # None: the ranks' device's default (services/common/step_budget.py)
    num_scheduler_steps: int = 0  # decode steps per round of plain decode rows; 0: auto (decode_steps.py)
    enable_prefix_caching: bool = True
    # KDA snapshot slots for the prefix index, reserved from the ranks' slot count (~142 MB each at full size on
    # every rank, see prefix.py). None: the slots left over after max_num_seqs, at most 16.
    max_snapshots: int | None = None
    # After a reply, prefill prompt + reply to the last 64-token grid point in the background and snapshot it there,
    # so the conversation's next turn resumes from it (replay.py).
    reply_reuse: bool = True
    # A replay starts only once no request has run or waited for this many seconds: beside users' rows it would
    # stretch their rounds, and a request that comes at once (a benchmark's next prompt, an agent's quick turn) would
    # queue behind it; the next turn's own prefill computes the same tokens anyway (docs/serving.md).
    reply_reuse_delay: float = 0.5
    num_draft_tokens: int = 4  # K: drafts asked per decoding request and round (with a drafter)
    draft_hidden: bool = False  # ask the ranks for hidden states and pass them to the drafter (MTP drafts)
    # Target layers whose outputs the ranks return for every row and the drafter is sent by position (DFlash drafts)
    draft_layers: tuple[int, ...] = ()
    kv_events_endpoint: str | None = None  # ZMQ address the prefix index's block events go out on (kv_events.py)

    @classmethod
    def from_settings(cls, s: SchedulerSettings) -> EngineConfig:
        """The engine's part of serve-scheduler's settings: each field takes the flag of its name, a negative draft
        count or replay delay counts as none, and --draft-layers is read as layer numbers (ValueError if not)."""
        try:
            layers = tuple(int(x) for x in (s.draft_layers or "").split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--draft-layers takes comma-separated layer numbers, got {s.draft_layers!r}") from None
        return cls(**{**config_values(s, cls), "reply_reuse_delay": max(0.0, s.reply_reuse_delay),
                      "num_draft_tokens": max(0, s.num_draft_tokens), "draft_layers": layers})


class Engine:
    def __init__(self, ranks: RankSet, info: ModelInfo, cfg: EngineConfig, drafter: DrafterClient | None = None,
                 grammars: GrammarBook | None = None) -> None:
        self.ranks = ranks
        self.info = info
        self.cfg = cfg
        self.scheduler = RoundScheduler(info, cfg, grammars, ranks.tier_listing)
        self.drafter = drafter
        self.steps = DecodeSteps(cfg.num_scheduler_steps)
        self._last_result: float | None = None  # when the last round's result came in (the steps' measure)
        self.loop_error: str | None = None  # last unexpected loop exception, for Health
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None  # waits for a failed rank group to come back
        self._stopping = False
        ranks.on_failure = self._on_rank_failure

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler-engine")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self, reason: str = "the scheduler is shutting down") -> None:
        self._stopping = True
        self.scheduler.fail_all(reason)
        for task in (self._task, self._recovery):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self._persist()
        if self.scheduler.kv_events is not None:
            self.scheduler.kv_events.close()

    async def _persist(self) -> None:
        """With a disk KV tier: one last plan of tier moves saving the pool's snapshots there (the ranks keep their
        Step streams open a few seconds after SIGTERM for this), so a restart resumes them."""
        if self.ranks.failure is not None:
            return
        moves = self.scheduler.kv.persist_moves()
        if not moves:
            return
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self.ranks.step(rank_pb2.StepPlan(tier_moves=moves)), timeout=30)
        except Exception as exc:  # noqa: BLE001 — shutting down: a cache we could not save is only a cache
            log.warning("could not save the prefix cache to the disk tier: %s", exc)
            return
        prefix = self.scheduler.kv.prefix
        assert prefix is not None  # tier moves come only from a prefix index
        log.info("saved %d prefix snapshots to the disk kv tier in %.2f s", len(prefix.snaps), time.monotonic() - t0)

    # -- requests in ----------------------------------------------------------------------------------------------
    def submit(self, msg: generate_pb2.GenerateRequest, trace_parent: Context | None = None) -> Request:
        """Validate and queue; raises Unavailable, InvalidRequest or QueueFull (nothing is queued then).
        `trace_parent`: the caller's trace context when tracing is on (the request's spans go under it)."""
        if self.ranks.stuck is not None:
            raise Unavailable("the ranks came back with other settings than the scheduler started with; the "
                              "scheduler must be restarted")
        if self.ranks.failure is not None:
            raise Unavailable(f"{self.ranks.failure.public}; waiting for the rank group to restart")
        if self._stopping or not self.alive:
            raise Unavailable("the scheduler is not running")
        req = self.scheduler.add(msg, trace_parent)
        self._wake.set()
        return req

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a live request; False when no such request is waiting or running."""
        found = self.scheduler.abort(request_id, reason)
        if found:
            self._wake.set()  # a waiting loop reaps it at once
        return found

    # -- the loop -------------------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        # Rounds submitted to the ranks and not yet committed, oldest first (see `_overlap`).
        inflight: collections.deque[_InFlight] = collections.deque()
        sched = self.scheduler
        while not self._stopping:
            try:
                sched.reap_aborted()
                if self.ranks.failure is None:
                    sched.admit()
                if inflight and (len(inflight) >= PIPELINE_DEPTH or not self._overlap()):
                    await self._collect(inflight.popleft())
                    continue
                drafts = await self._propose() if self.ranks.failure is None and not inflight else {}
                if drafts:
                    sched.reap_aborted()  # the Propose call awaited: an abort may have come in meanwhile
                steps = self.steps.want() if self._overlap() else 1  # a multi-step round is pipelined work
                step = sched.schedule(drafts, steps) if self.ranks.failure is None else None
                if step is not None:
                    inflight.append(await self._send(step))
                elif inflight:
                    await self._collect(inflight.popleft())
                else:
                    self._wake.clear()  # no await since the checks above, so no wake-up is lost
                    await self._sleep(sched.replay_wait())
            except asyncio.CancelledError:
                raise
            except RankError as err:
                while inflight:  # the streams are gone with the ranks; recovery starts them over from round 1
                    f = inflight.popleft()
                    self.ranks.abandon(f.round)
                    f.span.close()
                self._on_rank_failure(err)  # idempotent: the rank set usually called it already
            except Exception as exc:  # noqa: BLE001 — the loop must survive its own bugs
                log.exception("scheduler loop error; failing the running requests")
                self.loop_error = f"{type(exc).__name__}: {exc}"
                sched.fail_running(f"scheduler error: {self.loop_error}")
                await self._drain(inflight)
                sched.kv.forget_snapshots()
                await asyncio.sleep(0.05)  # never spin hot on a repeating failure

    async def _sleep(self, timeout: float | None) -> None:
        """Until something wakes the loop, or `timeout` seconds (when a held reply replay may start)."""
        if timeout is None:
            await self._wake.wait()
            return
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def _overlap(self) -> bool:
        """Whether the next round may be planned before the previous one's result is in. Its decode rows then say
        "the token you sampled last" (the ranks fill it in), so it must need nothing else from that result: no
        drafts (they start from the last token), no hidden states, nothing that reads the samples themselves
        (`RoundScheduler.reads_last_samples`)."""
        if self.drafter is not None and self.cfg.num_draft_tokens > 0 and self.drafter.usable:
            return False
        return not self.cfg.draft_hidden and not self.cfg.draft_layers and not self.scheduler.reads_last_samples

    async def _propose(self) -> dict[str, list[int]]:
        """Drafts for this round's decoders from the drafter; {} without one, or when it is down or slow."""
        if self.drafter is None or self.cfg.num_draft_tokens < 1 or not self.drafter.usable:
            return {}
        want = self.scheduler.draft_wants()
        if not want:
            return {}
        seqs = self._draft_seqs(want)
        with propose_span([r for r, _ in want]) as metadata:
            drafts = await self.drafter.propose(seqs, metadata)
        if drafts is None:
            return {}  # DFlash context rows stay pending: the next call sends them again
        for (r, _), (_, _, _, hidden, _) in zip(want, seqs):
            if self.cfg.draft_layers and hidden is not None:
                r.draft_rows.delivered(hidden.shape[0])
        return {r.id: d for (r, _), d in zip(want, drafts) if d}

    def _draft_seqs(self, want: list[tuple[Request, int]]) -> list[tuple[str, list[int], int, torch.Tensor | None,
                                                                          int]]:
        """What the drafter call carries per request beside its tokens and k: its last hidden state (MTP), or its
        pending context rows from the position of the first, at most PROPOSE_ROW_BYTES of them in all (DFlash)."""
        if not self.cfg.draft_layers:
            return [(r.id, r.tokens, k, r.last_hidden, 0) for r, k in want]
        out = []
        left = PROPOSE_ROW_BYTES
        for r, k in want:
            rows = r.draft_rows.pending(left)
            left -= 0 if rows is None else rows.numel() * rows.element_size()
            out.append((r.id, r.tokens, k, rows, r.draft_rows.start))
        return out

    async def _send(self, step: ScheduledRound) -> _InFlight:
        step.plan.want_hidden = self.drafter is not None and self.cfg.draft_hidden
        if self.drafter is not None and self.cfg.draft_layers:
            # Every round, the drafter up or not: the context it conditions on must have no holes.
            step.plan.hidden_layers.extend(self.cfg.draft_layers)
        span = contextlib.ExitStack()
        span.enter_context(round_span(step.number, step.seqs, step.plan))  # before the rank set seals the plan
        try:
            rnd = await self.ranks.submit(step.plan)
        except BaseException:
            span.close()
            raise
        self.scheduler.sent(step)
        return _InFlight(step, rnd, span, time.monotonic())

    async def _collect(self, f: _InFlight) -> None:
        try:
            output = await self.ranks.collect(f.round)
            now = time.monotonic()
            if f.step.decode_only and self._last_result is not None and f.t0 <= self._last_result:
                self.steps.observe(f.step.steps, now - self._last_result)  # queued all along: the ranks' pace
            self._last_result = now
            if log.isEnabledFor(logging.DEBUG):
                log.debug("round %d: %d seqs, %d rows, %d sampled, %.1f ms", f.round.plan.round, len(f.step.seqs),
                          sum(len(s.token_ids) for s in f.step.seqs), len(output.sampled),
                          (time.monotonic() - f.t0) * 1e3)
            self.scheduler.commit(f.step, output)
        finally:
            f.span.close()

    async def _drain(self, inflight: collections.deque[_InFlight]) -> None:
        """After a loop error with the ranks still in lock-step: read what is still in flight (each stream must stay
        in round order) and drop it; its requests are finished already."""
        while inflight:
            f = inflight.popleft()
            try:
                await self._collect(f)
            except Exception:  # noqa: BLE001 — the round's requests are failed already
                log.warning("dropped round %d after a loop error", f.round.plan.round)

    # -- rank failures --------------------------------------------------------------------------------------------
    def _on_rank_failure(self, err: RankError) -> None:
        self.scheduler.ranks_lost(err.public)
        self._wake.set()
        if not self._stopping and (self._recovery is None or self._recovery.done()):
            self._recovery = asyncio.get_running_loop().create_task(self._recover(), name="rank-recovery")

    async def _recover(self) -> None:
        """Serve again once the rank group has restarted, with caches as empty as the new ranks' caches."""
        if await self.ranks.wait_for_new_group():
            # No await between the streams reopening and this: no round is planned against the old pool.
            self.scheduler.new_caches(self.ranks.tier_listing)
            pool = self.scheduler.kv.pool
            log.info("rank group back: pool and prefix index rebuilt empty (%d blocks, %d request slots)",
                     pool.num_blocks, pool.num_slots)
            self._wake.set()
