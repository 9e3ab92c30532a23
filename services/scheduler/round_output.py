"""A round's result as the scheduler reads it: the decoded shapes of a rank's StepResult, in one place.

`RankSet.collect` returns one `RoundOutput` per round (rank 0's answer, with the tier entries every rank found bad)
and `RoundScheduler.commit(step, output)` takes it. A new per-round output is a field here, a field of the rank's
`RoundResult` (services/rank_worker/rounds.py, which also serializes it) and its proto field: see docs/design.md
"One round's result".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.tensors import from_proto, ids
from twinspark.v1 import rank_pb2


@dataclass
class TokenLogprobs:
    """Logprobs of sampled tokens, in order: one entry per token, each with its top-k (k = what was asked)."""

    chosen: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class PromptScores:
    """Prompt logprobs of consecutive prompt tokens (a chunk's score rows): logprob, rank, top ids / logprobs."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def cut(self, a: int, b: int) -> "PromptScores":
        return PromptScores(self.logprobs[a:b], self.ranks[a:b], self.top_ids[a:b], self.top_logprobs[a:b])


@dataclass
class RoundOutput:
    """One round's result: the sampled ids of every sample row in order (row after row: a multi-step plan's row r
    has its `steps` samples together), and what the plan asked for beside them."""

    sampled: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted per sequence (plans with verify windows)
    hidden: torch.Tensor | None = None  # [R, D] per sample row (plans with want_hidden: MTP drafts)
    layers: torch.Tensor | None = None  # [T, L * D] every packed row's hidden_layers outputs (DFlash drafts)
    logprobs: TokenLogprobs | None = None  # per sample row (plans with logprobs_k)
    scores: PromptScores | None = None  # per score row (plans with score_rows)
    tier_bad: list[bytes] = field(default_factory=list)  # tier entries some rank's loads found corrupt (all dropped)


def sample_count(plan: rank_pb2.StepPlan) -> int:
    """How many ids a plan samples: every sample row once per decode step."""
    return (plan.sample_rows.shape[0] if plan.sample_rows.shape else 0) * max(1, plan.steps)


def decode(plan: rank_pb2.StepPlan, res: rank_pb2.StepResult, *, full: bool) -> RoundOutput:
    """A rank's StepResult for `plan`, checked against it (ValueError says what does not match). `full`: rank 0's
    answer, which carries the round's extras; the other ranks' answers are read for their sampled ids (compared
    with rank 0's) and their bad tier entries only."""
    sampled = ids(res.sampled) if res.HasField("sampled") else []
    out = RoundOutput(sampled, tier_bad=list(res.tier_bad))
    if not full:
        return out
    n_sample = sample_count(plan)
    if len(sampled) != n_sample:
        raise ValueError(f"{len(sampled)} sampled ids for {n_sample} rows")
    out.accepted = ids(res.accepted) if res.HasField("accepted") else []
    out.hidden = from_proto(res.hidden) if plan.want_hidden and res.HasField("hidden") else None
    out.layers = _layers(plan, res)
    if plan.HasField("logprobs_k") and plan.logprobs_k.shape and plan.logprobs_k.shape[0]:
        out.logprobs = _logprobs(res, n_sample)
    if plan.HasField("score_rows") and plan.score_rows.shape and plan.score_rows.shape[0]:
        out.scores = _scores(res, plan.score_rows.shape[0])
    n_seqs = plan.lengths.shape[0] if plan.lengths.shape else 0
    if plan.HasField("verify") and len(out.accepted) != n_seqs:
        raise ValueError(f"{len(out.accepted)} accepted counts for {n_seqs} sequences")
    return out


def _layers(plan: rank_pb2.StepPlan, res: rank_pb2.StepResult) -> torch.Tensor | None:
    """The layer outputs a plan with hidden_layers gets back: one row per packed row."""
    if not plan.hidden_layers:
        return None
    n_rows = plan.token_ids.shape[0] if plan.token_ids.shape else 0
    t = from_proto(res.layer_hidden) if res.HasField("layer_hidden") else None
    if t is None or t.dim() != 2 or t.shape[0] != n_rows:
        raise ValueError(f"layer_hidden must be [{n_rows}, L * D], got {None if t is None else list(t.shape)}")
    return t


def _logprobs(res: rank_pb2.StepResult, n_sample: int) -> TokenLogprobs:
    """The sample rows' logprobs: chosen [R], top ids / logprobs [R, K]."""
    chosen, top_ids, top_lp = from_proto(res.logprobs), from_proto(res.top_ids), from_proto(res.top_logprobs)
    if chosen.shape != (n_sample,) or top_ids.dim() != 2 or top_ids.shape[0] != n_sample \
            or top_lp.shape != top_ids.shape:
        raise ValueError(f"logprobs do not match the {n_sample} sample rows")
    return TokenLogprobs(chosen.tolist(), top_ids.tolist(), top_lp.tolist())


def _scores(res: rank_pb2.StepResult, n_score: int) -> PromptScores:
    """The score rows' prompt logprobs: logprob and rank [S], top ids / logprobs [S, K]."""
    lp, ranks = from_proto(res.score_logprobs), from_proto(res.score_ranks)
    top_ids, top_lp = from_proto(res.score_top_ids), from_proto(res.score_top_logprobs)
    if lp.shape != (n_score,) or ranks.shape != (n_score,) or top_ids.dim() != 2 or top_ids.shape[0] != n_score \
            or top_lp.shape != top_ids.shape:
        raise ValueError(f"prompt logprobs do not match the {n_score} score rows")
    return PromptScores(lp.tolist(), ranks.tolist(), top_ids.tolist(), top_lp.tolist())
