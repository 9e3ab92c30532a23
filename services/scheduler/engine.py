"""The scheduler's loop: admit → plan a round → send it to every rank → commit the sampled tokens → stop rules → events.

Everything runs on one asyncio loop, so the engine's structures need no locks: Generate / Abort handlers call
`submit` / `abort` between the loop's awaits, and the loop acts on them at the next round boundary. One round is in
flight at a time; an abort or a cancelled call therefore frees its blocks and slot within one round.

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
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass

import torch
from opentelemetry.context import Context

from services.common.tensors import from_proto, ids
from services.scheduler.admission import AdmissionQueue, QueueFull
from services.scheduler.batcher import PlannedSeq, build_step_plan, plan_round
from services.scheduler.drafts import DrafterClient
from services.scheduler.grammar import GrammarBook, GrammarError
from services.scheduler.kv_tiers import TierIndex, state_key
from services.scheduler.penalties import PenaltyError, PenaltySpec, PenaltyState
from services.scheduler.pool import BlockPool, PoolExhausted
from services.scheduler.prefix import KDA_CHUNK, Match, PrefixIndex, Snapshot, block_hashes, reuse_granule
from services.scheduler.ranks import ModelInfo, RankError, RankSet, Round
from services.scheduler.request import Request, SamplingSpec, State, TokenLogprobs, derive_seed
from services.scheduler.tracing import RequestSpans, propose_span, round_span
from twinspark.v1 import generate_pb2, rank_pb2

log = logging.getLogger("twinspark.scheduler")

__all__ = ["Engine", "EngineConfig", "InvalidRequest", "QueueFull", "Unavailable"]


# Bounds on a Generate request's small fields (ids end up in every log line of the request).
MAX_REQUEST_ID = 256
MAX_STOP_IDS = 4096
MAX_IMAGES = 64


# Rounds in flight at most (`_overlap`): while the ranks compute round n, rounds n+1 and n+2 are planned and sent, so
# a rank on a GPU queues n+1 behind n and finds n+2 waiting when it has read n back — the GPU never waits for this
# loop's round trip (result in, commit, plan, send). A request that stops at a sample still in flight gets at most
# two rows too many, dropped at commit.
PIPELINE_DEPTH = 3


@dataclass
class _InFlight:
    seqs: list[PlannedSeq]
    round: Round
    span: contextlib.ExitStack  # the round's trace span, closed when its result is committed
    t0: float
    loads: list[Snapshot]  # snapshots this round loads from a KV tier (usable once it is back)


class InvalidRequest(ValueError):
    """A request the scheduler will never run; `str()` is the INVALID_ARGUMENT details, "<code>: <message>"."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class Unavailable(RuntimeError):
    """The engine cannot serve (a rank is down, or it is shutting down)."""


@dataclass(frozen=True)
class EngineConfig:
    max_waiting: int = 64
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    enable_prefix_caching: bool = True
    # KDA snapshot slots for the prefix index, reserved from the ranks' slot count (~142 MB each at full size on
    # every rank, see prefix.py). None: the slots left over after max_num_seqs, at most 16.
    max_snapshots: int | None = None
    # After a reply, prefill prompt + reply to the last 64-token grid point in the background and snapshot it there,
    # so the conversation's next turn resumes from it (`_start_replay`).
    reply_reuse: bool = True
    num_draft_tokens: int = 4  # K: drafts asked per decoding request and round (with a drafter)
    draft_hidden: bool = False  # ask the ranks for hidden states and pass them to the drafter (MTP drafts)


_REASON = {generate_pb2.FINISH_STOP: "stop", generate_pb2.FINISH_LENGTH: "length",
           generate_pb2.FINISH_ABORTED: "aborted", generate_pb2.FINISH_ERROR: "error"}


