"""What one round leaves behind: the work queued on the device (`Launched`) and the results read back
(`StepOutput`), the two halves of `Executor.launch` / `Executor.finish`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.batch import Batch


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
class StepOutput:
    sampled: list[int]
    forward_ms: float
    sample_ms: float
    accepted: list[int] | None = None  # per sequence, when the plan has verify windows
    hidden: torch.Tensor | None = None  # [R, D] fp32, when the plan wants hidden states
    logprobs: RowLogprobs | None = None  # when the plan asks for logprobs
    tier_bad: list[bytes] | None = None  # tier entries that failed their checksum on some rank (dropped on all)
    scores: RowScores | None = None  # when the plan has score rows
    layer_hidden: torch.Tensor | None = None  # [T, L * D] fp32 in plan row order, when the plan has hidden_layers


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
