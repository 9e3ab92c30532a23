"""Which CUDA graphs a GPU rank captures (model/cuda_graphs.py): the shape rules, checked here
without a GPU; tests/gpu/test_fast_path.py checks on CUDA that a replay equals the eager forward bit for bit."""

from __future__ import annotations

from model.cuda_graphs import BATCH_BUCKETS, graph_inputs, graph_width, start_buckets, warmup_inputs


def test_width_is_a_power_of_two_between_the_floor_and_the_cache():
    # floor 128 blocks = index_topk 2,048 tokens in 16-token blocks: every context up to there shares one graph
    assert [graph_width(w, floor=128, cap=4096) for w in (1, 2, 100, 128)] == [128] * 4
    assert [graph_width(w, floor=128, cap=4096) for w in (129, 256, 257, 4000)] == [256, 256, 512, 4096]
    assert graph_width(5000, floor=128, cap=4096) == 4096  # never wider than the cache's blocks
    assert graph_width(3, floor=1, cap=64) == 4 and graph_width(1, floor=1, cap=64) == 1


def test_buckets_captured_before_serving_cover_every_slot():
    assert start_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert start_buckets(5) == [1, 2, 4, 8]  # 5 running sequences replay the 8-row graph
    assert start_buckets(1) == [1]
    assert start_buckets(10_000) == list(BATCH_BUCKETS)  # more slots than the largest bucket: all of them


def _batch(lengths: list[int], starts: list[int], verify: list[bool]):
    import torch

    from model.batch import Batch
    n = sum(lengths)
    return Batch(token_ids=torch.zeros(n, dtype=torch.long), starts=starts, lengths=lengths,
                 block_tables=torch.zeros(len(lengths), 1, dtype=torch.long), slots=[7, 3, 5][: len(lengths)],
                 logit_rows=torch.arange(n), verify=verify, prompt=[False] * len(lengths))


def _split(flat: list[int], seqs: int, rows: int) -> list[list[int]]:
    out, lo = [], 0
    for size in (rows, rows, seqs, seqs, seqs, seqs, seqs, 1):
        out.append(flat[lo : lo + size])
        lo += size
    assert lo == len(flat)
    return out


def test_decode_graph_inputs_pad_with_one_scratch_sequence_a_row():
    flat = graph_inputs(_batch([1, 1, 1], [40, 0, 9], [False] * 3), seqs=4, rows=4, scratch_slot=8)
    positions, row_seq, row0, length, slot, fresh, pending, n_real = _split(flat, 4, 4)
    assert positions == [40, 0, 9, 0] and row_seq == row0 == [0, 1, 2, 3] and length == [1] * 4
    assert slot == [7, 3, 5, 8] and fresh == [0, 1, 0, 1] and pending == [-1] * 4
    assert n_real == [3]  # 3 rows route


def test_window_graph_inputs_keep_windows_in_their_rows():
    # a window of 3 at 20, a decode step at 0, a window of 2 at 8: 6 rows in a graph of 8 rows and 4 sequences
    flat = graph_inputs(_batch([3, 1, 2], [20, 0, 8], [True, False, True]), seqs=4, rows=8, scratch_slot=8)
    positions, row_seq, row0, length, slot, fresh, pending, n_real = _split(flat, 4, 8)
    assert positions == [20, 21, 22, 0, 8, 9, 0, 1]  # the padding sequence's two rows from position 0
    assert row_seq == [0, 0, 0, 1, 2, 2, 3, 3] and row0 == [0, 3, 4, 6] and length == [3, 1, 2, 2]
    assert slot == [7, 3, 5, 8] and fresh == [0, 1, 0, 1]
    assert pending == [0, -1, 4, -1]  # a window's states go to the pending rows of its own packed rows
    assert n_real == [6]


def test_warmup_inputs_fill_the_layout_of_a_replay():
    for window in (False, True):
        flat = warmup_inputs(4, 8, window, scratch_slot=8)
        assert len(flat) == len(graph_inputs(_batch([1], [3], [False]), seqs=4, rows=8, scratch_slot=8))
        positions, row_seq, row0, length, slot, fresh, pending, n_real = _split(flat, 4, 8)
        assert length == [8, 0, 0, 0] and slot == [8] * 4 and pending[0] == (0 if window else -1) and n_real == [0]
