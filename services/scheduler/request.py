"""One request's state inside the scheduler, and the events it streams back to the gateway.

Positions: `tokens` is prompt + generated ids; `num_cached` is how many of them the ranks hold in the cache. While
prefilling, the next rows are prompt[num_cached : num_cached + chunk]. Once the prompt is in, the invariant is
`num_cached == len(tokens) - 1`: the last sampled token is the only one not yet fed back, and the next decode row
is that token at position `num_cached`.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.tensors import to_proto
from services.scheduler.drafts import DraftRows
from services.scheduler.pool import Reservation
from services.scheduler.prefix import Snapshot
from services.scheduler.round_output import PromptScores, TokenLogprobs
from twinspark.v1 import generate_pb2

if TYPE_CHECKING:
    from services.scheduler.grammar import RequestGrammar
    from services.scheduler.penalties import PenaltyState
    from services.scheduler.thinking import ThinkingBudget
    from services.scheduler.tracing import RequestSpans

_MASK64 = (1 << 64) - 1


def derive_seed(prompt: list[int]) -> int:
    """The seed of a request that did not give one: the first 8 bytes (little-endian u64) of sha256 over the prompt
    as little-endian int32 — so the same request always gets the same reply (docs/design.md §5.4)."""
    digest = hashlib.sha256(struct.pack(f"<{len(prompt)}i", *prompt)).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int  # u64

    @property
    def seed_i64(self) -> int:
        """The seed's u64 bits as a signed int64 (how StepPlan.seed carries them)."""
        s = self.seed & _MASK64
        return s - (1 << 64) if s >= 1 << 63 else s


# StepPlan.token_ids' "the token you sampled last for this slot" (services/rank_worker/executor.py)
PENDING_TOKEN = -1


