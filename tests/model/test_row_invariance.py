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


def test_rows_do_not_depend_on_the_thread_count(tiny_default):
    """A rank at TP 2 runs with half the CPU threads of one at TP 1 (`offline._rank_main`, serve-rank): a prompt whose
    last chunk holds a partial 64-row attention span, and decode rows after it, get the same bits with 1 and 2
    threads (torch's CPU GEMM picks its path for a few rows by the thread count; ops/reference.py pads them)."""
    from model.batch import Batch
    from tests.model.reference import random_ids

    model = our_model(tiny_default)
    ids = random_ids(140, seed=28)
    threads = torch.get_num_threads()

    def run(n_threads: int) -> torch.Tensor:
        torch.set_num_threads(n_threads)
        cache = model.new_cache(num_blocks=16, block_size=16, num_slots=1)
        prompt = Batch.single(ids[:134], 0, list(range(9)), all_logits=True)
        prompt.prompt = [True]
        out = [model.forward(prompt, cache).logits]
        out += [model.forward(Batch.single([t], p, list(range(9))), cache).logits for p, t in enumerate(ids[134:], 134)]
        return torch.cat(out)

    try:
        assert torch.equal(run(1), run(2))
    finally:
        torch.set_num_threads(threads)
