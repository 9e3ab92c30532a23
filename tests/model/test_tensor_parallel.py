"""TP = 2 and TP = 4 (rank processes on one host: the same-host collective, and gloo) against TP = 1: same greedy
tokens and bit-identical logits.

Bit identity is by construction (docs/design.md §5.3): every sharded dimension is cut into 4 virtual shards whatever the
rank count, each shard's product is computed separately, and row-parallel partials are all-gathered and summed in
shard order on every rank.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from services.rank_worker.offline import run_on_ranks
from tests.model.reference import random_ids
from tests.model.tp_jobs import logits_and_greedy

pytestmark = pytest.mark.tp  # several rank processes over gloo

IDS = random_ids(96, seed=21)
JOB = partial(logits_and_greedy, ids=IDS, prompt_len=64, max_tokens=24)


@pytest.fixture(scope="module")
def tp1(tiny_shared):
    return run_on_ranks(tiny_shared, JOB, tp=1)


@pytest.mark.parametrize("tp, collective", [(2, "ipc"), (4, "ipc"), (2, "gloo")])
def test_tp_equals_tp1(tiny_shared, tp1, tp, collective):
    result = run_on_ranks(tiny_shared, JOB, tp=tp, collective=collective)
    assert result["tokens"] == tp1["tokens"]
    delta = (result["logits"] - tp1["logits"]).abs().max().item()
    same = torch.equal(result["logits"], tp1["logits"])
    print(f"TP={tp} over {collective}: max |dlogits| vs TP=1 = {delta:.1e}, bit-identical = {same}")
    assert torch.equal(result["logits"], tp1["logits"])
