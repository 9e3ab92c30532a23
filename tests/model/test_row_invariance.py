"""Row invariance (docs/design.md §5.2): a row's logits are bit-identical whether it is computed alone or packed with 1-16
other rows (other sequences' decode rows and prefill chunks), on CPU in fp32."""

from __future__ import annotations

import pytest
import torch

from tests.model.reference import our_model
from tests.model.row_batches import SEQS, mixed_batch, packed_step, prepare


@pytest.fixture(scope="module")
def prepared(tiny_sparse):
    return prepare(our_model(tiny_sparse))


@pytest.mark.parametrize("others", [1, 2, 3, 5, 8, 13, 16])
def test_decode_row_alone_equals_batched(prepared, others):
    members, chunk = mixed_batch(others, target=0)
    alone = packed_step(prepared, [0], chunk)[0][0]
    together = packed_step(prepared, members, chunk)[0][0]
    assert torch.equal(alone, together)


def test_prefill_chunk_alone_equals_batched(prepared):
    chunk = {s: 1 for s in range(SEQS)}
    chunk[5] = 4
    alone = packed_step(prepared, [5], chunk)[0][5]
    together = packed_step(prepared, list(range(SEQS)), chunk)[0][5]
    assert torch.equal(alone, together)
