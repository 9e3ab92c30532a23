"""The target layers' outputs a rank returns for DFlash drafts (StepPlan.hidden_layers): every packed row, in the
plan's row order even when the rank runs the decode-class sequences first; a layer the model lacks is refused."""

from __future__ import annotations

import pytest
import torch

from services.common.tensors import from_proto, to_proto
from services.rank_worker.executor import Executor
from services.rank_worker.plan_checks import PlanError
from tests.model.reference import our_model, random_ids
from tests.rank_worker.test_state_copies import BLOCK, _plan
from twinspark.v1 import rank_pb2

LAYERS = (5, 1, 3)


def _executor(model) -> Executor:
    return Executor(model, model.new_cache(num_blocks=16, block_size=BLOCK, num_slots=2))


def _joined(first: rank_pb2.StepPlan, second: rank_pb2.StepPlan, prompt: list[int]) -> rank_pb2.StepPlan:
    """Two one-sequence plans as one, `second`'s rows after `first`'s; `prompt` marks the prompt chunks."""
    plan = rank_pb2.StepPlan(round=1, request_ids=["a", "b"])
    n = from_proto(first.lengths).tolist()[0]
    for name in ("token_ids", "starts", "lengths", "slots", "temperature", "top_p", "top_k", "min_p", "seed"):
        getattr(plan, name).CopyFrom(to_proto(torch.cat([from_proto(getattr(p, name)) for p in (first, second)])))
    plan.sample_rows.CopyFrom(to_proto(torch.cat([from_proto(first.sample_rows),
                                                  from_proto(second.sample_rows) + n])))
    plan.block_tables.CopyFrom(to_proto(torch.cat([from_proto(p.block_tables) for p in (first, second)])))
    plan.prompt.CopyFrom(to_proto(prompt))
    return plan


def _with_layers(plan: rank_pb2.StepPlan, layers=LAYERS) -> rank_pb2.StepPlan:
    plan.hidden_layers.extend(layers)
    return plan


def test_layer_rows_come_back_in_plan_order(tiny_default):
    model = our_model(tiny_default)
    a, b = random_ids(10, seed=1), random_ids(7, seed=2)
    table_a, table_b = list(range(4)), list(range(4, 8))
    # Alone: A's prompt, then its decode row; B's prompt.
    alone = _executor(model)
    first = alone.execute(_plan(a, 0, 0, table_a))
    decode = alone.execute(_with_layers(_plan(first.sampled, 10, 0, table_a)))
    b_alone = _executor(model).execute(_with_layers(_plan(b, 0, 1, table_b)))
    # Together: B's prompt chunk first in the plan, A's decode row second (the rank runs it first).
    ex = _executor(model)
    ex.execute(_plan(a, 0, 0, table_a))
    both = ex.execute(_with_layers(_joined(_plan(b, 0, 1, table_b), _plan(first.sampled, 10, 0, table_a), [1, 0])))
    assert both.layer_hidden is not None and tuple(both.layer_hidden.shape) == (8, 3 * model.cfg.hidden_size)
    assert torch.equal(both.layer_hidden[:7], b_alone.layer_hidden)
    assert torch.equal(both.layer_hidden[7:], decode.layer_hidden)
    assert _executor(model).execute(_plan(b, 0, 1, table_b)).layer_hidden is None  # only when asked


def test_layers_the_model_lacks_are_refused(tiny_default):
    model = our_model(tiny_default)
    for layers in ((model.cfg.num_hidden_layers,), (-1,)):
        with pytest.raises(PlanError, match="hidden_layers"):
            _executor(model).execute(_with_layers(_plan(random_ids(4, seed=3), 0, 0, list(range(4))), layers))
