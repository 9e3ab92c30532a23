"""StepPlan.steps on a rank: a round of one-row decode steps run several times in one plan, each step fed the
token its slot sampled the step before (on the device). Its samples and logprobs must be the bits of the same
steps sent one plan at a time (each a pending decode step); plans it cannot run that way are refused whole."""

from __future__ import annotations

import pytest
import torch

from services.common.tensors import to_proto
from services.rank_worker.executor import Executor
from services.rank_worker.plan_checks import MAX_STEPS, PENDING_TOKEN, PlanError
from tests.model.reference import our_model, random_ids
from twinspark.v1 import rank_pb2

BLOCK = 16
TABLES = [list(range(0, 4)), list(range(4, 8))]  # 64 positions per sequence
SAMPLING = dict(temperature=[0.0, 0.8], top_p=[1.0, 0.9], top_k=[0, 20], min_p=[0.0, 0.0], seed=[0, 77])


def _plan(tokens: list[int], lengths: list[int], starts: list[int], *, steps: int = 0, logprobs: bool = False,
          tables: list[list[int]] = TABLES) -> rank_pb2.StepPlan:
    """Two sequences in slots 0 and 1 (greedy, seeded at 0.8), each sampled at its last row."""
    rows = [sum(lengths[: i + 1]) - 1 for i in range(len(lengths))]
    plan = rank_pb2.StepPlan(
        round=1, token_ids=to_proto(tokens), starts=to_proto(starts), lengths=to_proto(lengths),
        slots=to_proto([0, 1]), block_tables=to_proto(torch.tensor(tables, dtype=torch.int32)),
        sample_rows=to_proto(rows), temperature=to_proto(SAMPLING["temperature"], "float32"),
        top_p=to_proto(SAMPLING["top_p"], "float32"), top_k=to_proto(SAMPLING["top_k"]),
        min_p=to_proto(SAMPLING["min_p"], "float32"), seed=to_proto(SAMPLING["seed"], "int64"),
        request_ids=["a", "b"], steps=steps)
    if logprobs:
        plan.logprobs_k.CopyFrom(to_proto([3, -1]))
    return plan


def _prompted(model) -> tuple[Executor, list[int]]:
    """An executor whose slots 0 and 1 hold prompts of 20 and 13 tokens (each sampled once)."""
    ex = Executor(model, model.new_cache(num_blocks=16, block_size=BLOCK, num_slots=4))
    a, b = random_ids(20, seed=1), random_ids(13, seed=2)
    first = ex.execute(_plan(a + b, [20, 13], [0, 0])).sampled
    return ex, first


def test_steps_equal_one_step_plans_bit_for_bit(tiny_default):
    model = our_model(tiny_default)
    steps = 5
    one, first = _prompted(model)
    singles, logprobs = [], []
    for i in range(steps):
        out = one.execute(_plan([PENDING_TOKEN] * 2, [1, 1], [20 + i, 13 + i], logprobs=True))
        singles.append(out.sampled)
        logprobs.append(out.logprobs)
    multi, first_again = _prompted(model)
    assert first_again == first
    out = multi.execute(_plan([PENDING_TOKEN] * 2, [1, 1], [20, 13], steps=steps, logprobs=True))
    # Row after row: sequence a's five samples, then b's.
    assert out.sampled == [singles[i][r] for r in range(2) for i in range(steps)]
    for name in ("chosen", "top_ids", "top_logprobs"):
        want = torch.stack([getattr(lp, name) for lp in logprobs], 1).flatten(0, 1)
        assert torch.equal(getattr(out.logprobs, name), want), name
    # Both end where the one-step plans ended: the next pending step is the same.
    after = [ex.execute(_plan([PENDING_TOKEN] * 2, [1, 1], [20 + steps, 13 + steps])).sampled for ex in (one, multi)]
    assert after[0] == after[1]


def test_plans_that_cannot_run_several_steps_are_refused(tiny_default):
    model = our_model(tiny_default)
    ex, _ = _prompted(model)

    def refused(plan: rank_pb2.StepPlan, match: str) -> None:
        with pytest.raises(PlanError, match=match):
            ex.execute(plan)

    pending = [PENDING_TOKEN] * 2
    refused(_plan(pending, [1, 1], [20, 13], steps=MAX_STEPS + 1), "at most")
    refused(_plan(random_ids(3, seed=4) + pending[:1], [3, 1], [20, 13], steps=2), "only one-row decode steps")
    for field, value in (("want_hidden", True), ("hidden_layers", [0])):
        plan = _plan(pending, [1, 1], [20, 13], steps=2)
        getattr(plan, field).extend(value) if field == "hidden_layers" else setattr(plan, field, value)
        refused(plan, f"cannot carry {field}")
    masked = _plan(pending, [1, 1], [20, 13], steps=2)
    masked.mask_index.CopyFrom(to_proto([0, -1]))
    masked.bitmask.CopyFrom(to_proto(torch.full((1, 8), -1, dtype=torch.int32)))
    refused(masked, "cannot carry mask_index")
    one_row = _plan(pending, [1, 1], [20, 13], steps=2)
    one_row.sample_rows.CopyFrom(to_proto([1]))
    for name in ("temperature", "top_p", "min_p"):
        getattr(one_row, name).CopyFrom(to_proto([0.0 if name != "top_p" else 1.0], "float32"))
    one_row.top_k.CopyFrom(to_proto([0]))
    one_row.seed.CopyFrom(to_proto([0], "int64"))
    refused(one_row, "every sequence's row is a sample row")
    narrow = [t[:2] for t in TABLES]  # 32 positions each: a's 13th step would be at position 32
    refused(_plan(pending, [1, 1], [20, 13], steps=13, tables=narrow), "past the end of its block table")
    # Nothing ran: the slots still continue at 20 and 13, and 12 steps fit the narrow tables.
    assert len(ex.execute(_plan(pending, [1, 1], [20, 13], steps=12, tables=narrow)).sampled) == 24
