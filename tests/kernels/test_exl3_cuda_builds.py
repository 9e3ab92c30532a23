"""Which build of the CUDA EXL3 product a weight runs in (kernels/gpu/exl3_cuda.py), checked without a GPU: the
choice is a function of the weight's shape alone (so a product's K order is too), and `runs` refuses a weight its
build cannot tile. tests/gpu/test_exl3_cuda.py runs both builds on CUDA (K of 512 and 4,096)."""

from __future__ import annotations

import pytest
import torch

from kernels.gpu import exl3_cuda
from kernels.gpu.wtiles import Fmt


class _Weight:  # the fields `runs` reads of a WeightArgs
    def __init__(self, n: int, k: int) -> None:
        self.fmt, self.n, self.k, self.block_n, self.block_k = Fmt.EXL3, n, k, 2, 40  # mul1 at 2.5 bits


def test_short_products_take_the_short_k_build_and_the_rest_the_shipped_one() -> None:
    # the MoE's down projection a virtual shard holds (2,048 / 4) and at two shards; gate|up and the dense linears
    assert exl3_cuda.build_of(512) == exl3_cuda.build_of(1024) == exl3_cuda.SHORT_K_BUILD
    assert exl3_cuda.build_of(1536) == exl3_cuda.build_of(4096) == exl3_cuda.build_of(12288) == ()


@pytest.mark.parametrize("n,k,ok", [(4096, 512, True), (96, 512, False), (96, 4096, True), (4096, 768, False)])
def test_runs_only_where_the_build_tiles_the_weight(n: int, k: int, ok: bool, monkeypatch) -> None:
    # the short-K build holds 64 outputs a block (32 in the shipped one); K stays a multiple of 512
    monkeypatch.setenv("TWINSPARK_EXL3_KERNEL", "auto")
    assert exl3_cuda.runs(torch.device("cuda"), torch.float16, _Weight(n, k), exl3_cuda.BLOCK_M) is ok
