"""The scheduler proper: the waiting queue, the running requests and the KV cache, turned into one round's plan at a
time, and each round's result turned back into tokens, stops and events.

Synchronous and free of I/O (vLLM v1's split): engine.py carries plans to the ranks and results back and calls in
here between its awaits, so the same state and calls always give the same plans. Every call leaves the state
consistent: `add` / `abort` come from the RPC handlers at any point between two rounds.

Rounds overlap (engine.py `PIPELINE_DEPTH`): a round may be planned while earlier ones are in flight, so a request
counts its rows in flight (`Request.pending_rows`), and a finished request keeps its blocks and slot until they are
back (`KVCacheManager.release`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from opentelemetry.context import Context

from services.scheduler.admission import AdmissionQueue
from services.scheduler.batcher import PlannedSeq, build_step_plan, plan_round
from services.scheduler.grammar import GrammarBook
from services.scheduler.kv_cache import KVCacheManager, snapshot_slots
from services.scheduler.kv_events import KVEvents
from services.scheduler.model_info import ModelInfo
from services.scheduler.pool import PoolExhausted
from services.scheduler.prefix import KDA_CHUNK, Snapshot
from services.scheduler.replay import reply_replay
from services.scheduler.request import Request, State
from services.scheduler.round_masks import apply_round_masks
from services.scheduler.round_output import PromptScores, RoundOutput, TokenLogprobs
from services.scheduler.tracing import RequestSpans
from services.scheduler.validation import validate
from twinspark.v1 import generate_pb2, rank_pb2

if TYPE_CHECKING:
    from services.scheduler.engine import EngineConfig

log = logging.getLogger("twinspark.scheduler")

_REASON = {generate_pb2.FINISH_STOP: "stop", generate_pb2.FINISH_LENGTH: "length",
           generate_pb2.FINISH_ABORTED: "aborted", generate_pb2.FINISH_ERROR: "error"}


@dataclass
class ScheduledRound:
    """One round as planned: its number, its sequences, the plan for the ranks, and the snapshots it loads from a KV
    tier (usable once it is back)."""

    number: int
    seqs: list[PlannedSeq]
    plan: rank_pb2.StepPlan
    loads: list[Snapshot]

    @property
    def steps(self) -> int:
        return max(1, self.plan.steps)

    @property
    def decode_only(self) -> bool:
        """Rows of decode steps only (no prompt chunk, no verify window): the rounds whose pace says how long a decode
        step takes (decode_steps.py)."""
        return bool(self.seqs) and not any(s.prompt or s.verify for s in self.seqs)


class RoundScheduler:
    def __init__(self, info: ModelInfo, cfg: EngineConfig, grammars: GrammarBook | None = None,
                 tier_listing: list[rank_pb2.TierEntry] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`grammars`: None without a tokenizer (structured output is refused); `tier_listing`: the disk KV tier
        entries every rank holds; `clock`: seconds, for when a reply replay may start."""
        self.budget = info.round_budget(cfg.max_num_batched_tokens)
        if cfg.max_num_seqs < 1 or self.budget < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.info = info
        self.cfg = cfg
        self.grammars = grammars
        snapshots = snapshot_slots(cfg, info)
        # vLLM's KV events for a router (kv_events.py): only with a prefix index to report on.
        self.kv_events = KVEvents(cfg.kv_events_endpoint, info.block_size) \
            if cfg.kv_events_endpoint and snapshots else None
        self.kv = KVCacheManager(info, snapshots, tier_listing or [], events=self.kv_events)
        self.queue = AdmissionQueue(cfg.max_waiting)
        self.running: list[Request] = []
        self.live: dict[str, Request] = {}  # waiting + running, by request id
        # A running request holds a KDA slot, so the ranks' slot count caps concurrency too.
        self.max_running = min(cfg.max_num_seqs, self.kv.pool.num_slots)
        if self.budget < self.max_running + KDA_CHUNK:
            # Prompts are cut only on the 64-token KDA grid (batcher.py): a round must hold every decode row and
            # one whole grid chunk, or a long prompt could never make progress.
            raise ValueError(f"--max-num-batched-tokens ({self.budget}) must be at least the running "
                             f"sequences ({self.max_running}) + {KDA_CHUNK}")
        self.rounds = 0
        self.drafted_total = 0  # drafts verified, all requests
        self.accepted_total = 0  # of which accepted
        self.windows_total = 0  # verify windows run
        self._order = itertools.count()
        self._clock = clock
        self._busy_at = clock()  # when a request last ran or waited (reply replays start after cfg.reply_reuse_delay)

    def new_caches(self, tier_listing: list[rank_pb2.TierEntry]) -> None:
        """An empty pool and prefix index: the rank group restarted and its caches are empty."""
        self.kv = KVCacheManager(self.info, self.kv.snapshots, tier_listing, old=self.kv, events=self.kv_events)
        if self.kv_events is not None:
            self.kv_events.cleared()

    # -- requests in ----------------------------------------------------------------------------------------------
    def add(self, msg: generate_pb2.GenerateRequest, trace_parent: Context | None = None) -> Request:
        """Validate and queue; raises InvalidRequest or QueueFull (nothing is queued then). `trace_parent`: the
        caller's trace context when tracing is on (the request's spans go under it)."""
        req = validate(msg, self.info, grammars=self.grammars, live=self.live, order=self._order)
        self.admit()  # let older waiters in first, so the bound below counts only requests that must wait
        runs_now = not len(self.queue) and len(self.running) < self.max_running and self.kv.fits(req)
        self.queue.push(req, capacity=self.max_running, force=runs_now)
        self.live[req.id] = req
        if trace_parent is not None:
            req.spans = RequestSpans(trace_parent, req.id, req.prompt_len)
        req.emit_progress()  # PHASE_QUEUED at acceptance: the gateway can answer headers / keepalives now
        # Admitting here (not only at the next round) is safe: the rounds in flight were planned already and new
        # running requests only join the next plan.
        self.admit()
        return req

    def abort(self, request_id: str, reason: str = "aborted") -> bool:
        """Abort a live request; False when no such request is waiting or running."""
        req = self.live.get(request_id)
        if req is None or req.state is State.FINISHED:
            return False
        if req.state is State.WAITING:
            self.queue.remove(req)
            self._finish(req, generate_pb2.FINISH_ABORTED, note=reason)
        elif req.abort_reason is None:
            # It may have rows in a round in flight: it is finished and freed when that round is back.
            req.abort_reason = reason
        return True

    def admit(self) -> None:
        """Move waiting requests to running, in queue order, while a slot and their full reservation fit (reply
        replays give their slot and blocks up to a request that needs them)."""
        while True:
            head = self.queue.head()
            if head is None:
                return
            if len(self.running) >= self.max_running or not self.kv.fits(head):
                if self._cancel_replay():
                    continue
                return  # strict order: nobody overtakes a head that does not fit yet
            try:
                self.kv.reserve(head)
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
                     time.monotonic() - head.t_accepted, len(self.running), len(self.queue), self.kv.pool.free_blocks)

    # -- a round --------------------------------------------------------------------------------------------------
    def draft_wants(self) -> list[tuple[Request, int]]:
        """The decoders worth asking drafts for, with how many: a window yields up to k + 1 tokens, so k < tokens
        still allowed. That also keeps the window's rows (positions num_cached .. num_cached + k) inside the
        request's reservation, which covers prompt + max_tokens positions."""
        want = []
        for r in self.running:
            if r.prefilling or r.no_draft or r.abort_reason is not None:
                continue
            k = max(0, min(self.cfg.num_draft_tokens, r.tokens_left - 1))
            if k > 0:
                want.append((r, k))
        return want

    @property
    def reads_last_samples(self) -> bool:
        """Whether a running request's next rows depend on its last samples themselves, not only on how many there
        are: grammar masks, penalties that count the generated tokens (logit_bias and min_tokens do not), and a
        thinking budget whose next row may be forced (thinking.py)."""
        return any(r.grammar is not None or (r.penalties is not None and r.penalties.spec.reads_output)
                   or (r.thinking is not None and r.thinking.needs_samples(r.pending_samples))
                   for r in self.running)

    def schedule(self, drafts: dict[str, list[int]] | None = None, steps: int = 1) -> ScheduledRound | None:
        """The next round (`drafts`: request id -> proposed drafts for its decode row; `steps`: decode steps wanted,
        see `_steps`); None when there is nothing to send: no rows to run and no KV tier moves waiting."""
        plannable = self._plannable()
        seqs = plan_round(plannable, self.budget, drafts)
        if not seqs and not self.kv.tier_work:
            return None
        apply_round_masks(seqs, self.info.vocab_size)
        k = self._steps(seqs, steps, plannable)
        for s in seqs:
            s.steps = k
        plan = build_step_plan(seqs, self.kv.pool.block_size, self.kv.state_copies(seqs)) if seqs \
            else rank_pb2.StepPlan()  # tier moves only: a request waits for its load
        moves, loads = self.kv.take_tier_moves()
        plan.tier_moves.extend(moves)
        self.rounds += 1
        now = time.monotonic()
        for s in seqs:
            s.req.last_round = self.rounds
            if s.req.t_scheduled is None:
                s.req.t_scheduled = now
        return ScheduledRound(self.rounds, seqs, plan, loads)

    @staticmethod
    def _steps(seqs: list[PlannedSeq], want: int, plannable: list[Request]) -> int:
        """Decode steps for a round of `seqs` (decode_steps.py): `want` when the round is plain decode rows only —
        no plannable request has prompt rows waiting (they go first; a reply replay held back is not plannable), no
        verify window, no grammar or penalties (their rows read the samples or counts before them) — cut so that
        every step's row stays inside its request's reservation and before its thinking budget (no step's row is
        forced); else 1."""
        if want <= 1 or not seqs or any(r.prompt_left for r in plannable):
            return 1
        if any(s.prompt or s.verify or not s.sample or s.masks is not None or s.req.grammar is not None
               or s.req.penalties is not None for s in seqs):
            return 1
        return max(1, min(want, *(_free_rows(s.req) for s in seqs)))

    @staticmethod
    def sent(step: ScheduledRound) -> None:
        """The round went to the ranks: its rows are in flight."""
        for s in step.seqs:
            s.req.plan_rows(s)

    def commit(self, step: ScheduledRound, out: RoundOutput) -> None:
        """The round's result is in (round_output.py says what it holds): each sequence takes its samples, drafts,
        logprobs and prompt logprobs; the tier loads are settled."""
        accepted, scores, layers = out.accepted, out.scores, out.layers
        pos = 0  # index of the sequence's first sample in `sampled` (and `hidden`, `logprobs`)
        at = 0  # index of the sequence's first score row in `scores`
        row = 0  # index of the sequence's first packed row in `layers`
        for i, s in enumerate(step.seqs):
            if layers is not None:
                self._keep_draft_rows(s, layers[row : row + len(s.token_ids)], accepted[i] if accepted else 0)
            row += len(s.token_ids)
            n_samples = s.samples
            s.req.rows_back(s)
            self.kv.release_deferred(s.req)
            a = accepted[i] if accepted and i < len(accepted) else 0
            mine = scores.cut(at, at + s.scored) if s.scored and scores is not None else None
            self._commit_seq(s, out.sampled[pos : pos + n_samples], pos, a, out.hidden, out.logprobs, mine)
            pos += n_samples
            at += s.scored
        self.reap_aborted()
        self.kv.loads_back(step.loads, out.tier_bad, self._requeue_readers)

    @staticmethod
    def _keep_draft_rows(s: PlannedSeq, rows: torch.Tensor, accepted: int) -> None:
        """Keep the rows of a sequence's round that become its context for DFlash drafts: a prompt chunk's and a
        decode row's all, a verify window's first accepted + 1 (the last committed token and the accepted drafts;
        a stop inside the window finishes the request, so rows past it never matter)."""
        req = s.req
        if req.replay or req.no_draft or req.state is not State.RUNNING or req.abort_reason is not None:
            return
        req.draft_rows.add(s.start, rows[: accepted + 1] if s.verify else rows)

    def _commit_seq(self, s: PlannedSeq, samples: list[int], first: int, accepted: int,
                    hidden: torch.Tensor | None, logprobs: TokenLogprobs | None,
                    scores: PromptScores | None = None) -> None:
        """One sequence's part of a round's result; `first`: the index of its first sample row; `scores`: its
        chunk's prompt logprobs."""
        req = s.req
        if req.state is not State.RUNNING or req.abort_reason is not None:
            return  # finished or aborted meanwhile: its rows are dropped (an abort is reaped after the round)
        if s.scored:
            if scores is None or len(scores.logprobs) != s.scored:
                self._finish(req, generate_pb2.FINISH_ERROR, error="the ranks returned no prompt logprobs")
                return
            req.emit_prompt_logprobs(s.start + 1, scores)
        if not s.sample:
            req.commit(len(s.token_ids), None)
            if not req.replay and not req.prefilling and req.max_tokens == 0:
                self._finish(req, generate_pb2.FINISH_LENGTH)  # prefill only (scoring): nothing to generate
            elif not req.replay:
                req.emit_progress()  # one more prefill chunk is in
            elif not req.prefilling:
                self._end_replay(req)  # its snapshot at the end is registered; the copy goes out next
            return
        if s.verify:
            req.drafted_tokens += s.num_drafts
            req.accepted_tokens += accepted
            self.drafted_total += s.num_drafts
            self.accepted_total += accepted
            self.windows_total += 1
            new = samples[: accepted + 1]  # the accepted drafts (equal to our samples) and the bonus sample
            rows = [1] * len(new)
        else:  # the last row's sample, then one per further decode step (one row each)
            new, rows = samples, [len(s.token_ids)] + [1] * (len(samples) - 1)
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
        req.emit_tokens(out, _logprobs_of(req, logprobs, first, len(out)))
        # Stopping tokens too: a grammar that failed in `mask` allowed only EOS.
        for control in (req.thinking, req.grammar):
            error = control.commit(out) if control is not None else None
            if error is not None:
                self._finish(req, generate_pb2.FINISH_ERROR, error=error)
                return
        if stop is not None:
            self._finish(req, stop[0], stop_token_id=stop[1])

    def reap_aborted(self) -> None:
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
        self.kv.drop_resume(req)
        if was_running and reason in (generate_pb2.FINISH_STOP, generate_pb2.FINISH_LENGTH):
            self._start_replay(req)  # takes over the reservation when there is a reply worth caching
        if req.reservation is not None:
            self.kv.release(req.reservation, req)
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

    def _requeue_readers(self, snap: Snapshot) -> None:
        """The admitted requests that were to resume from `snap` never ran: back to the head of the queue (their
        resume point is gone)."""
        for req in [r for r in self.running if r.resume is snap]:
            self.kv.unreserve(req)
            self.running.remove(req)
            req.state = State.WAITING
            self.queue.push_front(req)

    # -- reply reuse (replay.py) ----------------------------------------------------------------------------------
    def _plannable(self) -> list[Request]:
        """The running requests a round may give rows: every one, less the reply replays not yet begun while the
        engine has not been idle for cfg.reply_reuse_delay (no request running or waiting)."""
        now = self._clock()
        if self.queue.head() is not None or any(not r.replay for r in self.running):
            self._busy_at = now
        if now - self._busy_at >= self.cfg.reply_reuse_delay:
            return self.running
        return [r for r in self.running if not r.replay or r.last_round]

    def replay_wait(self) -> float | None:
        """Seconds until a held reply replay may be planned (the loop sleeps at most this long when nothing else
        runs); None when no replay waits to begin."""
        if not any(r.replay and not r.last_round for r in self.running):
            return None
        return max(0.0, self._busy_at + self.cfg.reply_reuse_delay - self._clock())

    def _start_replay(self, req: Request) -> None:
        if not self.cfg.reply_reuse or len(self.queue):
            return  # a replay runs only when nothing waits
        rep = reply_replay(req, self.kv, self._order)
        if rep is not None:
            self.running.append(rep)

    def _end_replay(self, rep: Request) -> None:
        """A replay is done (its snapshot is registered) or gives way: free its slot and blocks."""
        if rep.state is State.FINISHED:
            return
        self.kv.drop_resume(rep)
        rep.state = State.FINISHED
        self.running.remove(rep)
        res, rep.reservation = rep.reservation, None
        if res is None:
            return
        parent = rep.after  # the replay's rows are back, but its finished request's last rows may not be
        holder = parent if not rep.pending_rows and parent is not None and parent.pending_rows else rep
        self.kv.release(res, holder)

    def _cancel_replay(self) -> bool:
        """Give the newest replay's slot and blocks to a waiting request; False when no replay runs."""
        reps = [r for r in self.running if r.replay]
        if not reps:
            return False
        self._end_replay(reps[-1])
        return True

    # -- failures -------------------------------------------------------------------------------------------------
    def fail_all(self, error: str) -> None:
        for req in list(self.running) + list(self.queue):
            self._finish(req, generate_pb2.FINISH_ERROR, error=error)

    def ranks_lost(self, error: str) -> None:
        """The rank group failed: the rounds in flight died with it (nothing of them will come back)."""
        for req in self.running:
            req.pending_rows = req.pending_samples = 0
        self.fail_all(error)

    def fail_running(self, error: str) -> None:
        """A bug in the loop: fail only what was running (the ranks are still in lock-step, and a new request
        starts at position 0 with a fresh slot state)."""
        for req in list(self.running):
            self._finish(req, generate_pb2.FINISH_ERROR, error=error)

    # -- figures --------------------------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests running for clients (reply replays are cache upkeep, not requests)."""
        return sum(1 for r in self.running if not r.replay)

    def pool_stats(self) -> generate_pb2.PoolStats:
        return self.kv.pool_stats([r for r in self.running if r.replay])


def _free_rows(req: Request) -> int:
    """Decode rows `req` may be given now without a sample of its own in between: the tokens it may still take,
    and while its thinking budget may still force a row, only the rows before the budget."""
    n = req.tokens_left
    th = req.thinking
    if th is not None and not th.ended:
        n = min(n, th.spec.budget - th.seen - req.pending_samples)
    return n


def _logprobs_of(req: Request, logprobs: TokenLogprobs | None, first: int, n: int) -> TokenLogprobs | None:
    """The logprobs of `req`'s `n` tokens committed from sample rows `first`.., cut to the top k it asked for."""
    if logprobs is None or req.logprobs_k < 0:
        return None
    rows, k = range(first, first + n), req.logprobs_k
    return TokenLogprobs([logprobs.chosen[j] for j in rows], [logprobs.top_ids[j][:k] for j in rows],
                         [logprobs.top_logprobs[j][:k] for j in rows])