class State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    def __init__(self, *, request_id: str, prompt: list[int], max_tokens: int, sampling: SamplingSpec,
                 stop_ids: frozenset[int], eos_ids: frozenset[int], priority: int, order: int,
                 max_model_len: int, no_draft: bool = False, grammar: RequestGrammar | None = None,
                 logprobs_k: int = -1, images: list[generate_pb2.Image] | None = None,
                 penalties: PenaltyState | None = None, thinking: ThinkingBudget | None = None,
                 prompt_logprobs: int | None = None) -> None:
        self.id = request_id
        self.prompt_len = len(prompt)
        self.tokens: list[int] = list(prompt)
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.eos_ids = eos_ids  # already empty when the request asked for ignore_eos
        self.priority = priority
        self.order = order  # arrival number: FCFS tie-breaker everywhere
        self.max_model_len = max_model_len
        self.num_cached = 0
        self.no_draft = no_draft
        self.grammar = grammar  # structured output: masks every sample row (drafts included)
        self.logprobs_k = logprobs_k  # -1: no logprobs; k >= 0: each token's logprob and the top k
        self.penalties = penalties  # penalties / logit_bias / min_tokens and the history they read (None: none)
        self.thinking = thinking  # the thinking budget: forces the end of thinking once spent (None: unbounded)
        # Prompt logprobs with the top k (None: none). Such a request prefills its whole prompt itself (never
        # resumes from the prefix cache: kv_cache.py), and its prompt chunks' rows are scored on the ranks.
        self.prompt_logprobs = prompt_logprobs
        self.images = images or []  # prompt images, by offset (the ranks embed them at their placeholder rows)
        self.drafted_tokens = 0  # drafts verified for this request
        self.accepted_tokens = 0  # of which the ranks accepted
        self.last_hidden = None  # the target's hidden state at the row that sampled the last token (MTP drafts)
        self.draft_rows = DraftRows()  # context rows the drafter has not been sent yet (DFlash drafts)
        self.reservation: Reservation | None = None
        # Prefix cache (services/scheduler/prefix.py): prompt tokens served from it, the prompt's block hash chain
        # (computed once), the snapshot this request resumes from until its state copy goes out, and the positions
        # (ascending, with "shared prefix?") where a prefill chunk must end so a snapshot can be taken there.
        self.cached_tokens = 0
        self.block_hashes: list[bytes] | None = None
        self.resume: Snapshot | None = None
        self.snap_points: list[tuple[int, bool]] = []
        # Rows and samples of rounds submitted to the ranks but not committed yet (the engine plans round n+1 while
        # round n computes); a finished request whose rows are still in flight frees its blocks after them.
        self.pending_rows = 0
        self.pending_samples = 0
        self.release_deferred = False
        # A reply replay (replay.py): prefills a finished request's prompt + reply for the prefix cache,
        # samples nothing, streams nothing, and gives way to any request that needs its slot or blocks.
        self.replay = False
        self.after: Request | None = None  # a replay's finished request, whose last rows may still be in flight
        self.state = State.WAITING
        self.abort_reason: str | None = None  # set by Abort / cancellation; acted on at the next round boundary
        self.last_round = 0  # last round this request had rows in (fair order when the budget is short)
        # One queue per request: the engine puts events, the Generate handler streams them. Unbounded on purpose:
        # the engine must never block on a slow client (one slow reader would stall every stream).
        self.events: asyncio.Queue[generate_pb2.GenerateEvent] = asyncio.Queue()
        self.t_accepted = time.monotonic()
        self.t_scheduled: float | None = None
        self.t_first_token: float | None = None
        self.t_finished: float | None = None
        self.finished: generate_pb2.Finished | None = None
        self.spans: RequestSpans | None = None  # set by the engine when tracing is on

    # -- where it stands ------------------------------------------------------------------------------------------
    @property
    def prefilling(self) -> bool:
        return self.num_cached < self.prompt_len

    @property
    def planned(self) -> int:
        """Positions covered by committed rows and rows in flight: where the next planned row starts."""
        return self.num_cached + self.pending_rows

    @property
    def prompt_left(self) -> bool:
        """Prompt rows remain to be planned."""
        return self.planned < self.prompt_len

    @property
    def ready(self) -> bool:
        """Whether its next rows may be planned: not while the snapshot it resumes from is still coming back from
        a KV tier, nor (a replay) while its finished request's last rows are in flight."""
        if self.resume is not None and self.resume.loading:
            return False
        return self.after is None or not self.after.pending_rows

    @property
    def wants_rows(self) -> bool:
        """Whether a new round may give this request rows: prompt left, or tokens still allowed once every sample in
        flight is counted (a request stopping at an EOS in flight gets one row too many, dropped at commit)."""
        if self.prompt_left:
            return True
        if self.replay:  # a reply replay only prefills (it samples nothing): once its rows are planned it is done
            return False
        return self.tokens_left > 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def reserve_tokens(self) -> int:
        """Positions reserved at admission. The last sampled token is never written, so prompt + max_tokens - 1
        would do; one spare position keeps room for a verify window's bonus row later."""
        return self.prompt_len + self.max_tokens

    def next_rows(self, budget: int) -> tuple[int, list[int]]:
        """(start, token ids) of this request's rows for a round with `budget` tokens left for it. A decode row whose
        input is a sample still in flight says PENDING_TOKEN: the ranks put in the token they sampled last."""
        start = self.planned
        if self.prompt_left:
            return start, self.tokens[start : start + budget]
        return start, [PENDING_TOKEN] if self.pending_samples else self.tokens[-1:]

    def plan_rows(self, seq) -> None:
        """A round with this request's rows (`seq`, a PlannedSeq) was sent to the ranks."""
        if not seq.verify:  # verify windows are never pipelined: nothing to count ahead
            self.pending_rows += seq.positions
            self.pending_samples += seq.samples

    def rows_back(self, seq) -> None:
        """That round's result is in (committed or dropped)."""
        if not seq.verify:
            self.pending_rows -= seq.positions
            self.pending_samples -= seq.samples

    @property
    def tokens_left(self) -> int:
        """Tokens it may still sample once the samples in flight are counted (max_tokens, the model's window)."""
        n = len(self.tokens) + self.pending_samples
        return min(self.max_tokens - (n - self.prompt_len), self.max_model_len - n)

    @property
    def image_spans(self) -> list[tuple[int, int, bytes]]:
        """(offset, tokens, digest) of each image: what the prefix cache keys its blocks by."""
        return [(im.offset, im.tokens, im.digest) for im in self.images]

    # -- commit ---------------------------------------------------------------------------------------------------
    def commit(self, n_rows: int, sampled: int | None) -> None:
        """The ranks wrote `n_rows` rows; `sampled` is the next token when this round sampled for us."""
        self.num_cached += n_rows
        if sampled is not None:
            if self.t_first_token is None:
                self.t_first_token = time.monotonic()
                if self.spans is not None:
                    self.spans.first_token()
            self.tokens.append(sampled)
            if self.penalties is not None:
                self.penalties.counts[sampled] += 1

    def stop_reason(self) -> tuple[int, int] | None:
        """(FinishReason, stopping id or -1) when the last committed token ends the request.

        A stop id beats the length limit when both hit on the same token (the reply really did stop there)."""
        if not self.generated:
            return None
        last = self.tokens[-1]
        if last in self.eos_ids or last in self.stop_ids:
            return generate_pb2.FINISH_STOP, last
        if len(self.generated) >= self.max_tokens or len(self.tokens) >= self.max_model_len:
            return generate_pb2.FINISH_LENGTH, -1
        return None

    # -- events ---------------------------------------------------------------------------------------------------
    def emit_tokens(self, new: list[int], logprobs: TokenLogprobs | None = None) -> None:
        # A stopping EOS / stop id is streamed like any other token (the gateway hides it from text; it still
        # counts in completion_tokens and shows in return_token_ids, as vLLM does).
        chunk = generate_pb2.TokenChunk(ids=to_proto(new))
        if logprobs is not None:
            k = max(0, self.logprobs_k)
            chunk.logprobs.CopyFrom(to_proto(logprobs.chosen, "float32"))
            chunk.top_ids.CopyFrom(to_proto(torch.tensor(logprobs.top_ids, dtype=torch.int32).view(len(new), k)))
            chunk.top_logprobs.CopyFrom(to_proto(
                torch.tensor(logprobs.top_logprobs, dtype=torch.float32).view(len(new), k)))
        self.events.put_nowait(generate_pb2.GenerateEvent(tokens=chunk))

    def emit_prompt_logprobs(self, start: int, scores: PromptScores) -> None:
        """The scores of prompt tokens [start, start + n), cut to the top k the request asked for."""
        k = self.prompt_logprobs or 0
        n = len(scores.logprobs)
        self.events.put_nowait(generate_pb2.GenerateEvent(prompt_logprobs=generate_pb2.PromptLogprobs(
            start=start, logprobs=to_proto(scores.logprobs, "float32"), ranks=to_proto(scores.ranks),
            top_ids=to_proto(torch.tensor([t[:k] for t in scores.top_ids], dtype=torch.int32).view(n, k)),
            top_logprobs=to_proto(torch.tensor([t[:k] for t in scores.top_logprobs],
                                               dtype=torch.float32).view(n, k)))))

    def progress_event(self) -> generate_pb2.GenerateEvent | None:
        """A keepalive while nothing else is streaming: queued or prefilling; None once tokens flow."""
        if self.state is State.WAITING:
            phase = generate_pb2.PHASE_QUEUED
        elif self.state is State.RUNNING and self.prefilling:
            phase = generate_pb2.PHASE_PREFILLING
        else:
            return None
        return generate_pb2.GenerateEvent(progress=generate_pb2.Progress(phase=phase, prefilled=self.num_cached))

    def emit_progress(self) -> None:
        ev = self.progress_event()
        if ev is not None:
            self.events.put_nowait(ev)

    def finish(self, reason: int, *, stop_token_id: int = -1, error: str = "") -> generate_pb2.Finished:
        """Close the request: state, timings and the final event. The caller releases the reservation."""
        now = time.monotonic()
        self.t_finished = now
        self.state = State.FINISHED
        scheduled = self.t_scheduled if self.t_scheduled is not None else now
        first = self.t_first_token if self.t_first_token is not None else now
        self.finished = generate_pb2.Finished(
            reason=reason, prompt_tokens=self.prompt_len, completion_tokens=len(self.generated),
            cached_tokens=self.cached_tokens,
            stop_token_id=stop_token_id, error=error,
            drafted_tokens=self.drafted_tokens, accepted_tokens=self.accepted_tokens,
            queue_s=scheduled - self.t_accepted,
            prefill_s=max(0.0, first - scheduled) if self.t_scheduled is not None else 0.0,
            decode_s=max(0.0, now - first) if self.t_first_token is not None else 0.0,
        )
        if self.spans is not None:
            self.spans.finished(self.finished)
        self.events.put_nowait(generate_pb2.GenerateEvent(finished=self.finished))
        return self.finished