class Engine:
    def __init__(self, ranks: RankSet, info: ModelInfo, cfg: EngineConfig, drafter: DrafterClient | None = None,
                 grammars: GrammarBook | None = None) -> None:
        if cfg.max_num_seqs < 1 or cfg.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.ranks = ranks
        self.info = info
        self.cfg = cfg
        snaps = 0
        if cfg.enable_prefix_caching:
            snaps = cfg.max_snapshots if cfg.max_snapshots is not None else \
                max(0, min(16, info.num_slots - cfg.max_num_seqs))
            if not 0 <= snaps < info.num_slots:
                raise ValueError(f"--max-snapshots must be in [0, {info.num_slots}) (the ranks have {info.num_slots} "
                                 f"KDA slots and running requests need at least one), got {snaps}")
        self._snapshot_slots = snaps
        self.prefix: PrefixIndex | None = None
        self._new_caches()
        if cfg.enable_prefix_caching and not snaps:
            log.warning("prefix caching is on but no KDA slot is left for snapshots (%d slots, max_num_seqs %d): "
                        "raise the ranks' --num-slots or set --max-snapshots", info.num_slots, cfg.max_num_seqs)
        self.queue = AdmissionQueue(cfg.max_waiting)
        self.running: list[Request] = []
        self.live: dict[str, Request] = {}  # waiting + running, by request id
        # A running request holds a KDA slot, so the ranks' slot count caps concurrency too.
        self.max_running = min(cfg.max_num_seqs, self.pool.num_slots)
        if cfg.max_num_batched_tokens < self.max_running + KDA_CHUNK:
            # Prompts are cut only on the 64-token KDA grid (batcher.py): a round must hold every decode row and
            # one whole grid chunk, or a long prompt could never make progress.
            raise ValueError(f"--max-num-batched-tokens ({cfg.max_num_batched_tokens}) must be at least the running "
                             f"sequences ({self.max_running}) + {KDA_CHUNK}")
        self.rounds = 0
        self.drafter = drafter
        self.grammars = grammars  # None: no tokenizer given, structured output is refused
        self.drafted_total = 0  # drafts verified, all requests
        self.accepted_total = 0  # of which accepted
        self.windows_total = 0  # verify windows run
        self.loop_error: str | None = None  # last unexpected loop exception, for Health
        self._eos = frozenset(info.eos_ids)
        self._order = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._recovery: asyncio.Task[None] | None = None  # waits for a failed rank group to come back
        self._stopping = False
        ranks.on_failure = self._on_rank_failure

    def _new_caches(self) -> None:
        """A fresh logical pool and prefix index: at start, and after the rank group restarted (its caches are
        empty). The prefix figures carry over, so the exported counters never go backwards."""
        info, snaps, old = self.info, self._snapshot_slots, self.prefix
        # Slots [0, n) hold running requests' KDA states, [n, num_slots) the prefix index's snapshots.
        req_slots = info.num_slots - snaps
        self.pool = BlockPool(info.num_blocks, info.block_size, req_slots)
        tiers = None
        if snaps and (info.tier_host_bytes > 0 or info.tier_disk_bytes > 0):
            # The host tier is gone with the old ranks; the disk tier is what every new rank lists.
            tiers = TierIndex(host_capacity=info.tier_host_bytes, disk_capacity=info.tier_disk_bytes,
                              block_bytes=info.block_bytes, state_bytes=info.state_bytes,
                              block_size=info.block_size)
            tiers.restore(self.ranks.tier_listing)
            if old is not None and old.tiers is not None:
                tiers.figures = old.tiers.figures
            log.info("kv tiers: host %d bytes, disk %d bytes per rank; %d snapshots on disk", tiers.host_capacity,
                     tiers.disk_capacity, len(tiers.snaps))
        self.prefix = PrefixIndex(self.pool, list(range(req_slots, info.num_slots)),
                                  granule=reuse_granule(info.block_size), tiers=tiers) if snaps else None
        if old is not None and self.prefix is not None:
            self.prefix.queries, self.prefix.hits = old.queries, old.hits
        # (request slot, snapshot) copies that go out in the next plan (the request may be done by then: its slot
        # is only reused by a later plan, whose copies run before its forward)
        self._takes_next: list[tuple[int, Snapshot]] = []

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler-engine")

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self, reason: str = "the scheduler is shutting down") -> None:
        self._stopping = True
        self._fail_all(reason)
        for task in (self._task, self._recovery):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        await self._persist()

    async def _persist(self) -> None:
        """With a disk KV tier: one last plan of tier moves saving the pool's snapshots there (the ranks keep their
        Step streams open a few seconds after SIGTERM for this), so a restart resumes them."""
        prefix = self.prefix
        if prefix is None or prefix.tiers is None or prefix.tiers.disk_capacity <= 0 or self.ranks.failure is not None:
            return
        prefix.persist()
        moves = prefix.tiers.take_moves()
        if not moves:
            return
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(self.ranks.step(rank_pb2.StepPlan(tier_moves=moves)), timeout=30)
        except Exception as exc:  # noqa: BLE001 — shutting down: a cache we could not save is only a cache
            log.warning("could not save the prefix cache to the disk tier: %s", exc)
            return
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
        req = self._validate(msg)
        self._admit()  # let older waiters in first, so the bound below counts only requests that must wait
        runs_now = not len(self.queue) and len(self.running) < self.max_running and self._fits(req)
        self.queue.push(req, capacity=self.max_running, force=runs_now)
        self.live[req.id] = req
        if trace_parent is not None:
            req.spans = RequestSpans(trace_parent, req.id, req.prompt_len)
        req.emit_progress()  # PHASE_QUEUED at acceptance: the gateway can answer headers / keepalives now
        # Admitting here (not only at the loop's next turn) is safe: the round in flight was planned already and
        # new running requests only join the next plan.
        self._admit()
        self._wake.set()
        return req

    def _validate(self, msg: generate_pb2.GenerateRequest) -> Request:
        info = self.info
        try:
            prompt = ids(msg.prompt_ids)
        except ValueError as exc:
            raise InvalidRequest("invalid_prompt", f"prompt_ids: {exc}") from exc
        if not prompt:
            raise InvalidRequest("invalid_prompt", "the prompt is empty")
        if len(msg.request_id) > MAX_REQUEST_ID:
            raise InvalidRequest("invalid_request_id", f"request_id is longer than {MAX_REQUEST_ID} characters")
        if len(msg.stop_token_ids) > MAX_STOP_IDS:
            raise InvalidRequest("invalid_stop_token_ids", f"more than {MAX_STOP_IDS} stop_token_ids")
        if msg.max_tokens < 1:
            raise InvalidRequest("invalid_max_tokens", f"max_tokens must be >= 1, got {msg.max_tokens}")
        total = len(prompt) + msg.max_tokens
        if total > info.max_model_len:  # before the per-token check below: a huge prompt is refused at once
            raise InvalidRequest(
                "context_length_exceeded",
                f"this model's maximum context length is {info.max_model_len} tokens; the request needs {total} "
                f"({len(prompt)} in the prompt, {msg.max_tokens} max_tokens)")
        for i, t in enumerate(prompt):
            if not 0 <= t < info.vocab_size:
                raise InvalidRequest("invalid_token_id",
                                     f"prompt token {i} is {t}, outside the vocabulary [0, {info.vocab_size})")
        if not self.pool.fits_ever(total):
            raise InvalidRequest(
                "context_length_exceeded",
                f"the request needs {total} tokens of KV cache but the ranks' cache holds only "
                f"{info.num_blocks * info.block_size}")
        sp = msg.sampling
        # proto3 cannot tell "unset" from 0: top_p 0 means off (1), like top_k 0 and min_p 0.
        top_p = 1.0 if sp.top_p == 0 else sp.top_p
        if not (sp.temperature >= 0 and math.isfinite(sp.temperature)):
            raise InvalidRequest("invalid_sampling", f"temperature must be >= 0, got {sp.temperature}")
        if not 0 < top_p <= 1:
            raise InvalidRequest("invalid_sampling", f"top_p must be in (0, 1], got {sp.top_p}")
        if sp.top_k < 0:
            raise InvalidRequest("invalid_sampling", f"top_k must be >= 0, got {sp.top_k}")
        if not 0 <= sp.min_p <= 1:
            raise InvalidRequest("invalid_sampling", f"min_p must be in [0, 1], got {sp.min_p}")
        if msg.priority not in (generate_pb2.PRIORITY_NORMAL, generate_pb2.PRIORITY_BACKGROUND):
            raise InvalidRequest("invalid_priority", f"unknown priority {msg.priority}")
        rid = msg.request_id or f"sched-{uuid.uuid4().hex}"
        if rid in self.live:
            raise InvalidRequest("duplicate_request_id", f"request {rid!r} is already in flight")
        seed = sp.seed if sp.HasField("seed") else derive_seed(prompt)
        seed = (seed + msg.seed_offset) & 0xFFFF_FFFF_FFFF_FFFF  # choice i of an n > 1 request: seed + i
        if msg.logprobs and not 0 <= msg.top_logprobs <= 20:
            raise InvalidRequest("invalid_logprobs", f"top_logprobs must be in [0, 20], got {msg.top_logprobs}")
        grammar = None
        if msg.grammar:
            if self.grammars is None:
                raise InvalidRequest("invalid_grammar", "structured output needs the scheduler's --tokenizer")
            try:
                grammar = self.grammars.compile(msg.grammar)
            except GrammarError as exc:
                raise InvalidRequest("invalid_grammar", str(exc)) from None
        try:
            spec = PenaltySpec.of(msg, info.vocab_size)
        except PenaltyError as exc:
            raise InvalidRequest("invalid_penalties", str(exc)) from None
        images = self._images(msg, len(prompt))
        return Request(
            request_id=rid, prompt=prompt, max_tokens=msg.max_tokens, images=images,
            sampling=SamplingSpec(temperature=sp.temperature, top_p=top_p, top_k=sp.top_k, min_p=sp.min_p, seed=seed),
            stop_ids=frozenset(msg.stop_token_ids), eos_ids=frozenset() if msg.ignore_eos else self._eos,
            priority=msg.priority, order=next(self._order), max_model_len=info.max_model_len,
            no_draft=msg.no_draft, grammar=grammar, logprobs_k=msg.top_logprobs if msg.logprobs else -1,
            penalties=PenaltyState(spec, prompt) if spec is not None else None)

    @staticmethod
    def _images(msg: generate_pb2.GenerateRequest, prompt_len: int) -> list[generate_pb2.Image]:
        """The request's images, checked: in prompt order, placeholders inside the prompt, pixel tensors of a
        sane shape (the ranks check them against the vision tower's geometry)."""
        images = list(msg.images)
        if len(images) > MAX_IMAGES:
            raise InvalidRequest("invalid_image", f"more than {MAX_IMAGES} images")
        end = 0
        for i, im in enumerate(images):
            if im.offset < end or im.tokens < 1 or im.offset + im.tokens > prompt_len:
                raise InvalidRequest("invalid_image", f"image {i}: its placeholder tokens [{im.offset}, "
                                     f"{im.offset + im.tokens}) overlap another image or leave the prompt")
            end = im.offset + im.tokens
            try:
                pixels, grid = from_proto(im.pixel_values), ids(im.grid_thw)
            except ValueError as exc:
                raise InvalidRequest("invalid_image", f"image {i}: {exc}") from exc
            if pixels.dtype != torch.float32 or pixels.dim() != 2 or len(grid) != 3 or min(grid) < 1 \
                    or grid[0] * grid[1] * grid[2] != pixels.shape[0] or len(im.digest) != 32:
                raise InvalidRequest("invalid_image", f"image {i}: pixel_values must be float32 [t*h*w, patch] for "
                                     "grid_thw (t, h, w), with a sha256 digest")
        return images

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a live request; False when no such request is waiting or running."""
        req = self.live.get(request_id)
        if req is None or req.state is State.FINISHED:
            return False
        if req.state is State.WAITING:
            self.queue.remove(req)
            self._finish(req, generate_pb2.FINISH_ABORTED, note=reason)
        elif req.abort_reason is None:
            # It may have rows in the round now in flight: it is finished and freed when that round is back.
            req.abort_reason = reason
            self._wake.set()
        return True

    # -- figures --------------------------------------------------------------------------------------------------
    def pool_stats(self) -> generate_pb2.PoolStats:
        """Cached blocks that no request reads count as free (they are evicted as soon as admission needs them),
        as in vLLM; slots are the running requests' slots (snapshot slots are the prefix index's)."""
        p = self.pool
        idle = self.prefix.idle_blocks if self.prefix is not None else 0
        idle += self._replay_blocks()  # replays give way to any request that needs their blocks
        return generate_pb2.PoolStats(block_size=p.block_size, total_blocks=p.num_blocks,
                                      free_blocks=p.free_blocks + idle, total_slots=p.num_slots,
                                      free_slots=p.free_slots)

    def _replay_blocks(self) -> int:
        return sum(1 for r in self.running if r.replay and r.reservation is not None
                   for b in r.reservation.blocks if self.pool.refcount(b) == 1)

    def tier_stats(self) -> list[generate_pb2.TierStats]:
        tiers = self.prefix.tiers if self.prefix is not None else None
        return tiers.stats() if tiers is not None else []

    @property
    def num_running(self) -> int:
        """Requests running for clients (reply replays are cache upkeep, not requests)."""
        return sum(1 for r in self.running if not r.replay)

    @property
    def prefix_queries(self) -> int:
        return self.prefix.queries if self.prefix is not None else 0

    @property
    def prefix_hits(self) -> int:
        return self.prefix.hits if self.prefix is not None else 0

    # -- the loop -------------------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        # Rounds submitted to the ranks and not yet committed, oldest first (see `_overlap`).
        inflight: collections.deque[_InFlight] = collections.deque()
        while not self._stopping:
            try:
                self._reap_aborted()
                if self.ranks.failure is None:
                    self._admit()
                if inflight and (len(inflight) >= PIPELINE_DEPTH or not self._overlap()):
                    await self._collect(inflight.popleft())
                    continue
                drafts = await self._propose() if self.ranks.failure is None and not inflight else {}
                if drafts:
                    self._reap_aborted()  # the Propose call awaited: an abort may have come in meanwhile
                seqs = plan_round(self.running, self.cfg.max_num_batched_tokens, drafts) \
                    if self.ranks.failure is None else []
                if not seqs and self._tier_work():
                    seqs = []  # a plan of tier moves only: a request waits for its load
                    inflight.append(await self._submit(seqs))
                    continue
                if not seqs:
                    if inflight:
                        await self._collect(inflight.popleft())
                        continue
                    self._wake.clear()  # no await since the checks above, so no wake-up is lost
                    await self._wake.wait()
                    continue
                inflight.append(await self._submit(seqs))
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
                for req in list(self.running):
                    self._finish(req, generate_pb2.FINISH_ERROR, error=f"scheduler error: {self.loop_error}")
                await self._drain(inflight)
                if self.prefix is not None:  # a state copy planned this round may never have run: trust no snapshot
                    self.prefix.clear()
                    self._takes_next = []
                await asyncio.sleep(0.05)  # never spin hot on a repeating failure

    def _tier_work(self) -> bool:
        """KV tier moves wait for a plan (a load a request waits for, saves of what admission evicted)."""
        return self.prefix is not None and self.prefix.tiers is not None and bool(self.prefix.tiers.moves)

    def _overlap(self) -> bool:
        """Whether the next round may be planned before the previous one's result is in. Its decode rows then say
        "the token you sampled last" (the ranks fill it in), so it must need nothing else from that result: no
        drafts (they start from the last token), no grammar masks (they depend on it), no penalties that count the
        generated tokens (logit_bias and min_tokens do not), no hidden states."""
        if self.drafter is not None and self.cfg.num_draft_tokens > 0 and self.drafter.usable:
            return False
        return not self.cfg.draft_hidden and not any(
            r.grammar is not None or (r.penalties is not None and r.penalties.spec.reads_output) for r in self.running)

    async def _submit(self, seqs: list[PlannedSeq]) -> "_InFlight":
        self._grammar_masks(seqs)
        plan = build_step_plan(seqs, self.pool.block_size, self._state_copies(seqs)) if seqs else rank_pb2.StepPlan()
        plan.want_hidden = self.drafter is not None and self.cfg.draft_hidden
        loads: list[Snapshot] = []
        if self.prefix is not None and self.prefix.tiers is not None:
            plan.tier_moves.extend(self.prefix.tiers.take_moves())
            loads = self.prefix.take_loads()
        self.rounds += 1
        now = time.monotonic()
        for s in seqs:
            s.req.last_round = self.rounds
            if s.req.t_scheduled is None:
                s.req.t_scheduled = now
        span = contextlib.ExitStack()
        span.enter_context(round_span(self.rounds, seqs, plan))  # before the rank set seals the plan
        try:
            rnd = await self.ranks.submit(plan)
        except BaseException:
            span.close()
            raise
        for s in seqs:
            s.req.plan_rows(s)
        return _InFlight(seqs, rnd, span, time.monotonic(), loads)

    async def _collect(self, f: "_InFlight") -> None:
        try:
            sampled = await self.ranks.collect(f.round)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("round %d: %d seqs, %d rows, %d sampled, %.1f ms", f.round.plan.round, len(f.seqs),
                          sum(len(s.token_ids) for s in f.seqs), len(sampled), (time.monotonic() - f.t0) * 1e3)
            self._commit(f.seqs, sampled, self.ranks.last_accepted, self.ranks.last_hidden,
                         self.ranks.last_logprobs)
            self._loads_back(f.loads, self.ranks.last_tier_bad)
        finally:
            f.span.close()

    async def _drain(self, inflight: collections.deque["_InFlight"]) -> None:
        """After a loop error with the ranks still in lock-step: read what is still in flight (each stream must stay
        in round order) and drop it; its requests are finished already."""
        while inflight:
            f = inflight.popleft()
            try:
                await self._collect(f)
            except Exception:  # noqa: BLE001 — the round's requests are failed already
                log.warning("dropped round %d after a loop error", f.round.plan.round)

    # -- prefix cache ---------------------------------------------------------------------------------------------
    def _match(self, req: Request) -> Match | None:
        if self.prefix is None:
            return None
        if req.block_hashes is None:  # full blocks of [0, prompt_len - 1): the last prompt token is always computed
            req.block_hashes = block_hashes(req.tokens, self.pool.block_size, req.prompt_len - 1, req.image_spans)
        return self.prefix.match(req.block_hashes, req.prompt_len)

    def _loads_back(self, loads: list[Snapshot], bad: list[bytes]) -> None:
        """A round with KV tier loads is back. A snapshot whose state or blocks failed a checksum on some rank is
        forgotten (every rank dropped the bad entries) and the requests that were to resume from it start over."""
        prefix = self.prefix
        if prefix is None or prefix.tiers is None or not (loads or bad):
            return
        gone = set(bad)
        for snap in loads:
            ok = state_key(snap.key) not in gone and not gone.intersection(snap.chain)
            prefix.loaded(snap, ok)
            if not ok:
                log.warning("kv tier: snapshot at %d failed its checksum on load; dropped, recomputing", snap.pos)
                for req in [r for r in self.running if r.resume is snap]:
                    self._requeue(req)
        prefix.tiers.bad(bad)
        self._wake.set()

    def _requeue(self, req: Request) -> None:
        """An admitted request that never ran goes back to the head of the queue (its resume point is gone)."""
        assert self.prefix is not None and req.reservation is not None and req.resume is not None
        self.pool.release(req.reservation)
        self.prefix.copied_out(req.resume)
        self.prefix.queries -= req.prompt_len
        self.prefix.hits -= req.cached_tokens
        req.reservation, req.resume = None, None
        req.num_cached = req.cached_tokens = 0
        req.snap_points = []
        self.running.remove(req)
        req.state = State.WAITING
        self.queue.push_front(req)

    def _fits(self, req: Request, m: Match | None = None) -> bool:
        """Whether `req` can be admitted now: a slot, and its blocks from the free list plus what evicting idle
        cached prefixes would free (a reused prefix's blocks are not needed again)."""
        if self.pool.free_slots < 1:
            return False
        if self.prefix is None:
            return self.pool.can_reserve(req.reserve_tokens)
        m = m if m is not None else self._match(req)
        need = self.pool.blocks_for(req.reserve_tokens) - m.pos // self.pool.block_size
        if need <= self.pool.free_blocks:
            return True
        return need <= self.pool.free_blocks + self.prefix.reclaimable(keep=m.snapshot)

    def _reserve(self, req: Request) -> None:
        m = self._match(req)
        if m is None:
            req.reservation = self.pool.reserve(req.reserve_tokens)
            return
        prefix, g = self.prefix, self.prefix.granule
        assert req.block_hashes is not None
        ts = prefix.tier_match(req.block_hashes, req.prompt_len, m.pos)
        if ts is not None:  # a deeper snapshot waits in a KV tier: load it (the request runs once it is back)
            snap = prefix.load(ts)
            if snap is not None:
                m = Match(snap, snap.pos, max(m.matched, snap.pos))
        shared: list[int] = []
        if m.snapshot is not None:
            shared = prefix.acquire(m.snapshot)
        need = self.pool.blocks_for(req.reserve_tokens) - len(shared)
        prefix.make_room(need)
        if need > self.pool.free_blocks:
            # `_fits` counted cached blocks that eviction could not free after all (a request that needs nearly the
            # whole pool, say): give the snapshot back and let the request wait instead of failing it.
            for b in shared:
                self.pool.drop(b)
            if m.snapshot is not None:
                prefix.copied_out(m.snapshot)
            raise PoolExhausted(f"need {need} free blocks, {self.pool.free_blocks} after evicting what can be")
        if m.snapshot is not None:
            req.resume = m.snapshot
            req.num_cached = req.cached_tokens = m.pos
        req.reservation = self.pool.reserve(req.reserve_tokens, shared)
        prefix.queries += req.prompt_len
        prefix.hits += m.pos
        # Snapshots to take during this prefill: at the fork point (the prompt shares more of a cached prefix than
        # any snapshot covers: the next request with this prefix resumes there) and at the prompt end (the largest
        # reuse point below it: a resend or a longer next turn of this conversation resumes there).
        fork = min(m.matched, req.prompt_len - 1) // g * g
        end = (req.prompt_len - 1) // g * g
        if fork > m.pos:
            req.snap_points.append((fork, True))
        if end > max(m.pos, fork):
            req.snap_points.append((end, False))

    def _state_copies(self, seqs: list[PlannedSeq]) -> list[tuple[int, int]]:
        """This plan's KDA state copies, in order: snapshots taken when the previous plan's chunks ended at a
        snapshot point (request slot -> snapshot slot; the slot still holds the state at that position), then
        resumes of requests whose first chunk is in this plan (snapshot slot -> request slot). Also registers the
        snapshots this plan's chunks reach, to be copied in the next plan."""
        if self.prefix is None:
            return []
        copies: list[tuple[int, int]] = []
        for slot, snap in self._takes_next:
            copies.append((slot, snap.slot))
            self.prefix.sent(snap)
        self._takes_next = []
        for s in seqs:
            req, res = s.req, s.req.reservation
            assert res is not None
            if req.resume is not None:
                copies.append((req.resume.slot, res.slot))
                self.prefix.copied_out(req.resume)
                req.resume = None
            end = s.start + len(s.token_ids)
            while req.snap_points and req.snap_points[0][0] <= end:
                pos, shared = req.snap_points.pop(0)
                if pos != end:
                    continue  # not reached exactly (cannot happen: chunks end at snapshot points)
                assert req.block_hashes is not None
                snap = self.prefix.take(req.block_hashes[: pos // self.pool.block_size], res.blocks, shared=shared)
                if snap is not None:
                    self._takes_next.append((res.slot, snap))
        return copies

    def _admit(self) -> None:
        """Move waiting requests to running, in queue order, while a slot and their full reservation fit (reply
        replays give their slot and blocks up to a request that needs them)."""
        while True:
            head = self.queue.head()
            if head is None:
                return
            if len(self.running) >= self.max_running or not self._fits(head):
                if self._cancel_replay():
                    continue
                return  # strict order: nobody overtakes a head that does not fit yet
            try:
                self._reserve(head)
            except PoolExhausted as exc:
                log.info("%s waits for blocks: %s", head.id, exc)
                return
            self.queue.pop_head()
            head.state = State.RUNNING
            if head.spans is not None:
                head.spans.admitted()
            self.running.append(head)
            assert head.reservation is not None
            log.info("admitted %s: prompt %d (%d cached), max_tokens %d, %d blocks, slot %d, waited %.3f s "
                     "(running %d, waiting %d, free blocks %d)", head.id, head.prompt_len, head.cached_tokens,
                     head.max_tokens, len(head.reservation.blocks), head.reservation.slot,
                     time.monotonic() - head.t_accepted, len(self.running), len(self.queue), self.pool.free_blocks)

    def _draft_budget(self, req: Request) -> int:
        """Drafts worth asking for: a window yields up to k + 1 tokens, so k < tokens still allowed. That also
        keeps the window's rows (positions num_cached .. num_cached + k) inside the request's reservation, which
        covers prompt + max_tokens positions."""
        left = min(req.max_tokens - len(req.generated), req.max_model_len - len(req.tokens))
        return max(0, min(self.cfg.num_draft_tokens, left - 1))

    async def _propose(self) -> dict[str, list[int]]:
        """Drafts for this round's decoders from the drafter; {} without one, or when it is down or slow."""
        if self.drafter is None or self.cfg.num_draft_tokens < 1 or not self.drafter.usable:
            return {}
        want = [(r, self._draft_budget(r)) for r in self.running
                if not r.prefilling and not r.no_draft and r.abort_reason is None]
        want = [(r, k) for r, k in want if k > 0]
        if not want:
            return {}
        with propose_span([r for r, _ in want]) as metadata:
            drafts = await self.drafter.propose([(r.id, r.tokens, k, r.last_hidden) for r, k in want], metadata)
        if drafts is None:
            return {}
        return {r.id: d for (r, _), d in zip(want, drafts) if d}

    @staticmethod
    def _grammar_masks(seqs: list[PlannedSeq]) -> None:
        """Masks for the sample rows of constrained requests; a verify window keeps only the drafts its grammar
        allows (a forbidden draft would be rejected anyway: the rank's masked sample can never equal it)."""
        for s in seqs:
            g = s.req.grammar
            if g is None or not s.sample:
                continue
            if s.verify:
                s.masks, kept = g.window(s.token_ids[1:])
                s.token_ids = s.token_ids[: 1 + len(kept)]
                s.verify = bool(kept)
            else:
                s.masks = [g.mask()]

    def _commit(self, seqs: list[PlannedSeq], sampled: list[int], accepted: list[int] | None = None,
                hidden=None, logprobs: tuple[list[float], list[list[int]], list[list[float]]] | None = None
                ) -> None:
        pos = 0  # index of the sequence's first sample in `sampled` (and `hidden`)
        for i, s in enumerate(seqs):
            n_samples = len(s.token_ids) if s.verify else (1 if s.sample else 0)
            samples = sampled[pos : pos + n_samples]
            first = pos
            pos += n_samples
            req = s.req
            req.rows_back(s)
            if req.release_deferred and req.pending_rows == 0 and req.reservation is not None:
                req.release_deferred = False  # the last round writing its blocks and slot is done
                self.pool.release(req.reservation)
                self._wake.set()
            if req.state is not State.RUNNING or req.abort_reason is not None:
                continue  # finished or aborted meanwhile: its rows are dropped (an abort is reaped below)
            if not s.sample:
                req.commit(len(s.token_ids), None)
                if req.replay:
                    if not req.prefilling:
                        self._end_replay(req)  # its snapshot at the end is registered; the copy goes out next
                    continue
                req.emit_progress()  # one more prefill chunk is in
                continue
            if s.verify:
                a = accepted[i] if accepted and i < len(accepted) else 0
                req.drafted_tokens += s.num_drafts
                req.accepted_tokens += a
                self.drafted_total += s.num_drafts
                self.accepted_total += a
                self.windows_total += 1
                new = samples[: a + 1]  # the accepted drafts (equal to our samples) and the bonus sample
                rows = [1] * len(new)
            else:
                new, rows = samples, [len(s.token_ids)]
            out: list[int] = []
            stop = None
            for n_rows, token in zip(rows, new):
                req.commit(n_rows, token)
                out.append(token)
                stop = req.stop_reason()
                if stop is not None:
                    break
            if hidden is not None:
                req.last_hidden = hidden[first + len(out) - 1]
            lp = None
            if logprobs is not None and req.logprobs_k >= 0:
                rows_of = range(first, first + len(out))  # the token of sample row j is out[j - first]
                k = req.logprobs_k
                lp = TokenLogprobs([logprobs[0][j] for j in rows_of], [logprobs[1][j][:k] for j in rows_of],
                                   [logprobs[2][j][:k] for j in rows_of])
            req.emit_tokens(out, lp)
            if req.grammar is not None:  # stopping tokens too: a grammar that failed in `mask` allowed only EOS
                error = req.grammar.commit(out)
                if error is not None:
                    self._finish(req, generate_pb2.FINISH_ERROR, error=error)
                    continue
            if stop is not None:
                self._finish(req, stop[0], stop_token_id=stop[1])
        self._reap_aborted()

    def _reap_aborted(self) -> None:
        for req in [r for r in self.running if r.abort_reason is not None]:
            self._finish(req, generate_pb2.FINISH_ABORTED, note=req.abort_reason or "")

    def _finish(self, req: Request, reason: int, *, stop_token_id: int = -1, error: str = "", note: str = "") -> None:
        """Finish a live request: free its blocks and slot, drop it from every list, send the final event.

        `error` goes to the client (FINISH_ERROR only); `note` only to the log (why it was aborted)."""
        if req.state is State.FINISHED:
            return
        if req.replay:
            self._end_replay(req)
            return
        was_running = req.state is State.RUNNING
        if req.resume is not None and self.prefix is not None:  # admitted but never planned
            self.prefix.copied_out(req.resume)
            req.resume = None
        if was_running and reason in (generate_pb2.FINISH_STOP, generate_pb2.FINISH_LENGTH):
            self._start_replay(req)  # takes over the reservation when there is a reply worth caching
        if req.reservation is not None:
            if req.pending_rows:  # a round in flight still writes its blocks and slot: free them once it is back
                req.release_deferred = True
            else:
                self.pool.release(req.reservation)
        if was_running:
            self.running.remove(req)
        else:
            self.queue.remove(req)
        self.live.pop(req.id, None)
        f = req.finish(reason, stop_token_id=stop_token_id, error=error)
        if was_running and req.t_scheduled is not None and req.t_finished is not None:
            self.queue.record_service(req.t_finished - req.t_scheduled)
        level = logging.WARNING if reason == generate_pb2.FINISH_ERROR else logging.INFO
        log.log(level, "finished %s: %s%s, prompt %d (%d cached), completion %d, drafts %d/%d accepted, queue %.3f s, "
                "prefill %.3f s, decode %.3f s%s",
                req.id, _REASON.get(reason, reason), f" (id {stop_token_id})" if stop_token_id >= 0 else "",
                f.prompt_tokens, f.cached_tokens, f.completion_tokens, f.accepted_tokens, f.drafted_tokens, f.queue_s,
                f.prefill_s, f.decode_s,
                f" — {error or note}" if error or note else "")
        self._wake.set()  # blocks or a slot came free: admission may proceed

    # -- reply reuse ----------------------------------------------------------------------------------------------
    def _start_replay(self, req: Request) -> None:
        """Cache a finished request's prompt + reply for the conversation's next turn. The reply's rows were
        decoded (recurrent KDA, decode arithmetic), so its blocks and state are not what a prompt computes; the
        next turn resumed from them would differ in the last bits from the same prompt computed fresh. Instead a
        background prefill (a "replay") recomputes the tokens from the deepest snapshot on their chain up to the
        last 64-token grid point E <= len(tokens) in the request's own blocks and slot, with prompt arithmetic, and
        snapshots E: exactly what a fresh prefill of the next turn computes, so resuming there keeps every
        exactness promise. It runs only when nothing waits, and gives way to any request that needs its slot or
        blocks (`_cancel_replay`)."""
        prefix = self.prefix
        if prefix is None or not self.cfg.reply_reuse or len(self.queue) or req.reservation is None:
            return
        bs, g = self.pool.block_size, prefix.granule
        end = len(req.tokens) // g * g
        if end <= (req.prompt_len - 1) // g * g:
            return  # the reply reaches no grid point past the prompt's own snapshot
        hashes = block_hashes(req.tokens, bs, end, req.image_spans)
        m = prefix.match(hashes, end + 1)
        if m.pos >= end:
            return
        rep = Request(request_id=f"{req.id}:reply", prompt=req.tokens[:end], max_tokens=1, sampling=req.sampling,
                      stop_ids=frozenset(), eos_ids=frozenset(), priority=generate_pb2.PRIORITY_BACKGROUND,
                      order=next(self._order), max_model_len=req.max_model_len, images=req.images)
        rep.replay, rep.state, rep.block_hashes = True, State.RUNNING, hashes
        rep.reservation, req.reservation = req.reservation, None
        rep.num_cached = m.pos
        rep.after = req  # its rows still in flight (a decode row past EOS) come back before the replay is planned
        if m.snapshot is not None:
            prefix.pin(m.snapshot)
            rep.resume = m.snapshot
        rep.snap_points = [(end, False)]
        self.running.append(rep)
        log.debug("replaying %s's reply: positions %d..%d for the prefix cache", req.id, m.pos, end)

    def _end_replay(self, rep: Request) -> None:
        """A replay is done (its snapshot is registered) or gives way: free its slot and blocks."""
        if rep.state is State.FINISHED:
            return
        if rep.resume is not None and self.prefix is not None:
            self.prefix.copied_out(rep.resume)
            rep.resume = None
        rep.state = State.FINISHED
        self.running.remove(rep)
        res, rep.reservation = rep.reservation, None
        if res is None:
            return
        parent = rep.after
        if rep.pending_rows:
            rep.reservation, rep.release_deferred = res, True
        elif parent is not None and parent.pending_rows:  # the parent's last rows are not back yet
            parent.reservation, parent.release_deferred = res, True
        else:
            self.pool.release(res)
        self._wake.set()

    def _cancel_replay(self) -> bool:
        """Give the newest replay's slot and blocks to a waiting request; False when no replay runs."""
        reps = [r for r in self.running if r.replay]
        if not reps:
            return False
        self._end_replay(reps[-1])
        return True

    def _fail_all(self, error: str) -> None:
        for req in list(self.running) + list(self.queue):
            self._finish(req, generate_pb2.FINISH_ERROR, error=error)

    def _on_rank_failure(self, err: RankError) -> None:
        for req in self.running:  # rounds in flight died with the ranks: nothing of them will come back
            req.pending_rows = req.pending_samples = 0
        self._fail_all(err.public)
        self._wake.set()
        if not self._stopping and (self._recovery is None or self._recovery.done()):
            self._recovery = asyncio.get_running_loop().create_task(self._recover(), name="rank-recovery")

    async def _recover(self) -> None:
        """Serve again once the rank group has restarted, with caches as empty as the new ranks' caches."""
        if await self.ranks.wait_for_new_group():
            # No await between the streams reopening and this: no round is planned against the old pool.
            self._new_caches()
            log.info("rank group back: pool and prefix index rebuilt empty (%d blocks, %d request slots)",
                     self.pool.num_blocks, self.pool.num_slots)
            self._wake.set()
