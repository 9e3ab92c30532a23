"""The shared sampling ranges: one rule reads the same on a number (scheduler), a tensor (rank plan check, sampler)
and as pydantic bounds (gateway)."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kernels.sampling_rules import (LOGIT_BIAS, MIN_P, MIN_TOKENS, N, REPETITION_PENALTY, SAMPLER_TOP_P, SEED,
                                    TEMPERATURE, TOP_K, TOP_LOGPROBS, TOP_P, Range)

PROBES = [-101.0, -2.5, -2.0, -1e-9, 0.0, 1e-9, 0.5, 1.0, 1.5, 2.0, 20.0, 100.0, 100.5, math.inf, -math.inf,
          math.nan]
FLOAT_RULES = [TEMPERATURE, TOP_P, SAMPLER_TOP_P, MIN_P, REPETITION_PENALTY, LOGIT_BIAS]


def test_ends_open_and_closed_and_nan_never_inside():
    assert TOP_P.holds(1.0) and not TOP_P.holds(0.0) and SAMPLER_TOP_P.holds(0.0)
    assert TEMPERATURE.holds(0.0) and TEMPERATURE.holds(1e30) and not TEMPERATURE.holds(math.inf)
    assert not REPETITION_PENALTY.holds(0.0) and REPETITION_PENALTY.holds(1e-9)
    assert MIN_TOKENS.holds(10**12) and not MIN_TOKENS.holds(-1)
    assert SEED.holds(2**64 - 1) and SEED.holds(-(2**63)) and not SEED.holds(2**64)
    assert not any(r.holds(math.nan) for r in FLOAT_RULES + [TOP_K, N])


def test_a_tensor_holds_when_every_element_does():
    assert TOP_LOGPROBS.holds(torch.tensor([0, 20])) and not TOP_LOGPROBS.holds(torch.tensor([0, 21]))
    assert TOP_LOGPROBS.holds(torch.tensor([], dtype=torch.int64))
    for rule in FLOAT_RULES:
        for v in PROBES:
            assert rule.holds(torch.tensor([v], dtype=torch.float32)) == rule.holds(v), (rule.name, v)


def test_messages_name_the_range():
    assert str(TOP_P) == "in (0, 1]" and str(TEMPERATURE) == "finite and >= 0" and str(MIN_TOKENS) == ">= 0"
    assert str(REPETITION_PENALTY) == "finite and > 0" and str(Range("x", 0, 1, hi_open=True)) == "in [0, 1)"
    assert TOP_LOGPROBS.error(21) == "top_logprobs must be in [0, 20], got 21"


@pytest.mark.parametrize("rule", FLOAT_RULES, ids=lambda r: r.name)
def test_the_gateway_bounds_refuse_what_the_rule_refuses(rule: Range):
    class Body(BaseModel):
        model_config = ConfigDict(strict=True)
        value: float = Field(**rule.field())

    for v in PROBES:
        try:
            Body(value=v)
            accepted = True
        except ValidationError:
            accepted = False
        assert accepted == rule.holds(v), (rule.name, v)
