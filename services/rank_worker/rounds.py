"""What one round leaves behind: the work queued on the device (`Launched`) and the results read back
(`RoundResult`), the two halves of `Executor.launch` / `Executor.finish`. `RoundResult.to_proto` is the one place a
round's result becomes the StepResult the scheduler decodes (services/scheduler/round_output.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.batch import Batch
from services.common.tensors import to_proto
from twinspark.v1 import rank_pb2


@dataclass
class RowLogprobs:
    """Per sample row: the sampled token's logprob [R], and the top-K ids / logprobs [R, K] (rows that asked
    for fewer than K, or none, carry the same K columns; the scheduler reads only what each row asked for)."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass
class RowScores:
    """Per score row (prompt logprobs): the next prompt token's logprob [S] and rank [S], and the top-K ids /
    logprobs [S, K]."""

    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


@dataclass
class RoundResult:
    """A round read back: the sampled ids of every sample row and what the plan asked for beside them."""

    sampled: list[int]
    forward_ms: float
    sample_ms: float
    accepted: list[int] | None = None  # per sequence, when the plan has verify windows
    hidden: torch.Tensor | None = None  # [R, D] fp32, when the plan wants hidden states
    logprobs: RowLogprobs | None = None  # when the plan asks for logprobs
    tier_bad: list[bytes] | None = None  # tier entries that failed their checksum on some rank (dropped on all)
    scores: RowScores | None = None  # when the plan has score rows
    layer_hidden: torch.Tensor | None = None  # [T, L * D] fp32 in plan row order, when the plan has hidden_layers

    def to_proto(self, round_: int, rank: int) -> rank_pb2.StepResult:
        """The StepResult that carries this result to the scheduler."""
        res = rank_pb2.StepResult(round=round_, rank=rank, sampled=to_proto(self.sampled),
                                  forward_ms=self.forward_ms, sample_ms=self.sample_ms)
        if self.accepted is not None:
            res.accepted.CopyFrom(to_proto(self.accepted))
        if self.hidden is not None:
            res.hidden.CopyFrom(to_proto(self.hidden, "float32"))
        if self.layer_hidden is not None:
            res.layer_hidden.CopyFrom(to_proto(self.layer_hidden, "float32"))
        if self.tier_bad:
            res.tier_bad.extend(self.tier_bad)
        if self.logprobs is not None:
            res.logprobs.CopyFrom(to_proto(self.logprobs.chosen, "float32"))
            res.top_ids.CopyFrom(to_proto(self.logprobs.top_ids, "int32"))
            res.top_logprobs.CopyFrom(to_proto(self.logprobs.top_logprobs, "float32"))
        if self.scores is not None:
            res.score_logprobs.CopyFrom(to_proto(self.scores.logprobs, "float32"))
            res.score_ranks.CopyFrom(to_proto(self.scores.ranks, "int32"))
            res.score_top_ids.CopyFrom(to_proto(self.scores.top_ids, "int32"))
            res.score_top_logprobs.CopyFrom(to_proto(self.scores.top_logprobs, "float32"))
        return res


@dataclass
class Launched:
    """A round whose work is queued on the device (`Executor.launch`): what `Executor.finish` reads back. On a GPU
    the results are copied to pinned host memory behind the round's kernels; `done` passes when they are there."""

    batch: Batch | None  # in class order; None for a plan of tier moves only
    order: list[int]  # batch sequence -> plan sequence
    rows: torch.Tensor  # host int64 sample rows in the batch's row order
    sampled: torch.Tensor  # int64 [R], on the host once `done` has passed
    logprobs: RowLogprobs | None
    hidden: torch.Tensor | None
    tier_bad: list[bytes] | None
    forward_ms: float
    t1: float  # perf_counter when the forward had been queued
    done: torch.cuda.Event | None  # None: the work ran synchronously (CPU)
    scores: RowScores | None = None  # prompt logprobs of the plan's score rows
    layer_hidden: torch.Tensor | None = None  # [T, L * D] the plan's hidden_layers' outputs, plan row order
    begin: torch.cuda.Event | None = None  # timing event before the round's work (round_stats.py); None on the CPU
    steps: int = 1  # decode steps (StepPlan.steps)

    @property
    def has_prompt(self) -> bool:
        """Whether the round has prompt rows (a prefill chunk), for the rank's round stats."""
        return self.batch is not None and any(self.batch.is_prompt(s) for s in range(self.batch.num_seqs))

    def ready(self) -> bool:
        """Whether reading this round back would not wait."""
        return self.done is None or self.done.query()

    @property
    def overlappable(self) -> bool:
        """Whether the next round may be launched before this one is read back: on a device that runs
        asynchronously, and without verify windows (accepting drafts changes the KDA state the next round starts
        from, and the acceptance is decided on the host)."""
        return self.done is not None and not (self.batch is not None and self.batch.has_verify)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device result to the host without waiting: valid once the round's event has passed."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
