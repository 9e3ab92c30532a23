"""Row invariance (DESIGN §5.2): a row's logits are bit-identical whether it is computed alone or packed with 1-16
other rows (other sequences' decode rows and prefill chunks), on CPU in fp32."""

from __future__ import annotations

import random

import pytest
import torch

from services.rank_worker.model.batch import Batch
from tests.model.reference import clone_cache, fresh_cache, our_model, random_ids, run_chunks, table

SEQS = 17
CAP = 64


@pytest.fixture(scope="module")
def prepared(tiny_sparse):
    """17 sequences with 20..36 tokens already cached, plus one more token (or chunk) each to compute next."""
    model = our_model(tiny_sparse)
    cache = fresh_cache(model, CAP, slots=SEQS)
    seqs = [random_ids(40, seed=100 + s) for s in range(SEQS)]
    done = [20 + s for s in range(SEQS)]
    for s in range(SEQS):
        run_chunks(model, cache, seqs[s][: done[s]], [done[s]], slot=s, capacity=CAP)
    return model, cache, seqs, done


def _step(model, cache, seqs, done, members: list[int], chunk: dict[int, int]) -> dict[int, torch.Tensor]:
    """One packed forward of the given sequences (chunk[s] new rows each); logits per sequence."""
    rows = [seqs[s][done[s] : done[s] + chunk[s]] for s in members]
    batch = Batch(token_ids=torch.tensor(sum(rows, [])), starts=[done[s] for s in members],
                  lengths=[len(r) for r in rows], block_tables=torch.tensor([table(s, CAP) for s in members]),
                  slots=members, logit_rows=torch.arange(sum(len(r) for r in rows)))
    logits = model.forward(batch, clone_cache(cache)).logits.split([len(r) for r in rows])
    return dict(zip(members, logits))


@pytest.mark.parametrize("others", [1, 2, 3, 5, 8, 13, 16])
def test_decode_row_alone_equals_batched(prepared, others):
    model, cache, seqs, done = prepared
    rng = random.Random(others)
    target = 0
    mates = rng.sample(range(1, SEQS), others)
    # Mix decode rows with prefill chunks of varied length among the other rows.
    chunk = {s: (1 if rng.random() < 0.5 else rng.randint(2, 4)) for s in mates}
    chunk[target] = 1
    alone = _step(model, cache, seqs, done, [target], chunk)[target]
    members = mates[: others // 2] + [target] + mates[others // 2 :]  # the row sits mid-batch, not first
    together = _step(model, cache, seqs, done, members, chunk)[target]
    assert torch.equal(alone, together)


def test_prefill_chunk_alone_equals_batched(prepared):
    model, cache, seqs, done = prepared
    chunk = {s: 1 for s in range(SEQS)}
    chunk[5] = 4
    alone = _step(model, cache, seqs, done, [5], chunk)[5]
    together = _step(model, cache, seqs, done, list(range(SEQS)), chunk)[5]
    assert torch.equal(alone, together)
