"""ops/fused_rows.build: the row and sequence facts of a mixed batch as the fused kernels read them (host tensors
here: no GPU), worked out by hand for a decode step, a verify window and two prompt chunks."""

from __future__ import annotations

import torch

from model.batch import Batch
from ops.fused_rows import build


def _ints(t: torch.Tensor) -> list[int]:
    return t.tolist()


def test_a_mixed_batch_rows() -> None:
    # decode (start 7, slot 2), verify window of 3 (start 10, slot 1), prompt A of 5 (fresh, slot 3), prompt B of 2
    # (start 20, slot 4): B is shorter than the conv history, so its new history keeps a row of its old one
    batch = Batch(token_ids=torch.arange(11) + 5, starts=[7, 10, 0, 20], lengths=[1, 3, 5, 2],
                  block_tables=torch.zeros(4, 2, dtype=torch.int64), slots=[2, 1, 3, 4], logit_rows=torch.tensor([10]),
                  verify=[False, True, False, False], prompt=[False, False, True, True])
    rows = build(batch, kpool=4)
    assert rows.n_rows == 11 and rows.decode_rows == 4 and rows.verify == [1] and rows.verify_rows == [1]
    assert _ints(rows.positions) == [7, 10, 11, 12, 0, 1, 2, 3, 4, 20, 21]
    assert _ints(rows.row_seq) == [0, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3]
    assert rows.max_pools == 22 // 4
    k = rows.kda
    assert (_ints(k.row0), _ints(k.length), _ints(k.slot), _ints(k.fresh)) == ([0, 1], [1, 3], [2, 1], [0, 0])
    assert _ints(k.pending) == [-1, 1]
    p = rows.prompt
    assert p is not None and p.seqs == [2, 3]
    assert _ints(p.cu_seqlens) == _ints(p.cu_seqlens_host) == [0, 5, 7]
    assert (_ints(p.slots), _ints(p.fresh)) == ([3, 4], [1, 0])
    assert _ints(p.row_first) == [0] * 5 + [5] * 2
    assert _ints(p.row_slot) == [3] * 5 + [4] * 2
    assert _ints(p.row_fresh) == [1] * 5 + [0] * 2
    # A keeps its rows 2, 3, 4; B (2 rows) keeps the last row of its old history, then its rows 5 and 6
    assert _ints(p.hist_row) == [2, 3, 4, 5, 5, 6]
    assert _ints(p.hist_old) == [2, 2, 2, 5, 5, 5]
    assert _ints(p.hist_new) == [1, 1, 1, 0, 1, 1]
