"""Which CUDA graphs a GPU rank captures (model/cuda_graphs.py): the shape rules, checked here
without a GPU; tests/gpu/test_fast_path.py checks on CUDA that a replay equals the eager forward bit for bit."""

from __future__ import annotations

from model.cuda_graphs import BATCH_BUCKETS, graph_width, start_buckets


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
