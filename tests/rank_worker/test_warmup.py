"""The rank's warm-up before serving (services/rank_worker/warmup.py): its rounds pass the plan checks, and they
leave no trace — a request served after the warm-up, in the slots and blocks it used, gets the ids it gets from a
rank that never warmed up."""

from __future__ import annotations

from services.rank_worker.executor import Executor
from services.rank_worker.plan_checks import PENDING_TOKEN
from services.rank_worker.warmup import GRID, warm_budget, warm_up
from tests.model.reference import our_model, random_ids
from tests.rank_worker.test_state_copies import BLOCK, _plan


def test_warm_budget_is_the_budget_on_the_grid_within_the_pool() -> None:
    assert warm_budget(8192, num_blocks=100_000, block_size=16, max_positions=1 << 20) == 8192
    assert warm_budget(8100, num_blocks=100_000, block_size=16, max_positions=1 << 20) == 8064  # on the grid
    assert warm_budget(8192, num_blocks=400, block_size=16, max_positions=1 << 20) == 3136  # two prompts fit
    assert warm_budget(8192, num_blocks=4, block_size=16, max_positions=1 << 20) < GRID  # too small: skipped


def _generate(executor: Executor, prompt: list[int], steps: int) -> list[int]:
    table = list(range(8))
    out = [executor.execute(_plan(prompt, 0, 0, table)).sampled[0]]
    for i in range(steps):
        out.append(executor.execute(_plan([PENDING_TOKEN], len(prompt) + i, 0, table)).sampled[0])
    return out


def test_a_request_after_the_warm_up_gets_the_ids_of_a_cold_rank(tiny_default) -> None:
    model = our_model(tiny_default)
    prompt = random_ids(40, seed=11)
    cold = Executor(model, model.new_cache(num_blocks=64, block_size=BLOCK, num_slots=2))
    want = _generate(cold, prompt, 5)

    warm = Executor(model, model.new_cache(num_blocks=64, block_size=BLOCK, num_slots=2))
    assert warm_up(warm, 256) > 0  # six rounds ran through the plan checks, the forward and sampling
    assert warm.slot_end == {}  # and the rank forgot them: slot 0 is fresh for the scheduler
    assert _generate(warm, prompt, 5) == want  # same slot, same blocks as the warm-up's first sequence
