"""bench/decode_prefill.py's own time per kernel name: what each kernel adds to the GPU's timeline when kernels
overlap (programmatic launch places a kernel while the one before drains)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.decode_prefill import own_times


def _k(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_overlapping_kernels_count_only_what_they_add() -> None:
    kernels = [_k("gemm", 0, 10), _k("norm", 8, 13), _k("gemm", 12, 20), _k("tiny", 14, 16), _k("norm", 25, 27)]
    own = own_times(kernels)
    # gemm: 10 + (20 - 13); norm: (13 - 10) + 2; tiny ends inside gemm's second run: 0; the idle gap 20-25 is no one's
    assert own == {"gemm": 17, "norm": 5, "tiny": 0}
    assert sum(own.values()) == 27 - 5
