"""A StepPlan checked on its own (services/rank_worker/plan_checks.py): no model, no cache, only the rank's Limits
and its slots' last sampling rounds. The end-to-end refusals through a running rank are test_hostile_plans.py's."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from services.common.tensors import to_proto
from services.rank_worker import plan_checks as checks
from services.rank_worker.plan_checks import PENDING_TOKEN, Limits, PlanError
from twinspark.v1 import rank_pb2

LIMITS = Limits(num_blocks=8, block_size=4, num_slots=2, vocab_size=100, max_positions=64)


def _plan(tokens: list[int], *, start: int = 0, slot: int = 0, rows: list[int] | None = None,
          **fields) -> rank_pb2.StepPlan:
    """One sequence of `tokens` from `start`, two blocks, the last row (or `rows`) sampled greedily."""
    rows = [len(tokens) - 1] if rows is None else rows
    r = len(rows)
    plan = rank_pb2.StepPlan(
        token_ids=to_proto(tokens), starts=to_proto([start]), lengths=to_proto([len(tokens)]), slots=to_proto([slot]),
        block_tables=to_proto(torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)), sample_rows=to_proto(rows),
        temperature=to_proto([0.0] * r, "float32"), top_p=to_proto([1.0] * r, "float32"), top_k=to_proto([0] * r),
        min_p=to_proto([0.0] * r, "float32"), seed=to_proto([0] * r, "int64"))
    for name, value in fields.items():
        getattr(plan, name).CopyFrom(value)
    return plan


def test_a_good_plan_comes_back_as_host_tensors():
    seqs = checks.check_sequences(_plan([1, 2, 3], start=4), LIMITS, {})
    assert seqs.tokens.tolist() == [1, 2, 3] and seqs.starts.tolist() == [4] and seqs.rows.tolist() == [2]
    assert seqs.tokens.dtype == torch.int64 and seqs.verify is None and seqs.pending == []
    assert seqs.params.temperature.tolist() == [0.0]


@pytest.mark.parametrize("plan, error", [
    (_plan([1, 200]), "outside the vocabulary"),
    (_plan([1], slot=2), "slots must be distinct"),
    (_plan([1] * 17), "past the end of its block table"),
    (_plan([1], rows=[1]), "sample row is outside"),
    (_plan([1], temperature=to_proto([1], "int32")), "temperature: int32 is not a valid dtype"),
    (_plan([1], top_p=to_proto([0.0], "float32")), "top_p must be in"),
    (_plan([1, 2], verify=to_proto([1])), "not all its rows are sample rows"),
    (_plan([1], verify=to_proto([1]), prompt=to_proto([1])), "both a verify window and a prompt chunk"),
    (_plan([1], prompt=to_proto([2])), "prompt flags must be 0 or 1"),
])
def test_bad_sequences_are_refused(plan, error):
    with pytest.raises(PlanError, match=error):
        checks.check_sequences(plan, LIMITS, {})


def test_positions_stay_in_the_model_window():
    with pytest.raises(PlanError, match="past the model's 8 positions"):
        checks.check_sequences(_plan([1], start=8), replace(LIMITS, max_positions=8), {})
    with pytest.raises(PlanError, match="past the model's 64 positions"):  # not wrapped round at the int64 limit
        checks.check_positions(torch.tensor([2**63 - 2]), torch.tensor([4]), 64)


def test_counts_are_bounded_by_the_cache():
    wide = torch.zeros(1, 9, dtype=torch.int64)
    with pytest.raises(PlanError, match="width 9 exceed the cache's 8 blocks"):
        checks.check_counts(torch.zeros(4), wide, torch.zeros(1), LIMITS)
    with pytest.raises(PlanError, match="33 token rows exceed"):
        checks.check_counts(torch.zeros(33), wide[:, :1], torch.zeros(1), LIMITS)


def test_a_pending_token_continues_where_its_slot_ended():
    seqs = checks.check_sequences(_plan([PENDING_TOKEN], start=5, slot=1), LIMITS, {1: 5})
    assert (seqs.pending, seqs.pending_slots, seqs.tokens.tolist()) == ([0], [1], [0])
    with pytest.raises(PlanError, match="slot 1's last sampling round ended at 4"):
        checks.check_sequences(_plan([PENDING_TOKEN], start=5, slot=1), LIMITS, {1: 4})
    with pytest.raises(PlanError, match="only valid as a decode step's one row"):
        checks.check_sequences(_plan([7, PENDING_TOKEN], start=4, slot=1), LIMITS, {1: 4})


def test_per_row_extras():
    plan = _plan([1, 2], rows=[0, 1], logprobs_k=to_proto([-1, 3]), mask_index=to_proto([0, -1]),
                 bitmask=to_proto(torch.zeros(1, 4, dtype=torch.int32)))
    assert checks.logprobs_k(plan, 2).tolist() == [-1, 3]
    index, bitmask = checks.row_masks(plan, 2)
    assert index.tolist() == [0, -1] and bitmask.shape == (1, 4)
    assert checks.logprobs_k(_plan([1, 2], rows=[0, 1], logprobs_k=to_proto([-1, -1])), 2) is None
    with pytest.raises(PlanError, match=r"logprobs_k must be -1 or in \[0, 20\]"):
        checks.logprobs_k(_plan([1], logprobs_k=to_proto([21])), 1)
    with pytest.raises(PlanError, match="mask_index must be in"):
        checks.row_masks(_plan([1], mask_index=to_proto([1]), bitmask=to_proto(torch.zeros(1, 4, dtype=torch.int32))),
                         1)
    assert checks.row_penalties(_plan([1]), 1, LIMITS.vocab_size, LIMITS.max_positions) is None


def test_state_copies_and_tier_moves():
    assert checks.state_copies(_plan([1], state_copies=to_proto([[0, 1]])), 2) == [(0, 1)]
    with pytest.raises(PlanError, match="slots must be in"):
        checks.state_copies(_plan([1], state_copies=to_proto([[0, 2]])), 2)
    save = rank_pb2.TierMove(kind=rank_pb2.TIER_SAVE, block_keys=[b"k"], blocks=to_proto([3]))
    plan = rank_pb2.StepPlan(tier_moves=[save])
    with pytest.raises(PlanError, match="no tiers"):
        checks.tier_moves(plan, None, LIMITS)
    host_only = SimpleNamespace(dir=None)
    assert checks.tier_moves(plan, host_only, LIMITS) == [(save, [3])]
    with pytest.raises(PlanError, match="no --kv-disk-dir"):
        checks.tier_moves(rank_pb2.StepPlan(tier_moves=[rank_pb2.TierMove(kind=rank_pb2.TIER_SPILL, block_keys=[b"k"])]),
                          host_only, LIMITS)
    far = rank_pb2.TierMove(kind=rank_pb2.TIER_LOAD, block_keys=[b"k"], blocks=to_proto([8]))
    with pytest.raises(PlanError, match=r"blocks must be in \[0, 8\)"):
        checks.tier_moves(rank_pb2.StepPlan(tier_moves=[far]), host_only, LIMITS)
    checks.tier_moves_only(plan)
    with pytest.raises(PlanError, match="must carry tier moves"):
        checks.tier_moves_only(rank_pb2.StepPlan())
    assert not checks.has_sequences(plan) and checks.has_sequences(_plan([1]))


def test_images_need_a_tower():
    image = rank_pb2.ImageRows(pixel_values=to_proto(torch.zeros(4, 6), "float32"), grid_thw=to_proto([1, 2, 2]),
                               row=0, first=0, count=1)
    plan = rank_pb2.StepPlan(images=[image])
    vision = SimpleNamespace(spatial_merge_size=2, patch_dim=6)
    [part] = checks.image_rows(plan, 4, vision, can_encode=True)
    assert (part.row, part.count, part.grid, part.digest) == (0, 1, (1, 2, 2), b"")
    with pytest.raises(PlanError, match="no vision tower"):
        checks.image_rows(plan, 4, None, can_encode=True)
    with pytest.raises(PlanError, match="no vision tower"):
        checks.image_rows(plan, 4, vision, can_encode=False)
    with pytest.raises(PlanError, match="do not fit"):
        checks.image_rows(plan, 0, vision, can_encode=True)
