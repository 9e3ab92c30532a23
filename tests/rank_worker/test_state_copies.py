"""StepPlan.state_copies on a rank: KDA recurrent + conv state copied slot to slot before the forward (prefix
snapshots taken and resumed), validated with the rest of the plan."""

from __future__ import annotations

import pytest
import torch

from services.common.tensors import to_proto
from services.rank_worker.executor import Executor
from services.rank_worker.plan_checks import PlanError
from tests.model.reference import our_model, random_ids
from twinspark.v1 import rank_pb2

BLOCK = 16


def _plan(tokens: list[int], start: int, slot: int, table: list[int], copies: list[tuple[int, int]] | None = None,
          sample: bool = True) -> rank_pb2.StepPlan:
    plan = rank_pb2.StepPlan(
        round=1, token_ids=to_proto(tokens), starts=to_proto([start]), lengths=to_proto([len(tokens)]),
        slots=to_proto([slot]), block_tables=to_proto(torch.tensor([table], dtype=torch.int32)),
        sample_rows=to_proto([len(tokens) - 1] if sample else []),
        temperature=to_proto([0.0] if sample else [], "float32"), top_p=to_proto([1.0] if sample else [], "float32"),
        top_k=to_proto([0] if sample else []), min_p=to_proto([0.0] if sample else [], "float32"),
        seed=to_proto([0] if sample else [], "int64"), request_ids=["r"])
    if copies is not None:
        plan.state_copies.CopyFrom(to_proto(torch.tensor(copies, dtype=torch.int32).view(-1, 2)))
    return plan


def _states(cache, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for layer in cache.kda_state for t in (cache.kda_state[layer], cache.conv_state[layer])]


def test_snapshot_and_resume_reproduce_the_state_bit_for_bit(tiny_default):
    model = our_model(tiny_default)
    ex = Executor(model, model.new_cache(num_blocks=32, block_size=BLOCK, num_slots=4))
    prompt = random_ids(100, seed=3)
    table_a = list(range(0, 8))
    # Request A: chunk [0, 64), then the snapshot copy (slot 0 -> 2) before its next chunk [64, 100).
    ex.execute(_plan(prompt[:64], 0, 0, table_a, sample=False))
    at_64 = _states(ex.cache, 0)
    full = ex.execute(_plan(prompt[64:], 64, 0, table_a, copies=[(0, 2)])).sampled
    assert all(torch.equal(a, b) for a, b in zip(_states(ex.cache, 2), at_64))
    end_a = _states(ex.cache, 0)
    # Request B resumes at 64: snapshot slot 2 -> its slot 1, A's first 4 blocks shared, its own blocks after.
    table_b = table_a[:4] + list(range(8, 12))
    resumed = ex.execute(_plan(prompt[64:], 64, 1, table_b, copies=[(2, 1)])).sampled
    assert resumed == full
    assert all(torch.equal(a, b) for a, b in zip(_states(ex.cache, 1), end_a))  # bit-identical states
    # A fresh prefill of the whole prompt in one call has the same 64-chunk grid: the same bits again.
    assert ex.execute(_plan(prompt, 0, 3, list(range(12, 20)))).sampled == full
    assert all(torch.equal(a, b) for a, b in zip(_states(ex.cache, 3), end_a))
    latent = ex.cache.latent[model.cfg.mla_layers[0]].data
    assert torch.equal(latent[12:19], latent[:7])
    # A wrong snapshot (here A's end state instead of the one at 64) changes the state.
    ex.execute(_plan(prompt[64:], 64, 3, table_b, copies=[(0, 3)]))
    assert not all(torch.equal(a, b) for a, b in zip(_states(ex.cache, 3), end_a))
    # An empty [0, 2] tensor is no copies at all.
    ex.execute(_plan(prompt[:5], 0, 3, table_b, copies=[]))


@pytest.mark.parametrize("bad", [[(0, 4)], [(-1, 0)], "shape"])
def test_bad_state_copies_are_refused_before_anything_changes(tiny_default, bad):
    model = our_model(tiny_default)
    ex = Executor(model, model.new_cache(num_blocks=8, block_size=BLOCK, num_slots=4))
    ex.execute(_plan([1, 2, 3], 0, 0, [0, 1], sample=False))
    before = _states(ex.cache, 0)
    plan = _plan([4], 3, 0, [0, 1])
    if bad == "shape":
        plan.state_copies.CopyFrom(to_proto([0, 1, 2]))
    else:
        plan.state_copies.CopyFrom(to_proto(torch.tensor(bad, dtype=torch.int32)))
    with pytest.raises(PlanError, match="state_copies"):
        ex.execute(plan)
    assert all(torch.equal(a, b) for a, b in zip(_states(ex.cache, 0), before))
