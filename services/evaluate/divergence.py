"""Perplexity, and the KL divergence of one model's next-token distribution from another's, from top-k logprobs.

A served model shows at most the top k logprobs of each position (k <= 20 through the API), not its whole
distribution. KL(P || Q) is therefore taken between coarsened distributions: the ids in both top-k lists, each its
own bucket, and one bucket for every other id,

    KL_k = sum_{v in T_P & T_Q} p(v) log(p(v) / q(v)) + p_rest log(p_rest / q_rest),
    p_rest = 1 - sum_{v in T_P & T_Q} p(v)   (q_rest likewise),

which needs nothing the API does not return. It is exactly the KL divergence of the bucketed distributions, hence
never above the full-vocabulary KL (a coarsening can only lose divergence: the log-sum inequality) and equal to it
once every id that either model gives mass to is in both lists. Top-1 agreement compares the two argmax ids (each
list's first, ties by the lowest id).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Top = list[tuple[int, float]]  # (id, logprob), by logprob descending


def kl_topk(p_top: Top, q_top: Top) -> float:
    """KL_k(P || Q) in nats from the two top-k lists (see the module note)."""
    q = dict(q_top)
    both = [(math.exp(lp), math.exp(q[i])) for i, lp in p_top if i in q]
    kl = sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in both if pv > 0)
    p_rest = max(0.0, 1.0 - sum(pv for pv, _ in both))
    q_rest = max(0.0, 1.0 - sum(qv for _, qv in both))
    if p_rest > 1e-12:  # below: rounding of a list that holds (nearly) all of P's mass
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-30)))
    return max(0.0, kl)


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass
class Perplexity:
    """Summed negative log-likelihood of counted tokens."""

    nll: float = 0.0
    tokens: int = 0

    def add(self, logprobs: list[float]) -> None:
        self.nll -= sum(logprobs)
        self.tokens += len(logprobs)

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def summary(self) -> dict[str, float | int]:
        return {"perplexity": self.value, "nll_per_token": self.nll / self.tokens if self.tokens else float("nan"),
                "tokens": self.tokens}


@dataclass
class Divergence:
    """KL_k(P || Q) and top-1 agreement per counted position."""

    kl: list[float] = field(default_factory=list)
    same_top1: int = 0

    def add(self, p_top: Top, q_top: Top) -> None:
        self.kl.append(kl_topk(p_top, q_top))
        self.same_top1 += int(p_top[0][0] == q_top[0][0])

    def summary(self) -> dict[str, float | int]:
        s = sorted(self.kl)
        n = len(s)
        return {"kl_mean": sum(s) / n if n else float("nan"), "kl_median": _quantile(s, 0.5),
                "kl_p90": _quantile(s, 0.9), "kl_p99": _quantile(s, 0.99), "kl_max": s[-1] if s else float("nan"),
                "top1_agreement": self.same_top1 / n if n else float("nan"), "positions": n}
