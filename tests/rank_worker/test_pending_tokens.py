"""StepPlan token id -1 (pipelined rounds): a decode step whose input is the token the rank sampled last for the
slot. The rank fills it in, only where the slot's last sampling round ended, and refuses the plan otherwise."""

from __future__ import annotations

import pytest

from services.rank_worker.executor import Executor
from services.rank_worker.plan_checks import PENDING_TOKEN, PlanError
from tests.model.reference import our_model, random_ids
from tests.rank_worker.test_state_copies import BLOCK, _plan


def test_pending_token_is_the_last_sample_of_the_slot(tiny_default):
    model = our_model(tiny_default)
    table = list(range(8))
    prompt = random_ids(20, seed=5)

    explicit = Executor(model, model.new_cache(num_blocks=16, block_size=BLOCK, num_slots=2))
    first = explicit.execute(_plan(prompt, 0, 0, table)).sampled[0]
    second = explicit.execute(_plan([first], 20, 0, table)).sampled[0]

    pending = Executor(model, model.new_cache(num_blocks=16, block_size=BLOCK, num_slots=2))
    assert pending.execute(_plan(prompt, 0, 0, table)).sampled[0] == first
    assert pending.execute(_plan([PENDING_TOKEN], 20, 0, table)).sampled[0] == second
    # One position too far (as after a refused round): refused, nothing runs.
    with pytest.raises(PlanError, match="pending token id at position 22"):
        pending.execute(_plan([PENDING_TOKEN], 22, 0, table))
    # A slot that never sampled, or a pending id inside a prompt chunk: refused.
    with pytest.raises(PlanError, match="nothing was sampled|ended at None"):
        pending.execute(_plan([PENDING_TOKEN], 0, 1, table))
    with pytest.raises(PlanError, match="one row"):
        pending.execute(_plan([3, PENDING_TOKEN], 21, 0, table))
