"""The range of every sampling setting, stated once.

The gateway's schemas, the scheduler's request check, the sampler and the rank's plan check all take their bounds
from here and raise their own kind of error (a 400 naming the param, INVALID_ARGUMENT, ValueError, a refused plan),
so a value that one layer lets through is never refused by the next for a rule written another way.

This module imports nothing heavy: the gateway reads it too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """`lo <= v <= hi`, either end possibly open; an open infinite `hi` means "finite". NaN is never inside."""

    name: str
    lo: float
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v: Any) -> bool:
        """Whether `v` is inside: a number, or every element of a tensor (an empty tensor holds). The comparisons
        are the same operators for both, so a plan's tensors and a request's numbers meet the very same rule."""
        inside = (v > self.lo if self.lo_open else v >= self.lo) & (v < self.hi if self.hi_open else v <= self.hi)
        return bool(inside.all()) if hasattr(inside, "all") else bool(inside)

    def __str__(self) -> str:
        if self.hi == math.inf:
            lo = f"{'>' if self.lo_open else '>='} {self.lo}"
            return f"finite and {lo}" if self.hi_open else lo
        return f"in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"

    def error(self, value: Any) -> str:
        return f"{self.name} must be {self}, got {value}"

    def field(self) -> dict[str, Any]:
        """The bounds as pydantic `Field` arguments (the gateway's schemas), so its 400s name the same range."""
        out: dict[str, Any] = {"gt" if self.lo_open else "ge": self.lo}
        if self.hi != math.inf:
            out["lt" if self.hi_open else "le"] = self.hi
        elif self.hi_open:
            out["allow_inf_nan"] = False
        return out


# What every sample row carries (kernels/sampling.py); the neutral value of each is in its comment.
TEMPERATURE = Range("temperature", 0, hi_open=True)  # 0: greedy
# 1: off. A request or a plan never carries 0: proto3 cannot tell it from "unset", which the scheduler reads as 1.
TOP_P = Range("top_p", 0, 1, lo_open=True)
SAMPLER_TOP_P = Range("top_p", 0, 1)  # the sampler itself also takes 0: the top token alone, as greedy
TOP_K = Range("top_k", 0, 2**31 - 1)  # 0: off; int32 on the wire
MIN_P = Range("min_p", 0, 1)  # 0: off
SEED = Range("seed", -(2**63), 2**64 - 1)  # 64 bits, signed or not: s and s - 2**64 sample alike
VLLM_TOP_K_OFF = -1  # vLLM's other spelling of top_k "off", which the gateway turns into 0
MAX_API_TEMPERATURE = 2  # the Responses and Messages APIs' own cap (chat completions, as in vLLM, has none)

# Penalties and bias (kernels/penalties.py): OpenAI's ranges; repetition and min_tokens are vLLM's.
PRESENCE_PENALTY = Range("presence_penalty", -2, 2)  # 0: off
FREQUENCY_PENALTY = Range("frequency_penalty", -2, 2)  # 0: off
REPETITION_PENALTY = Range("repetition_penalty", 0, lo_open=True, hi_open=True)  # 1: off
LOGIT_BIAS = Range("logit_bias", -100, 100)  # the bias of each listed token id
MAX_LOGIT_BIAS = 300  # listed token ids at most
MIN_TOKENS = Range("min_tokens", 0)  # and at most the request's max_tokens

# What comes back and how many times.
TOP_LOGPROBS = Range("top_logprobs", 0, 20)  # top alternatives per token (completions call it `logprobs`)
PROMPT_LOGPROBS = Range("prompt_logprobs", 0, 20)  # top alternatives per prompt token (vLLM's prompt_logprobs)
N = Range("n", 1, 16)  # choices of one request (completions' best_of too)
