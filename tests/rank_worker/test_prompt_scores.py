"""Prompt logprobs on a rank (StepPlan.score_rows): the raw log-softmax of a prefill's rows at the next prompt
token, equal bit for bit to the offline runtime's (`offline.prompt_log_softmax`), whatever the chunking and company;
a score row leaves the sample rows' bits alone; malformed score rows are refused before anything runs."""

from __future__ import annotations

import pytest
import torch

from services.common.tensors import to_proto
from services.rank_worker.executor import Executor
from services.rank_worker.offline import prompt_log_softmax
from services.rank_worker.plan_checks import PlanError
from tests.model.reference import our_model, random_ids
from tests.rank_worker.test_state_copies import BLOCK, _plan

K = 3


def _scored(plan, rows: list[int], next_ids: list[int], k: int = K):
    plan.score_rows.CopyFrom(to_proto(rows))
    plan.score_ids.CopyFrom(to_proto(next_ids))
    plan.score_k = k
    plan.prompt.CopyFrom(to_proto([1] * plan.lengths.shape[0]))
    return plan


def test_score_rows_equal_the_offline_log_softmax_bit_for_bit(tiny_default):
    model = our_model(tiny_default)
    prompt = random_ids(100, seed=11)
    ref = prompt_log_softmax(model, prompt)  # whole prompt, one chunk
    ex = Executor(model, model.new_cache(num_blocks=16, block_size=BLOCK, num_slots=2))
    table = list(range(8))
    # Chunks [0, 64) (no sample) and [64, 100) (the last row is sampled, not scored).
    a = ex.execute(_scored(_plan(prompt[:64], 0, 0, table, sample=False), list(range(64)), prompt[1:65]))
    b = ex.execute(_scored(_plan(prompt[64:], 64, 0, table), list(range(35)), prompt[65:100]))
    got = torch.cat([a.scores.logprobs, b.scores.logprobs])
    want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    assert torch.equal(got, want)
    top = torch.cat([a.scores.top_logprobs, b.scores.top_logprobs])
    ids = torch.cat([a.scores.top_ids, b.scores.top_ids]).long()
    assert torch.equal(top, ref.gather(1, ids)) and torch.equal(top[:, 0], ref.max(dim=-1).values)
    ranks = torch.cat([a.scores.ranks, b.scores.ranks]).long()
    assert torch.equal(ranks, (ref >= want[:, None]).sum(-1))
    # Scoring changes nothing of the sample row: the same prefill without score rows samples the same token.
    plain = Executor(model, model.new_cache(num_blocks=16, block_size=BLOCK, num_slots=2))
    plain.execute(_plan(prompt[:64], 0, 0, table, sample=False))
    assert plain.execute(_plan(prompt[64:], 64, 0, table)).sampled == b.sampled


def test_bad_score_rows_are_refused(tiny_default):
    model = our_model(tiny_default)
    ex = Executor(model, model.new_cache(num_blocks=16, block_size=BLOCK, num_slots=2))
    prompt = random_ids(10, seed=2)
    table = list(range(4))
    for rows, ids, k, match in (([10], [1], 1, "score_rows"), ([1, 1], [1, 2], 1, "distinct"),
                                ([1], [10**6], 1, "vocabulary"), ([1], [1], 21, "score_k"),
                                ([1], [1, 2], 1, "score_ids")):
        with pytest.raises(PlanError, match=match):
            ex.execute(_scored(_plan(prompt, 0, 0, table), rows, ids, k))
    unflagged = _scored(_plan(prompt, 0, 0, table), [1], [1])
    unflagged.prompt.CopyFrom(to_proto([0]))
    with pytest.raises(PlanError, match="prompt chunk"):
        ex.execute(unflagged)
