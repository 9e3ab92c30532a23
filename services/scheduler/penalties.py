"""Penalties, logit bias and min_tokens: what each sample row of a round carries to the ranks (StepPlan.penalties).

The ranks apply them (kernels/penalties.py); the scheduler knows what they depend on: the prompt, the tokens
generated so far, and how many there are. Only a row's own request decides what it carries, so a request's tokens
do not depend on the batch it shares. Rows whose penalties read the generated tokens (presence, frequency,
repetition) need the previous sample first: the engine does not plan their next round before the last one is back
(`Engine._overlap`). logit_bias and min_tokens need only counts the scheduler has, and keep rounds overlapped.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.tensors import to_proto
from twinspark.v1 import rank_pb2

if TYPE_CHECKING:
    from services.scheduler.request import Request


@dataclass(frozen=True)
class PenaltySpec:
    """A request's settings, already in range (validation.py)."""

    presence: float = 0.0     # OpenAI presence_penalty, over the generated tokens
    frequency: float = 0.0    # OpenAI frequency_penalty, over the generated tokens
    repetition: float = 1.0   # vLLM repetition_penalty, over prompt + generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    min_tokens: int = 0       # EOS and stop ids are banned until this many tokens are generated

    @property
    def reads_output(self) -> bool:
        """Whether a row's values depend on the tokens generated before it (not only on how many)."""
        return self.presence != 0 or self.frequency != 0 or self.repetition != 1


class PenaltyState:
    """One request's spec and the history its rows read: generated-token counts (kept as tokens are committed) and
    the prompt's distinct ids (for the repetition penalty)."""

    def __init__(self, spec: PenaltySpec, prompt: list[int]) -> None:
        self.spec = spec
        self.counts: collections.Counter[int] = collections.Counter()
        self.prompt_ids = sorted(set(prompt)) if spec.repetition != 1 else []

    def row(self, req: Request, drafted: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(seen ids, their generated counts, banned ids) of a sample row of `req` whose input follows the committed
        tokens, the samples in flight (only counted, see the module docstring) and `drafted` (a verify window's
        drafts before the row, taken as accepted: if they are not, the row's sample is dropped)."""
        counts = self.counts
        if drafted:
            counts = counts + collections.Counter(drafted)
        seen: dict[int, int] = {}
        if self.spec.reads_output:
            assert not req.pending_samples, "a row whose penalties read the output is planned before its input"
            seen = dict.fromkeys(self.prompt_ids, 0)
            seen.update(counts)
        n = len(req.generated) + req.pending_samples + len(drafted)
        banned = sorted(req.eos_ids | req.stop_ids) if n < self.spec.min_tokens else []
        return list(seen), list(seen.values()), banned


def _padded(lists: list[list], dtype: torch.dtype, fill) -> torch.Tensor:
    width = max((len(x) for x in lists), default=0)
    out = torch.full((len(lists), width), fill, dtype=dtype)
    for i, x in enumerate(lists):
        out[i, : len(x)] = torch.tensor(x, dtype=dtype)
    return out


def row_penalties(rows: list[tuple[int, PenaltySpec, tuple[list[int], list[int], list[int]]]]
                  ) -> rank_pb2.RowPenalties:
    """The plan's penalties message from (sample row, spec, `PenaltyState.row`) per penalised row, rows ascending."""
    bias = [s.logit_bias for _, s, _ in rows]
    return rank_pb2.RowPenalties(
        rows=to_proto([r for r, _, _ in rows]),
        presence=to_proto([s.presence for _, s, _ in rows], "float32"),
        frequency=to_proto([s.frequency for _, s, _ in rows], "float32"),
        repetition=to_proto([s.repetition for _, s, _ in rows], "float32"),
        seen_ids=to_proto(_padded([r[0] for _, _, r in rows], torch.int32, -1)),
        seen_counts=to_proto(_padded([r[1] for _, _, r in rows], torch.int32, 0)),
        bias_ids=to_proto(_padded([[t for t, _ in b] for b in bias], torch.int32, -1)),
        bias_values=to_proto(_padded([[v for _, v in b] for b in bias], torch.float32, 0.0)),
        banned_ids=to_proto(_padded([r[2] for _, _, r in rows], torch.int32, -1)),
    )
